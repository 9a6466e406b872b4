"""Measure live engines for `kvroute calibrate`: prefill time against prompt length, decode step time against batch
size and context — every point on all listed engines at once, because engines that share a machine (cores, memory
bandwidth, the network stack) slow each other down, and that contention is part of what a deployment's profile must
describe. Further probes: calibrate/slot_probe.py, newcomer_probe.py, mixed_probe.py.

Prompts are fresh text (a unique nonce first, so no engine has any of it cached) sized from each engine's own token
count, so a point's length is in the engine's tokens, never an estimate. Two first requests of different sizes give
a line — a fixed cost per prompt (the nonce, a BOS) plus bytes per token — refitted on every answer's
``usage.prompt_tokens``; one size alone put every point ~40 tokens over its target against a real vLLM, whose
tokenizer spent more tokens on the nonce than on the words. The engines' context limit (vLLM's ``max_model_len`` in
/v1/models) bounds the sweep: the first requests stay below half of it, and lengths the limit cannot hold are
replaced by the longest that fits (:func:`fit_sweep`), with a line saying so.

* **Prefill**: a non-streamed request with ``max_tokens: 1``; its latency is the time to the first
  token (one prefill step; HTTP and scheduling are in it, as they are for every client).
* **Decode**: ``batch`` prompts of ``ctx`` tokens are first sent once (``max_tokens: 1``), so the
  engine holds them in its prefix cache; then all are streamed together with ``decode_tokens``
  tokens each. Once every stream has its first token and before any has finished, all sequences
  decode in one batch, one token per step: the median gap between tokens in that window is the
  step time, at the context ``ctx`` plus half the tokens generated (calibrate/decode_points.py).

**Repeats** (issue 21w): each repeat takes every prefill, warm prefill and decode point once, odd repeats in
the reverse order, and the fit takes each point's median over all repeats. The decode points used to be taken
once, after both prefill repeats and the probes: a drift of the machine's speed between the two stretches then
moved c0 (from the decode fit) against the prefill intercept taken after it, and a decode point rested on one
moment only. Three repeats by default, the fewest whose median one outlying repeat cannot move; then more, up
to ``max_repeats``, while leaving one repeat out would move a kind of point by more than ``shift_limit``
(calibrate/repeat_check.py). The probes (noise, slots, newcomer, mixed, busy engines) follow the repeats.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import aiohttp

from kvroute.calibrate.decode_points import busy_points, decode_round
from kvroute.calibrate.host_cpu import CpuLedger
from kvroute.calibrate.mixed_decode_probe import mixed_decode_points
from kvroute.calibrate.mixed_probe import mixed_points
from kvroute.calibrate.newcomer_probe import newcomer_points
from kvroute.calibrate.repeat_check import too_wide
from kvroute.calibrate.slot_probe import slot_points
from kvroute.errors import ServiceError

WORDS = ("the", "a", "of", "and", "to", "in", "is", "for", "on", "that", "with", "as", "it", "at", "by", "from", "this",
         "be", "are", "or", "an", "was", "not", "but", "all", "can", "has", "more", "one", "time", "data", "model",
         "system", "value", "state", "point", "number")

LLAMA_SERVER_N_BATCH = 2048  # llama-server's default --batch-size (logical batch of prompt tokens)


class CalibrationError(ServiceError):
    """An engine could not be measured; the message names it and why."""


class ContextOverflow(CalibrationError):
    """A prompt was longer than the engine's context limit (it answered 400 saying so)."""


def _overflow(answer: str) -> bool:
    """Whether an engine's 400 answer says the prompt left no room in its context. vLLM 0.32 says
    "context length" for a prompt longer than ``max_model_len``, but a prompt of exactly
    ``max_model_len`` tokens leaves ``max_tokens = max_model_len - input_length = 0``
    (.venv-vllm ``vllm/entrypoints/serve/utils/api_utils.py`` ``get_max_tokens``), which its
    sampling params refuse as "max_tokens must be at least 1, got 0" (``sampling_params.py``)."""
    text = answer.lower()
    return "context" in text or "max_tokens must be at least 1, got 0" in text


@dataclass
class Sweep:
    """What to measure (every point on every engine at once: module docstring)."""

    prefill_lengths: tuple[int, ...] = (128, 512, 1024, 2048)
    batch_sizes: tuple[int, ...] = (1, 2, 4)
    contexts: tuple[int, ...] = (128, 1024)
    decode_tokens: int = 24
    repeats: int = 3  # prefill, warm and decode points each; medians over repeats (calibrate/repeat_check.py)
    timeout_s: float = 120.0  # any one request
    # warm prefills: a prompt of ``ctx`` tokens, then it plus ``n`` new tokens (its prefix cached):
    # new tokens' attention over a cached context, which cold prefills cannot tell apart from the
    # per-token cost (fit.py). 96 and 256 new tokens, like a chat turn's new part: past llama.cpp's
    # 64-row attention tile (below it a row-by-row kernel the model lacks: profile prefill_attn_tile)
    warm_contexts: tuple[int, ...] = (512, 1536)
    warm_lengths: tuple[int, ...] = (96, 256)
    noise_probes: int = 8  # rounds of a tiny prompt, for the per-request delay's spread (noise.py)
    # rounds of a tiny prompt beside a decoding batch per decode context (fit.py's c_admit_s, the median):
    # one round gave a stall of 2.4 ms, then 0.05 ms: 4 of 20 fidelity ratios crossed the 20 % line (issue 21)
    busy_rounds: int = 3
    slot_sizes: tuple[int, ...] = (1024, 3072)  # llama-server's slot copies (calibrate/slot_probe.py)
    slot_rounds: int = 3
    newcomer_rounds: int = 0  # prefills started beside busy engines (calibrate/newcomer_probe.py; --host-cores: 2)
    mixed_rounds: int = 0  # two prompts in one step against one (calibrate/mixed_probe.py: h_cv)
    mixed_decode_rounds: int = 0  # a warm prefill joining a decoding batch (calibrate/mixed_decode_probe.py)
    # check and repeat: more repeats, up to max_repeats, while leaving one repeat out moves a kind of point by
    # more than shift_limit (calibrate/repeat_check.py; 5 %: half the band half of bench fidelity's ratios
    # must meet, issue 21 item 8)
    max_repeats: int = 5
    shift_limit: float = 0.05


@dataclass
class EngineFacts:
    """What an engine says about itself (None: it does not say)."""

    url: str
    bytes_per_token: float
    kv_tokens: int | None = None
    slots: int | None = None
    batch_tokens: int | None = None  # prompt tokens one engine step takes at most
    max_model_len: int | None = None  # context limit (prompt + output tokens), where it says
    # tokens per block of its prefix cache: a cached prefix is reused in whole blocks (vLLM's
    # block size; llama-server reuses any common prefix: 1)
    cache_block: int | None = None


@dataclass
class Measurements:
    """The raw points, each with the sweep value it was taken for: ``prefill`` (target length,
    engine's prompt tokens, seconds), ``decode`` (batch, target context, mean context, step s)."""

    engines: list[EngineFacts]
    model: str = ""
    prefill: list[tuple[int, int, float]] = field(default_factory=list)
    decode: list[tuple[int, int, float, float]] = field(default_factory=list)
    # (target context, target new tokens, cached tokens, new tokens, seconds) per warm prefill
    warm: list[tuple[int, int, int, int, float]] = field(default_factory=list)
    probes: list[tuple[int, float]] = field(default_factory=list)  # (engine index, seconds) tiny prompts
    # (batch, context, prompt tokens, seconds, the batch's longest token gap meanwhile): a tiny
    # prompt beside a decoding batch
    busy: list[tuple[int, float, int, float, float]] = field(default_factory=list)
    slot_saves: list[tuple[int, float]] = field(default_factory=list)  # calibrate/slot_probe.py
    newcomer: list[tuple[int, str, float, float]] = field(default_factory=list)  # calibrate/newcomer_probe.py
    mixed: list[tuple[int, float, int, int, float]] = field(default_factory=list)  # calibrate/mixed_probe.py
    # calibrate/mixed_decode_probe.py: (batch, mean context, cached, new, decode step s, joined step s, latency s)
    mixed_decode: list[tuple[int, float, int, int, float, float, float]] = field(default_factory=list)
    # the lengths of prefill, warm and decode after each repeat of the sweep (calibrate/repeat_check.py)
    repeat_ends: list[tuple[int, int, int]] = field(default_factory=list)
    wall_s: float = 0.0
    background_cores: float | None = None  # other CPU on the engines' machine meanwhile (host_cpu.py)
    sweep: Sweep | None = None  # what was swept: the asked sweep as the context limit let it run


def _text(n_bytes: int, rng: random.Random) -> str:
    """A fresh prompt of ``n_bytes`` UTF-8 bytes, the nonce included (never shorter than it), the
    last word cut to fit (a whole word is several tokens of a small vocabulary: targets missed)."""
    out = [f"calibration {uuid.uuid4().hex}."]
    nonce = len(out[0])
    size = nonce
    while size < n_bytes:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:max(n_bytes, nonce)]


class _Engine:
    """One engine's completions endpoint."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str, sweep: Sweep, api_key: str | None):
        self.session, self.url, self.model, self.sweep = session, url.rstrip("/"), model, sweep
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.bytes_per_token = 4.0
        self.overhead = 0.0  # tokens a prompt costs beyond its words (the nonce, a BOS)
        self.seen: list[tuple[int, int]] = []  # (prompt bytes, the engine's prompt tokens)
        self.rng = random.Random(url)
        self.cached: int | None = None  # cached prompt tokens of the last answer, where the engine says

    def suffix(self, tokens: int) -> str:
        """Text of about ``tokens`` tokens to append to a fresh prompt: words only (no nonce, whose
        hex digits cost a small vocabulary many tokens; the prompt before it is already fresh)."""
        n_bytes = max(1, int(tokens * self.bytes_per_token))
        words: list[str] = []
        size = 0
        while size < n_bytes:
            words.append(self.rng.choice(WORDS))
            size += len(words[-1]) + 1
        return " ".join(words)[:n_bytes]

    def prompt(self, tokens: int) -> str:
        return _text(max(1, int((tokens - self.overhead) * self.bytes_per_token)), self.rng)

    def learn(self, n_bytes: int, tokens: int) -> None:
        """Refit tokens = overhead + bytes / bytes_per_token on every prompt the engine counted."""
        self.seen.append((n_bytes, tokens))
        fitted = token_line(self.seen)
        if fitted is not None:
            self.overhead, self.bytes_per_token = fitted

    async def complete(self, prompt: str, max_tokens: int) -> tuple[float, int]:
        """Non-streamed: (seconds, the engine's prompt tokens)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        t0 = time.perf_counter()
        try:
            async with self.session.post(f"{self.url}/v1/completions", json=body, headers=self.headers,
                                         timeout=aiohttp.ClientTimeout(total=self.sweep.timeout_s)) as r:
                data = await r.json(content_type=None)
                if r.status != 200:
                    kind = ContextOverflow if r.status == 400 and _overflow(str(data)) else CalibrationError
                    raise kind(f"{self.url}: /v1/completions answered {r.status}: {str(data)[:200]}")
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
            raise CalibrationError(f"{self.url}: {exc.__class__.__name__}: {exc}") from None
        elapsed = time.perf_counter() - t0
        try:
            tokens = int(data["usage"]["prompt_tokens"])
        except (KeyError, TypeError, ValueError):
            raise CalibrationError(f"{self.url}: the answer has no usage.prompt_tokens") from None
        try:
            self.cached = int(data["usage"]["prompt_tokens_details"]["cached_tokens"])
        except (KeyError, TypeError, ValueError):
            self.cached = None
        self.learn(len(prompt.encode()), tokens)
        return elapsed, tokens

    async def sized(self, tokens: int, max_tokens: int = 1) -> tuple[float, int]:
        """:meth:`complete` on a fresh prompt of about ``tokens`` tokens, 10 % shorter after each
        context overflow (up to 3 times): bytes per token drift with length (vLLM's tiny test model:
        1.72 at 500 tokens, 1.50 past 1,000), so a prompt near the limit may overshoot the margin."""
        for _ in range(3):
            try:
                return await self.complete(self.prompt(tokens), max_tokens)
            except ContextOverflow:
                tokens = int(tokens * 0.9)
        return await self.complete(self.prompt(tokens), max_tokens)

    async def stream_times(self, prompt: str, max_tokens: int, on_first: Callable[[], None] | None = None,
                           on_token: Callable[[], None] | None = None) -> list[float]:
        """Streamed: the arrival time of every token event; ``on_first()`` at the first, ``on_token()`` at each."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "stream": True}
        times = []
        try:
            async with self.session.post(f"{self.url}/v1/completions", json=body, headers=self.headers,
                                         timeout=aiohttp.ClientTimeout(total=self.sweep.timeout_s)) as r:
                if r.status != 200:
                    raise CalibrationError(f"{self.url}: streaming /v1/completions answered {r.status}")
                async for line in r.content:
                    if line.startswith(b"data:") and b"[DONE]" not in line and b'"text"' in line:
                        times.append(time.perf_counter())
                        if on_first is not None and len(times) == 1:
                            on_first()
                        if on_token is not None:
                            on_token()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise CalibrationError(f"{self.url}: {exc.__class__.__name__}: {exc}") from None
        return times

    async def facts(self, max_model_len: int | None = None) -> EngineFacts:
        """Its tokenizer's bytes per token and fixed cost per prompt (from two first requests, below half of
        ``max_model_len``: even one token per byte fits) and capacity, where it says."""
        size = 2000 if max_model_len is None else max(64, min(2000, max_model_len // 2))
        for n_bytes in (size // 2, size):
            await self.complete(_text(n_bytes, self.rng), 1)
        if token_line(self.seen) is None:  # no line through the two: bytes per token alone
            total_bytes, total_tokens = sum(b for b, _ in self.seen), sum(t for _, t in self.seen)
            self.overhead, self.bytes_per_token = 0.0, total_bytes / max(1, total_tokens)
        facts = EngineFacts(self.url, self.bytes_per_token, max_model_len=max_model_len)
        # llama-server: slots and context per slot (other engines have no /props: nothing learned)
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, json.JSONDecodeError, AttributeError):
            async with self.session.get(f"{self.url}/props", timeout=aiohttp.ClientTimeout(total=5)) as r:
                props = await r.json(content_type=None) if r.status == 200 else {}
            slots = props.get("total_slots")
            n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
            if isinstance(slots, int) and slots > 0:
                facts.slots = slots
                # llama-server evaluates at most n_batch (default 2048) prompt tokens per step;
                # /props does not say, so the default is assumed (override: --max-batched-tokens)
                facts.batch_tokens = LLAMA_SERVER_N_BATCH
                # its slots reuse the longest common prefix token by token (cached counts such
                # as 1,762 and 1,796 in the fidelity runs, not whole blocks)
                facts.cache_block = 1
                if isinstance(n_ctx, int) and n_ctx > 0:
                    facts.kv_tokens = slots * n_ctx
        if facts.kv_tokens is None:
            from kvroute.gateway.probes import kv_block_size, kv_capacity

            # vLLM's cache_config_info, SGLang's max_total_num_tokens (unreadable: capacity unknown)
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
                async with self.session.get(f"{self.url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    text = await r.text() if r.status == 200 else ""
                    facts.kv_tokens, facts.cache_block = kv_capacity(text), kv_block_size(text)
        return facts


def _another(m: Measurements, sweep: Sweep, say) -> bool:
    """Whether the repeats so far disagree too much (calibrate/repeat_check.py), saying so."""
    wide = too_wide(m, sweep.shift_limit)
    if wide:
        say(f"after {len(m.repeat_ends)} repeats, leaving one out moves " + ", ".join(
            f"{k} by {v:.1%}" for k, v in wide.items()) + f" (limit {sweep.shift_limit:.0%}): another repeat")
    return bool(wide)


async def _warm_point(engines: list[_Engine], ctx: int, n: int, m: Measurements, say) -> None:
    """One warm prefill on every engine at once: a fresh prompt of ``ctx`` tokens, then that prompt plus ``n`` fresh
    tokens; the second's time is a prefill of its uncached tokens over the cached context, both as the engine counts
    them (an engine that does not report cached tokens gives no point)."""
    bases = [e.prompt(ctx) for e in engines]
    await asyncio.gather(*(e.complete(b, 1) for e, b in zip(engines, bases, strict=True)))

    async def grow(e: _Engine, base: str) -> tuple[float, int, int | None]:
        s, tokens = await e.complete(base + " " + e.suffix(n), 1)
        return s, tokens, e.cached

    got = await asyncio.gather(*(grow(e, b) for e, b in zip(engines, bases, strict=True)))
    m.warm.extend((ctx, n, cached, tokens - cached, s) for s, tokens, cached in got
                  if cached is not None and cached > 0 and tokens > cached)
    say(f"warm prefill {n} tokens after {ctx}: " + ", ".join(
        f"{s * 1000:.1f} ms ({c} cached)" for s, _, c in got))


def token_line(seen: list[tuple[int, int]]) -> tuple[float, float] | None:
    """(overhead tokens, bytes per token) of the least-squares line tokens = overhead + bytes / bytes_per_token through
    (prompt bytes, prompt tokens) points; None when they do not span two sizes or give a line no tokenizer has (a
    negative overhead is clamped to 0)."""
    n = len(seen)
    xs = [float(b) for b, _ in seen]
    ys = [float(t) for _, t in seen]
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var <= 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var  # tokens per byte
    if not 1 / 64 <= slope <= 4:
        return None
    overhead = my - slope * mx
    if overhead < 0:  # no negative cost: refit through the origin
        return 0.0, sum(xs) / max(1.0, sum(ys))
    return overhead, 1 / slope


def fit_sweep(sweep: Sweep, max_model_len: int | None) -> tuple[Sweep, list[str]]:
    """The sweep the engines' context limit can hold, and what was changed: a prefill length (plus its one output token)
    or a decode context (plus ``decode_tokens``) over the limit, less a margin of 2 % for how closely prompts hit their
    length, is replaced by the longest that fits."""
    if max_model_len is None:
        return sweep, []
    margin = max(4, max_model_len // 50)
    notes = []

    def fit(values: tuple[int, ...], extra: int, name: str) -> tuple[int, ...]:
        top = max_model_len - extra - margin
        if top < 16:
            raise CalibrationError(f"the engines' max_model_len ({max_model_len}) leaves no room for {name} "
                                   f"(with {extra} output token(s))")
        kept = tuple(dict.fromkeys(v if v <= top else top for v in values))
        if kept != values:
            notes.append(f"{name} {','.join(map(str, values))} → {','.join(map(str, kept))}: the engines' "
                         f"max_model_len is {max_model_len}")
        return kept

    fitted = replace(sweep, prefill_lengths=fit(sweep.prefill_lengths, 1, "prefill lengths"),
                     contexts=fit(sweep.contexts, sweep.decode_tokens, "decode contexts"),
                     warm_contexts=fit(sweep.warm_contexts, max(sweep.warm_lengths, default=0) + 1,
                                       "warm prefill contexts"))
    return fitted, notes


async def _model_card(session: aiohttp.ClientSession, url: str, model: str | None) -> tuple[str, int | None]:
    """The model to ask for (``model``, else the first the engine lists: llama-server takes any
    name, vLLM needs its own) and its context limit where the card says (vLLM's max_model_len)."""
    try:
        async with session.get(f"{url.rstrip('/')}/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as r:
            data = await r.json(content_type=None)
        cards = [c for c in data["data"] if isinstance(c, dict)]
        card = next((c for c in cards if c.get("id") == model), cards[0] if model is None else {})
        name = model if model is not None else str(card["id"])
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
        raise CalibrationError(f"{url}: cannot read /v1/models ({exc.__class__.__name__}: {exc}); "
                               "is an engine listening there?") from None
    limit = card.get("max_model_len")
    return name, limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


async def measure(urls: list[str], model: str | None = None, sweep: Sweep | None = None,
                  api_key: str | None = None, log=None) -> Measurements:
    """Run the sweep against every engine at once (see the module docstring)."""
    sweep = sweep or Sweep()
    say = log or (lambda _msg: None)
    t0 = time.perf_counter()
    ledger, cpu0 = CpuLedger(urls), time.process_time()
    # a fresh connection per request: llama-server closes after every stream while advertising
    # keep-alive, and a reused dead connection would fail a point
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        model, _ = await _model_card(session, urls[0], model)
        limits = [limit for _, limit in await asyncio.gather(*(_model_card(session, u, model) for u in urls))]
        known = [limit for limit in limits if limit is not None]
        sweep, notes = fit_sweep(sweep, min(known) if known else None)
        for note in notes:
            say(note)
        engines = [_Engine(session, u, model, sweep, api_key) for u in urls]
        facts = list(await asyncio.gather(*(e.facts(limit) for e, limit in zip(engines, limits, strict=True))))
        m = Measurements(facts, model, sweep=sweep)
        rep = 0
        while rep < sweep.repeats or (rep < sweep.max_repeats and _another(m, sweep, say)):
            # odd repeats run backwards, so a load that drifts during the sweep biases no slope; every repeat
            # takes prefill, warm and decode points, so the decode terms (c0, which the prefill fit's intercept
            # is taken after) are measured over the same minutes as the prefill ones (issue 21w)
            back = rep % 2 == 1
            for n in (sweep.prefill_lengths[::-1] if back else sweep.prefill_lengths):
                got = await asyncio.gather(*(e.sized(n) for e in engines))
                m.prefill.extend((n, tokens, s) for s, tokens in got)
                say(f"prefill {n} tokens (repeat {rep + 1}): " + ", ".join(f"{s * 1000:.1f} ms" for s, _ in got))
            warm = [(ctx, n) for ctx in sweep.warm_contexts for n in sweep.warm_lengths]
            for ctx, n in (warm[::-1] if back else warm):
                await _warm_point(engines, ctx, n, m, say)
            m.decode.extend(await decode_round(engines, sweep, say, backwards=back))
            m.repeat_ends.append((len(m.prefill), len(m.warm), len(m.decode)))
            rep += 1
        for _ in range(sweep.noise_probes):
            got = await asyncio.gather(*(e.complete(e.prompt(16), 1) for e in engines))
            m.probes.extend((i, s) for i, (s, _) in enumerate(got))
        m.slot_saves = await slot_points(engines, facts, sweep.slot_sizes, sweep.slot_rounds, say)
        m.newcomer, m.mixed = await newcomer_points(engines, sweep, say), await mixed_points(engines, sweep, say)
        slots = [f.slots for f in facts if f.slots]
        m.mixed_decode = await mixed_decode_points(engines, sweep, say, slots=min(slots, default=None))
        for ctx in sweep.contexts:
            for _ in range(sweep.busy_rounds):
                m.busy.extend(await busy_points(engines, ctx, max(sweep.batch_sizes), sweep.decode_tokens,
                                                sweep.timeout_s, slots, say))
    m.wall_s = time.perf_counter() - t0
    m.background_cores = ledger.background(m.wall_s, time.process_time() - cpu0)
    return m
