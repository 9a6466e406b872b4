"""The live gateway: an OpenAI-compatible load balancer over real (or emulated) engines."""
