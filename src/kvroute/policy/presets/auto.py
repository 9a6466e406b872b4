"""``auto``: the default policy — one composition of the seeds' mechanisms, each in charge where it wins.

Side by side no preset is best everywhere (issue 22): LMetric's P-tokens × batch-size score leads
on prefix-heavy single-region traffic, GORGO's cost in some multi-region chat setups, and on
length-only traces they tie. ``auto`` decides per request, from what a live load balancer observes
and nothing else — its own accounting (in-flight requests and tokens, the prefill backlog it
dispatched), the prefix index, the RTTs its probes measure and the TTFTs its requests report —
never a step-time model:

1. **hot prefix** (LMetric §5.2, ``hotspot: true``; off by default): the two-phase KV-hotspot
   detector watches which request classes outgrow the instances caching their prefix; while it
   fires, the class is routed among the others (branch ``hotspot-filtered``, the hotspot route's
   own, as in ``lmetric``). Measured with ``kvroute bench auto``'s cells (3 seeds each) it fired
   only on the hot-prefix scenario and there it lengthened the TTFT p99 (2.35 → 2.45 s at 50 %,
   2.24 → 2.44 s at 70 %, 2.44 → 2.52 s at 90 % of the knee), so ``auto`` leaves it off, as
   ``lmetric`` does;
2. **the incumbent, LMetric's score**: (queued prefill + this request's uncached tokens) ×
   (batch + 1) — it follows the cache while that saves prefill and spreads load when it does not;
   on traffic without prefix reuse it reduces to least prefill work (branch ``auto:prefix-load``).
   On mixed hardware each factor is scaled by the replica's prefill / decode time learned online
   from the TTFTs and TPOTs it reports (``lmetric_speed``, :mod:`kvroute.policy.adaptive.replica_speed`),
   so a replica k× faster carries about k× the load; unless prefill and decode times both spread
   past ``speed_spread``, every factor is 1 (a homogeneous fleet routes exactly by LMetric's score).
   On a fleet judged mixed (a judgment that then holds), ``speed_ttft`` picks among the replicas
   the scaled score ranks within ``trust`` × its best the one with the least TTFT predicted from
   the learned prefill lines — the score keeps the load in proportion to speed, the prediction
   sends each prompt where its first token comes soonest;
3. **one region, one hardware kind: the least work** (``least_work``, branch ``auto:least-work``): while
   every replica the load balancer sees is within ``rtt_spread_ms`` of probe RTT and the learned speeds
   have not judged the fleet mixed (``uniform_fleet``, :mod:`kvroute.policy.adaptive.selector.uniform`),
   among the replicas the incumbent's score ranks within ``trust`` × its best, the one with the least
   prefill work ahead of this request's first token (queued + uncached tokens), then the fewest of
   this LB's requests in flight — among the replicas whose KV capacity holds the request beside the prompt blocks
   of this LB's requests in flight there (``kv_room``, :mod:`kvroute.policy.adaptive.selector.kv_room`; all when
   none does: an engine admits a prompt only when its cache has room). llm-d's predicted TTFT (``llm_d``, a
   step-time model `auto` may not read) is on such a fleet almost all prefill work — a step of the L4 profile
   costs 0.48 ms per prefill token against 0.4 ms per running sequence (``profiles/l4-llama3.1-8b.yaml``) — and it led
   TTFT p99 in most one-region cells; LMetric's product lets a replica with a short batch win with
   twice the prefill ahead. The trust region bounds how far it departs from LMetric's load balance
   (``llm_d`` alone was unstable on bursty-chat and hot-prefix at 90 % of the knee), and no trials
   run here (9 seeds per cell: docs/auto.md). The request's uncached tokens count once more in proportion
   to the share of the candidates that have prefill queued (``busy_prefill``, scorer ``busy_uncached``):
   while every replica is busy, a prefill the cache would have saved is work some queue waits for (a tree
   or conversation then stays with its cached replica); while some replica is idle, sending it there costs
   nobody (the least work alone). Given the TPOT SLO (``slo_tpot_ms``), not while the replica with the longest
   cached prefix has no TPOT headroom (its measured p90 past the SLO: it keeps the decodes too;
   ``busy_uncached_headroom``, :mod:`kvroute.policy.adaptive.replica_speed.headroom`). Optionally
   (``behind_prefill``, off by default), once more per request this LB has waiting for a first token on every
   candidate (scorer ``waiting_uncached``): first come, first served, about as many requests arrive behind a
   prefill during its wait as were waiting when it came (Little's law), and each of them waits for the tokens the
   cache would have saved — a shared system prompt stays where it is being prefilled. That term may move the pick
   only to a replica that then queues no more prefill than the longest queue among the candidates now: in the
   burst of every client's first request the slowest first tokens are the last on the longest queue (session 8's
   unguarded term lengthened tot's TTFT p99 at 70 % of the knee by 3 %; guarded, not — but over 9 seeds it costs
   live-3region-skewed 1–2 % of goodput, so it stays off: docs/auto.md). On traffic that fans out
   (``decode_prefill`` with ``decode_fanout``; scorer ``decoding_uncached``), once more per request of this LB
   decoding on the replica (first token seen, not finished) × the share of the candidates with no prefill queued: a
   prefill lengthens the steps of every answer decoding on its replica, so where the cache does not save it, it goes
   where fewer answers wait on it — on a closed loop of trees the answers' decode time, not the first token, sets
   the pace. That term may move the pick only to a replica with no prefill queued (a burst's first tokens wait on
   queues), and it acts only while at least a quarter of this LB's dispatches are fan-outs (a program's second
   request sent on one answer: a tree's children; ``FANOUT_SHARE``): on conversations, open-loop chat and traces
   it lengthened the TTFT tail or cost goodput (docs/auto.md, sessions 10 and 14);
4. **the challenger, GORGO's cost**, trialled online against it (``ttft_selector``, interleaved
   trials, switching only on evidence of a better mean TTFT, guarded by end-to-end latency):
   across regions — the candidates' probe RTTs spread by more than ``rtt_spread_ms`` — w_rtt·RTT
   + t_p·uncached + w_queue·queued tokens (GORGO v1 §3, v2's weights; branch ``auto:rtt-aware``),
   within one region the same without the RTT (branch ``auto:additive``). It chooses only among
   the replicas the incumbent's score ranks within ``trust`` × its best (the ``near_best`` trust
   region), so a trial can never send a request where the incumbent judges it far worse.

Across regions (the candidates' probe RTTs spread past ``rtt_spread_ms``) every rule chooses among
the nearest region's *free* replicas while there is one (``local_first``, ``builtin/filters.py``:
no prefill of this LB's queued there, nothing waiting at the probe, a batch no larger than every
farther replica's), else among all: load balancers that each may send anywhere otherwise herd
onto the remote replica whose stale SGLang gauge looks idle (SkyWalker §3.2 and GORGO v1 §3.3 serve
locally first too).

Behind SkyWalker's two layers (peer load balancers) ``auto`` holds a request — which the load
balancer then forwards — only when no local replica admits it and a peer would take it at once
(admission ``forward``, :class:`~kvroute.policy.admission.ForwardGate`); otherwise it never holds.

The branch of every decision says which mechanism was in charge: ``kvroute_policy_branch`` in the
gateway's /metrics and decision records, ``branches`` in the simulation report; each selector's
state (``ttft_selector.region.*`` / ``ttft_selector.regions.*``: serving, trials, wins, evidence)
is in ``policy_state`` and ``GET /admin/policy``. Where it falls short: see ``kvroute bench auto``
and docs/auto.md.
"""

from __future__ import annotations

from pydantic import Field

from kvroute.model import Branch
from kvroute.policy.adaptive import selector  # noqa: F401  (registers ttft_selector)
from kvroute.policy.catalog import register_preset
from kvroute.policy.params import AdmissionName, PolicyParams, admission_field

# the hotspot route names its decisions itself (Branch.HOTSPOT_FILTERED), whatever the rule says
HOTSPOT = Branch.HOTSPOT_FILTERED.value
RTT_AWARE, ADDITIVE, PREFIX_LOAD = "auto:rtt-aware", "auto:additive", "auto:prefix-load"
LEAST_WORK = "auto:least-work"
# the challenger's trust region: the incumbent's score with the incumbent's settings; every copy of it (final
# rule, trust regions) hears the same events and learns into one replica-speed fit (one refresh per event)
INCUMBENT = {"lmetric_speed": {"spread": "$speed_spread", "learn": "$speed", "live_batch": "$live_batch",
                                "min_samples": "$speed_samples", "ttft_pick": "$speed_ttft", "near": "$trust",
                                "detour": "$speed_detour", "shared_fit": "incumbent", "slo_tpot_ms": "$slo_tpot_ms"}}
TRUST = {"near_best": {"scorer": INCUMBENT, "factor": "$trust"}}
# one region, one hardware kind: the prefill tokens ahead of the first token (uncached ones once more as far as
# the candidates are busy: a prefill the cache would have saved is then work a queue waits for — and once more per
# request every candidate has waiting for its first token, with behind_prefill > 0: about that many will arrive
# behind it; that term never moves the pick to a replica that would then have the longest queue), then this LB's
# requests in flight
# (busy_prefill not while the best-cached replica's measured p90 TPOT is past the TPOT SLO, when one is given: it
# keeps the decodes too; replica_speed/headroom.py); with decode_prefill > 0 (while the traffic fans out, with
# decode_fanout: a tree's children), once more per answer of this LB decoding
# on the replica x the share of candidates with no prefill queued (a prefill lengthens their steps; moves the pick
# only to an empty queue)
LEAST_WORK_COST = {"new_prefill": 1.0,
                   "busy_uncached_headroom": {"weight": "$busy_prefill", "slo_tpot_ms": "$slo_tpot_ms",
                                              "shared_fit": "incumbent", "min_samples": "$speed_samples",
                                              "spread": "$speed_spread"},
                   "waiting_uncached": {"weight": "$behind_prefill", "busy": "$busy_prefill"},
                   "decoding_uncached": {"weight": "$decode_prefill", "busy": "$busy_prefill",
                                         "fanout": "$decode_fanout"},
                   "inflight": 1.0}
# ... among the trust region, while the LB's whole fleet is one region of one hardware kind
UNIFORM = {"uniform_fleet": {"scorer": INCUMBENT, "factor": "$trust", "ms": "$rtt_spread_ms"}}
# ... among the replicas whose KV capacity holds the request's prompt beside the distinct prompt blocks of this LB's
# requests in flight there (all when none does): a full cache makes a first token wait for memory (selector/kv_room.py)
KV_ROOM = {"kv_room": {"on": "$kv_room"}}


def _select(scope: str) -> dict[str, dict[str, str]]:
    """The selector of one regime (its state is named by ``scope``)."""
    return {"ttft_selector": {"window": "$select_window", "exploit": "$select_exploit", "z": "$select_z",
                              "scope": scope}}


@register_preset(
    "auto", source="issue 22: LMetric §4 score and §5.2 hotspot detector; GORGO v1 §3 / v2 cost, trialled online",
    filters=[{"local_first": {"ms": "$rtt_spread_ms", "on": "$local_first"}}],
    rules=[{"enabled": "$hotspot", "route": {"hotspot": "$hotspot_window"}, "branch": HOTSPOT},
           {"enabled": "$select", "when": [{"rtt_spread_above": "$rtt_spread_ms"}, _select("regions")],
            "branch": RTT_AWARE, "among": TRUST,
            "cost": {"rtt_ms": "$w_rtt", "uncached_tokens": "$t_p", "inflight_tokens": "$w_queue"}},
           {"enabled": "$least_work", "branch": LEAST_WORK, "among": [KV_ROOM, UNIFORM], "cost": LEAST_WORK_COST},
           {"enabled": "$select", "when": [{"rtt_spread_at_most": "$rtt_spread_ms"}, _select("region")],
            "branch": ADDITIVE, "among": TRUST, "cost": {"uncached_tokens": "$t_p", "inflight_tokens": "$w_queue"}},
           {"cost": INCUMBENT, "branch": PREFIX_LOAD}])
class AutoParams(PolicyParams):
    """The default: LMetric's score on learned replica speeds, GORGO's cost trialled against it online.

    Which mechanism decided is each decision's branch (``auto:prefix-load``, ``auto:additive``,
    ``auto:rtt-aware``, ``hotspot-filtered``); see the module docstring for when each takes charge and why.
    """

    admission: AdmissionName = admission_field("forward")
    hotspot: bool = Field(False, description="LMetric §5.2's KV-hotspot detector takes a hot class's "
                          "instances out of its targets while it fires")
    hotspot_window: int = Field(256, ge=8, description="routed requests the detector measures class shares over")
    rtt_spread_ms: float = Field(10.0, ge=0, description="candidates whose probe RTTs differ by more than this "
                                 "are in different regions: weigh the network (GORGO's cost)")
    w_rtt: float = Field(0.5, ge=0.0, description="RTT weight per ms in the cross-region cost (GORGO v2 start)")
    t_p: float = Field(1.0, ge=0.0, description="cost per uncached prompt token in the cross-region cost")
    w_queue: float = Field(0.1, ge=0.0, description="weight of queued tokens in the cross-region cost")
    select: bool = Field(True, description="trial GORGO's cost (RTT-aware across regions, additive within one) "
                         "against LMetric's score online (interleaved, mean TTFT, E2E guard) and switch to it on "
                         "evidence; false: LMetric's score only")
    select_window: int = Field(64, ge=8, description="dispatches per rule in one trial")
    select_exploit: int = Field(8, ge=1, description="windows the kept rule serves before the next trial (doubling "
                                "while it keeps winning, up to 8x)")
    trust: float = Field(2.0, ge=1, description="GORGO's cost chooses only among replicas LMetric's score ranks "
                         "within this factor of its best (safe exploration)")
    select_z: float = Field(2.0, ge=0, description="standard errors by which GORGO's mean TTFT must lead to take over")
    speed: bool = Field(True, description="the incumbent scales LMetric's score by each replica's prefill and decode "
                        "time learned from measured TTFTs and TPOTs (mixed hardware); false: LMetric's score as is, "
                        "in the challenger's trust region too")
    live_batch: bool = Field(True, description="LMetric's batch term counts at least the requests this load "
                             "balancer has in flight on the replica (an SGLang gauge can be 40 decode steps old); "
                             "false: probed running + waiting + dispatched since the probe, as lmetric")
    speed_ttft: bool = Field(True, description="on a fleet judged mixed, pick among the replicas the speed-scaled "
                             "score ranks within trust x its best the one with the least TTFT predicted from the "
                             "learned prefill lines; false: the scaled score alone")
    speed_detour: bool = Field(True, description="on a fleet judged mixed, the score chooses among the replicas "
                               "where the request's first token comes no later than the soonest by the fleet's mean "
                               "TTFT: the near set's, and those outside it whose measured decode time per token is no "
                               "longer than on the near set's pick (short prompts to slow replicas, long ones to "
                               "fast ones); false: the near set's soonest")
    slo_tpot_ms: float = Field(0.0, ge=0, description="the deployment's TPOT objective in ms (0: none given): on a "
                               "fleet judged mixed, a replica has TPOT headroom while the p90 time per output token "
                               "predicted at its count in flight (a learned line) is within it; a slow replica then "
                               "takes only first tokens that are not tail ones (no later than the soonest or the "
                               "fleet's p90 wait) unless the soonest has no headroom, and one outside the near set "
                               "only while its measured p90 is within it; and busy_prefill stands aside while the "
                               "best-cached replica's p90 is past it")
    speed_samples: int = Field(2, ge=1, description="first tokens and completions per replica before its "
                               "learned speed counts (at least 3 first tokens, 2 completions: what a standard error "
                               "needs); the spread must also stand apart by Student's t at 95.45 %")
    local_first: bool = Field(True, description="across regions, route among the nearest region's free replicas "
                              "(no prefill of this LB queued, nothing waiting at the probe) while there is one; "
                              "false: every replica competes on every request")
    least_work: bool = Field(True, description="when the load balancer sees one region (probe RTTs within "
                             "rtt_spread_ms) of one hardware kind, route among the replicas LMetric's score ranks "
                             "within trust x its best by the least prefill work ahead of the first token (queued + "
                             "uncached tokens, then requests in flight), without trials; false: the selector trials "
                             "GORGO's additive cost against LMetric's score there too")
    kv_room: bool = Field(True, description="in the least-work rule, only the replicas whose KV capacity "
                          "(kv_blocks x block_size) holds this request's prompt tokens beside the distinct prompt "
                          "blocks of this load balancer's requests in flight there (all when none does): an engine "
                          "admits a prompt only when its cache has room, so a full one makes the first token wait "
                          "for memory; false: every replica (docs/auto.md, session 12)")
    busy_prefill: float = Field(1.0, ge=0, description="in the least-work rule, this request's uncached tokens count "
                                "once more times this weight x the share of the candidates with prefill queued (while "
                                "every replica is busy a prefill the cache would have saved is work a queue waits for; "
                                "an idle replica costs nobody); 0: the least work alone")
    behind_prefill: float = Field(0.0, ge=0, description="in the least-work rule, this request's uncached tokens "
                                  "count once more times this weight per request of this load balancer waiting for "
                                  "its first token on every candidate (the fewest on any): first come, first served, "
                                  "about as many requests arrive behind a prefill during its wait as were waiting "
                                  "when it came (Little's law), and each waits for the tokens the cache would have "
                                  "saved — but it may move the pick only to a replica that then queues no more "
                                  "prefill than the longest queue now (a burst's tail); 0 (default): off — on, it "
                                  "trades goodput on trees for 1-2 % of goodput behind SkyWalker's two layers "
                                  "(docs/auto.md, sessions 8 and 9)")
    decode_prefill: float = Field(1.0, ge=0, description="in the least-work rule, this request's uncached tokens "
                                  "count once more times this weight per request of this load balancer decoding on "
                                  "the replica (first token seen, not finished) x the share of the candidates with no "
                                  "prefill queued: a prefill lengthens the steps of every answer decoding there; it "
                                  "may move the pick only to a replica with no prefill queued (a burst's first tokens "
                                  "wait on queues); with decode_fanout (the default) only while the traffic fans out; "
                                  "0: off (docs/auto.md, sessions 10 and 14)")
    decode_fanout: bool = Field(True, description="the decode_prefill term acts only while at least a quarter of "
                                "this load balancer's dispatches are fan-outs — a program's (routing key's) second or "
                                "later request sent as soon as one of its answers ended, as a tree of thought's "
                                "children are; on conversations, open-loop chat and traces it lengthened the TTFT "
                                "tail; false: on any traffic (docs/auto.md, session 14)")
    speed_spread: float = Field(1.5, ge=1, description="the fleet counts as mixed hardware when learned prefill and "
                                "decode times both spread past this factor (max / min); else it routes as one kind")
