"""Online correction of the gateway's prompt-token estimate from what engines report.

Without a tokenizer the gateway counts a prompt as ``ceil(bytes / 4)`` tokens (GORGO's
estimate). GGUF deployments ship no ``tokenizer.json``, and a real tokenizer's bytes per token
differ from 4 (issue 12: 11 % low in front of llama.cpp). Every successful response carries the
engine's own count in ``usage.prompt_tokens``; :class:`TokenRatio` keeps, per replica, an EWMA of
engine tokens per estimated token, bounded, and scales the estimate by it.

Choice (the prefix index's unit): a prefix block stays a fixed number of *bytes* of the prompt
key (``block_tokens × 4``), so block hashes, and therefore the index's contents, never change
when the ratio moves. What moves is how many tokens one block is worth: a request carries
``block_tokens = round(nominal block tokens × ratio)``, so matched blocks convert to cached
tokens in the engine's units, and the index's capacity (engine KV tokens ÷ tokens per block) is
recomputed when the ratio has moved by more than :data:`RESIZE_STEP`.

Choice (which replica's ratio): a prompt's estimate is made before routing, so it uses the mean
of the replicas' ratios (replicas behind one gateway normally serve one tokenizer); a replica
with no observation yet does not count. Each replica keeps its own ratio so that one serving
another model does not pull the others' when it is forgotten (removed, restarted).
"""

from __future__ import annotations

import math
import re
from typing import Final

ALPHA: Final = 0.2  # EWMA weight of a new observation: ~90 % converged after 10 responses
LOW: Final = 0.25  # engine tokens per estimated token: 1 to 16 bytes per token
HIGH: Final = 4.0
MIN_TOKENS: Final = 8  # smaller prompts say more about the chat template than about the tokenizer
RESIZE_STEP: Final = 0.05  # index capacity is recomputed when the ratio moves this much (relative)

_PROMPT_TOKENS: Final = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION_TOKENS: Final = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_GENERATED: Final = re.compile(rb'"(?:content|text|reasoning_content|reasoning)"\s*:\s*"')  # a generated piece
_EMPTY: Final = re.compile(rb'"(?:content|text)"\s*:\s*""')
_ENDING: Final = re.compile(rb'"finish_reason"\s*:\s*"')


_SPACE: Final = b" \t\n\r\f\v"  # what a bytes pattern's \s matches


def round_even(x: float) -> int:
    """``round(x)`` of a finite float — the nearest integer, a half to the even one — written with
    ``math.floor``, which the compiled build turns into a native floor: there ``round`` was a generic call
    to the builtin and then to ``float.__round__`` (~650 instructions a time, twice per request; callgrind,
    tenth round, docs/hot-path.md). ``x - floor(x)`` is exact for every double, so the comparison with
    one half decides exactly as ``round`` does; an infinity or NaN raises as ``round`` does."""
    down = math.floor(x)
    rest = x - down
    if rest > 0.5 or (rest == 0.5 and down % 2 == 1):
        return down + 1
    return down


def _is_space(c: int) -> bool:
    """``c`` is one of ``_SPACE``'s bytes (compared as ints: native arithmetic in the compiled build, where
    ``c in _SPACE`` is a generic containment call per byte)."""
    return c == 32 or 9 <= c <= 13


def _last_count(payload: bytes, field: bytes, pattern: re.Pattern[bytes]) -> int | None:
    """The number of the last match of ``pattern`` (``<field>\\s*:\\s*(\\d+)``) in ``payload``, or
    None. Every match starts with ``field``, so a count after the field's last occurrence is the
    last match: that one place is read byte by byte (a memory search and a few byte reads instead
    of a regex scan of the body and an ``int()`` of its digits: ~11,000 instructions per response
    in the compiled build, docs/hot-path.md), and only when no count follows it does the regex
    scan what comes before."""
    at = payload.rfind(field)
    if at < 0:
        return None
    n, i = len(payload), at + len(field)
    while i < n and _is_space(payload[i]):
        i += 1
    if i < n and payload[i] == 58:  # ":"
        i += 1
        while i < n and _is_space(payload[i]):
            i += 1
        value = -1
        while i < n and 48 <= payload[i] <= 57:  # ASCII digits, as \d in a bytes pattern
            value = (value if value > 0 else 0) * 10 + payload[i] - 48
            i += 1
        if value >= 0:
            return value
    found = pattern.findall(payload, 0, at)
    return int(found[-1]) if found else None


def reported_prompt_tokens(payload: bytes) -> int | None:
    """The last ``"prompt_tokens": N`` in a response body or stream tail (``usage`` comes last
    in OpenAI responses and in the final stream chunk), or None."""
    return _last_count(payload, b'"prompt_tokens"', _PROMPT_TOKENS)


def reported_completion_tokens(payload: bytes) -> int | None:
    """The last ``"completion_tokens": N`` in a response body or stream tail, or None."""
    return _last_count(payload, b'"completion_tokens"', _COMPLETION_TOKENS)


def token_events(chunk: bytes) -> int:
    """Stream events in ``chunk`` that carry a generated token — counted by events, not by text:
    engines stream one event per token and many carry empty text (``gateway/continuation.py``
    counts exactly the same way from parsed events). An empty event that announces the role or
    only carries the ending is not a token. For a stream whose engine reports no usage; an
    estimate: an event split across two chunks may be missed or counted twice."""
    n = 0
    for event in chunk.split(b"\n\n"):
        # compact JSON, as the engines send it, is recognised by a substring search (a few times
        # cheaper than the regex, which stays for other spellings); this runs once per token
        if b'"content":"' in event or b'"text":"' in event or _GENERATED.search(event):
            if not (b'""' in event and _EMPTY.search(event) and (b'"role"' in event or _ENDING.search(event))):
                n += 1
    return n


class TokenRatio:
    """Per-replica EWMA of engine-reported prompt tokens per estimated token, bounded to
    [``LOW``, ``HIGH``]."""

    def __init__(self, alpha: float = ALPHA):
        self.alpha = alpha
        self.ratios: dict[str, float] = {}
        self.scale = 1.0  # the mean over replicas with observations (1.0: none yet)

    def observe(self, replica: str, estimated: int, reported: int) -> None:
        """One response: the gateway estimated ``estimated`` tokens (unscaled), the engine
        counted ``reported``."""
        if estimated < MIN_TOKENS or reported <= 0:
            return
        sample = min(HIGH, max(LOW, reported / estimated))
        old = self.ratios.get(replica)
        self.ratios[replica] = sample if old is None else old + self.alpha * (sample - old)
        self._update()

    def forget(self, replica: str) -> None:
        """The replica was removed: its ratio no longer counts."""
        if self.ratios.pop(replica, None) is not None:
            self._update()

    def _update(self) -> None:
        # summed in order from 0.0, as sum() does on 3.11, written out: a compiled build iterates the
        # dict natively instead of a generic call (once per response)
        total = 0.0
        for ratio in self.ratios.values():
            total += ratio
        n = len(self.ratios)
        self.scale = total / n if n else 1.0

    def tokens(self, estimated: int) -> int:
        """An estimate in the engines' units."""
        return max(1, round_even(estimated * self.scale)) if estimated else 0

    def block_tokens(self, nominal: int) -> int:
        """How many engine tokens one prefix block (``nominal × 4`` bytes) holds."""
        return max(1, round_even(nominal * self.scale))
