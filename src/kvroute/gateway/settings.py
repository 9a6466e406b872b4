"""The gateway's operating settings, one model per concern: probes, KV-event consumption, the hold
queue, retries, timeouts, the circuit breaker, stall detection, TLS, tracing and HTTP limits
(sections of :class:`~kvroute.gateway.config.GatewayConfig`)."""

from __future__ import annotations

import ssl

from pydantic import Field, model_validator

from kvroute.gateway.tracing import Tracer
from kvroute.policy import DEFAULT_TICK_S
from kvroute.schema import StrictModel


class ProbeConfig(StrictModel):
    """How often and how patiently replicas (and peers) are probed, and when a streak of results ejects or
    re-admits one."""

    interval_s: float = Field(0.1, gt=0)  # SkyWalker probes every 100 ms
    idle_interval_s: float = Field(1.0, gt=0, description="a replica with nothing in flight and nothing running "
                                   "or waiting at its last probe is probed less often: the wait doubles from "
                                   "interval_s up to this; a dispatch to it restores interval_s (set it equal to "
                                   "interval_s for a fixed rate)")
    timeout_s: float = Field(0.5, gt=0, description="a probe that takes longer fails")
    unhealthy_after: int = Field(3, ge=1, description="consecutive probe failures → ejected. A replica is not "
                                 "routable until a probe answers; requests only such replicas could take wait "
                                 "(bounded by queue.max_wait_s) until one answers or has failed this many")
    healthy_after: int = Field(2, ge=1, description="consecutive successes → re-admitted after an ejection "
                               "(a replica's first answered probe admits it at once, as Envoy does at start-up)")
    rtt_ewma: float = Field(0.3, gt=0, le=1)  # GORGO's RTT smoothing
    models_every_s: float = Field(10.0, gt=0)  # how often /v1/models is read, for model routing


class KVEventsSettings(StrictModel):
    """How the gateway consumes the replicas' KV-cache events (``replicas[].kv_events``)."""

    stale_s: float = Field(30.0, gt=0, description="after a gap replay cannot fill, the replica is routed on the "
                           "approximate index for this long while events rebuild its table")
    speculative_ttl_s: float = Field(2.0, ge=0, description="a routed prompt counts as cached on its replica for "
                                     "this long unless its BlockStored arrives first (0: off)")
    replay_timeout_s: float = Field(2.0, gt=0, description="a replay that sends nothing for this long failed")


class QueueConfig(StrictModel):
    """The gateway's own FIFO for requests a policy holds: its length limit, wait limit and dispatch pacing."""

    max_len: int = Field(1024, ge=0)  # beyond this: 429
    max_wait_s: float = Field(30.0, gt=0)  # waited longer: 503
    # at most one request leaves the queue per tick (SkyWalker's 10 ms queue processor); 0: no pacing
    dispatch_tick_s: float = Field(DEFAULT_TICK_S, ge=0)


class RetryConfig(StrictModel):
    """Retrying a failed attempt on another replica, and continuing a stream that broke or outgrew its
    replica."""

    max_attempts: int = Field(3, ge=1, description="attempts per request, the first included, each on another "
                              "replica when one is left")
    backoff_s: float = Field(0.02, ge=0, description="wait before the first retry; doubles per attempt, with jitter")
    backoff_max_s: float = Field(0.5, ge=0, description="longest wait between attempts")
    max_continuations: int = Field(2, ge=0, description="times one streamed chat or completions request may "
                                   "be continued on another replica with its prompt plus the text generated so "
                                   "far: when its replica fails mid-stream, or when it outgrows the replica's "
                                   "stage (a policy's context_limit); 0: never (a mid-stream failure ends the "
                                   "stream with an SSE error)")


class TimeoutConfig(StrictModel):
    """Time limits of one proxied request: connect, first byte, gaps between body pieces, a whole non-streamed
    response."""

    connect_s: float = Field(2.0, gt=0, description="to open a connection to a replica")
    # until the first body byte: per attempt, and in all for every attempt of one request
    first_byte_s: float = Field(60.0, gt=0)
    first_byte_total_s: float = Field(120.0, gt=0, description="until the first body byte, over every attempt "
                                      "of one request")
    idle_s: float = Field(60.0, gt=0)  # between body pieces once the response has begun
    non_stream_s: float = Field(600.0, gt=0, description="a whole non-streamed response, per attempt: an "
                                "engine answers it when generation ends, so first_byte_s would cut it short")
    non_stream_total_s: float = Field(600.0, gt=0, description="a non-streamed response over every attempt; "
                                      "equal to non_stream_s by default, so a slow generation that times out "
                                      "is not started again on another replica")


class BreakerConfig(StrictModel):
    """Per-replica circuit breaker: consecutive failures that open it, the cooldown, trials that close it."""

    failures: int = Field(5, ge=1)  # consecutive failures → open
    cooldown_s: float = Field(5.0, gt=0)  # then half-open: one trial request at a time
    successes: int = Field(1, ge=1)  # consecutive good trials that close it again


class StallConfig(StrictModel):
    """Ejecting an engine whose streams all stopped making progress (``gateway/outlier.py``)."""

    enabled: bool = Field(True, description="watch streamed requests' progress; eject an engine none of whose "
                          "streams got a token for its threshold, retry or continue them elsewhere")
    factor: float = Field(10.0, gt=0, description="threshold: this many times the longest gap between tokens "
                          "the engine normally shows (a decaying peak)")
    min_s: float = Field(1.0, gt=0, description="the threshold is never shorter (plus the expected prefill of "
                         "prompts still waiting for their first token)")
    max_s: float = Field(3.0, gt=0, description="nor longer (plus that prefill): with the sweep's granularity, "
                         "a frozen engine is out within max_s + 0.25 s")
    canary_interval_s: float = Field(1.0, gt=0, description="while ejected, a one-token request is sent this "
                                     "often; the first answered re-admits the engine")

    @model_validator(mode="after")
    def _bounds(self) -> StallConfig:
        if self.min_s > self.max_s:
            raise ValueError(f"min_s ({self.min_s:g}) must not exceed max_s ({self.max_s:g})")
        return self


class TLSConfig(StrictModel):
    """TLS on the gateway's listener."""

    cert_file: str = Field(description="PEM certificate chain the listener presents")
    key_file: str = Field(description="PEM private key of that certificate")

    def context(self) -> ssl.SSLContext:
        """A server context; unreadable or mismatched files are an error naming them."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"tls: cannot load cert_file {self.cert_file} / key_file {self.key_file}: "
                             f"{getattr(exc, 'strerror', None) or exc}") from None
        return ctx

    @model_validator(mode="after")
    def _loads(self) -> TLSConfig:
        self.context()  # unreadable files fail at load, with the config's file:line
        return self


class TracingConfig(StrictModel):
    """OpenTelemetry spans per request (needs the ``otel`` extra)."""

    enabled: bool = Field(False, description="one span per proxied request, to the process's tracer provider")

    @model_validator(mode="after")
    def _installed(self) -> TracingConfig:
        if self.enabled:
            Tracer(True)  # fails at load, naming the extra, when OpenTelemetry is missing
        return self


class HTTPConfig(StrictModel):
    """Limits on what one client can hold (see ``gateway/http.py``)."""

    max_head_bytes: int = Field(64 * 1024, ge=1024, description="request line and headers; beyond: 431")
    max_headers: int = Field(100, ge=8, description="header fields per request; beyond: 431")
    header_timeout_s: float = Field(10.0, gt=0)  # to send a whole request head (slowloris)
    body_timeout_s: float = Field(60.0, gt=0)  # to send a whole body, once the head is in
    keepalive_timeout_s: float = Field(30.0, gt=0)  # an idle kept-alive connection is closed
    max_connections: int = Field(4096, ge=1)  # beyond: 503 + Retry-After and close
    max_connections_per_client: int = Field(
        1024, ge=1, description="open connections per client address; beyond: 503 + Retry-After and close "
                                "(behind a front proxy every client has its address: set it to max_connections)")
