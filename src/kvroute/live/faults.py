"""Fault injection flags of ``kvroute live``: ``--kill`` and ``--pause``.

    --kill gateway:us@10s          SIGKILL the gateway of region us 10 s into each policy's run
    --kill gateway:us@10s+5s       ... and start it again 5 s later (same port, same config)
    --pause replica:eu-0@5s+2s     SIGSTOP replica eu-0 at 5 s, SIGCONT at 7 s (no +: until the end)
    --kill controller@8s+3s        the controller too (clients keep their last /resolve answer)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("gateway", "replica", "controller")
_SPEC = re.compile(r"^(?P<kind>[a-z]+)(?::(?P<target>[A-Za-z0-9_.-]+))?@(?P<at>\d+(?:\.\d+)?)s?"
                   r"(?:\+(?P<for>\d+(?:\.\d+)?)s?)?$")


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: ``action`` on ``kind:target`` at ``at_s``, undone after ``for_s``."""

    action: str  # kill | pause
    kind: str  # gateway | replica | controller
    target: str | None
    at_s: float
    for_s: float | None = None

    def describe(self) -> str:
        """The flag as a user would write it."""
        what = self.kind + (f":{self.target}" if self.target else "")
        return f"{self.action} {what}@{self.at_s:g}s" + (f"+{self.for_s:g}s" if self.for_s is not None else "")


def parse_fault(action: str, text: str) -> Fault:
    """``gateway:us@10s+5s`` → Fault; a malformed value is a ValueError naming the flag and the form."""
    m = _SPEC.match(text.strip())
    form = (f"--{action} KIND:NAME@SECONDSs[+SECONDSs] with KIND one of {', '.join(KINDS)} (controller takes no "
            f"NAME), e.g. --{action} gateway:us@10s+5s")
    if m is None:
        raise ValueError(f"--{action} {text!r}: expected {form}")
    kind, target = m["kind"], m["target"]
    if kind not in KINDS:
        raise ValueError(f"--{action} {text!r}: unknown kind {kind!r}; allowed: {', '.join(KINDS)}")
    if (kind == "controller") != (target is None):
        raise ValueError(f"--{action} {text!r}: expected {form}")
    return Fault(action, kind, target, float(m["at"]), float(m["for"]) if m["for"] is not None else None)
