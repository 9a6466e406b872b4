"""SkyWalker (EuroSys '26; 000_6f99922b2639b957.txt): the claims of §5 against kvroute's simulator.

Setups: ``kvroute/scenarios/reproduce/skywalker-{chat,tot,mixed,fig9,fig10}.yaml``. Baselines run
behind ONE load balancer in the US managing every replica (Fig. 8); SkyWalker runs one LB per
region with forwarding.
"""

from __future__ import annotations

from kvroute.reproduce.common import (
    DIRECTION,
    NO,
    NOT_MODELLED,
    YES,
    Lab,
    Row,
    fmt_range,
    pct,
    ratio_agreement,
    similar,
    unstable_note,
)
from kvroute.sim.sweep import find_knee

BASELINES = ("round_robin@global", "least_request@global", "consistent_hash@global",
             "sglang_cache_aware(miss=smallest_tree)@global")
SHORT = {"round_robin@global": "RR", "least_request@global": "LL", "consistent_hash@global": "CH",
         "sglang_cache_aware(miss=smallest_tree)@global": "SGLang"}

def why_chat(sw: dict, best: tuple[str, dict]) -> str:
    """The measured mechanism behind SkyWalker's chat rows, from its own run."""
    br = sw["branches"]
    share = br.get("least-load", 0) / max(1, sum(br.values()))
    fwd = sw.get("by_path", {}).get("forwarded", {})
    text = (f"model: {share:.0%} of SkyWalker's decisions take the least-load branch (under the pending "
            "gate only replicas with no waiting request are candidates")
    if share > 0.5:
        text += ("; an L4's 46K KV tokens hold about 18 requests of this workload, so the replica with a "
                 "conversation's prefix is rarely free")
    text += (f"); {fwd.get('requests', 0)} forwarded requests hit {fwd.get('prefix_hit_rate', 0):.0%}. "
             f"SkyWalker's hit rate is {sw['prefix_hit_rate']:.0%} against the global {best[0]} "
             f"baseline's {best[1]['prefix_hit_rate']:.0%}")
    if sw["prefix_hit_rate"] < best[1]["prefix_hit_rate"] - 0.05:
        text += ", so it loses reuse the cache-aware baseline keeps"
    else:
        text += (f": reuse is at par, and closed-loop throughput, bounded by decode time (E2E p50 "
                 f"{sw['e2e_s']['p50']:.1f} s vs TTFT p50 {sw['ttft_s']['p50']:.2f} s), moves little")
    return text + ". Setup: synthetic chat stands in for Arena/WildChat"


def knee_clients(lab: Lab) -> tuple[float, dict]:
    """Round robin's capacity knee on the chat setup, as a factor on its 120/40/40 clients.

    The paper does not give Fig. 8's client count, and every paper compares below saturation
    (reproduction.md): the knee is the highest client count at which ≥ 90 % of round robin's
    requests meet the default SLO (TTFT ≤ 5 s, TPOT ≤ 100 ms), found with ``simulate --sweep``'s
    search on 2,500-request runs (1,000 with --quick).
    """
    sc = lab.scenario("skywalker-chat", requests=2500)
    knee = find_knee(sc, "round_robin", "round_robin", None, topology="global", stability=False)
    f = knee["slo"]["factor"] or 1.0
    return f, {r: max(1, round(n * f)) for r, n in sc.clients().items()}


def chat_rows(lab: Lab, key: str, chat: dict, where: str) -> list[Row]:
    """The chat claims of Fig. 8 on one run of the chat setup."""
    out: list[Row] = []
    sw, ch = chat["skywalker"], chat["skywalker_ch"]
    base = {b: chat[b] for b in BASELINES}
    note = unstable_note(lab, key)
    best = max(base.items(), key=lambda kv: kv[1]["prefix_hit_rate"])
    why = why_chat(sw, (SHORT[best[0]], best[1]))
    tput = {SHORT[b]: sw["throughput_rps"] / r["throughput_rps"] for b, r in base.items()}
    agree = ratio_agreement(list(tput.values()), 1.12, 1.2)
    out.append(Row(f"throughput vs single-LB baselines, chat {where}", "1.12–1.2×",
                   ", ".join(f"{k} {v:.2f}×" for k, v in tput.items()) + note, agree,
                   "" if agree == YES else why, key))
    hits = (base["round_robin@global"]["prefix_hit_rate"], base["least_request@global"]["prefix_hit_rate"],
            sw["prefix_hit_rate"])
    order = hits[0] < hits[1] < hits[2]
    inside = 0.108 - 0.05 <= hits[0] <= 0.166 + 0.05 and 0.283 - 0.05 <= hits[1] <= 0.311 + 0.05 \
        and 0.37 - 0.05 <= hits[2] <= 0.466 + 0.05
    agree = YES if order and inside else DIRECTION if order else NO
    out.append(Row(f"prefix hit: round robin / least load / SkyWalker {where}",
                   "10.8–16.6 / 28.3–31.1 / 37.0–46.6 %", " / ".join(pct(h) for h in hits) + note, agree,
                   "" if agree == YES else why if not order else "setup: synthetic chat's prefix reuse "
                   "differs from Arena/WildChat's; the ordering holds", key))
    for q, paper, lo, hi in (("p50", "15.9–57.6 %", 0.159, 0.576), ("p90", "10.1–23.4 %", 0.101, 0.234)):
        shares = [sw["ttft_s"][q] / r["ttft_s"][q] for r in base.values()]
        agree = ratio_agreement(shares, lo, hi)
        out.append(Row(f"TTFT {q}, SkyWalker as share of baselines {where}", paper,
                       fmt_range(shares, "{:.0%}") + note, agree, "" if agree == YES else why, key))
    e2e = [r["e2e_s"]["p50"] / sw["e2e_s"]["p50"] for r in base.values()]
    agree = ratio_agreement(e2e, 1.05, 2.14)
    out.append(Row(f"E2E p50 improvement over baselines {where}", "1.05–2.14×", fmt_range(e2e) + note, agree,
                   "" if agree == YES else why, key))
    r = sw["throughput_rps"] / ch["throughput_rps"]
    agree = ratio_agreement([r], 1.0134, 1.0821)
    out.append(Row(f"SkyWalker vs SkyWalker-CH throughput {where}", "+1.34–8.21 %",
                   f"{(r - 1) * 100:+.2f} %" + note, agree,
                   "" if agree == YES else f"model: both share the pending gate and forwarding; hit rates "
                   f"{sw['prefix_hit_rate']:.0%} vs {ch['prefix_hit_rate']:.0%}, so the prefix trie gains "
                   "little over session hashing here", key))
    return out


def rows(lab: Lab) -> list[Row]:
    """SkyWalker's claims: the skewed chat comparison and its knee, tree-of-thought and mixed-tree workloads,
    selective pushing (Fig. 9) and cross-region replicas (Fig. 10)."""
    out: list[Row] = []
    chat = lab.run("skywalker-chat")
    out += chat_rows(lab, "skywalker-chat", chat, "(120/40/40 clients)")
    f, clients = knee_clients(lab)
    at_knee = lab.run("skywalker-chat", key="skywalker-chat-knee", overrides={"workload": {"clients": clients}})
    out += chat_rows(lab, "skywalker-chat-knee", at_knee,
                     f"(at round robin's knee: {'/'.join(map(str, clients.values()))} clients)")
    out.insert(1, Row("throughput vs GKE Gateway", "1.43–2.06×", "–", NOT_MODELLED,
                      "missing baseline: GKE Gateway's routing is not implemented in kvroute", "skywalker-chat"))

    tot = lab.run("skywalker-tot")
    t_sw, t_ch = tot["skywalker"], tot["consistent_hash@global"]
    t_ll, t_rr = tot["least_request@global"], tot["round_robin@global"]
    ch_sw = t_ch["throughput_rps"] / t_sw["throughput_rps"]
    ch_ll = t_ch["throughput_rps"] / t_ll["throughput_rps"]
    agree_sim = similar(ch_sw)
    agree_ll = ratio_agreement([ch_ll], 1.4, 1.4)
    agree = YES if agree_sim == YES and agree_ll == YES else DIRECTION if ch_ll > 1 else NO
    out.append(Row("tree of thought: CH ≈ SkyWalker, CH ≈ 1.4× least load (throughput)",
                   "CH/SkyWalker 1.02, CH/LL 1.4", f"CH/SkyWalker {ch_sw:.2f}, CH/LL {ch_ll:.2f}"
                   + unstable_note(lab, "skywalker-tot"), agree,
                   "" if agree == YES else f"model: CH's hit rate beats LL's ({t_ch['prefix_hit_rate']:.0%} vs "
                   f"{t_ll['prefix_hit_rate']:.0%}) but a tree node's time is mostly decoding its answer "
                   f"(E2E p50 {t_ch['e2e_s']['p50']:.1f} s vs TTFT p50 {t_ch['ttft_s']['p50']:.2f} s), which "
                   "a cache hit does not shorten; SkyWalker matches CH's hit rate and adds the pending gate",
                   "skywalker-tot"))
    hits = ((t_rr["prefix_hit_rate"] + t_ll["prefix_hit_rate"]) / 2, t_sw["prefix_hit_rate"])
    agree = YES if abs(hits[0] - 0.59) <= 0.1 and abs(hits[1] - 0.90) <= 0.1 else \
        DIRECTION if hits[1] > hits[0] else NO
    out.append(Row("tree of thought: prefix hit, RR/LL vs SkyWalker", "≈ 59 % vs ≈ 90 %",
                   f"{pct(hits[0])} vs {pct(hits[1])}", agree,
                   "" if agree == YES else "setup: the paper's ToT prompts are not published; kvroute's "
                   "nodes append an answer (median 200 tokens) and a question to their parent's prompt, so "
                   "the ordering holds while both levels sit lower than the paper's", "skywalker-tot"))

    mixed = lab.run("skywalker-mixed")
    m_sw, m_ch = mixed["skywalker"], mixed["consistent_hash@global"]
    win = m_sw["throughput_rps"] / m_ch["throughput_rps"]
    var = (m_ch["imbalance_cv"] ** 2) / max(1e-9, m_sw["imbalance_cv"] ** 2)
    agree = YES if win > 1 and var > 2 else DIRECTION if win > 1 or var > 1 else NO
    out.append(Row("mixed tree: SkyWalker wins; CH overloads a replica", "SkyWalker > CH; CH 3.36× load variance",
                   f"SkyWalker/CH throughput {win:.2f}×; CH/SkyWalker load variance {var:.2f}×"
                   + unstable_note(lab, "skywalker-mixed"), agree,
                   "" if agree == YES else "setup: the paper's per-region shapes are not published (assumed "
                   "here); kvroute's pending gate keeps SkyWalker's replicas busy but unevenly loaded (CV), "
                   "and CH's session keys spread well over 12 replicas", "skywalker-mixed"))

    f9 = lab.run("skywalker-fig9")
    bp = f9["sglang_cache_aware(admission=blind,miss=smallest_tree)"]
    spo = f9["sglang_cache_aware(admission=outstanding,max_outstanding=16,miss=smallest_tree)"]
    spp = f9["sglang_cache_aware(admission=pending,miss=smallest_tree)"]
    t_ratio = spp["throughput_rps"] / bp["throughput_rps"]
    p90 = bp["ttft_s"]["p90"] / spp["ttft_s"]["p90"]
    agree_t, agree_p = ratio_agreement([t_ratio], 1.27, 1.27), ratio_agreement([p90], 18.47, 18.47)
    agree = YES if YES == agree_t == agree_p else DIRECTION if t_ratio > 1 and p90 > 1 else NO
    out.append(Row("Fig. 9: SP-P vs blind pushing (1 region, 4 replicas, 30 clients, ToT)",
                   "1.27× throughput, 18.47× lower P90 TTFT, hit 89.9 vs 68.9 %",
                   f"{t_ratio:.2f}× throughput, {p90:.2f}× P90 TTFT, hit {pct(spp['prefix_hit_rate'])} vs "
                   f"{pct(bp['prefix_hit_rate'])}" + unstable_note(lab, "skywalker-fig9"), agree,
                   "" if agree == YES else f"model: at 30 ToT clients on 4 simulated L4s blind pushing builds "
                   f"no backlog (BP's P90 TTFT {bp['ttft_s']['p90']:.2f} s, {bp['preemptions']} preemptions, "
                   f"hit {bp['prefix_hit_rate']:.0%}), so there is nothing for the pending gate to fix; the "
                   "paper's 18× comes from BP queues that evicted shared prefixes on its testbed",
                   "skywalker-fig9"))
    tt = spp["throughput_rps"] / spo["throughput_rps"]
    ttft = spp["ttft_s"]["p90"] / spo["ttft_s"]["p90"]
    agree = YES if ratio_agreement([tt], 1.4, 1.4) == YES and similar(ttft, 0.25) == YES else \
        DIRECTION if tt > 1 else NO
    out.append(Row("Fig. 9: SP-P vs SP-O (fixed outstanding limit)", "similar TTFT, 1.4× throughput",
                   f"P90 TTFT ratio {ttft:.2f}, {tt:.2f}× throughput", agree,
                   "" if agree == YES else "setup: the paper's SP-O limit is not published (16 assumed); "
                   "with 16 per replica SP-O holds requests the engine could batch, so its TTFT is far "
                   "higher than SP-P's rather than similar", "skywalker-fig9"))

    f10 = lab.run("skywalker-fig10")
    cross = f10["skywalker"]["throughput_rps"] / f10["skywalker@regional"]["throughput_rps"]
    agree = ratio_agreement([cross], 1.07, 1.18)
    nine = lab.run("skywalker-fig10", key="skywalker-fig10-9v12",
                   overrides={"replicas": [{"region": r, "count": 3, "profile": "l4-llama3.1-8b"}
                                           for r in ("us", "eu", "asia")],
                              "policies": ["skywalker"]})
    nine_ratio = nine["skywalker"]["throughput_rps"] / f10["skywalker@regional"]["throughput_rps"]
    agree9 = similar(nine_ratio)
    both = YES if agree == YES and agree9 == YES else DIRECTION if cross > 1 else NO
    out.append(Row("Fig. 10: cross-region vs region-local (equal replicas); 9 cross-region ≈ 12 local",
                   "1.07–1.18×; 9 ≈ 12 (25 % cost cut)",
                   f"{cross:.2f}×; 9 cross-region / 12 local = {nine_ratio:.2f}"
                   + unstable_note(lab, "skywalker-fig10"),
                   both, "" if both == YES else f"model: forwarding cuts the P90 TTFT from "
                   f"{f10['skywalker@regional']['ttft_s']['p90']:.1f} s (region-local) to "
                   f"{f10['skywalker']['ttft_s']['p90']:.1f} s, but the hit rate falls from "
                   f"{f10['skywalker@regional']['prefix_hit_rate']:.0%} to {f10['skywalker']['prefix_hit_rate']:.0%} "
                   "(see the chat rows: pending gate + forwarded turns), and closed-loop throughput "
                   "(clients ÷ latency) does not rise", "skywalker-fig10"))
    return out
