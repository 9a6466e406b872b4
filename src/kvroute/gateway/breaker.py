"""Per-replica circuit breaker (pure: the caller passes the clock).

closed ──(``failures`` consecutive failures)──▶ open ──(``cooldown_s``)──▶ half-open
half-open admits ONE trial request at a time; ``successes`` consecutive good trials close the
circuit, a failed trial opens it again for another cooldown. A trial that ends without a verdict
(the client left, the engine answered a client error) frees the slot for the next one.
Modelled on SGLang's router circuit breaker and Envoy's outlier ejection, with a single-trial
half-open so a replica that is still broken sees one request, not the whole burst.

A replica that stalled (``gateway/outlier.py``) is *held* open: no cooldown lets it half-open,
only :meth:`CircuitBreaker.release` — once it made progress again — closes it.
"""

from __future__ import annotations

from enum import IntEnum


class CircuitState(IntEnum):
    """The breaker's state; the value is what the ``kvroute_circuit_state`` gauge exports."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class CircuitBreaker:
    """Decides whether a replica may take new requests, from the outcomes of past ones."""

    def __init__(self, failures: int = 5, cooldown_s: float = 5.0, successes: int = 1):
        self.threshold, self.cooldown_s, self.successes_to_close = failures, cooldown_s, successes
        self.state = CircuitState.CLOSED
        self.failures = 0  # consecutive, while closed
        self.trial_successes = 0  # consecutive, while half-open
        self.trial_running = False
        self.opened_at = 0.0
        self.held = False  # open until released (a stalled replica), whatever the cooldown

    @property
    def allows(self) -> bool:
        """True when a new request may be sent now."""
        if self.state is CircuitState.CLOSED:
            return True
        return self.state is CircuitState.HALF_OPEN and not self.trial_running

    def dispatched(self) -> None:
        """A request was sent; in half-open it is the trial."""
        if self.state is CircuitState.HALF_OPEN:
            self.trial_running = True

    def success(self) -> None:
        """A request completed well."""
        if self.state is CircuitState.HALF_OPEN:
            self.trial_running = False
            self.trial_successes += 1
            if self.trial_successes >= self.successes_to_close:
                self.state, self.failures = CircuitState.CLOSED, 0
        else:
            self.failures = 0

    def failure(self, now: float) -> None:
        """A request failed because of the replica (connect error, timeout, 5xx, broken HTTP)."""
        if self.state is CircuitState.HALF_OPEN:
            self._open(now)
        elif self.state is CircuitState.CLOSED:
            self.failures += 1
            if self.failures >= self.threshold:
                self._open(now)

    def neutral(self) -> None:
        """A request ended without saying anything about the replica's health."""
        if self.state is CircuitState.HALF_OPEN:
            self.trial_running = False

    def hold(self, now: float) -> None:
        """Open and stay open until :meth:`release` (the replica stopped making progress)."""
        self._open(now)
        self.held = True

    def release(self, trial: bool = False) -> None:
        """End a hold: closed (the replica progressed again), or half-open for one trial
        request when progress could not be shown."""
        if self.held:
            self.held = False
            if trial:
                self.state, self.trial_running, self.trial_successes = CircuitState.HALF_OPEN, False, 0
            else:
                self.state, self.failures = CircuitState.CLOSED, 0

    def tick(self, now: float) -> None:
        """Move from open to half-open once the cooldown has passed (not while held)."""
        if self.state is CircuitState.OPEN and not self.held and now - self.opened_at >= self.cooldown_s:
            self.state, self.trial_running, self.trial_successes = CircuitState.HALF_OPEN, False, 0

    def _open(self, now: float) -> None:
        self.state, self.opened_at, self.trial_running = CircuitState.OPEN, now, False
