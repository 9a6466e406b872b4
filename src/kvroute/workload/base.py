"""What a workload hands the simulator.

Open-loop workloads yield ``SimRequest``s in arrival order (pulled lazily, so a million-request
run never holds them all). Closed-loop workloads run ``Program``s: each program issues its
first requests, then more whenever one of its requests completes at the client (the next turn
of a conversation; a tree node's children, which run concurrently).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

from kvroute.model import Request


@dataclass(slots=True)
class SimRequest:
    """A request as the simulator issues it: what the router sees (``req``), how many tokens the engine will
    really generate, and the client program to tell when it completes (None for open-loop arrivals)."""

    req: Request
    output_tokens: int  # what the engine will generate; the router never sees it
    program: Program | None = None
    # the engine's own prefix-cache blocks (hashes, tokens per block) where they are finer than
    # the router's index blocks (``req.block_hashes``): an OpenAI trace with
    # ``workload.engine_block_tokens`` (a real engine caches whole blocks of its block size, or
    # any prefix at all); None: the engine caches the router's blocks
    engine_blocks: tuple[tuple[int, ...], int] | None = None

    def cache_blocks(self) -> tuple[tuple[int, ...], int]:
        """The blocks the engine's prefix cache keys this prompt by: (hashes, tokens per block)."""
        return self.engine_blocks or (self.req.block_hashes, self.req.block_tokens)


class Program(ABC):
    """A closed-loop client program (conversation, tree of thought)."""

    @abstractmethod
    def start(self) -> list[SimRequest]:
        """The program's first requests."""

    @abstractmethod
    def on_complete(self, done: SimRequest) -> list[SimRequest]:
        """Requests to issue now that ``done`` completed at the client."""


class Workload:
    """Base class. Open loop: override ``arrivals``. Closed loop: set ``clients`` and override
    ``new_program``; the simulator keeps ``clients[region]`` programs running per region."""

    name = "workload"
    clients: dict[str, int] = {}
    think_time_s: float = 0.0

    def arrivals(self) -> Iterator[SimRequest]:
        """Open-loop requests in arrival order (``req.arrival_s`` set); none by default."""
        return iter(())

    def new_program(self, region: str, slot: int) -> Program | None:
        """A new client program for slot ``slot`` of ``region`` (closed loop), or None when the workload has
        run out."""
        return None

    @property
    def closed_loop(self) -> bool:
        """Whether the simulator keeps ``clients`` programs running (closed loop) rather than replaying
        ``arrivals``."""
        return bool(self.clients)
