"""The settings the per-request path reads, copied out of the gateway's config into plain
attributes.

The config is a tree of pydantic models, and a pydantic model defines ``__getattr__``: every
attribute read on one goes through Python's slower lookup hook (about 430 machine instructions
per read under callgrind, issue 25's fourth round, docs/hot-path.md), and a proxied request
read about twenty of them. The runtime makes one :class:`HotConfig` from each config it applies
(start-up and every reload, ``Runtime.reconfigure``), so what a request reads is always the
config in force; a setting read only off the hot path (continuation bounds, queue limits) is
read from the config itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvroute.gateway.config import GatewayConfig


class HotConfig:
    """Per-request settings of one :class:`~kvroute.gateway.config.GatewayConfig`, as plain
    attributes (names follow the config's sections: ``retry.max_attempts`` → ``max_attempts``)."""

    __slots__ = ("access_log", "log_prompts", "replica_header", "forward_authorization", "continuable",
                 "max_attempts", "backoff_s", "backoff_max_s", "connect_s", "first_byte_s", "first_byte_total_s",
                 "non_stream_s", "non_stream_total_s", "idle_s", "stall_watch", "probe_interval_s")

    def __init__(self, config: GatewayConfig):
        to, rc = config.timeouts, config.retry
        self.access_log: bool = config.access_log
        self.log_prompts: bool = config.log_prompts
        self.replica_header: bool = config.replica_header
        self.forward_authorization: bool = config.auth.forward_authorization
        self.continuable: bool = rc.max_continuations > 0  # streams are spliced to be continued
        self.max_attempts: int = rc.max_attempts
        self.backoff_s: float = rc.backoff_s
        self.backoff_max_s: float = rc.backoff_max_s
        self.connect_s: float = to.connect_s
        self.first_byte_s: float = to.first_byte_s
        self.first_byte_total_s: float = to.first_byte_total_s
        self.non_stream_s: float = to.non_stream_s
        self.non_stream_total_s: float = to.non_stream_total_s
        self.idle_s: float = to.idle_s
        self.stall_watch: bool = config.stall.enabled
        self.probe_interval_s: float = config.probe.interval_s
