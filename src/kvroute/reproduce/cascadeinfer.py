"""CascadeInfer (004_131677394a4b07f8.txt): its mechanisms are not built in kvroute yet.

Length-staged routing, the QoE model, the DP stage partition, range refinement and bid-ask
rebalancing with live migration are later issues; until they land every row says so. The batch
heterogeneity factor the paper measured (1.1–2.1×) is part of kvroute's step-time model
(``sim/profile.py``) and is checked by the profile tests, not here.
"""

from __future__ import annotations

from kvroute.reproduce.common import NOT_IMPLEMENTED, Lab, Row

CLAIMS = (
    ("QoE model mean relative error", "8.9 % (static mean predictor 64 %)", "the QoE model"),
    ("stage partition with 16 instances, 128K length", "0.06 s", "the DP stage partition"),
    ("vs chain layout (one instance per stage)", "30 % lower latency, 7.1 % higher throughput",
     "length-staged routing and stage layouts"),
    ("vs memory-based range refinement", "21 % lower latency, 12 % higher throughput", "range refinement"),
    ("end to end vs state of the art", "up to 67 % lower E2E, 69 % lower tail, up to 2.89× throughput",
     "length-staged routing with migration"),
    ("bid-ask vs round robin, output-token imbalance", "lower CV per stage (Fig. 16)",
     "bid-ask rebalancing"),
)


def rows(lab: Lab) -> list[Row]:
    return [Row(claim, paper, "–", NOT_IMPLEMENTED, f"{what} is not built yet (a later issue)", "–")
            for claim, paper, what in CLAIMS]
