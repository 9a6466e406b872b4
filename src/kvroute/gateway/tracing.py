"""What the gateway records per request: OpenTelemetry spans (optional: ``pip install
'kvroute[otel]'``; off by default) and the access log line (``access_log: true``).

With ``tracing: {enabled: true}`` every proxied request becomes one ``kvroute.request`` span whose
attributes carry the routing decision (policy, branch, replica, replicas that failed it, model)
and the outcome (status, aborted). Spans go to whatever tracer provider the process has: set one
up with the OpenTelemetry SDK's environment variables or ``opentelemetry-instrument``; kvroute
does not pick an exporter for you. Disabled, this costs one attribute check per request.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvroute.prefix import chat_key

access = logging.getLogger("kvroute.access")


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


def access_line(resp: Any, route: str, body: dict[str, Any], req: Any, served: dict[str, Any], t0: float,
                client_rid: str | None, log_prompts: bool) -> None:
    """One JSON line per request: what happened, never the prompt unless asked (``log_prompts``)."""
    fields = {"rid": req.id, "client_rid": client_rid, "route": route,
              "status": resp.status or 499,  # 499: the client left
              "replica": served.get("replica"), "branch": served.get("branch"),
              "prompt_tokens": req.prompt_tokens, "stream": bool(body.get("stream")),
              "ms": round((time.monotonic() - t0) * 1000, 2)}
    if served["excluded"]:
        fields["failed_on"] = served["excluded"]
    if served.get("legs"):
        fields["legs"] = served["legs"]  # continued on other replicas; "replica" is the last
    if resp.started and not resp.finished:
        fields["aborted"] = True  # the client left mid-response
    if log_prompts:
        prompt = body.get("messages")
        fields["prompt"] = (chat_key(prompt) if isinstance(prompt, list) else
                            str(next((body[f] for f in ("prompt", "input", "content", "tokens") if f in body),
                                     "")))[:512]
    access.info("request", extra={"fields": fields})
