"""GORGO v1's calibration done online (§4.2): the per-replica TTFT fit (:mod:`.fit`) and the
``calibration`` scorer that costs replicas by it (:mod:`.plugin`). See README.md."""

from kvroute.policy.adaptive.ttft_fit.fit import TTFTFit, TTFTModel
from kvroute.policy.adaptive.ttft_fit.plugin import CalibratedTTFT, CalibrationPlugin

__all__ = ["CalibratedTTFT", "CalibrationPlugin", "TTFTFit", "TTFTModel"]
