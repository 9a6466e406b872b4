"""GORGO v2's online weight tuner (§2.2): the (1+1)-ES core (:mod:`.es`) and the ``es`` scorer
whose weights it tunes (:mod:`.plugin`). See README.md."""

from kvroute.policy.adaptive.es_tuner.es import GORGO_RANGES, OnePlusOneES, WeightRange
from kvroute.policy.adaptive.es_tuner.plugin import TunedCost, TunerPlugin

__all__ = ["GORGO_RANGES", "OnePlusOneES", "TunedCost", "TunerPlugin", "WeightRange"]
