"""Trace loaders: Mooncake JSONL, Azure LLM CSV, OpenAI-messages JSONL conversations.

Every loader reads lazily and reports a malformed line as ``file:line: field ...``; with
``skip_bad`` such lines are skipped and counted instead.
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Iterator, Mapping
from datetime import datetime
from pathlib import Path

from kvroute.errors import ConfigError
from kvroute.model import Request
from kvroute.prefix import BlockHasher, PromptError, chat_key, estimate_tokens
from kvroute.prefix.blocks import hash_text_spans, hash_token_ids
from kvroute.prefix.keys import CHARS_PER_TOKEN
from kvroute.workload.base import Program, SimRequest, Workload

MOONCAKE_BLOCK_TOKENS = 512  # Mooncake: one hash id per 512-token block
_INT_ONLY = {int}


class TraceError(ConfigError):
    """A malformed trace line; the message names file:line and the field."""


class _BadLines:
    def __init__(self, skip: bool):
        self.skip, self.skipped = skip, 0

    def __call__(self, where: str, msg: str) -> None:
        if not self.skip:
            raise TraceError(f"{where}: {msg} (use --skip-bad to skip such lines)")
        self.skipped += 1


def _text_lines(path: Path, f) -> Iterator[str]:
    """Lines of a file opened in binary mode, decoded one by one, so that bytes which are not
    UTF-8 (a binary file given as a trace) name the line instead of ending in a traceback."""
    for lineno, raw in enumerate(f, 1):
        try:
            yield raw.decode()
        except UnicodeDecodeError:
            raise TraceError(f"{path}:{lineno}: not UTF-8 text — is this a binary file? A trace is "
                             "Mooncake or OpenAI-messages JSONL, or an Azure CSV") from None


def check_trace_file(path: str | Path) -> Path:
    """``path`` as a ``Path`` when it is a readable file; else a ``TraceError`` that says why."""
    p = Path(path)
    if p.is_dir():
        raise TraceError(f"{path}: is a directory; give a trace file in it (Mooncake or OpenAI-messages "
                         "JSONL, or an Azure CSV)")
    if not p.is_file():
        raise TraceError(f"{path}: no such trace file")
    return p


def _parsed_lines(path: Path, bad: _BadLines, parse):
    """``(lineno, parse(line, where, lineno))`` for each non-empty line; bad lines go to ``bad``."""
    with path.open("rb") as f:
        for lineno, line in enumerate(_text_lines(path, f), 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                item = parse(line, where, lineno)
            except TraceError as exc:
                bad(where, str(exc).removeprefix(f"{where}: "))
                continue
            yield lineno, item


_PARSED: dict[tuple, tuple[list, int]] = {}  # (path, mtime, size, parser, skip) → (lines, skipped)
_CACHE_MAX_BYTES = 64 << 20


def _cached_lines(path: Path, bad: _BadLines, parse, kind: str):
    """``_parsed_lines``, remembered for files up to 64 MB while they are unchanged.

    ``simulate`` replays one trace once per policy (and ``--sweep`` many times more); parsing
    JSON is about a tenth of a replay's cost. Larger traces stay lazy: they are read line by
    line and never held in memory.
    """
    st = path.stat()
    if st.st_size > _CACHE_MAX_BYTES:
        yield from _parsed_lines(path, bad, parse)
        return
    key = (str(path.resolve()), st.st_mtime_ns, st.st_size, kind, bad.skip)
    hit = _PARSED.get(key)
    if hit is None:
        counter = _BadLines(bad.skip)
        lines = list(_parsed_lines(path, counter, parse))
        hit = _PARSED[key] = (lines, counter.skipped)
        if len(_PARSED) > 8:
            _PARSED.pop(next(iter(_PARSED)))
    bad.skipped = hit[1]
    yield from hit[0]


def _json_object(line: str, where: str) -> dict:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: invalid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object")
    return obj


def _int_field(obj: dict, field: str, where: str, minimum: int = 0) -> int:
    if field not in obj:
        raise TraceError(f"{where}: missing field {field!r}")
    v = obj[field]
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < minimum or v != int(v):
        raise TraceError(f"{where}: field {field!r} must be an integer ≥ {minimum}, got {v!r}")
    return int(v)


class _Regions:
    """Assigns trace requests (which carry no region) to regions by weight, deterministically."""

    def __init__(self, weights: Mapping[str, float], seed: int):
        self.regions = list(weights) or ["local"]
        self.weights = [weights[r] for r in self.regions] if weights else [1.0]
        self.rng = random.Random(seed)

    def __call__(self) -> str:
        if len(self.regions) == 1:
            return self.regions[0]
        return self.rng.choices(self.regions, self.weights)[0]


class MooncakeTrace(Workload):
    """Open-loop replay of a Mooncake trace: ``timestamp`` (ms), ``input_length``,
    ``output_length``, ``hash_ids`` (chained ids of 512-token blocks).

    ``time_scale`` stretches inter-arrival times (GORGO v2: 1.0 saturates their testbed, 3.0
    does not); ``rate`` instead re-times arrivals as a Poisson process. The session key for
    consistent hashing is the conversation's second block id (the first is usually a shared
    system prompt).
    """

    name = "mooncake"

    def __init__(self, path: str | Path, time_scale: float = 1.0, rate: float | None = None,
                 regions: Mapping[str, float] | None = None, seed: int = 0, skip_bad: bool = False,
                 max_requests: int | None = None, max_prompt_tokens: int | None = None,
                 max_output_tokens: int | None = None):
        """``max_prompt_tokens`` drops longer requests (counted in ``dropped``); ``max_output_tokens``
        caps output lengths (GORGO v2 filters prompts over 24,000 tokens and caps output at 128)."""
        self.path = check_trace_file(path)
        if time_scale <= 0:
            raise TraceError(f"time_scale must be positive, got {time_scale}")
        self.time_scale, self.rate = time_scale, rate
        self.region_of = _Regions(regions or {}, seed)
        self.rng = random.Random(seed + 1)
        self.bad = _BadLines(skip_bad)
        self.max_requests = max_requests
        self.max_prompt_tokens, self.max_output_tokens = max_prompt_tokens, max_output_tokens
        self.dropped = 0
        # stamps earlier than the line before them (replayed in file order: such a request arrives
        # right after its predecessor); the first one as (line, its stamp, the one before)
        self.unsorted = 0
        self.first_unsorted: tuple[int, str, str] | None = None

    def _out_of_order(self, lineno: int, stamp: str, before: str) -> None:
        self.unsorted += 1
        if self.first_unsorted is None:
            self.first_unsorted = (lineno, stamp, before)

    def _retime(self, last_s: float, stamp_s: float) -> float:
        """Arrival time of the next kept request, given the previous one's (``last_s``) and its own
        stamp in seconds from the trace's start: Poisson at ``rate`` when set, else the stamp
        stretched by ``time_scale``."""
        if self.rate:
            return last_s + self.rng.expovariate(self.rate)
        return stamp_s * self.time_scale

    def _parse(self, line: str, where: str, lineno: int) -> tuple[float, int, int, tuple[int, ...]]:
        obj = _json_object(line, where)
        ts = obj.get("timestamp")
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0:
            raise TraceError(f"{where}: field 'timestamp' must be a number of ms ≥ 0, got {ts!r}")
        inp = _int_field(obj, "input_length", where, 1)
        out = _int_field(obj, "output_length", where, 0)
        ids = obj.get("hash_ids", [])
        if not isinstance(ids, list) or not set(map(type, ids)) <= _INT_ONLY:
            raise TraceError(f"{where}: field 'hash_ids' must be a list of integers")
        return float(ts), inp, max(1, out), tuple(ids)

    def arrivals(self) -> Iterator[SimRequest]:
        """The trace's requests in file order, re-timed and filtered as configured (counts ``dropped`` and
        out-of-order stamps as it goes)."""
        t = 0.0
        n = 0
        prev = 0.0
        self.unsorted, self.first_unsorted = 0, None
        for lineno, (ts, inp, out, ids) in _cached_lines(self.path, self.bad, self._parse, self.name):
            if ts < prev and not self.rate:
                self._out_of_order(lineno, f"{ts:g} ms", f"{prev:g} ms")
            prev = max(prev, ts)
            if self.max_prompt_tokens and inp > self.max_prompt_tokens:
                self.dropped += 1
                continue
            if self.max_output_tokens and out > self.max_output_tokens:
                out = self.max_output_tokens
            t = self._retime(t, ts / 1000.0)
            key = str(ids[1] if len(ids) > 1 else ids[0]) if ids else None
            req = Request(id=f"m{lineno}", arrival_s=t, region=self.region_of(), routing_key=key,
                          block_hashes=ids, block_tokens=MOONCAKE_BLOCK_TOKENS,
                          prompt_tokens=inp, max_output_tokens=out)
            yield SimRequest(req, out)
            n += 1
            if self.max_requests and n >= self.max_requests:
                return

    @property
    def skipped(self) -> int:
        """Malformed lines skipped (with ``skip_bad``)."""
        return self.bad.skipped


class AzureTrace(MooncakeTrace):
    """Open-loop replay of the Azure LLM inference CSV (TIMESTAMP, ContextTokens,
    GeneratedTokens): lengths only, so no prefix is ever shared."""

    name = "azure"

    def arrivals(self) -> Iterator[SimRequest]:
        """The CSV's rows in file order as prompt/output lengths (no block hashes), re-timed and filtered as
        configured."""
        t0 = None
        t = 0.0
        n = 0
        prev: datetime | None = None
        self.unsorted, self.first_unsorted = 0, None
        with self.path.open("rb") as f:
            reader = csv.reader(_text_lines(self.path, f))
            header = next(reader, None)
            expected = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
            if header != expected:
                raise TraceError(f"{self.path}:1: expected header {','.join(expected)}, got {header}")
            for lineno, row in enumerate(reader, 2):
                where = f"{self.path}:{lineno}"
                try:
                    if len(row) != 3:
                        raise TraceError(f"{where}: expected 3 columns, got {len(row)}")
                    try:
                        stamp = datetime.fromisoformat(row[0].strip()[:26])
                    except ValueError:
                        raise TraceError(f"{where}: field 'TIMESTAMP' is not a date-time: {row[0]!r}") from None
                    ints = []
                    for name, raw in zip(expected[1:], row[1:]):
                        if not raw.strip().isdigit():
                            raise TraceError(f"{where}: field {name!r} must be a non-negative integer, got {raw!r}")
                        ints.append(int(raw))
                except TraceError as exc:
                    self.bad(where, str(exc).removeprefix(f"{where}: "))
                    continue
                ctx, gen = ints
                if prev is not None and stamp < prev and not self.rate:
                    self._out_of_order(lineno, str(stamp), str(prev))
                prev = stamp if prev is None else max(prev, stamp)
                if ctx <= 0:
                    self.bad(where, "field 'ContextTokens' must be positive")
                    continue
                if self.max_prompt_tokens and ctx > self.max_prompt_tokens:
                    self.dropped += 1
                    continue
                if self.max_output_tokens and gen > self.max_output_tokens:
                    gen = self.max_output_tokens
                t0 = t0 or stamp
                t = self._retime(t, (stamp - t0).total_seconds())
                req = Request(id=f"a{lineno}", arrival_s=t, region=self.region_of(),
                              prompt_tokens=ctx, max_output_tokens=max(1, gen))
                yield SimRequest(req, max(1, gen))
                n += 1
                if self.max_requests and n >= self.max_requests:
                    return


class _Replay(Program):
    """Replays one recorded conversation turn by turn (closed loop)."""

    def __init__(self, turns: list[tuple[Request, int, tuple[tuple[int, ...], int] | None]]):
        self.turns = turns
        self.i = 0

    def _next(self) -> list[SimRequest]:
        if self.i >= len(self.turns):
            return []
        req, out, engine_blocks = self.turns[self.i]
        self.i += 1
        return [SimRequest(req, out, self, engine_blocks)]

    def start(self) -> list[SimRequest]:
        return self._next()

    def on_complete(self, done: SimRequest) -> list[SimRequest]:
        return self._next()


class OpenAIConversations(Workload):
    """Closed-loop replay of OpenAI-messages JSONL: one conversation per line,
    ``{"messages": [...], "user": "...", "region": "...", "max_tokens": n}``.

    Each user message becomes a request whose prompt is the conversation up to it; the
    assistant message that follows gives its output length (else ``max_tokens`` or 256), capped
    at the line's ``max_tokens`` when it has one, as an engine would stop there.

    Prompts are counted by kvroute's bytes/4 estimate; ``token_ratio`` (engine tokens per
    estimated token, what the gateway learns online from ``usage.prompt_tokens``) or a local
    ``tokenizer_path`` makes the simulator count the engine's tokens. With a ratio, a prefix
    block stays the same span of bytes and is worth ``block_tokens × ratio`` tokens, as in the
    gateway (gateway/tokens.py).
    ``clients`` conversations run concurrently per region; lines without a region go to the
    first region.

    ``engine_block_tokens``: the engines' own prefix-cache granularity in engine tokens (vLLM:
    its block size; llama-server: 1, it reuses any common prefix), apart from the router's index
    blocks. Without it an engine caches the index's blocks (64 estimated tokens: 95 llama.cpp or
    150 vLLM tokens of the tiny test models), and a warm turn recomputes on average half a block
    more than the real engine: against three llama-servers the simulator's warm turns prefilled
    159-167 new tokens where the engines reported 105-114 (issue 21, fidelity).
    """

    name = "openai"

    def __init__(self, path: str | Path, clients: dict[str, int], seed: int = 0,
                 skip_bad: bool = False, block_tokens: int = 64, token_ratio: float | None = None,
                 tokenizer_path: str | None = None, engine_block_tokens: int | None = None):
        if engine_block_tokens is not None and engine_block_tokens <= 0:
            raise ValueError(f"engine_block_tokens must be positive, got {engine_block_tokens}")
        self.engine_block_tokens = engine_block_tokens
        self.path = check_trace_file(path)
        self.clients = dict(clients) or {"local": 8}
        self.bad = _BadLines(skip_bad)
        self.hasher = BlockHasher(block_tokens, tokenizer_path)
        self.token_ratio = None if tokenizer_path else token_ratio
        self.default_region = next(iter(self.clients))
        self.queues: dict[str, list[_Replay]] = {r: [] for r in self.clients}
        self._load()

    def _load(self) -> None:
        for _, program in _parsed_lines(self.path, self.bad, self._conversation):
            region = program.turns[0][0].region
            self.queues.setdefault(region, []).append(program)
        for q in self.queues.values():
            q.reverse()  # pop() takes them in file order

    def _conversation(self, line: str, where: str, lineno: int) -> _Replay:
        obj = _json_object(line, where)
        messages = obj.get("messages")
        if not isinstance(messages, list) or not messages:
            raise TraceError(f"{where}: field 'messages' must be a non-empty list")
        region = obj.get("region", self.default_region)
        if region not in self.clients:
            raise TraceError(f"{where}: field 'region' is {region!r}; regions with clients: "
                             f"{', '.join(self.clients)}")
        user = obj.get("user")
        cap = obj.get("max_tokens")
        default_out = 256 if cap is None else cap
        if not isinstance(default_out, int) or default_out <= 0:
            raise TraceError(f"{where}: field 'max_tokens' must be a positive integer")
        ratio = self.token_ratio
        turns = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") != "user":
                continue
            try:
                key = chat_key(messages[: i + 1])
            except PromptError as exc:
                raise TraceError(f"{where}: {exc}") from None
            nxt = messages[i + 1] if i + 1 < len(messages) else None
            if isinstance(nxt, dict) and nxt.get("role") == "assistant" and isinstance(nxt.get("content"), str):
                out = max(1, estimate_tokens(nxt["content"]))
                out = min(out, cap) if cap is not None else out
            else:
                out = default_out
            hashes, tokens = self.hasher(key)
            block_tokens = self.hasher.block_tokens
            if ratio:
                tokens, block_tokens = max(1, round(tokens * ratio)), max(1, round(block_tokens * ratio))
            req = Request(id=f"o{lineno}.{i}", region=region, tenant=user, routing_key=user,
                          block_hashes=hashes, block_tokens=block_tokens,
                          prompt_tokens=tokens, max_output_tokens=out)
            turns.append((req, out, self._engine_blocks(key)))
        if not turns:
            raise TraceError(f"{where}: field 'messages' has no user message")
        return _Replay(turns)

    def _engine_blocks(self, key: str) -> tuple[tuple[int, ...], int] | None:
        """The prompt's blocks of ``engine_block_tokens`` engine tokens (None without it): token ids
        with a tokenizer, else spans of bytes worth that many tokens at the trace's one ratio of
        engine tokens to bytes (one ratio for all prompts, so equal prefixes cut equal blocks)."""
        b = self.engine_block_tokens
        if b is None:
            return None
        if self.hasher.tokenizer is not None:
            return hash_token_ids(self.hasher.tokenizer.encode(key, add_special_tokens=False).ids, b), b
        return hash_text_spans(key, max(1.0, b * CHARS_PER_TOKEN / (self.token_ratio or 1.0))), b

    def new_program(self, region: str, slot: int) -> Program | None:
        """The next conversation assigned to ``region`` to replay as a closed-loop client; None when that
        region's are used up."""
        q = self.queues.get(region)
        return q.pop() if q else None

    @property
    def skipped(self) -> int:
        """Malformed lines skipped (with ``skip_bad``)."""
        return self.bad.skipped
