"""Retrieval-augmented generation over a shared document corpus (open loop), optionally with a hot prefix.

Each request is the system prompt of one of two applications, the ``per_request`` documents a
retriever returned for it (most relevant first) and the user's question. Documents are drawn from
one corpus of ``documents`` chunks with Zipf(``zipf``) popularity — a few documents are retrieved for most questions, as
RAGCache (Jin et al., 2024, §3) measures for retrieval workloads — so requests that retrieved
the same first document share its KV blocks, and the cache placement a router chooses matters.
The corpus and the system prompts are shared by every region.

``hot_share`` of the requests instead go to one *hot* context — a long system prompt and a
manual everyone asks about (a launch-day product FAQ): the hot-prefix case of LMetric §5.2,
where the instances that cache one class's prefix become the bottleneck.

The lengths are assumed, not measured (no public RAG trace publishes them): document chunks
log-normal, median 700 tokens (σ 0.5); the two system prompts median 400; questions median 60;
answers median 180 (σ 0.7, at most 1,024); the hot context is 6,000 tokens.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterator

from kvroute.model import Request
from kvroute.workload.arrivals import ArrivalClock, Bursts
from kvroute.workload.base import SimRequest, Workload
from kvroute.workload.context import Context
from kvroute.workload.synthetic import BLOCK_TOKENS, lognormal


class RAGWorkload(Workload):
    """Poisson (or bursty) arrivals of RAG questions over a Zipf-popular shared corpus."""

    name = "rag"

    def __init__(self, rate: float, clients: dict[str, int], seed: int = 0, max_requests: int | None = None,
                 documents: int = 400, per_request: int = 3, zipf: float = 1.0, hot_share: float = 0.0,
                 bursts: Bursts | None = None, bt: int = BLOCK_TOKENS):
        if documents < per_request:
            raise ValueError(f"rag: documents ({documents}) must be at least per_request ({per_request})")
        self.rate, self.max_requests, self.bursts = rate, max_requests, bursts
        self.weights = dict(clients) or {"local": 1}
        self.per_request, self.hot_share = per_request, hot_share
        self.rng = random.Random(seed)
        rng = self.rng
        self.systems = [Context(bt).extend(rng.getrandbits(63), lognormal(rng, 400, 0.5, 32, 3000))
                        for _ in range(2)]
        self.docs = [(rng.getrandbits(63), lognormal(rng, 700, 0.5, 64, 4000)) for _ in range(documents)]
        self.cum = list(itertools.accumulate(1.0 / (i + 1) ** zipf for i in range(documents)))
        self.hot = Context(bt).extend(rng.getrandbits(63), 1500).extend(rng.getrandbits(63), 4500)

    def _retrieve(self) -> list[int]:
        """``per_request`` distinct documents by Zipf popularity, most relevant (first drawn) first."""
        got: list[int] = []
        total = self.cum[-1]
        while len(got) < self.per_request:
            i = bisect.bisect_left(self.cum, self.rng.random() * total)
            if i not in got:
                got.append(i)
        return got

    def arrivals(self) -> Iterator[SimRequest]:
        """Requests in arrival order, regions drawn by weight, until ``max_requests`` (forever without)."""
        rng = self.rng
        clock = ArrivalClock(rng, self.rate, self.bursts)
        regions = list(self.weights)
        weights = [self.weights[r] for r in regions]
        for n in itertools.count(1):
            if self.max_requests is not None and n > self.max_requests:
                return
            t = clock.next()
            region = rng.choices(regions, weights)[0]
            if rng.random() < self.hot_share:
                ctx, key = self.hot, "hot"
            else:
                app = rng.randrange(len(self.systems))
                ctx = self.systems[app]
                docs = self._retrieve()
                for d in docs:
                    ctx = ctx.extend(*self.docs[d])
                key = f"app{app}-doc{docs[0]}"
            ctx = ctx.extend(rng.getrandbits(63), lognormal(rng, 60, 0.8, 4, 1000))
            out = lognormal(rng, 180, 0.7, 1, 1024)
            req = Request(id=f"rag{n}", region=region, routing_key=key, block_hashes=ctx.hashes,
                          block_tokens=ctx.bt, prompt_tokens=ctx.tokens, max_output_tokens=1024, arrival_s=t)
            yield SimRequest(req, out)
