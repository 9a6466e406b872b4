"""Plugins for prefill/decode disaggregation (composed by :mod:`kvroute.policy.pd`).

Decode side: ``pd_kv_fits`` (a filter: engines whose free KV can take the prompt's cache) and
``pd_proximity`` (a scorer: the chosen prefill engine itself, then its region, then elsewhere).
Decider conditions (evaluated with a :class:`PDState`, the chosen pair in hand; all of a
decider's conditions must hold for a request to be split):

* ``pd_uncached_at_least`` — llm-d's ``prefix-based-pd-decider``: split when the decode engine
  would have at least ``tokens`` prompt tokens to compute itself (its parameter
  ``nonCachedTokens``, llm-d-router ``pkg/epp/framework/plugins/scheduling/profilehandler/disagg``;
  vllm-project/router uses 256 in its example, ``pd_uncached_token_threshold``);
* ``pd_dynamo`` — Dynamo's conditional disaggregation (``PyDisaggregatedRouter.prefill_remote``
  in ai-dynamo/dynamo's vLLM examples): split when the prefill length net of prefix hits
  exceeds ``max_local_prefill`` (default 1000) *and* the prefill queue is shorter than
  ``max_prefill_queue`` (default 2);
* ``pd_adaptive`` — kvroute's own rule (below).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from kvroute.model import Endpoint, Request
from kvroute.policy.catalog import register_plugin
from kvroute.policy.plugins import Condition, DecisionState, Filter, Scorer
from kvroute.policy.profiles import resolve_profile

if TYPE_CHECKING:
    from kvroute.policy.router import Router


def kv_transfer_s(tokens: int, kv_bytes_per_token: int, link_gb_s: float, rtt_s: float) -> float:
    """Seconds to move ``tokens`` of KV cache over a link of ``link_gb_s`` GB/s with round trip
    ``rtt_s``: the decode side asks for the blocks (one round trip: NIXL's read request,
    Mooncake's bootstrap handshake), then the bytes stream at link speed. One formula for the
    simulator, the emulator and ``pd_adaptive``."""
    if tokens <= 0:
        return rtt_s
    return rtt_s + tokens * kv_bytes_per_token / (link_gb_s * 1e9)


class PDState(DecisionState):
    """A decision's facts plus the pair under consideration, for the decider's conditions:
    the prefill and decode endpoints and the prompt blocks each side's index holds."""

    __slots__ = ("prefill", "decode", "prefill_matched", "decode_matched")

    def __init__(self, req: Request, router: Router, rng: random.Random, prefill: Endpoint,
                 decode: Endpoint, prefill_matched: int, decode_matched: int):
        super().__init__(req, router.view, rng)
        self.prefill = prefill
        self.decode = decode
        self.prefill_matched = prefill_matched
        self.decode_matched = decode_matched

    def uncached_on_decode(self) -> int:
        """Prompt tokens the decode engine would compute if it served the request alone."""
        return self.req.new_prefill_tokens(self.decode_matched)

    def uncached_on_prefill(self) -> int:
        """Prompt tokens the prefill engine computes for this request."""
        return self.req.new_prefill_tokens(self.prefill_matched)


def _pd(st: DecisionState, name: str) -> PDState:
    if not isinstance(st, PDState):
        raise TypeError(f"condition {name} decides prefill/decode splits: use it under pd.disaggregate")
    return st


@register_plugin
class KVFits(Filter):
    """Engines whose free KV cache (probed usage, less the prompts dispatched since) can hold
    the prompt; all of them when none can (decode admission waits for memory rather than fail)."""

    name = "pd_kv_fits"
    inputs = frozenset({"kv_usage", "load"})

    def filter(self, st: DecisionState, eps: list[Endpoint]) -> list[Endpoint]:
        """The endpoints with room for the prompt's KV, or all of ``eps`` when none has; an
        endpoint of unknown capacity (kv_blocks 0) always passes."""
        need = st.req.prompt_tokens
        kept = [e for e in eps if not e.kv_blocks
                or (1.0 - e.kv_usage) * e.kv_blocks * e.block_size >= need + e.dispatched_since_probe * need]
        return kept or eps


@register_plugin
class Proximity(Scorer):
    """Distance from the request's prefill engine: 0 for that engine itself (a mixed engine, no
    transfer), 1 in its region, 2 elsewhere (a cross-region transfer); 0 everywhere when the
    request has no prefill engine."""

    name = "pd_proximity"

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """The distance class of each endpoint from ``Request.pd_prefill``."""
        pid, region = st.req.pd_prefill, st.req.pd_prefill_region
        if pid is None:
            return [0.0] * len(eps)
        return [0.0 if e.id == pid else 1.0 if e.region == region else 2.0 for e in eps]


@register_plugin
class UncachedAtLeast(Condition):
    """Split when the decode engine would compute at least ``tokens`` uncached prompt tokens
    itself (llm-d's prefix-based decider, ``nonCachedTokens``)."""

    name = "pd_uncached_at_least"
    inputs = frozenset({"prefix"})

    def __init__(self, tokens: int = 256):
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be an integer >= 0, got {tokens!r}")
        self.tokens = tokens

    def holds(self, st: DecisionState, eps: list[Endpoint]) -> bool:
        """True when the prompt minus the decode engine's cached prefix is ≥ ``tokens``."""
        return _pd(st, self.name).uncached_on_decode() >= self.tokens


@register_plugin
class DynamoConditional(Condition):
    """Dynamo's conditional disaggregation: split when the prefill net of prefix hits is longer
    than ``max_local_prefill`` tokens and the prefill engine has fewer than
    ``max_prefill_queue`` requests waiting (probed waiting + prefills this router sent that
    have not finished)."""

    name = "pd_dynamo"
    inputs = frozenset({"prefix", "load"})

    def __init__(self, max_local_prefill: int = 1000, max_prefill_queue: int = 2):
        for n, v in (("max_local_prefill", max_local_prefill), ("max_prefill_queue", max_prefill_queue)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{n} must be an integer >= 0, got {v!r}")
        self.max_local_prefill = max_local_prefill
        self.max_prefill_queue = max_prefill_queue

    def holds(self, st: DecisionState, eps: list[Endpoint]) -> bool:
        """Both of Dynamo's conditions: a long local prefill and a short prefill queue."""
        pd = _pd(st, self.name)
        queue = max(pd.prefill.waiting, pd.prefill.inflight - pd.prefill.running)
        return pd.uncached_on_decode() > self.max_local_prefill and queue < self.max_prefill_queue


@register_plugin
class Adaptive(Condition):
    """kvroute's rule: split when the time the request loses by going through the prefill
    engine is less than the stall it spares the decode engine's running sequences.

    On a hardware profile's step-time model (``profile``), with the router's queued prefill
    tokens on each engine:

    * local   = backlog_D · c_prefill + prefill(U_D)      (U_D: uncached on the decode engine)
    * remote  = backlog_P · c_prefill + prefill(U_P) + transfer(prompt − D's cached prefix)
    * stall   = prefill(U_D) × running sequences on D     (each waits while D prefills)

    and split iff remote − local < ``stall_weight`` × stall. An idle decode engine keeps short
    prompts (nothing to spare, the transfer costs), a busy one sends long prompts away, and a
    prefill engine with a long queue stops being worth it. Transfer: :func:`kv_transfer_s` at
    ``link_gb_s`` with ``rtt_s`` (``cross_region_rtt_s`` when the pair spans regions)."""

    name = "pd_adaptive"
    inputs = frozenset({"prefix", "prefill_backlog", "load"})

    def __init__(self, profile: str = "h100-llama3.2-3b", link_gb_s: float = 25.0, rtt_s: float = 0.0005,
                 cross_region_rtt_s: float = 0.08, stall_weight: float = 1.0):
        self.profile = resolve_profile(profile)  # as the llm_d predictor does (policy/profiles.py)
        for n, v in (("link_gb_s", link_gb_s), ("rtt_s", rtt_s), ("cross_region_rtt_s", cross_region_rtt_s),
                     ("stall_weight", stall_weight)):
            if isinstance(v, bool) or not isinstance(v, int | float) or v < 0 or (n == "link_gb_s" and v <= 0):
                raise ValueError(f"{n} must be a number {'> 0' if n == 'link_gb_s' else '>= 0'}, got {v!r}")
        self.kv_bytes = self.profile.kv_bytes_per_token or 131072  # 128 KiB/token when the profile has none
        self.link_gb_s, self.rtt_s, self.cross_rtt_s = float(link_gb_s), float(rtt_s), float(cross_region_rtt_s)
        self.stall_weight = float(stall_weight)

    def holds(self, st: DecisionState, eps: list[Endpoint]) -> bool:
        """Split iff the extra TTFT of going remote is below the decode stall it avoids."""
        pd = _pd(st, self.name)
        prof = self.profile
        u_d, u_p = pd.uncached_on_decode(), pd.uncached_on_prefill()
        prefill_d = prof.prefill_time(u_d) if u_d else 0.0
        local = pd.decode.queued_prefill_tokens * prof.c_prefill_s + prefill_d
        rtt = self.rtt_s if pd.prefill.region == pd.decode.region else self.cross_rtt_s
        remote = (pd.prefill.queued_prefill_tokens * prof.c_prefill_s + (prof.prefill_time(u_p) if u_p else 0.0)
                  + kv_transfer_s(u_d, self.kv_bytes, self.link_gb_s, rtt))
        stall = prefill_d * (pd.decode.running + pd.decode.dispatched_since_probe)
        return bool(remote - local < self.stall_weight * stall)
