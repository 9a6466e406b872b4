import asyncio

import pytest

from kvroute.model import Endpoint, Request
from kvroute.policy import Router, build_policy
from kvroute.policyfiles import load_entry_points
from kvroute.prefix import BlockHasher, chat_key
from kvroute.sim.tracefiles import DATA_DIR
from tests import compile_harness

# The real Mooncake trace is data, not code: it lives in shared/ beside a checkout (or where
# KVROUTE_TRACES points). CI and developer machines have it; a lone clone skips these tests.
MOONCAKE = DATA_DIR / "mooncake" / "conversation_trace.jsonl"
needs_trace = pytest.mark.skipif(not MOONCAKE.exists(),
                                 reason=f"needs the Mooncake trace at {MOONCAKE} (set KVROUTE_TRACES)")


def make_request(rid: str, text: str = "", *, key: str | None = None, tokens: int | None = None,
                 block_tokens: int = 64, **kw) -> Request:
    hashes, est = BlockHasher(block_tokens)(chat_key([{"role": "user", "content": text or rid}]))
    return Request(id=rid, block_hashes=hashes, block_tokens=block_tokens,
                   prompt_tokens=tokens if tokens is not None else est, routing_key=key, **kw)


async def until(cond, timeout: float = 10.0, what: str = "condition"):
    """Poll ``cond()`` on the running loop every 20 ms; an AssertionError naming ``what`` after ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.fixture(autouse=True, scope="session")
def runtime_start_up():
    """What every runtime does at start-up (CLI, gateway config, scenario parsing): install the
    hardware-profile loader the llm_d predictor resolves its profile with, load entry points."""
    load_entry_points()


@pytest.fixture(autouse=True)
def registries_restored():
    """Tests register presets and plugins (files, entry points, compositions in scenarios): each
    test leaves the registries as it found them, so no test depends on another's order."""
    from kvroute.policy.catalog import PLUGINS, PRESETS_TABLE

    plugins = {kind: dict(table) for kind, table in PLUGINS.items()}
    presets = dict(PRESETS_TABLE)
    yield
    PRESETS_TABLE.clear()
    PRESETS_TABLE.update(presets)
    for kind, table in plugins.items():
        PLUGINS[kind].clear()
        PLUGINS[kind].update(table)


@pytest.fixture(autouse=True)
def kvroute_logging_restored():
    """A test that runs `kvroute serve` (or epp, controller) in-process configures the "kvroute"
    logger for JSON lines on stderr; restored afterwards, so later tests' gateways log through
    pytest's capture instead of printing between tests."""
    import logging

    logger = logging.getLogger("kvroute")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


@pytest.fixture(scope="session")
def vllm_shared():
    """The real vLLM pair (tests/vllm/engine.py SharedPair) that tests/test_vllm.py and
    tests/test_vllm_streams.py share: started by the first file that asks, revived for the next,
    stopped by PID when the session ends."""
    from tests.vllm.engine import SharedPair

    pair = SharedPair()
    _vllm_pairs.append(pair)
    try:
        yield pair
    finally:
        pair.close()


_vllm_pairs: list = []  # the session's shared vLLM pair, once a test has asked for it
_vllm_last: list[str] = []  # the node id of the last test that uses it


@pytest.fixture
def router_for():
    def build(preset: str, n: int = 4, params: dict | None = None, **ep_kw) -> Router:
        eps = [Endpoint(f"e{i}", **ep_kw) for i in range(n)]
        return Router(build_policy(preset, params), eps)
    return build


# Tests whose time is simulation volume, run without line tracing (pytest-cov's no_cover marker: the
# test runs and asserts as it is, its lines just are not counted). `make test` runs pytest --cov with
# branch coverage, whose tracer made these 2-5x slower than without it: overload's stability knee
# 4.3 s without vs 16.7 and 21.8 s in the two fresh-clone CI logs of session 15, gorgo-v2's rows
# 5.3 vs 19.9 and 17.2 s, the pool plan search 2.7 vs 14.0 and 9.0 s, while the gateway, HTTP and
# engine tests beside them took 0.4-1.0x. Their eight files under --cov (ci16, busy, one run each):
# these 13 tests 490 s traced, 124 s untraced; the files' other tests 182 and 98 s (the load fell);
# the eight files' own coverage 37 % -> 35 %. Smaller tests of the same modules still count their
# lines (tests/test_sim*.py, test_plan's and test_overload's other tests).
UNTRACED = (
    "tests/test_cascade_sim.py::test_reproduce_cascadeinfer_fills_every_row",
    "tests/test_plan.py::test_plan_and_sweep_on_a_real_ray_head_equal_the_serial_runs",
    "tests/test_plan.py::test_the_pool_searches_ahead_without_changing_the_answer",
    "tests/test_plan.py::test_a_pool_plans_exactly_as_the_serial_search",
    "tests/test_plan.py::test_an_unmeetable_slo_is_exit_2_with_the_closest_configuration",
    "tests/test_overload.py::test_sweep_finds_a_stability_knee_when_the_slo_is_unattainable",
    "tests/test_overload.py::test_slo_knee_lies_at_or_below_the_stability_knee",
    "tests/test_reproduce.py::test_gorgo_v2_rows_are_filled_quickly",
    "tests/test_sim_speed.py::test_the_speed_runs_name_their_build_and_summarise_repeats",
    "tests/test_parallel.py::test_pool_sweep_equals_the_serial_sweep",
    "tests/test_adaptive_sim.py::test_hotspot_detector_spreads_a_hot_prefix",
    "tests/test_adaptive_sim.py::test_a_mismatched_profile_predicts_ttft_worse",
    "tests/test_pacing.py::test_selective_pushing_keeps_up_with_round_robin_on_mooncake",
)


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: a deselected compile is never started
def pytest_collection_modifyitems(session, config, items):
    """The compiled build's tests go last, and its compile starts in the background once the timed
    tests have run (tests/compile_harness.py), so that it overlaps the rest of the suite; nothing is
    compiled for --collect-only. The tests named in ``UNTRACED`` run without coverage's tracer."""
    for it in items:
        if it.nodeid.split("[", 1)[0] in UNTRACED:
            it.add_marker(pytest.mark.no_cover)
    if not config.option.collectonly:
        compile_harness.schedule(items)
    _vllm_last[:] = [it.nodeid for it in items if "vllm_shared" in getattr(it, "fixturenames", ())][-1:]


def pytest_runtest_logfinish(nodeid, location):
    """The compile starts once the timed tests have run (tests/compile_harness.py); the shared vLLM
    pair stops once its last test has run, so that no idle engines sit beside the tests after it."""
    compile_harness.finished(nodeid)
    if _vllm_last and nodeid == _vllm_last[0]:
        for pair in _vllm_pairs:
            pair.close()


def pytest_sessionfinish(session, exitstatus):
    """A compile still running (its tests deselected or the run cut short) is stopped by its PID."""
    compile_harness.finish()
