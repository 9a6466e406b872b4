"""Scenario knobs of the stress workloads: RAG over a shared corpus (with a hot prefix) and bursts.

``workload.rag`` configures ``kind: rag`` (workload/rag.py); ``workload.bursts`` turns any
synthetic open-loop kind's Poisson arrivals (``chat-poisson``, ``long-context``, ``rag``) into
bursts (workload/arrivals.py). Both are issue 22's stress cases for ``auto``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from kvroute.schema import StrictModel
from kvroute.sim.tracefiles import ScenarioError
from kvroute.workload.arrivals import Bursts
from kvroute.workload.base import Workload
from kvroute.workload.long_context import LongContext
from kvroute.workload.rag import RAGWorkload
from kvroute.workload.synthetic import ChatPoisson


class RagSpec(StrictModel):
    """``kind: rag``: the shared corpus and the hot prefix."""

    documents: int = Field(400, ge=1, description="document chunks in the shared corpus")
    per_request: int = Field(3, ge=1, description="documents retrieved per question (most relevant first)")
    zipf: float = Field(1.0, ge=0, description="Zipf exponent of document popularity (0: uniform)")
    hot_share: float = Field(0.0, ge=0, le=1, description="share of requests for one hot 6,000-token context "
                             "(LMetric §5.2's hot prefix)")

    @model_validator(mode="after")
    def _enough_documents(self) -> RagSpec:
        if self.documents < self.per_request:
            raise ValueError(f"documents ({self.documents}) must be at least per_request ({self.per_request})")
        return self


class BurstSpec(StrictModel):
    """Bursty open-loop arrivals: ``factor`` × the mean rate for ``share`` of the time, in episodes of
    ``mean_s`` seconds on average (the calm periods make up the rest of the mean)."""

    factor: float = Field(4.0, ge=1, description="rate during a burst, as a multiple of the mean rate")
    share: float = Field(0.2, gt=0, lt=1, description="share of time in bursts; factor × share must be ≤ 1")
    mean_s: float = Field(5.0, gt=0, description="mean burst length in seconds")

    @model_validator(mode="after")
    def _feasible(self) -> BurstSpec:
        if self.factor * self.share > 1:
            raise ValueError(f"factor × share = {self.factor * self.share:g} > 1 leaves no traffic for the calm "
                             "periods; lower factor or share")
        return self

    def bursts(self) -> Bursts:
        """The arrival process's parameters."""
        return Bursts(self.factor, self.share, self.mean_s)


WorkloadKind = Literal["chat", "tot", "mixed", "chat-poisson", "long-context", "rag", "mooncake", "azure", "openai"]
OPEN_LOOP_SYNTHETIC = ("chat-poisson", "long-context", "rag")


def open_loop_workload(w: Any, clients: dict[str, int], seed: int, max_requests: int | None) -> Workload | None:
    """The synthetic open-loop workload ``w`` (a scenario's WorkloadSpec) describes, or None for the
    other kinds; ``bursts`` on a kind without Poisson arrivals is a one-line error."""
    bursts = w.bursts.bursts() if w.bursts else None
    if bursts and w.kind not in OPEN_LOOP_SYNTHETIC:
        raise ScenarioError(f"workload.bursts apply to {', '.join(OPEN_LOOP_SYNTHETIC)}, not {w.kind!r}")
    rate = w.rate or 1.0
    if w.kind == "chat-poisson":
        return ChatPoisson(rate, clients, seed, max_requests=max_requests, bursts=bursts)
    if w.kind == "long-context":
        return LongContext(rate, list(clients), seed, max_requests, bursts=bursts)
    if w.kind == "rag":
        g = w.rag
        return RAGWorkload(rate, clients, seed, max_requests, g.documents, g.per_request, g.zipf, g.hot_share, bursts)
    return None
