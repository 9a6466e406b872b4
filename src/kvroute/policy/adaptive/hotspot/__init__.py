"""LMetric's KV-hotspot detector (§5.2): the two-phase detector (:mod:`.detector`) and the
``hotspot`` route that filters a hot class's holders (:mod:`.plugin`). See README.md."""

from kvroute.policy.adaptive.hotspot.detector import HotspotDetector
from kvroute.policy.adaptive.hotspot.plugin import Hotspot, HotspotPlugin

__all__ = ["Hotspot", "HotspotDetector", "HotspotPlugin"]
