"""Synthetic workloads calibrated to the papers' published statistics.

Structure (what makes prefix-aware routing matter):

* **Shared system prompts.** Each region draws from its own pool of 16 system prompts plus 4
  global ones (10% of sessions); median 600 tokens. Region-local pools keep cross-region prefix
  affinity low, as SkyWalker measured (Fig. 5(a): 2.5% across regions).
* **Users and sessions.** Each region has 3 users per client slot. 60% of a user's sessions start
  with that user's own context (a document, median 1,500 tokens), so within-user prefix
  similarity is several times cross-user similarity (SkyWalker §2, GORGO v2 §5).
* **Multi-turn conversations.** 1 + Geometric(0.35) turns (mean ≈ 2.9, capped at 12): chat
  traces average 2–3 turns (LMSYS-Chat, WildChat). Turn n+1's prompt is turn n's prompt, its
  answer and a new question. Questions: log-normal, median 120 tokens; answers: log-normal,
  median 200 tokens, capped at 2,048 (ShareGPT-like lengths).
* **Trees of thought** (SkyWalker §5.1): depth 4, branching 2 → 15 requests per tree; children
  of a node run concurrently and extend the parent's prompt and answer; the question id is the
  consistent-hashing key.
* **Regional skew**: clients per region, e.g. 120/40/40 (SkyWalker's skewed setting).
* **Conversation shape** (``ConversationShape``): without the system prompt and document, a
  conversation starts from its first question, as SkyWalker's ChatBot Arena replay sends only the
  conversation's own turns; a turn floor and an answer cap follow that replay's multi-turn filter
  and ``max_tokens`` (skypilot-org/skypilot sky/lbbench/workloads/arena_syn.py, wildchat.py); a
  question mean and a per-turn end chance let a scenario give a dataset's published averages
  (ChatBot Arena's, Chatbot Arena paper Table 1: see scenarios/reproduce/skywalker-chat.yaml).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from kvroute.model import Request
from kvroute.workload.arrivals import ArrivalClock, Bursts
from kvroute.workload.base import Program, SimRequest, Workload
from kvroute.workload.context import Context

BLOCK_TOKENS = 64
QUESTION_SIGMA = 0.9  # log-normal σ of a question's tokens


def lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    """A log-normal integer with this median and σ, clipped to [``lo``, ``hi``]."""
    return int(min(hi, max(lo, round(median * math.exp(sigma * rng.gauss(0.0, 1.0))))))


class _Ids:
    def __init__(self, prefix: str):
        self.prefix, self.n = prefix, 0

    def __call__(self) -> str:
        self.n += 1
        return f"{self.prefix}{self.n}"


class ChatPopulation:
    """System prompts, users and their contexts; draws sessions deterministically from a seed."""

    def __init__(self, regions: list[str], users_per_region: dict[str, int], rng: random.Random,
                 bt: int = BLOCK_TOKENS):
        self.rng, self.bt = rng, bt
        seg = lambda: rng.getrandbits(63)  # noqa: E731 - a segment id is any fresh integer
        self.seg = seg
        self.global_systems = [Context(bt).extend(seg(), lognormal(rng, 600, 0.6, 64, 4000))
                               for _ in range(4)]
        self.systems = {r: [Context(bt).extend(seg(), lognormal(rng, 600, 0.6, 64, 4000))
                            for _ in range(16)] for r in regions}
        self.user_docs = {r: [(seg(), lognormal(rng, 1500, 0.7, 128, 12000))
                              for _ in range(max(1, users_per_region.get(r, 1)))] for r in regions}

    def session_context(self, region: str) -> tuple[str, Context]:
        """A new session in ``region``: (user key, its starting context) — a system prompt (one of the
        region's, 10 % of the time a global one), plus the user's document 60 % of the time."""
        rng = self.rng
        pool = self.global_systems if rng.random() < 0.1 else self.systems[region]
        ctx = rng.choice(pool)
        user = rng.randrange(len(self.user_docs[region]))
        if rng.random() < 0.6:
            doc, n = self.user_docs[region][user]
            ctx = ctx.extend(doc, n)
        return f"{region}-user{user}", ctx

    def question(self, median: float = 120) -> int:
        """Tokens of a user question (log-normal, σ 0.9, median 120 unless given)."""
        return lognormal(self.rng, median, QUESTION_SIGMA, 4, 4000)

    def answer(self) -> int:
        """Tokens of an answer (log-normal, median 200)."""
        return lognormal(self.rng, 200, 0.8, 1, 2048)


@dataclass(frozen=True)
class ConversationShape:
    """How a synthetic conversation (and a tree of thought's nodes) is shaped. The defaults are kvroute's
    chat (module docstring); SkyWalker's released replays (skypilot-org/skypilot serve-multi-region-lb,
    sky/lbbench/workloads/arena_syn.py, wildchat.py, tot.py) send no system prompt, only the program's own
    turns, keep conversations of more than one turn and ask for at most 512 tokens an answer (256 a tree
    node)."""

    context: bool = True                 # a system prompt, 60 % of the time the user's document, first
    min_turns: int = 1                   # turns = min_turns + Geometric(end_p), at most 12 (conversations)
    max_output_tokens: int | None = None  # cap on each answer's tokens (the request's max_tokens)
    question_mean: float | None = None   # mean question tokens (default: median 120, i.e. mean ~180)
    end_p: float = 0.35                  # chance of ending after each turn past min_turns (geometric)
    same_branches: bool = False          # trees: one prompt sent `branching` times, answered alike (tot.py)

    def question_median(self) -> float:
        """The log-normal median that gives ``question_mean`` (mean = median x exp(σ²/2)); 120 by default."""
        if self.question_mean is None:
            return 120
        return self.question_mean / math.exp(QUESTION_SIGMA ** 2 / 2)


class Conversation(Program):
    """A closed-loop chat: each turn's prompt is the whole conversation so far plus a new question;
    ``shape.min_turns`` to 12 turns (geometric) unless ``turns`` is given."""

    def __init__(self, pop: ChatPopulation, region: str, ids: _Ids, turns: int | None = None,
                 shape: ConversationShape = ConversationShape()):
        self.pop, self.region, self.ids = pop, region, ids
        self.user, self.ctx = pop.session_context(region)
        if not shape.context:  # same draws as with context (the user key stays), the context dropped
            self.ctx = Context(self.ctx.bt)
        self.max_answer = shape.max_output_tokens
        self.q_median = shape.question_median()
        rng = pop.rng
        self.turns_left = turns if turns is not None else min(12, shape.min_turns + _geometric(rng, shape.end_p))

    def _next(self) -> SimRequest:
        self.ctx = self.ctx.extend(self.pop.seg(), self.pop.question(self.q_median))
        self.turns_left -= 1
        out = self.pop.answer()
        cap = self.max_answer or 2048
        req = Request(id=self.ids(), region=self.region, tenant=self.user, routing_key=self.user,
                      block_hashes=self.ctx.hashes, block_tokens=self.ctx.bt,
                      prompt_tokens=self.ctx.tokens, max_output_tokens=cap)
        out = min(out, cap)
        return SimRequest(req, out, self)

    def start(self) -> list[SimRequest]:
        """The first turn."""
        return [self._next()]

    def on_complete(self, done: SimRequest) -> list[SimRequest]:
        """Append the answer to the context and ask the next question, until the turns run out."""
        self.ctx = self.ctx.extend(self.pop.seg(), done.output_tokens)
        return [self._next()] if self.turns_left > 0 else []


class ThoughtTree(Program):
    """Tree of thought: every finished node spawns ``branching`` children until ``depth``."""

    def __init__(self, pop: ChatPopulation, region: str, ids: _Ids, depth: int = 4, branching: int = 2,
                 shape: ConversationShape = ConversationShape()):
        self.pop, self.region, self.ids = pop, region, ids
        self.depth, self.branching = depth, branching
        self.cap = shape.max_output_tokens or 1024
        rng = pop.rng
        self.key = f"{region}-q{rng.getrandbits(32)}"
        base = rng.choice(pop.systems[region])
        if not shape.context:  # SkyWalker's ToT client sends the question with no system prompt (lbbench tot.py)
            base = Context(base.bt)
        self.root = base.extend(pop.seg(), lognormal(rng, 200, 0.5, 16, 2000))
        # SkyWalker's released client (lbbench tot.py) appends the level's instruction to the history once and
        # sends that same prompt `num_branches` times at temperature 0.001 ("to make the results more
        # deterministic"): with ``same_branches`` siblings share the prompt and their (near-greedy) answers
        self.same = shape.same_branches
        self.next_level: dict[int, tuple[Context, tuple[int | None, int]]] = {}  # level → its children's prompt, answer
        # request id → level, prompt, the answer's segment (None: drawn when it finishes)
        self.level: dict[str, tuple[int, Context, int | None]] = {}

    def _node(self, ctx: Context, level: int, answer: tuple[int | None, int] | None = None) -> SimRequest:
        if answer is None:  # a prompt and answer of its own
            ctx = ctx.extend(self.pop.seg(), 24)  # "consider the next step" instruction
            answer = (None, min(self.cap, lognormal(self.pop.rng, 150, 0.6, 8, 1024)))
        req = Request(id=self.ids(), region=self.region, routing_key=self.key,
                      block_hashes=ctx.hashes, block_tokens=ctx.bt, prompt_tokens=ctx.tokens,
                      max_output_tokens=self.cap)
        self.level[req.id] = (level, ctx, answer[0])
        return SimRequest(req, answer[1], self)

    def start(self) -> list[SimRequest]:
        """The root node: the question under one of the region's system prompts."""
        return [self._node(self.root, 1)]

    def on_complete(self, done: SimRequest) -> list[SimRequest]:
        """``branching`` children extending the finished node's answer, until ``depth``."""
        level, ctx, seg = self.level.pop(done.req.id)
        if level >= self.depth:
            return []
        ctx = ctx.extend(self.pop.seg() if seg is None else seg, done.output_tokens)
        if not self.same:
            return [self._node(ctx, level + 1) for _ in range(self.branching)]
        # every node of a level then has one history: the next level's prompt and answer are drawn once a tree
        nxt = self.next_level.get(level)
        if nxt is None:
            prompt = ctx.extend(self.pop.seg(), 24)  # the level's instruction
            out = min(self.cap, lognormal(self.pop.rng, 150, 0.6, 8, 1024))
            nxt = self.next_level[level] = (prompt, (self.pop.seg(), out))
        return [self._node(nxt[0], level + 1, nxt[1]) for _ in range(self.branching)]


def _geometric(rng: random.Random, p: float) -> int:
    if p >= 1.0:  # every conversation ends at min_turns (the draw is still taken, so later draws line up)
        rng.random()
        return 0
    return int(math.log(1.0 - rng.random()) / math.log(1.0 - p))


class ChatWorkload(Workload):
    """Closed loop: ``clients[region]`` concurrent conversations per region."""

    name = "chat"

    def __init__(self, clients: dict[str, int], seed: int = 0, think_time_s: float = 0.0,
                 tree_fraction: float = 0.0, depth: int = 4, branching: int = 2,
                 shapes: dict[str, tuple[float, int, int]] | None = None,
                 conversation: ConversationShape = ConversationShape()):
        """``shapes`` overrides (tree_fraction, depth, branching) per region: SkyWalker's mixed
        tree gives each region its own program shape; ``conversation`` shapes the conversations."""
        self.conversation = conversation
        self.clients = dict(clients)
        self.shapes = dict(shapes or {})
        self.think_time_s = think_time_s
        self.rng = random.Random(seed)
        self.tree_fraction = tree_fraction
        self.depth, self.branching = depth, branching
        self.ids = _Ids("c")
        self.pop = ChatPopulation(list(clients), {r: 3 * n for r, n in clients.items()}, self.rng)

    def new_program(self, region: str, slot: int) -> Program:
        """A tree of thought with the region's tree fraction, else a conversation."""
        frac, depth, branching = self.shapes.get(region, (self.tree_fraction, self.depth, self.branching))
        if frac and self.rng.random() < frac:
            return ThoughtTree(self.pop, region, self.ids, depth, branching, self.conversation)
        return Conversation(self.pop, region, self.ids, shape=self.conversation)


class ChatPoisson(Workload):
    """Open loop: chat turns arriving as a Poisson process at ``rate`` requests/s.

    A pool of ``sessions`` live conversations per region; each arrival continues one of them
    (its previous answer becomes part of the prompt), and finished conversations are replaced.
    Requests are generated lazily, so the run's memory does not grow with its length.
    """

    name = "chat-poisson"

    def __init__(self, rate: float, clients: dict[str, int], seed: int = 0, sessions: int = 512,
                 max_requests: int | None = None, bursts: Bursts | None = None):
        self.rate, self.bursts = rate, bursts
        self.weights = dict(clients)
        self.rng = random.Random(seed)
        self.sessions = sessions
        self.max_requests = max_requests
        self.ids = _Ids("p")
        self.pop = ChatPopulation(list(clients), {r: max(1, n) * 3 for r, n in clients.items()}, self.rng)

    def arrivals(self) -> Iterator[SimRequest]:
        """Poisson arrivals at ``rate``, each the next turn of a random live conversation in a region drawn by
        weight, until ``max_requests`` (forever without)."""
        rng = self.rng
        regions = list(self.weights)
        weights = [self.weights[r] for r in regions]
        live: dict[str, list[Conversation]] = {r: [] for r in regions}
        clock = ArrivalClock(rng, self.rate, self.bursts)
        n = 0
        while self.max_requests is None or n < self.max_requests:
            t = clock.next()
            region = rng.choices(regions, weights)[0]
            pool = live[region]
            if len(pool) < self.sessions:
                pool.append(Conversation(self.pop, region, self.ids))
            i = rng.randrange(len(pool))
            conv = pool[i]
            sreq = conv._next()
            sreq.program = None
            sreq.req.arrival_s = t
            conv.ctx = conv.ctx.extend(self.pop.seg(), sreq.output_tokens)
            if conv.turns_left <= 0:
                pool[i] = pool[-1]
                pool.pop()
            n += 1
            yield sreq
