"""Whole simulations: conservation, sanity, determinism, workloads, forwarding, bad input."""

import json

import pytest
from conftest import MOONCAKE, needs_trace

from kvroute.cli import main
from kvroute.sim.runner import run_scenario
from kvroute.sim.scenario import ScenarioError, load_scenario, parse_scenario
from kvroute.workload.synthetic import ChatWorkload, ConversationShape, ThoughtTree
from kvroute.workload.traces import MooncakeTrace, TraceError


def scenario(**kw):
    base = {"replicas": [{"region": "us", "count": 4, "profile": "l4-llama3.1-8b"}],
            "workload": {"kind": "chat", "clients": {"us": 24}},
            "policies": ["round_robin", "skywalker", "lmetric"],
            "limits": {"max_requests": 400}, "seed": 3}
    base.update(kw)
    return parse_scenario(base)


def test_conservation_every_request_finishes_once_or_fails():
    for run in run_scenario(scenario()):
        r = run.result
        assert r["requests"] + sum(r["failed"].values()) == r["issued"] == 400
        assert not r["failed"]
        assert 0 <= r["prefix_hit_rate"] <= 1
        assert r["ttft_s"]["p50"] <= r["ttft_s"]["p99"] and r["ttft_s"]["p50"] <= r["e2e_s"]["p50"]


def test_more_replicas_never_lower_throughput():
    tput = []
    for n in (2, 4, 8):
        sc = scenario(replicas=[{"region": "us", "count": n}], policies=["round_robin"],
                      workload={"kind": "chat-poisson", "rate": 40.0, "clients": {"us": 1}},
                      limits={"max_requests": 600})
        tput.append(run_scenario(sc)[0].result["throughput_rps"])
    assert tput[0] <= tput[1] <= tput[2], tput


@needs_trace
def test_larger_time_scale_never_raises_mean_ttft():
    means = []
    for ts in (0.05, 0.2, 1.0, 4.0):
        sc = scenario(replicas=[{"region": "us", "count": 4, "profile": "h20-qwen3-30b-a3b"}],
                      workload={"kind": "mooncake", "path": str(MOONCAKE), "time_scale": ts},
                      policies=["least_request"], limits={"max_requests": 600})
        means.append(run_scenario(sc)[0].result["ttft_s"]["mean"])
    assert all(a >= b for a, b in zip(means, means[1:])), means


def test_same_scenario_and_seed_give_byte_identical_json(tmp_path):
    sc = tmp_path / "s.yaml"
    sc.write_text("replicas: [{region: us, count: 3}]\nworkload: {kind: mixed, clients: {us: 12}}\n"
                  "policies: [sglang_cache_aware, lmetric]\nlimits: {max_requests: 300}\nseed: 9\n")
    outs = []
    for i in range(2):
        out = tmp_path / f"r{i}.json"
        assert main(["simulate", str(sc), "--json", str(out)]) == 0
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    data = json.loads(outs[0])
    for r in data["results"].values():
        assert {"requests", "ttft_s", "tpot_s", "e2e_s", "throughput_rps", "output_tps",
                "prefix_hit_rate", "imbalance_cv"} <= set(r)
        assert set(r["ttft_s"]) == {"mean", "p50", "p90", "p95", "p99"}


def test_tree_of_thought_issues_fifteen_requests_per_tree_with_concurrent_siblings():
    wl = ChatWorkload({"us": 1}, seed=1, tree_fraction=1.0)
    tree = wl.new_program("us", 0)
    assert isinstance(tree, ThoughtTree)
    pending, total, widest = tree.start(), 0, 0
    while pending:
        widest = max(widest, len(pending))
        total += len(pending)
        nxt = []
        for sreq in pending:
            nxt += tree.on_complete(sreq)
        pending = nxt
    assert total == 15 and widest == 8


def test_conversation_turns_extend_the_previous_prompt():
    wl = ChatWorkload({"us": 1}, seed=2)
    conv = wl.new_program("us", 0)
    conv.turns_left = 3
    first = conv.start()[0]
    second = conv.on_complete(first)[0]
    assert second.req.block_hashes[: len(first.req.block_hashes)] == first.req.block_hashes
    assert second.req.prompt_tokens > first.req.prompt_tokens + first.output_tokens


def _played(wl: ChatWorkload, programs: int) -> list:
    """Every request of ``programs`` programs played to the end without an engine."""
    out = []
    for slot in range(programs):
        todo = wl.new_program("us", slot).start()
        while todo:
            out += todo
            todo = [n for s in todo for n in s.program.on_complete(s)]
    return out


def test_conversation_shape_of_skywalkers_replay_bare_multi_turn_and_capped():
    # SkyWalker's released client: no system prompt, multi-turn conversations only, max_tokens 512.
    shape = ConversationShape(context=False, min_turns=2, max_output_tokens=512)
    default = ChatWorkload({"us": 2}, seed=3)
    bare = ChatWorkload({"us": 2}, seed=3, conversation=shape)
    first_bare = [bare.new_program("us", i).start()[0].req.prompt_tokens for i in range(200)]
    first_default = [default.new_program("us", i).start()[0].req.prompt_tokens for i in range(200)]
    # the same draws: the first turn is the question alone, without the system prompt (64+ tokens) before it
    assert all(b + 64 <= d for b, d in zip(first_bare, first_default))
    reqs = _played(ChatWorkload({"us": 2}, seed=4, conversation=shape), 300)
    assert max(r.output_tokens for r in reqs) <= 512 and all(r.req.max_output_tokens == 512 for r in reqs)
    assert max(r.output_tokens for r in _played(ChatWorkload({"us": 2}, seed=4), 300)) > 512
    turns = [sum(1 for r in _played(ChatWorkload({"us": 1}, seed=s, conversation=shape), 1)) for s in range(60)]
    assert min(turns) >= 2


def test_conversation_shape_question_mean_and_end_chance():
    # SkyWalker's Arena shape: Chatbot Arena's published averages (question mean, 1.3 turns -> end 1/1.3).
    shape = ConversationShape(context=False, min_turns=2, max_output_tokens=512, question_mean=75.9, end_p=0.769)
    wl = ChatWorkload({"us": 1}, seed=8, conversation=shape)
    firsts, turns = [], []
    for i in range(3000):
        conv = wl.new_program("us", i)
        firsts.append(conv.start()[0].req.prompt_tokens)  # no context: the first prompt is the question
        turns.append(conv.turns_left + 1)  # turns_left counts the turns after the one just started
    assert abs(sum(firsts) / len(firsts) - 75.9) < 0.08 * 75.9
    assert min(turns) == 2 and abs(sum(turns) / len(turns) - 2.3) < 0.08
    never = ChatWorkload({"us": 1}, seed=8, conversation=ConversationShape(min_turns=2, end_p=1.0))
    assert all(never.new_program("us", i).turns_left == 2 for i in range(50))


def test_conversation_shape_end_chance_outside_0_1_is_a_one_line_error():
    with pytest.raises(ScenarioError, match="end_p"):
        parse_scenario({"replicas": [{"count": 1}], "workload": {
            "kind": "chat", "clients": {"local": 1}, "conversation": {"end_p": 1.5}}}, "inline")


def test_tree_nodes_follow_the_shape_cap_and_bare_root():
    shape = ConversationShape(context=False, max_output_tokens=256)
    reqs = _played(ChatWorkload({"us": 1}, seed=5, tree_fraction=1.0, conversation=shape), 40)
    assert len(reqs) == 40 * 15 and max(r.output_tokens for r in reqs) <= 256
    bare = ChatWorkload({"us": 1}, seed=6, tree_fraction=1.0, conversation=shape)
    default = ChatWorkload({"us": 1}, seed=6, tree_fraction=1.0)
    for i in range(40):  # same draws: the root is the question and instruction, no system prompt (64+) first
        assert bare.new_program("us", i).start()[0].req.prompt_tokens + 64 <= \
            default.new_program("us", i).start()[0].req.prompt_tokens


def _levels(shape: ConversationShape) -> list[list]:
    """One tree played level by level: each level's requests."""
    tree = ChatWorkload({"us": 1}, seed=4, tree_fraction=1.0, conversation=shape).new_program("us", 0)
    levels, pending = [], tree.start()
    while pending:
        levels.append(pending)
        pending = [child for sreq in pending for child in tree.on_complete(sreq)]
    return levels


def test_same_branches_send_one_prompt_per_level_and_answer_it_alike():
    """SkyWalker's tot.py appends a level's instruction once and sends it num_branches times at temperature
    0.001: every node of a level has one history; by default each branch is its own."""
    same = _levels(ConversationShape(context=False, max_output_tokens=256, same_branches=True))
    own = _levels(ConversationShape(context=False, max_output_tokens=256))
    assert [len(level) for level in same] == [len(level) for level in own] == [1, 2, 4, 8]
    for level in same:
        assert len({tuple(s.req.block_hashes) for s in level}) == 1 and len({s.output_tokens for s in level}) == 1
    assert all(len({tuple(s.req.block_hashes) for s in level}) > 1 for level in own[2:])  # branches diverge
    # still one tree: level k's prompt extends level k-1's
    for up, down in zip(same, same[1:], strict=False):
        assert down[0].req.block_hashes[:len(up[0].req.block_hashes) - 1] == up[0].req.block_hashes[:-1]


def test_conversation_key_in_a_scenario_reaches_the_workload():
    sc = parse_scenario({"replicas": [{"count": 1}], "workload": {
        "kind": "chat", "clients": {"local": 1},
        "conversation": {"context": False, "min_turns": 2, "max_output_tokens": 512, "question_mean": 75.9,
                         "end_p": 0.769}}}, "inline")
    wl = sc.make_workload()
    assert isinstance(wl, ChatWorkload) and wl.conversation == ConversationShape(False, 2, 512, 75.9, 0.769)


def test_skewed_regions_forward_to_peers_with_skywalker():
    sc = scenario(
        replicas=[{"region": r, "count": 2} for r in ("us", "eu", "asia")],
        balancers=[{"region": r, "forward": True} for r in ("us", "eu", "asia")],
        workload={"kind": "chat", "clients": {"us": 60, "eu": 4, "asia": 4}},
        policies=["round_robin", "skywalker"], limits={"max_requests": 500})
    rr, sky = (run.result for run in run_scenario(sc))
    assert rr["cross_region_forwards"] == 0  # blind pushing never holds, so never forwards
    assert sky["cross_region_forwards"] > 0
    assert sky["cross_region_served"] == sky["cross_region_forwards"]
    assert sky["ttft_s"]["mean"] < rr["ttft_s"]["mean"]


def test_request_longer_than_kv_capacity_is_rejected_and_counted(tmp_path):
    trace = tmp_path / "t.jsonl"
    lines = [{"timestamp": i * 100, "input_length": 800, "output_length": 20, "hash_ids": [i, 1000 + i]}
             for i in range(20)]
    lines[5]["input_length"] = 10_000_000
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    sc = scenario(workload={"kind": "mooncake", "path": str(trace)}, policies=["round_robin"])
    r = run_scenario(sc)[0].result
    assert r["requests"] == 19 and r["failed"] == {"rejected": 1}


def test_malformed_trace_line_names_file_line_and_field(tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n'
                     '{"timestamp": 5, "input_length": "ten", "output_length": 5, "hash_ids": [2]}\n'
                     '{"timestamp": 9, "input_length": 10, "output_length": 5, "hash_ids": [3]}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:2: field 'input_length'"):
        list(MooncakeTrace(trace).arrivals())
    wl = MooncakeTrace(trace, skip_bad=True)
    assert len(list(wl.arrivals())) == 2 and wl.skipped == 1


def test_unknown_scenario_key_names_key_line_and_allowed(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("name: x\nworkload:\n  kind: chat\n  rat: 3\n")
    with pytest.raises(ScenarioError, match=r"s.yaml:4: unknown key 'workload.rat'; allowed: kind, clients"):
        load_scenario(str(f))
    f.write_text("name: x\npolicy: [lmetric]\n")
    with pytest.raises(ScenarioError, match=r"unknown key 'policy'; allowed: name, seed, network"):
        load_scenario(str(f))
    with pytest.raises(ScenarioError, match="unknown preset 'lmetrik'"):
        parse_scenario({"policies": ["lmetrik"]}).policy_list()


def test_cli_reports_bad_input_without_traceback(tmp_path, capsys):
    f = tmp_path / "s.yaml"
    f.write_text("workload: {kind: chat, clients: {us: 2}}\nreplicas: [{region: us, profile: tpu}]\n")
    assert main(["simulate", str(f)]) == 2
    assert "unknown profile 'tpu'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["chat-1region", "chat-3region-skewed", "tot", "mixed-tree", "mooncake"])
def test_bundled_scenarios_validate(name):
    sc = load_scenario(name)
    sc.setup()
    assert sc.policy_list()


def test_cli_simulate_writes_plots(tmp_path):
    assert main(["simulate", "--replicas", "2", "--workload", "tot", "--policy", "round_robin,skywalker",
                 "--max-requests", "150", "--plots", str(tmp_path)]) == 0
    for name in ("ttft_cdf.png", "e2e_cdf.png", "throughput.png", "replica_load.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_synthetic_context_hashes_match_a_token_by_token_reference():
    import random
    import struct
    from array import array

    import xxhash

    from kvroute.workload.context import Context

    def reference(segments, bt):
        tokens = [(s, i) for s, n in segments for i in range(n)]
        hashes, last = [], 0
        for b in range(len(tokens) // bt):
            pieces = []
            for s, i in tokens[b * bt:(b + 1) * bt]:
                if pieces and pieces[-1][0] == s and pieces[-1][1] + pieces[-1][2] == i:
                    pieces[-1][2] += 1
                else:
                    pieces.append([s, i, 1])
            data = (struct.pack("<qqq", *pieces[0]) if len(pieces) == 1
                    else array("q", [x for p in pieces for x in p]).tobytes())
            last = xxhash.xxh3_64_intdigest(data, last)
            hashes.append(last)
        return tuple(hashes)

    rng = random.Random(1)
    for _ in range(200):
        bt = rng.choice([4, 16, 64])
        segments = [(rng.getrandbits(62), rng.randint(1, 150)) for _ in range(rng.randint(1, 8))]
        ctx = Context(bt)
        for s, n in segments:
            ctx = ctx.extend(s, n)
        assert ctx.hashes == reference(segments, bt)
        assert ctx.tokens == sum(n for _, n in segments)
