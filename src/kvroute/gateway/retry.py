"""Retries, for the gateway and the live clients alike (pure: no I/O, no clock): which upstream
answers are worth another attempt elsewhere, how long to wait before it, and what the client gets
when every attempt failed.

An attempt that failed before any byte reached the client is retried on another replica when
the failure is on the allow-list — connect errors, timeouts, broken HTTP, and the statuses in
:data:`RETRY_STATUSES` (408, 429, 500, 502, 503, 504) — with exponential backoff and jitter
(:func:`backoff_s`) between attempts and never after the last.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from kvroute.gateway.upstream import UpstreamConnectError, UpstreamError, UpstreamTimeout

RETRY_STATUSES: Final = frozenset({408, 429, 500, 502, 503, 504})


def backoff_s(attempt: int, base_s: float, max_s: float, draw: float) -> float:
    """The wait after failed attempt ``attempt`` (1, 2, ...): ``base_s`` doubled per attempt,
    at most ``max_s``, times a jitter of 0.5 + ``draw`` (``draw`` uniform in [0, 1))."""
    return min(max_s, base_s * 2 ** (attempt - 1)) * (0.5 + draw)


class RetryReason(StrEnum):
    """Why an attempt is retried elsewhere (the ``reason`` label of ``kvroute_retries``)."""

    CONNECT = "connect"
    TIMEOUT = "timeout"
    PROTOCOL = "protocol"
    STATUS = "status"
    REPLICA_REMOVED = "replica_removed"


@dataclass
class Failure:
    """An attempt that sent nothing to the client: why, and what the client gets if it is the last."""

    reason: RetryReason
    message: str
    status: int = 502
    code: str = "upstream_error"
    replica: str | None = None  # the replica that failed, when not the attempt's target (a prefill leg)


def failure_of(exc: UpstreamError, target: str) -> Failure:
    """The failure an upstream error means: a timeout answers 504, the rest 502."""
    if isinstance(exc, UpstreamTimeout):
        return Failure(RetryReason.TIMEOUT, f"upstream {target} timed out: {exc}", 504, "upstream_timeout")
    if isinstance(exc, UpstreamConnectError):
        return Failure(RetryReason.CONNECT, f"upstream {target} unreachable: {exc}")
    return Failure(RetryReason.PROTOCOL, f"upstream {target} failed: {exc}")
