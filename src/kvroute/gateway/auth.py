"""API keys and per-key limits (pure: the caller passes the clock).

Keys are never kept in clear: the config holds ``sha256:<hex>`` digests, or names an environment
variable or a file whose content is hashed when the config loads. A presented key is hashed and
looked up by digest, so lookup time says nothing about any stored key. Each key may carry a
requests-per-minute and a tokens-per-minute limit, enforced with token buckets (refilled
continuously, bursts up to one minute's allowance); a request over either limit is refused with the
seconds after which it would pass (the ``Retry-After`` of the 429).
"""

from __future__ import annotations

import hashlib
import hmac
import math
from dataclasses import dataclass, field


def digest(key: str) -> str:
    """The stored form of an API key."""
    return hashlib.sha256(key.encode()).hexdigest()


class TokenBucket:
    """``rate_per_min`` units a minute, at most one minute's worth banked."""

    def __init__(self, rate_per_min: float, now: float):
        self.capacity = rate_per_min
        self.per_s = rate_per_min / 60.0
        self.level = rate_per_min
        self.at = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.per_s)
        self.at = now

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` is available (0: now). More than a minute's worth waits for
        a full bucket rather than forever."""
        self._refill(now)
        need = min(amount, self.capacity) - self.level
        return 0.0 if need <= 0 else need / self.per_s

    def take(self, amount: float) -> None:
        """Spend ``amount`` (at most a full bucket); call after :meth:`wait_s` said 0."""
        self.level -= min(amount, self.capacity)


@dataclass
class KeyState:
    """One API key's identity, limits and usage."""

    name: str
    admin: bool = False
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    used_requests: int = 0
    used_tokens: int = 0
    limited: int = 0
    zone: str | None = None  # residency: its requests stay in this zone

    def admit(self, tokens: int, now: float) -> int:
        """0 when the request may go (and is counted), else whole seconds to wait."""
        waits = [b.wait_s(amount, now) for b, amount in ((self.requests, 1), (self.tokens, tokens)) if b]
        wait = max(waits, default=0.0)
        if wait > 0:
            self.limited += 1
            return max(1, math.ceil(wait))
        if self.requests:
            self.requests.take(1)
        if self.tokens:
            self.tokens.take(tokens)
        self.used_requests += 1
        self.used_tokens += tokens
        return 0


@dataclass
class KeyRing:
    """The configured keys by digest, and the admin API's own token (its digest), which
    protects the admin API without making clients send keys."""

    keys: dict[str, KeyState] = field(default_factory=dict)
    admin_digest: str | None = None

    @property
    def enabled(self) -> bool:
        """Whether any key is configured: with none the gateway is open."""
        return bool(self.keys)

    def keeping_usage_of(self, old: KeyRing) -> KeyRing:
        """This ring (a reload's), each key that was in ``old`` keeping its usage and limit state."""
        for d, state in self.keys.items():
            if d in old.keys:
                was = old.keys[d]
                state.used_requests, state.used_tokens, state.limited = was.used_requests, was.used_tokens, was.limited
        return self

    def lookup(self, presented: str | None) -> KeyState | None:
        """The key a request presented (``Authorization: Bearer …``), or None."""
        if not presented:
            return None
        return self.keys.get(digest(presented))

    @property
    def has_admin(self) -> bool:
        """Whether an admin token or some admin key is configured (without, the admin API is off)."""
        return self.admin_digest is not None or any(k.admin for k in self.keys.values())

    def is_admin_token(self, presented: str | None) -> bool:
        """Whether ``presented`` is the admin token (compared by digest, in constant time)."""
        return bool(presented) and self.admin_digest is not None and \
            hmac.compare_digest(digest(presented or ""), self.admin_digest)


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header."""
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None
