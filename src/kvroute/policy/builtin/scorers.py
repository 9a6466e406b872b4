"""Scorers: one number per endpoint, each declaring what it reads.

Raw values feed a ``cost`` (weighted sum, lower wins); :meth:`Scorer.normalised` feeds a
``score`` (weighted sum of values in [0, 1], higher wins). Per-endpoint loops are list
comprehensions over plain attributes: they run for every endpoint of every decision.
"""

from __future__ import annotations

from kvroute.model import Endpoint, Request
from kvroute.policy.catalog import register_plugin
from kvroute.policy.hooks import Lifecycle
from kvroute.policy.plugins import DecisionState, Scorer


@register_plugin
class PrefixRatio(Scorer):
    """Share of the prompt cached on the endpoint (its longest prefix match), higher is better."""

    name = "prefix"
    inputs = frozenset({"prefix"})
    lower_is_better = False

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """Matched leading blocks × the prompt share one block covers, per endpoint (0 with no match)."""
        per_block = st.req.hit_ratio(1)  # the share of the prompt one cached block covers
        get = st.matches.get
        return [get(e.id, 0) * per_block for e in eps]

    def normalised(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """The share itself, capped at 1 (a last partial block can take it past 1 by less than a block)."""
        return [min(1.0, v) for v in self.values(st, eps)]


@register_plugin
class PrefixBlocks(Scorer):
    """Leading prompt blocks cached on the endpoint, higher is better."""

    name = "prefix_blocks"
    inputs = frozenset({"prefix"})
    lower_is_better = False

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """How many leading prompt blocks the index says each endpoint holds."""
        get = st.matches.get
        return [get(e.id, 0) for e in eps]


@register_plugin
class Queue(Scorer):
    """Waiting requests at the last probe (llm-d's queue scorer)."""

    name = "queue"
    inputs = frozenset({"load"})

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """Each endpoint's waiting count from its last probe."""
        return [e.waiting for e in eps]


@register_plugin
class KVCacheUtil(Scorer):
    """KV-cache usage at the last probe; normalised as the free share, 1 − usage (llm-d)."""

    name = "kv_cache_util"
    inputs = frozenset({"kv_usage"})

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """Each endpoint's KV-cache usage in [0, 1] from its last probe."""
        return [e.kv_usage for e in eps]

    def normalised(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """The free share, 1 − usage, so that emptier caches score higher."""
        return [1.0 - e.kv_usage for e in eps]  # probes clamp usage to [0, 1]


@register_plugin
class Inflight(Scorer):
    """Requests this router dispatched to the endpoint and not yet finished."""

    name = "inflight"
    inputs = frozenset({"load"})

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """Requests in flight per endpoint, as this router counted them."""
        return [e.inflight for e in eps]


@register_plugin
class QueuedPrefillTokens(Scorer):
    """Prefill tokens dispatched to the endpoint and not yet past their first token: its queue
    wait in tokens (GORGO v1 §3.4's QueueWaitTime, counted as the queued requests only)."""

    name = "queued_prefill_tokens"
    inputs = frozenset({"prefill_backlog"})

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """Queued prefill tokens per endpoint, as this router counted them."""
        return [e.queued_prefill_tokens for e in eps]


@register_plugin
class InflightTokens(Scorer):
    """Prompt tokens of the requests in flight on the endpoint (GORGO's queued tokens)."""

    name = "inflight_tokens"
    inputs = frozenset({"load"})

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """Prompt tokens in flight per endpoint, as this router counted them."""
        return [e.inflight_tokens for e in eps]


@register_plugin
class BatchSize(Scorer):
    """Engine batch: running + waiting at the last probe, plus dispatches since (LMetric's BS)."""

    name = "batch_size"
    inputs = frozenset({"load"})

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """running + waiting + dispatched since the last probe, per endpoint."""
        return [e.running + e.waiting + e.dispatched_since_probe for e in eps]


@register_plugin
class BatchHeadroom(Scorer):
    """Batch size; normalised as 1 − batch / the largest batch (Bailian's load term)."""

    name = "batch_headroom"
    inputs = frozenset({"load"})

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """running + waiting + dispatched since the last probe, per endpoint."""
        return [e.running + e.waiting + e.dispatched_since_probe for e in eps]

    def normalised(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """1 − batch / the largest batch among ``eps`` (an idle fleet scores 1 everywhere)."""
        sizes = self.values(st, eps)
        top = max(1.0, max(sizes))
        return [1.0 - b / top for b in sizes]


@register_plugin
class NewPrefill(Scorer):
    """Tokens the endpoint must prefill before this request's first token: its queued prefill
    backlog plus this request's uncached tokens."""

    name = "new_prefill"
    inputs = frozenset({"prefix", "prefill_backlog"})

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """Queued prefill tokens plus this request's uncached tokens, per endpoint."""
        return [n + e.queued_prefill_tokens for n, e in zip(st.new_prefill(eps), eps)]


@register_plugin
class UncachedTokens(Scorer):
    """This request's prompt tokens not cached on the endpoint (GORGO's t_p term)."""

    name = "uncached_tokens"
    inputs = frozenset({"prefix"})

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """Prompt tokens past each endpoint's cached prefix."""
        return st.new_prefill(eps)  # type: ignore[return-value]  # ints, read-only


@register_plugin
class BusyUncached(Scorer):
    """This request's uncached tokens × the share of the candidates that have prefill queued (as this
    router counts it): while every replica is busy, a prefill the cache would have saved is work some
    queue waits for; while some are idle, sending it there costs nobody (``auto``, docs/auto.md)."""

    name = "busy_uncached"
    inputs = frozenset({"prefix", "prefill_backlog"})

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """Uncached tokens per endpoint, times the share of ``eps`` whose queued prefill is above 0."""
        busy = sum(1 for e in eps if e.queued_prefill_tokens > 0) / len(eps) if eps else 0.0
        return [n * busy for n in st.new_prefill(eps)]


@register_plugin
class WaitingUncached(Scorer, Lifecycle):
    """This request's uncached tokens × the fewest of this router's requests waiting for their first token on
    any candidate. An engine prefills first come, first served: a prefill the cache would have saved delays
    the requests that arrive during its wait, about as many as were waiting when it came (Little's law), so
    at least that many wherever it goes while every candidate has a queue (``auto``, docs/auto.md). The
    count is the router's own (dispatched, no first token yet), kept from the lifecycle events.

    With ``guard`` (the default) the term may change the least work's pick (queued + uncached tokens × (1 + ``busy``
    × the share of candidates with prefill queued), ``auto``'s least-work rule without this term) only to a replica
    that would then queue no more prefill than the longest queue among the candidates now: in a burst (every
    client's first request at once) the slowest first tokens are the last ones on the longest queue, and keeping
    a prefix where it is cached must not make that queue longer; otherwise the least work decides alone
    (docs/auto.md, session 9)."""

    name = "waiting_uncached"
    inputs = frozenset({"prefix", "prefill_backlog"})

    def __init__(self, guard: bool = True, busy: float = 1.0) -> None:
        if busy < 0:
            raise ValueError(f"busy must be >= 0, got {busy}")
        self.guard, self.busy = guard, busy
        self.waiting: dict[str, int] = {}  # endpoint id → this router's requests without a first token
        self.at: dict[str, str] = {}  # request id → its endpoint, until its first token (or its end)

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """Uncached tokens per endpoint, times the fewest requests waiting for a first token on any of ``eps``
        (0 everywhere where the guard holds: the pick it would move to would become the longest queue)."""
        get = self.waiting.get
        depth = min((get(e.id, 0) for e in eps), default=0)
        if not depth:
            return [0.0] * len(eps)
        new = st.new_prefill(eps)
        term: list[float] = [float(n * depth) for n in new]
        if self.guard:
            queued = [e.queued_prefill_tokens for e in eps]
            share = 1.0 + self.busy * sum(1 for q in queued if q > 0) / len(eps)
            work = [q + n * share for q, n in zip(queued, new)]
            before = min(range(len(eps)), key=work.__getitem__)
            after = min(range(len(eps)), key=lambda i: work[i] + term[i])
            if after != before and queued[after] + new[after] > max(queued):
                return [0.0] * len(eps)
        return term

    def on_dispatched(self, req: Request, endpoint: Endpoint, new_prefill_tokens: int) -> None:
        """One more request waiting for its first token there."""
        self.at[req.id] = endpoint.id
        self.waiting[endpoint.id] = self.waiting.get(endpoint.id, 0) + 1

    def _done(self, req_id: str) -> None:
        eid = self.at.pop(req_id, None)
        if eid is not None:
            self.waiting[eid] -= 1

    def on_first_token(self, req_id: str, endpoint_id: str, ttft_s: float) -> None:
        """No longer waiting."""
        self._done(req_id)

    def on_finished(self, req_id: str, endpoint_id: str, e2e_s: float, output_tokens: int) -> None:
        """Finished without a first token reported (a runtime that does not stream): no longer waiting."""
        self._done(req_id)

    def on_failed(self, req_id: str, endpoint_id: str) -> None:
        """Left the endpoint: no longer waiting."""
        self._done(req_id)


def least_work_pick(queued: list[int], new: list[int], busy: float) -> int:
    """The index ``auto``'s least work picks without the optional terms: the least queued + uncached tokens × (1 +
    ``busy`` × the share of candidates with prefill queued) (``busy_uncached``'s weighting)."""
    share = 1.0 + busy * sum(1 for q in queued if q > 0) / len(queued)
    work = [q + n * share for q, n in zip(queued, new)]
    return min(range(len(work)), key=work.__getitem__)


# decoding_uncached with ``fanout``: the share of this router's dispatches that must be fan-outs (a program's second
# or later request sent on one answer) for the term to act. SkyWalker's trees of thought (depth 4, branching 2:
# workload/synthetic.py) send 7 of their 15 requests that way (0.47); a quarter is about half that, so traffic with
# trees on about half its clients qualifies (mixed-tree: 0.38), while closed-loop chats (a user key shared by two
# conversations: at most 0.005 measured), open-loop traffic with hot keys (hot-prefix: 0.054) and length-only traces (0)
# do not (docs/auto.md, session 14). A bound chosen between the classes, not fitted to a cell
FANOUT_SHARE = 0.25


@register_plugin
class DecodingUncached(Scorer, Lifecycle):
    """This request's uncached tokens × this router's requests decoding on the endpoint (first token seen, not
    finished) × the share of the candidates with no prefill queued.

    An engine steps its running batch together, and prefill tokens lengthen the step (SGLang runs a prefill batch
    between decode steps; vLLM's chunked prefill shares the step), so prefilling n tokens where k requests are
    decoding delays each of their answers by those n tokens' prefill time: k × n tokens' worth of time, on top of
    this request's own wait for its first token (the least work). Where the cache saves the prefill, nobody waits
    for it; where it does not, the request goes where fewer answers are being decoded. While every candidate
    queues prefill, the queues are what first tokens wait for and the term is 0 (weighted by the free share, the
    complement of ``busy_uncached``'s); and it may move the least work's pick (:func:`least_work_pick`) only to a
    replica with no prefill queued, whose first token then waits for nothing but its own prefill: the slowest first
    tokens are the last on a queue (every client's first request at once), and the term must not add to one
    (``auto``, docs/auto.md, session 10). The counts are the router's own, kept from the lifecycle events."""

    name = "decoding_uncached"
    inputs = frozenset({"prefix", "prefill_backlog"})

    def __init__(self, busy: float = 1.0, fanout: bool = False) -> None:
        if busy < 0:
            raise ValueError(f"busy must be >= 0, got {busy}")
        self.busy = busy  # busy_uncached's weight in the least work the guard compares with
        self.decoding: dict[str, int] = {}  # endpoint id → this router's requests past their first token
        self.at: dict[str, str] = {}  # request id → its endpoint, from its first token to its end
        self.fanout = fanout  # the term only while the traffic fans out (``gate``)
        self.key_of: dict[str, str] = {}  # request id → its routing key, from dispatch to end (fanout only)
        self.ended: set[str] = set()  # routing keys with an answer ended since the previous dispatch
        self.chain: str | None = None  # the previous dispatch's key, when it was a follow-up
        self.dispatched = self.followed = self.fanned = 0

    def gate(self) -> float:
        """With ``fanout``: 1 while at least ``FANOUT_SHARE`` of this router's dispatches were fan-outs, else 0; 1
        without ``fanout``. A *follow-up* is a request of a program (routing key) dispatched once an answer of that
        program had ended, with no other program's request dispatched in between; a *fan-out* is a follow-up right
        after another follow-up of the same answer (one answer, several requests: a tree of thought's children)."""
        if not self.fanout:
            return 1.0
        return 1.0 if self.fanned and self.fanned >= FANOUT_SHARE * self.dispatched else 0.0

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """Uncached tokens × requests decoding × the free share (while ``gate`` holds, with ``fanout``), per endpoint;
        0 everywhere where the term would move the least work's pick to a replica with prefill queued."""
        queued = [e.queued_prefill_tokens for e in eps]
        free = sum(1 for q in queued if q == 0) / len(eps) if eps else 0.0
        get = self.decoding.get
        weight = free * self.gate()
        if not weight or not any(get(e.id, 0) for e in eps):
            return [0.0] * len(eps)
        new = st.new_prefill(eps)
        term = [n * get(e.id, 0) * weight for n, e in zip(new, eps)]
        before = least_work_pick(queued, new, self.busy)
        share = 1.0 + self.busy * (1.0 - free)
        after = min(range(len(eps)), key=lambda i: queued[i] + new[i] * share + term[i])
        if after != before and queued[after] > 0:
            return [0.0] * len(eps)
        return term

    def on_dispatched(self, req: Request, endpoint: Endpoint, new_prefill_tokens: int) -> None:
        """With ``fanout``: count the dispatch, whether it follows its program's answer at once, and whether it is a
        second or later request on that answer."""
        if not self.fanout:
            return
        key = req.routing_key
        self.dispatched += 1
        follow = key is not None and (key in self.ended or key == self.chain)
        self.followed += follow
        self.fanned += follow and key == self.chain
        self.chain = key if follow else None
        self.ended.clear()
        if key is not None:
            self.key_of[req.id] = key

    def on_first_token(self, req_id: str, endpoint_id: str, ttft_s: float) -> None:
        """One more request decoding there."""
        if req_id not in self.at:
            self.at[req_id] = endpoint_id
            self.decoding[endpoint_id] = self.decoding.get(endpoint_id, 0) + 1

    def _done(self, req_id: str) -> None:
        eid = self.at.pop(req_id, None)
        if eid is not None:
            self.decoding[eid] -= 1

    def on_finished(self, req_id: str, endpoint_id: str, e2e_s: float, output_tokens: int) -> None:
        """No longer decoding; with ``fanout``, its program's answer has ended."""
        self._done(req_id)
        key = self.key_of.pop(req_id, None)
        if key is not None:
            self.ended.add(key)
            if key == self.chain:  # what follows this answer follows a new one: not the earlier answer's fan-out
                self.chain = None

    def on_failed(self, req_id: str, endpoint_id: str) -> None:
        """Left the endpoint: no longer decoding."""
        self._done(req_id)
        self.key_of.pop(req_id, None)

    def state(self) -> dict[str, float]:
        """With ``fanout``: dispatches ``followed`` and ``fanned`` out (counts), and whether the term acts (``on``)."""
        if not self.fanout:
            return {}
        return {"followed": self.followed, "fanned": self.fanned, "on": self.gate()}


@register_plugin
class RTT(Scorer):
    """Round trip to the endpoint in seconds (probed)."""

    name = "rtt"
    inputs = frozenset({"rtt"})

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """Probed (EWMA) round trip per endpoint, in seconds."""
        return [e.rtt_s for e in eps]


@register_plugin
class RTTms(Scorer):
    """Round trip to the endpoint in milliseconds (GORGO weighs RTT per millisecond)."""

    name = "rtt_ms"
    inputs = frozenset({"rtt"})

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """Probed (EWMA) round trip per endpoint, in milliseconds."""
        return [1000.0 * e.rtt_s for e in eps]


@register_plugin
class TreeSize(Scorer):
    """Blocks the router's index holds for the endpoint (SGLang's smallest-tree miss rule)."""

    name = "tree_size"
    inputs = frozenset({"prefix"})

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """Blocks the prefix index holds per endpoint (smaller tree: less cache to evict)."""
        blocks = st.view.prefix.blocks
        return [blocks(e.id) for e in eps]


@register_plugin
class LMetricScore(Scorer):
    """LMetric §4: P-tokens × BS — (queued prefill + this request's new prefill) × (batch + 1).

    The +1 keeps idle endpoints comparable by their P-tokens (blitz-router's lmetric.rs does
    the same)."""

    name = "lmetric"
    inputs = frozenset({"prefix", "prefill_backlog", "load"})

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """(queued prefill + new prefill) × (batch + 1) per endpoint; lower is better."""
        return st.lmetric(eps)  # computed once per decision (DecisionState.lmetric)


@register_plugin
class PrefillBlocks(Scorer):
    """Dynamo's prefill blocks: (queued prefill backlog + this request's uncached tokens) / block."""

    name = "prefill_blocks"
    inputs = frozenset({"prefix", "prefill_backlog"})

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """(queued prefill + uncached tokens) / block_tokens per endpoint."""
        bt = st.req.block_tokens
        return [(n + e.queued_prefill_tokens) / bt for n, e in zip(st.new_prefill(eps), eps)]


@register_plugin
class DecodeBlocks(Scorer):
    """Dynamo's decode blocks: (tokens of requests active on the endpoint + this prompt) / block."""

    name = "decode_blocks"
    inputs = frozenset({"load"})

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """(in-flight tokens + this prompt) / block_tokens per endpoint."""
        p, bt = st.req.prompt_tokens, st.req.block_tokens
        return [(e.inflight_tokens + p) / bt for e in eps]
