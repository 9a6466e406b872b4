"""SGLang-style admission (sim/sglang_admission.py): requests wait before the replica overcommits."""

from test_sim_engine import Harness, small_profile

from kvroute.perf.loader import load_profile
from kvroute.sim.engine import Seq
from kvroute.sim.sglang_admission import (
    CLIP_MAX_NEW_TOKENS,
    INIT_NEW_TOKEN_RATIO,
    MIN_NEW_TOKEN_RATIO_FACTOR,
    SGLangReserve,
)


def burst(h: Harness, n: int, prompt: int, output: int, max_new: int) -> int:
    """Submit ``n`` distinct requests at once; returns the most that waited at one time before the
    first preemption (what a pending probe sees while the replica has not yet overcommitted)."""
    for i in range(n):
        h.eng.submit(Seq(f"r{i}", prompt, output, (), 16, max_new=max_new))
    most = 0  # counted from the first step boundary on (submissions meanwhile queue in both)
    heap = h.loop._heap
    while heap:
        h.loop.run(until=heap[0][0])
        h.check()
        if h.eng.preemptions == 0:
            most = max(most, h.eng.queued)
    return most


def test_the_l4_profile_runs_sglang_admission():
    """SkyWalker's replicas ran SGLang (§5.1), so the L4 profile admits as SGLang does."""
    assert load_profile("l4-llama3.1-8b").admission == "sglang"


def test_sglang_holds_requests_that_vllm_admits_and_never_preempts():
    """12 requests of 500 + 1,500 tokens on a 16K-token cache: vLLM admits all 12 at once (6K
    prompt tokens fit), nothing waits until their outputs outgrow the cache and it preempts;
    SGLang reserves each one's future output, so some wait from the start (the 'pending' signal)
    and it never runs out. The step budget takes all 12 prompts at once (8,192 tokens): with the L4's
    2,048, vLLM v1 too holds prompts back for a few steps, for its token budget (sim/batch.py), not
    for memory."""
    vllm = Harness(small_profile(kv_blocks=1000, max_batched_tokens=8192))
    sgl = Harness(small_profile(kv_blocks=1000, admission="sglang", max_batched_tokens=8192))
    waited_vllm = burst(vllm, 12, 500, 1500, max_new=2048)
    waited_sgl = burst(sgl, 12, 500, 1500, max_new=2048)
    assert len(vllm.done) == len(sgl.done) == 12
    assert waited_vllm == 0 and vllm.eng.preemptions > 0
    assert waited_sgl > 0 and sgl.eng.preemptions == 0


def test_ratio_decays_per_decode_step_to_its_floor_and_resets_when_idle():
    h = Harness(small_profile(admission="sglang"))
    rule = h.eng.admission
    assert isinstance(rule, SGLangReserve) and rule.ratio == INIT_NEW_TOKEN_RATIO
    seen = []

    def probe(_):  # a request arriving ~700 decode steps in: admission looks at the ratio
        h.eng.submit(Seq("probe", 100, 5, (), 16))

    h.eng.submit(Seq("long", 100, 1200, (), 16))  # 1,200 decode steps > the 600 the decay takes
    h.loop.at(40.0, probe, None)
    h.loop.at(40.2, lambda _: seen.append(rule.ratio), None)  # after the probe's admission
    h.run()
    assert len(h.done) == 2 and seen == [INIT_NEW_TOKEN_RATIO * MIN_NEW_TOKEN_RATIO_FACTOR]
    h.eng.submit(Seq("after", 100, 5, (), 16))  # an idle engine starts again from init
    assert rule.ratio == INIT_NEW_TOKEN_RATIO


def test_a_request_without_max_tokens_reserves_up_to_the_clip():
    """No client cap: SGLang's max_new_tokens is the pool less the prompt, estimated at most 4,096."""
    rule = SGLangReserve(46_400)
    assert rule.max_new(Seq("a", 1000, 10, (), 16)) == 46_399 - 1000 - 1
    assert rule.max_new(Seq("b", 1000, 10, (), 16, max_new=256)) == 256
    h = Harness(small_profile(kv_blocks=1000, admission="sglang"))  # 16K tokens
    h.eng.submit(Seq("x", 100, 3000, (), 16))
    h.loop.run(until=h.loop._heap[0][0] + 0.5)
    assert h.eng.admission.held(h.eng) > 0.5 * CLIP_MAX_NEW_TOKENS * h.eng.admission.ratio
