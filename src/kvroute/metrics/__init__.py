"""Latency and throughput summaries, reports and plots."""

from kvroute.metrics.summary import Recorder, summarize

__all__ = ["Recorder", "summarize"]
