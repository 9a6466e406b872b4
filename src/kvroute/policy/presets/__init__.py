"""Named presets: each paper and industry router as a configuration of the pipeline."""
