"""gateway/retry.py: the one retry rule of the gateway and the live clients."""

import pytest

from kvroute.gateway.retry import RETRY_STATUSES, RetryReason, backoff_s, failure_of
from kvroute.gateway.upstream import UpstreamConnectError, UpstreamProtocolError, UpstreamTimeout


@pytest.mark.parametrize(("attempt", "draw", "want"), [
    (1, 0.0, 0.025), (1, 0.5, 0.05), (2, 0.5, 0.1), (3, 0.0, 0.1), (4, 0.5, 0.4), (5, 0.5, 0.5), (9, 0.999, 0.7495),
])
def test_backoff_doubles_from_its_base_is_capped_and_jittered(attempt, draw, want):
    assert backoff_s(attempt, 0.05, 0.5, draw) == pytest.approx(want)


@pytest.mark.parametrize(("exc", "reason", "status"), [
    (UpstreamTimeout("slow"), RetryReason.TIMEOUT, 504),
    (UpstreamConnectError("refused"), RetryReason.CONNECT, 502),
    (UpstreamProtocolError("garbled"), RetryReason.PROTOCOL, 502),
])
def test_an_upstream_error_becomes_the_failure_the_client_would_get(exc, reason, status):
    f = failure_of(exc, "r1")
    assert (f.reason, f.status) == (reason, status) and "r1" in f.message


def test_the_live_clients_retry_what_the_gateway_retries():
    from kvroute.live import clients

    assert clients.RETRY_STATUSES is RETRY_STATUSES
    assert {429, 502, 503, 504} <= RETRY_STATUSES and not {400, 404, 413} & RETRY_STATUSES
