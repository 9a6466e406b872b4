"""Plain data: requests, endpoints with their indicators, routing decisions."""

from kvroute.model.decision import Branch, Decision, DecisionKind
from kvroute.model.endpoint import Endpoint, EndpointKind
from kvroute.model.request import Request

__all__ = ["Branch", "Decision", "DecisionKind", "Endpoint", "EndpointKind", "Request"]
