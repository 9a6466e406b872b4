"""SkyWalker (EuroSys '26; 000_6f99922b2639b957.txt): the claims of §5 against kvroute's simulator.

Setups: ``kvroute/scenarios/reproduce/skywalker-{chat,tot,mixed,fig9,fig10}.yaml``, each value
cited from the paper or SkyWalker's released code (skypilot-org/skypilot serve-multi-region-lb: the
replicas' launch flags, the benchmark client's conversation and tree shapes) or named as a choice in
the file. Baselines run behind ONE load balancer in the US managing every replica (Fig. 8);
SkyWalker and GKE Gateway run one LB per region. The replicas run SGLang's admission
(profiles/l4-llama3.1-8b.yaml, sim/sglang_admission.py) with the 22,400-token KV pool derived from
the released ``--mem-fraction-static 0.8``.
"""

from __future__ import annotations

from kvroute.perf.loader import load_profile
from kvroute.reproduce.common import (
    DIRECTION,
    NO,
    YES,
    Lab,
    Row,
    fmt_range,
    pct,
    ratio_agreement,
    similar,
    unstable_note,
)
from kvroute.workload.synthetic import ChatWorkload, ConversationShape

BASELINES = ("round_robin@global", "least_request@global", "consistent_hash@global",
             "sglang_cache_aware(miss=smallest_tree)@global")
GKE = "round_robin@regional"  # a generic multi-cluster gateway: nearest region, GCP's ROUND_ROBIN default
GKE_EPP = "gke_gateway@regional"  # today's inference-extension EPP (queue 2, KV utilization 2, prefix 3)
GKE_NO_PREFIX = "gke_gateway(scorers={'queue': 2, 'kv_cache_util': 2})@regional"  # the EPP without prefix
SHORT = {"round_robin@global": "RR", "least_request@global": "LL", "consistent_hash@global": "CH",
         "sglang_cache_aware(miss=smallest_tree)@global": "SGLang", GKE: "GKE"}
# §5.1 "Multi-turn conversation": ChatBot Arena "80 ongoing conversations per region"; WildChat
# "40 in the US and 30 in both Europe and Asia". Conversation shapes from SkyWalker's released client
# (sky/lbbench/workloads/arena_syn.py, wildchat.py: multi-turn only, max_tokens 512; the Arena replay
# sends no system prompt); see scenarios/reproduce/skywalker-chat.yaml.
# Arena's question mean and turn count: the Chatbot Arena paper's Table 1 (94.9 Llama-2 tokens a prompt,
# 1.3 turns a conversation) at Llama 3's 4.0 vs Llama 2's 3.2 characters a token; derivation in the scenario.
ARENA = {"context": False, "min_turns": 2, "max_output_tokens": 512, "question_mean": 75.9, "end_p": 0.769}
WILDCHAT = {"context": False, "min_turns": 2, "max_output_tokens": 512}
CHATS = (("arena", {"us": 80, "eu": 80, "asia": 80}, ARENA), ("wildchat", {"us": 40, "eu": 30, "asia": 30}, WILDCHAT))


def why_chat(sw: dict, best: tuple[str, dict], lengths: str) -> str:
    """The measured mechanism behind SkyWalker's chat rows, from its own run."""
    br = sw["branches"]
    share = br.get("least-load", 0) / max(1, sum(br.values()))
    fwd = sw.get("by_path", {}).get("forwarded", {})
    text = (f"model: {share:.0%} of SkyWalker's decisions take the least-load branch (a prefix match "
            f"below 0.5, or the replica holding it has a waiting request); {fwd.get('requests', 0)} forwarded "
            f"requests hit {fwd.get('prefix_hit_rate', 0):.0%}. SkyWalker's hit rate is {sw['prefix_hit_rate']:.0%} "
            f"against the global {best[0]} baseline's {best[1]['prefix_hit_rate']:.0%}")
    if sw["prefix_hit_rate"] < best[1]["prefix_hit_rate"] - 0.05:
        text += ", so it loses reuse the cache-aware baseline keeps"
    else:
        text += (f": reuse is at par, and closed-loop throughput, bounded by decode time (E2E p50 "
                 f"{sw['e2e_s']['p50']:.1f} s vs TTFT p50 {sw['ttft_s']['p50']:.2f} s), moves little")
    return text + f". {lengths}"


def chat_lengths(clients: dict[str, int], shape: dict, conversations: int = 2000, seed: int = 1) -> tuple[float, float]:
    """Mean prompt tokens per request and mean turns per conversation of the synthetic chat with these
    clients and conversation ``shape`` at ``seed`` (the run's), played through without an engine (answers
    are the workload's draws)."""
    wl = ChatWorkload(clients, seed=seed, conversation=ConversationShape(**shape))
    regions = list(clients)
    prompts, turns = [], 0
    for slot in range(conversations):
        todo = wl.new_program(regions[slot % len(regions)], slot).start()
        while todo:
            prompts.append(todo[0].req.prompt_tokens)
            turns += 1
            todo = todo[0].program.on_complete(todo[0]) if todo[0].program else []
    return sum(prompts) / len(prompts), turns / conversations


def kv_note(lab: Lab, sw: dict, clients: dict[str, int], shape: dict) -> str:
    """Whether the chat run is saturated, and what that does to prefix reuse: contexts a replica's KV
    cache holds against the conversations each replica serves, beside the paper's own §3.3 count."""
    if sw["ttft_s"]["p90"] <= 10.0:
        return ""
    groups = lab.scenario("skywalker-chat").replicas
    replicas = sum(g.count for g in groups)
    prof = load_profile(groups[0].profile)
    kv = (groups[0].kv_blocks or prof.kv_blocks) * prof.block_size
    prompt, _ = chat_lengths(clients, shape, seed=lab.seed)
    per = sum(clients.values()) / replicas
    return (f"Saturated: SkyWalker's TTFT p90 is {sw['ttft_s']['p90']:.1f} s where the paper's P90s \"can reach "
            f"several seconds\" (§5.1); an L4's KV pool ({kv:,} tokens, from the released launch flags) holds "
            f"~{kv / prompt:.0f} contexts of {prompt:,.0f} tokens while each replica serves {per:.0f} "
            "conversations, so requests queue and a conversation's prefix is mostly evicted before its next turn, "
            f"under every policy. For {per:.0f} conversations a replica to fit the pool, as the paper's P90s and "
            "the \"20 to 50\" outstanding requests it saw an L4 hold (§3.3) suggest, its requests held at most "
            f"~{kv / per:,.0f} tokens each. ")


def lengths_note(clients: dict[str, int], shape: dict, key: str, seed: int = 1) -> str:
    """The synthetic chat's lengths at ``seed`` beside the published ones (what the chat rows' setup rests on)."""
    prompt, turns = chat_lengths(clients, shape, seed=seed)
    text = (f"Setup: synthetic chat stands in for the trace, shaped as SkyWalker's released client replays it "
            f"(sky/lbbench/workloads/arena_syn.py, wildchat.py: multi-turn conversations only, answers capped at "
            f"512 tokens, no system prompt); its requests average {prompt:,.0f} prompt tokens over {turns:.1f} "
            "turns a conversation")
    if key.endswith("arena"):
        return text + (": questions average 75.9 tokens and conversations 1.3 turns before the replay's "
                       "multi-turn filter, Chatbot Arena's averages (94.9 Llama-2 tokens a prompt, 1.3 turns; "
                       "Chatbot Arena paper, arXiv 2403.04132, Table 1) at Llama 3's 4.0 vs Llama 2's 3.2 "
                       "characters a token; the answers are the engine's own (unpublished; kvroute's draw, "
                       "median 200 tokens, is a choice)")
    return text + (" (the replay sends WildChat-1M's user turns; GORGO v2's 2,925-token average request on "
                   "WildChat-4.8M, §3, Fig. 1, includes the dataset's own answers)")


def chat_rows(lab: Lab, key: str, chat: dict, where: str, clients: dict[str, int], shape: dict) -> list[Row]:
    """The chat claims of Fig. 8(a)/(b) on one run of the chat setup."""
    out: list[Row] = []
    sw, ch = chat["skywalker"], chat["skywalker_ch"]
    base = {b: chat[b] for b in BASELINES}
    every = {**base, GKE: chat[GKE]}  # "across all evaluated systems" (§5.1, TTFT and E2E)
    note = unstable_note(lab, key)
    best = max(base.items(), key=lambda kv: kv[1]["prefix_hit_rate"])
    why = kv_note(lab, sw, clients, shape) + why_chat(sw, (SHORT[best[0]], best[1]),
                                                      lengths_note(clients, shape, key, lab.seed))
    tput = {SHORT[b]: sw["throughput_rps"] / r["throughput_rps"] for b, r in base.items()}
    agree = ratio_agreement(list(tput.values()), 1.12, 1.2)
    out.append(Row(f"throughput vs single-LB baselines, chat {where}", "1.12–1.2×",
                   ", ".join(f"{k} {v:.2f}×" for k, v in tput.items()) + note, agree,
                   "" if agree == YES else why, key))
    out.append(gke_row(chat, key, where, note, kv_note(lab, sw, clients, shape)))
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
        shares = {b: sw["ttft_s"][q] / r["ttft_s"][q] for b, r in every.items()}
        agree = ratio_agreement(list(shares.values()), lo, hi)
        regional = q == "p50" and max(shares, key=lambda k: shares[k]) == GKE
        out.append(Row(f"TTFT {q}, SkyWalker as share of every baseline incl. GKE {where}", paper,
                       fmt_range(list(shares.values()), "{:.0%}") + note, agree,
                       "" if agree == YES else closest(sw, every, shares, "ttft_s", q)
                       + (regional_p50(sw, every[GKE], clients, shape, lab.seed) if regional else "") + why, key))
    e2e = {b: r["e2e_s"]["p50"] / sw["e2e_s"]["p50"] for b, r in every.items()}
    agree = ratio_agreement(list(e2e.values()), 1.05, 2.14)
    out.append(Row(f"E2E p50 improvement over every baseline incl. GKE {where}", "1.05–2.14×",
                   fmt_range(list(e2e.values())) + note, agree,
                   "" if agree == YES else closest(sw, every, {b: 1 / v for b, v in e2e.items()}, "e2e_s", "p50")
                   + why, key))
    r = sw["throughput_rps"] / ch["throughput_rps"]
    agree = ratio_agreement([r], 1.0134, 1.0821)
    out.append(Row(f"SkyWalker vs SkyWalker-CH throughput {where}", "+1.34–8.21 %",
                   f"{(r - 1) * 100:+.2f} %" + note, agree,
                   "" if agree == YES else f"model: both share the pending gate and forwarding; hit rates "
                   f"{sw['prefix_hit_rate']:.0%} vs {ch['prefix_hit_rate']:.0%}, so the prefix trie gains "
                   "little over session hashing here", key))
    return out


def closest(sw: dict, every: dict, shares: dict, metric: str, q: str) -> str:
    """The baseline SkyWalker comes closest to (its largest share), with both values and the load."""
    b = max(shares, key=lambda k: shares[k])
    text = f"closest: {SHORT[b]} ({every[b][metric][q]:.2f} s vs SkyWalker's {sw[metric][q]:.2f} s). "
    if sw["ttft_s"]["p90"] <= 10.0:  # a saturated run says so in kv_note
        text += (f"Load: SkyWalker's TTFT p90 is {sw['ttft_s']['p90']:.1f} s where the paper's P90s \"can reach "
                 "several seconds\" (§5.1). ")
    return text


def regional_p50(sw: dict, gke: dict, clients: dict[str, int], shape: dict, seed: int = 1) -> str:
    """Why SkyWalker's TTFT p50 is no lower than a per-region gateway's: of the paper's two causes, the
    cross-region one is absent (both stay in the region), leaving prefill saved by prefix hits."""
    prompt, _ = chat_lengths(clients, shape, seed=seed)
    return ("The paper credits SkyWalker's lower P50 to \"its geo-distributed load balancers, which reduce "
            "cross-region latency, and its high prefix hit rates, which reduce prefill time\" (§5.1); GKE's "
            "gateway also serves each region's clients in their own region, so only prefill is left to save, "
            f"and with prompts of {prompt:,.0f} tokens on average (the paper: ~300 ms to prefill 512 tokens on an "
            f"L4, §2.1) SkyWalker's hit rate of {sw['prefix_hit_rate']:.0%} against GKE's "
            f"{gke['prefix_hit_rate']:.0%} saves little; the paper's GKE hit 18.1–24.3 % and SkyWalker "
            "37.0–46.6 %. ")


def gke_row(chat: dict, key: str, where: str, note: str, load: str) -> Row:
    """SkyWalker vs GKE Gateway: throughput (1.43–1.62× on the chat traces, §5.1) and GKE's hit rate. Judged on
    a generic gateway (the paper: "general-purpose multi-cluster load balancing", §5.1; "not tailored for LLM
    workloads", §6); the inference extension's EPP, with and without its prefix scorer, is shown beside it."""
    sw, gen, epp, bare = chat["skywalker"], chat[GKE], chat[GKE_EPP], chat[GKE_NO_PREFIX]
    ratio, ratio_bare, ratio_epp = (sw["throughput_rps"] / g["throughput_rps"] for g in (gen, bare, epp))
    agree = ratio_agreement([ratio], 1.43, 1.62)
    why = load + (f"model: GKE Gateway read as the paper describes it, a generic gateway with no prefix awareness "
                  "or selective pushing (§5.1, §6): each region's clients go to their own region's replicas, "
                  f"round robin (Google Cloud's default endpoint policy). Its hit rate is {gen['prefix_hit_rate']:.0%} "
                  f"(paper 18.1–24.3 %), SkyWalker's {sw['prefix_hit_rate']:.0%}; TTFT p90 "
                  f"{gen['ttft_s']['p90']:.1f} s vs SkyWalker's {sw['ttft_s']['p90']:.1f} s. The paper's clients per "
                  "region are balanced or near it, so staying in the region loses little, and closed-loop "
                  "throughput is bounded by decode time, which neither reuse nor the pending gate shortens")
    return Row(f"throughput vs GKE Gateway, chat {where}", "1.43–1.62× (GKE hit 18.1–24.3 %)",
               f"{ratio:.2f}× (generic gateway: round robin per region, hit {pct(gen['prefix_hit_rate'])}); vs the "
               f"inference extension's EPP {ratio_bare:.2f}× without its prefix scorer (hit "
               f"{pct(bare['prefix_hit_rate'])}), {ratio_epp:.2f}× with it (hit {pct(epp['prefix_hit_rate'])})" + note,
               agree, "" if agree == YES else why, key)


def rows(lab: Lab) -> list[Row]:
    """SkyWalker's claims: the chat comparisons at the paper's Arena and WildChat client counts, tree-of-thought
    and mixed-tree workloads, selective pushing (Fig. 9) and cross-region replicas (Fig. 10)."""
    out: list[Row] = []
    for trace, clients, shape in CHATS:
        key = f"skywalker-chat-{trace}"
        chat = lab.run("skywalker-chat", key=key, overrides={"workload": {"clients": clients, "conversation": shape}})
        label = "ChatBot Arena" if trace == "arena" else "WildChat"
        out += chat_rows(lab, key, chat, f"({label} clients: {'/'.join(map(str, clients.values()))})", clients,
                         shape)

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
                   "" if agree == YES else "setup: the paper gives the tree (depth four, 2 branches, 15 "
                   "requests) and the GSM8K questions; its released client (sky/lbbench/workloads/tot.py) "
                   "sends no system prompt, caps answers at 256 tokens and sends each level's prompt once per "
                   "branch at temperature 0.001 (identical branches, read as answered alike), which kvroute "
                   "follows, while the question (median 200 tokens) and answer lengths below the cap (median "
                   "150) are kvroute's choices; with no prompt shared across trees, RR/LL reuse only what the "
                   "nodes of a tree on one replica share, so the ordering holds while both levels sit lower",
                   "skywalker-tot"))

    mixed = lab.run("skywalker-mixed")
    m_sw, m_ch = mixed["skywalker"], mixed["consistent_hash@global"]
    win = m_sw["throughput_rps"] / m_ch["throughput_rps"]
    var = (m_ch["imbalance_cv"] ** 2) / max(1e-9, m_sw["imbalance_cv"] ** 2)
    agree = YES if win > 1 and var > 2 else DIRECTION if win > 1 or var > 1 else NO
    out.append(Row("mixed tree: SkyWalker wins; CH overloads a replica", "SkyWalker > CH; CH 3.36× load variance",
                   f"SkyWalker/CH throughput {win:.2f}×; CH/SkyWalker load variance {var:.2f}×"
                   + unstable_note(lab, "skywalker-mixed"), agree,
                   "" if agree == YES else f"model: the paper's shapes are used (US: 2 clients of 4-branch "
                   f"trees, 85 requests each; Europe/Asia: 20 clients each of 2-branch trees); CH keeps each "
                   f"tree on one replica (hit {m_ch['prefix_hit_rate']:.0%} vs SkyWalker's "
                   f"{m_sw['prefix_hit_rate']:.0%}) and its 42 concurrent trees spread over 12 replicas "
                   f"(load CV {m_ch['imbalance_cv']:.2f} vs {m_sw['imbalance_cv']:.2f}, TTFT p90 "
                   f"{m_ch['ttft_s']['p90']:.1f} vs {m_sw['ttft_s']['p90']:.1f} s); the paper's 3.36× comes from "
                   "\"user-generated request bursts\" that \"saturate individual replicas\", and a burst of a "
                   "US tree's 64 leaves on one simulated L4 does not saturate it as much", "skywalker-mixed"))

    f9 = lab.run("skywalker-fig9")
    bp = f9["sglang_cache_aware(admission=blind,miss=smallest_tree)"]
    spo = f9["sglang_cache_aware(admission=outstanding,max_outstanding=10,miss=smallest_tree)"]
    spp = f9["sglang_cache_aware(admission=pending,miss=smallest_tree)"]
    t_ratio = spp["throughput_rps"] / bp["throughput_rps"]
    p90 = bp["ttft_s"]["p90"] / spp["ttft_s"]["p90"]
    agree_t, agree_p = ratio_agreement([t_ratio], 1.27, 1.27), ratio_agreement([p90], 18.47, 18.47)
    agree = YES if YES == agree_t == agree_p else DIRECTION if t_ratio > 1 and p90 > 1 else NO
    out.append(Row("Fig. 9: SP-P vs blind pushing (1 region, 4 replicas, 30 clients, ToT)",
                   "1.27× throughput, 18.47× lower P90 TTFT, hit 89.9 vs 68.9 %",
                   f"{t_ratio:.2f}× throughput, {p90:.2f}× P90 TTFT, hit {pct(spp['prefix_hit_rate'])} vs "
                   f"{pct(bp['prefix_hit_rate'])}" + unstable_note(lab, "skywalker-fig9"), agree,
                   "" if agree == YES else f"setup: the paper's setup is used (4 replicas, 30 clients, ToT "
                   f"branching 2, SGLang admission, the 22,400-token KV pool of the released launch flags, no "
                   f"system prompt, 256-token answer cap and identical branches of the released client, tot.py), "
                   f"but blind pushing builds "
                   f"little backlog (BP's P90 TTFT {bp['ttft_s']['p90']:.2f} s, {bp['preemptions']} preemptions, "
                   f"hit {bp['prefix_hit_rate']:.0%}), so the pending gate has little to fix; the paper ran "
                   "\"replicas at high utilization\" (§5.1) and its BP lost hit rate (68.9 %), i.e. evicted "
                   "shared prefixes, which needs more KV per tree than kvroute's answers (a choice: median 150 "
                   "tokens under the 256 cap; the paper publishes no answer lengths) take. The released client "
                   "issues both branches at the first level too (tot.py: 2+4+8+16 = 30 requests a tree, 16 "
                   "leaves), where §5.1 says 15 requests a tree, which kvroute follows. Checked: the probe reads "
                   "SGLang's num_queue_reqs as SGLang sets it (at a prefill batch or every 40th decode step, "
                   "sim/queue_gauge.py), which is all SkyWalker's balancer reads (a replica is available iff "
                   "it is 0; skypilot serve-multi-region-lb load_balancer.py _probe_ie_queue)",
                   "skywalker-fig9"))
    tt = spp["throughput_rps"] / spo["throughput_rps"]
    ttft = spp["ttft_s"]["p90"] / spo["ttft_s"]["p90"]
    agree = YES if ratio_agreement([tt], 1.4, 1.4) == YES and similar(ttft, 0.25) == YES else \
        DIRECTION if tt > 1 else NO
    out.append(Row("Fig. 9: SP-P vs SP-O (fixed outstanding limit)", "similar TTFT, 1.4× throughput",
                   f"P90 TTFT ratio {ttft:.2f}, {tt:.2f}× throughput", agree,
                   "" if agree == YES else "setup: the paper does not state SP-O's limit; kvroute uses 10, the "
                   "per-replica default of SkyServe's load balancer (sky/serve/load_balancer.py), below the "
                   "20–50 outstanding requests the paper saw an L4 hold (§3.3): SP-O holds requests the engine "
                   "could batch, so its TTFT is far higher than SP-P's rather than similar", "skywalker-fig9"))

    f10 = lab.run("skywalker-fig10")
    cross = f10["skywalker"]["throughput_rps"] / f10["skywalker@regional"]["throughput_rps"]
    agree = ratio_agreement([cross], 1.07, 1.18)
    nine = lab.run("skywalker-fig10", key="skywalker-fig10-9v12",
                   overrides={"replicas": [{**g.model_dump(exclude_none=True), "count": 3}
                                           for g in lab.scenario("skywalker-fig10").replicas],
                              "policies": ["skywalker"]})
    nine_ratio = nine["skywalker"]["throughput_rps"] / f10["skywalker@regional"]["throughput_rps"]
    agree9 = similar(nine_ratio)
    both = YES if agree == YES and agree9 == YES else DIRECTION if cross > 1 else NO
    out.append(Row("Fig. 10: cross-region vs region-local (equal replicas); 9 cross-region ≈ 12 local",
                   "1.07–1.18×; 9 ≈ 12 (25 % cost cut)",
                   f"{cross:.2f}×; 9 cross-region / 12 local = {nine_ratio:.2f}"
                   + unstable_note(lab, "skywalker-fig10"),
                   both, "" if both == YES else why_fig10(f10), "skywalker-fig10"))
    return out


def why_fig10(f10: dict) -> str:
    """Fig. 10's mechanism in kvroute, from the run: what forwarding does to each side's latency and reuse."""
    loc, sky = f10["skywalker@regional"], f10["skywalker"]
    region = {name: r["by_client_region"] for name, r in (("local", loc), ("sky", sky))}
    away = [r for r in region["local"] if r != "us"]
    hit = {k: sum(region[k][r]["prefix_hit_rate"] for r in away) / len(away) for k in region}
    p90 = {k: max(region[k][r]["ttft_s"]["p90"] for r in away) for k in region}
    return (f"model: forwarding cuts the US clients' TTFT p90 from {region['local']['us']['ttft_s']['p90']:.1f} s "
            f"(region-local) to {region['sky']['us']['ttft_s']['p90']:.1f} s, but the forwarded conversations fill "
            f"the other regions' KV caches: their own clients' hit rate falls from {hit['local']:.0%} to "
            f"{hit['sky']:.0%} and their TTFT p90 rises from {p90['local']:.1f} s to {p90['sky']:.1f} s (overall hit "
            f"{loc['prefix_hit_rate']:.0%} → {sky['prefix_hit_rate']:.0%}), so closed-loop throughput (clients ÷ "
            "latency) does not rise. kvroute forwards as the paper does (\"If no local replica is available, the "
            "request is forwarded to an available remote region with the highest prefix hit ratio\", §4.1). "
            f"Load: 120 US clients on 4 simulated L4s saturate them (region-local US E2E p50 "
            f"{region['local']['us']['e2e_s']['p50']:.0f} s); the paper reports no latency for Fig. 10. Setup: the "
            "paper does not name Fig. 10's dataset (synthetic chat here, see the chat rows for its lengths)")
