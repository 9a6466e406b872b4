"""llm-d's predicted-TTFT routing (LMetric §4.6): the step-time TTFT model (:mod:`.model`) and the
``predictor`` scorer with its measured error (:mod:`.plugin`). See README.md."""

from kvroute.policy.adaptive.predictor.model import TTFTPredictor
from kvroute.policy.adaptive.predictor.plugin import PredictedTTFT, PredictionErrorPlugin

__all__ = ["PredictedTTFT", "PredictionErrorPlugin", "TTFTPredictor"]
