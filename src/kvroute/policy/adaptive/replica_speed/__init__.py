"""Replica speed learned online (prefill and decode time per replica from measured latencies) and
LMetric's score on it (scorer ``lmetric_speed``); see README.md."""

from kvroute.policy.adaptive.replica_speed.fit import SpeedFit
from kvroute.policy.adaptive.replica_speed.headroom import BusyUncachedHeadroom
from kvroute.policy.adaptive.replica_speed.plugin import SpeedLMetric, SpeedPlugin

__all__ = ["BusyUncachedHeadroom", "SpeedFit", "SpeedLMetric", "SpeedPlugin"]
