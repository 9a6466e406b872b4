"""OpenTelemetry spans per request (optional: ``pip install 'kvroute[otel]'``; off by default).

With ``tracing: {enabled: true}`` every proxied request becomes one ``kvroute.request`` span whose
attributes carry the routing decision (policy, branch, replica, replicas that failed it, model)
and the outcome (status, aborted). Spans go to whatever tracer provider the process has: set one
up with the OpenTelemetry SDK's environment variables or ``opentelemetry-instrument``; kvroute
does not pick an exporter for you. Disabled, this costs one attribute check per request.
"""

from __future__ import annotations

from typing import Any


class Tracer:
    """Starts and ends request spans, or does nothing when tracing is off."""

    def __init__(self, enabled: bool):
        self._tracer: Any = None
        if enabled:
            try:
                from opentelemetry import trace
            except ImportError:
                raise ValueError("tracing.enabled needs OpenTelemetry: pip install 'kvroute[otel]'") from None
            self._tracer = trace.get_tracer("kvroute")

    @property
    def enabled(self) -> bool:
        """Whether spans are recorded (tracing.enabled and OpenTelemetry installed)."""
        return self._tracer is not None

    def start(self, route: str) -> Any:
        """A span for one request (None when tracing is off)."""
        return self._tracer.start_span("kvroute.request", attributes={"kvroute.route": route}) if self._tracer else None

    @staticmethod
    def end(span: Any, attributes: dict[str, Any]) -> None:
        """Record what happened and end the span; None values are left out."""
        if span is None:
            return
        span.set_attributes({f"kvroute.{k}": v for k, v in attributes.items() if v is not None})
        span.end()
