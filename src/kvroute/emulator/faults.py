"""The emulator's fault and behaviour knobs (``kvroute emulate`` flags, ``POST /_fault`` at run
time): failures, hangs, cut streams, slowdowns, and the habits of real engines it can imitate."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Faults:
    """Fault and behaviour knobs, settable at start (flags) or at run time (``POST /_fault``)."""

    fail_rate: float = 0.0  # share of requests answered 500
    hang: bool = False  # accept requests and never answer
    close_after_tokens: int | None = None  # cut every stream after this many tokens
    slowdown: float = 1.0  # model time runs this many times slower
    probe_hang: bool = False  # /metrics and /health never answer
    # what llama-server (llama-cpp-python 0.3.36) does, see shared/design/facts.md:
    close_after_stream: bool = False  # close the connection after each stream despite Keep-Alive
    ignore_disconnect: bool = False  # a non-stream request runs on after its client left
    # what vLLM (CPU build, 0.32) does, see emulator/quirks.py:
    empty_text: float = 0.0  # share of stream events sent with empty text (the text comes later)
    frozen: bool = False  # the engine core stops; /health, /metrics, /v1/models still answer

    def update(self, changes: dict[str, object]) -> None:
        """Apply run-time changes, all or none; a bad name or value raises ValueError naming it."""
        allowed = set(self.__dataclass_fields__)
        unknown = sorted(set(changes) - allowed)
        if unknown:
            raise ValueError(f"unknown fault(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
        checked = {name: _check_fault(name, value) for name, value in changes.items()}
        for name, value in checked.items():
            setattr(self, name, value)


def _check_fault(name: str, value: object) -> object:
    if name in ("hang", "probe_hang", "close_after_stream", "ignore_disconnect", "frozen"):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
    elif name == "fail_rate":
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            raise ValueError(f"fail_rate must be a number from 0 to 1, got {value!r}")
    elif name == "empty_text":
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
            raise ValueError(f"empty_text must be a number from 0 to below 1, got {value!r}")
    elif name == "slowdown":
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1000:
            raise ValueError(f"slowdown must be a number > 0 and <= 1000, got {value!r}")
    elif name == "close_after_tokens":
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"close_after_tokens must be null or an integer >= 0, got {value!r}")
    return value
