"""Request-lifecycle hooks: the Router forwards every event to the policy's listeners, and both
runtimes feed them measured times."""

from kvroute.model import Endpoint
from kvroute.policy import Router, build_policy
from kvroute.policy.hooks import Lifecycle
from tests.conftest import make_request


class Recorder(Lifecycle):
    """Records every event it hears."""

    name = "rec"

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_dispatched(self, req, endpoint, new_prefill_tokens):
        self.events.append(("dispatched", req.id, endpoint.id, endpoint.inflight, new_prefill_tokens))

    def on_first_token(self, req_id, endpoint_id, ttft_s):
        self.events.append(("first", req_id, endpoint_id, ttft_s))

    def on_finished(self, req_id, endpoint_id, e2e_s, output_tokens):
        self.events.append(("finished", req_id, endpoint_id, e2e_s, output_tokens))

    def on_failed(self, req_id, endpoint_id):
        self.events.append(("failed", req_id, endpoint_id))

    def state(self):
        return {"events": float(len(self.events))}


def test_router_forwards_each_event_once_with_the_ticket_endpoint():
    policy = build_policy("round_robin")
    rec = Recorder()
    policy.listeners = (rec,)
    router = Router(policy, [Endpoint("e0"), Endpoint("e1")])
    a, b, c = (make_request(x, f"{x} prompt " * 40) for x in "abc")
    assert router.route(a).target == "e0"
    router.on_first_token("a", 0.25)
    router.on_finish("a", 1.5, 12)
    router.on_finish("a", 1.5, 12)  # idempotent: no second event
    router.route(b)
    router.on_failed("b")
    router.commit(c, "e0")
    router.commit(c, "e1")  # re-routed: e0 hears a failure
    router.on_first_token("c")  # no measured TTFT: nothing to tell
    assert rec.events == [
        ("dispatched", "a", "e0", 1, a.prompt_tokens), ("first", "a", "e0", 0.25),
        ("finished", "a", "e0", 1.5, 12),
        ("dispatched", "b", "e1", 1, b.prompt_tokens), ("failed", "b", "e1"),
        ("dispatched", "c", "e0", 1, c.prompt_tokens), ("failed", "c", "e0"),
        ("dispatched", "c", "e1", 1, c.prompt_tokens)]
    assert router.policy_state() == {"rec.events": 8.0}
    assert Router(build_policy("lmetric")).policy_state() == {}


def test_simulator_feeds_measured_ttft_and_e2e(monkeypatch):
    import kvroute.sim.balancer as balancer
    from kvroute.sim.runner import run_scenario
    from kvroute.sim.scenario import parse_scenario

    recorders: list[Recorder] = []

    def with_recorder(preset, params=None, seed=0):
        policy = build_policy(preset, params, seed=seed)
        recorders.append(Recorder())
        policy.listeners = (recorders[-1],)
        return policy

    monkeypatch.setattr(balancer, "build_policy", with_recorder)
    sc = parse_scenario({"replicas": [{"region": "us", "count": 2}],
                         "workload": {"kind": "chat", "clients": {"us": 4}},
                         "policies": ["skywalker"], "limits": {"max_requests": 40}, "seed": 1})
    result = run_scenario(sc)[0].result
    (rec,) = recorders
    kinds = [e[0] for e in rec.events]
    assert kinds.count("dispatched") == kinds.count("first") == kinds.count("finished") == 40
    ttft = {e[1]: e[3] for e in rec.events if e[0] == "first"}
    e2e = {e[1]: e[3] for e in rec.events if e[0] == "finished"}
    assert all(0 < ttft[r] < e2e[r] for r in ttft)
    assert all(e[4] > 0 for e in rec.events if e[0] == "finished")  # output tokens known
    assert result["policy_state"] == {"rec.events": 120.0}  # three events per request


def test_gateway_feeds_measured_ttft_and_exports_plugin_state():
    import urllib.request

    import openai

    from tests.gateway_harness import LiveDeployment

    dep = LiveDeployment(replicas=2, policy="round_robin")
    try:
        rec = Recorder()
        dep.runtime.router.policy.listeners = (rec,)
        c = openai.OpenAI(base_url=f"{dep.url}/v1", api_key="unused", max_retries=0, timeout=20)
        c.chat.completions.create(model="emulated", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        stream = c.chat.completions.create(model="emulated", messages=[{"role": "user", "content": "yo"}],
                                           max_tokens=4, stream=True)
        assert list(stream)
        usage = c.chat.completions.create(model="emulated", messages=[{"role": "user", "content": "hey"}],
                                          max_tokens=5, stream=True, stream_options={"include_usage": True})
        assert list(usage)
        completion = c.completions.create(model="emulated", prompt=[1, 2, 3], max_tokens=6, stream=True)
        assert list(completion)  # token ids: no splice, the gateway counts the text pieces
        assert dep.settle() == (0, 0, 0)
        kinds = [e[0] for e in rec.events]
        assert kinds == ["dispatched", "first", "finished"] * 4
        for first, done in ((rec.events[1], rec.events[2]), (rec.events[4], rec.events[5])):
            assert 0 < first[3] <= done[3] < 20
        # the completion tokens, as the simulator passes them: usage, else the pieces streamed
        assert [e[4] for e in rec.events if e[0] == "finished"] == [3, 4, 5, 6]
        with urllib.request.urlopen(f"{dep.url}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert 'kvroute_policy_state{key="rec.events"} 12.0' in text
    finally:
        dep.close()
