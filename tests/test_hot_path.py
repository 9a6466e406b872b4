"""The hot path's shortcuts (docs/hot-path.md) give what the long way gives: the splice's unparsed
first leg, the substring token count, the byte-level vLLM usage field, the msgspec decode with
the standard library's errors, and the lock-free latency histograms."""

from __future__ import annotations

import json
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kvroute.errors import ClientError
from kvroute.gateway import tokens
from kvroute.gateway.continuation import RAW_LIMIT, Splice
from kvroute.gateway.metrics import LATENCY_BUCKETS, LocalHistogram
from kvroute.gateway.openai import _loads

CHAT = [{"role": "user", "content": "hi"}]


def _events(rng: random.Random, n: int) -> list[bytes]:
    """A chat stream as engines send it: a role announcement, token events (some empty, some in
    spaced JSON, one with a quote in its text), a finishing event, [DONE]."""
    out = [{"id": "a", "created": 1, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                      "content": ""}}]}]
    for _ in range(n):
        text = rng.choice(["", " to", 'say "hi"', "ö", " x"])
        out.append({"id": "a", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})
    out.append({"id": "a", "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}]})
    lines = [(json.dumps(o) if i % 3 else json.dumps(o, separators=(",", ":"))) for i, o in enumerate(out)]
    return [f"data: {line}\n\n".encode() for line in lines] + [b"data: [DONE]\n\n"]


@pytest.mark.parametrize("split", ["random", "whole", "events", "odd"])
@pytest.mark.parametrize("seed", range(5))
def test_an_unparsed_first_leg_counts_and_continues_like_a_parsed_one(seed, split):
    """Whatever the reads look like — cut anywhere, the whole stream in one read (a block that
    starts with the first event and ends with [DONE]), one event per read, or a stream with a
    comment and a [DONE] before its last event — the fast path forwards, counts and continues
    exactly as parsing every event does."""
    rng = random.Random(seed)
    events = _events(rng, rng.randint(1, 60))
    if split == "odd":
        events.insert(2, b": keep-alive\n\n")
        events.insert(len(events) - 2, b"data: [DONE]\n\n")
    stream = b"".join(events)
    if split == "whole":
        pieces = [stream]
    elif split == "events":
        pieces = events
    else:
        cuts = sorted(rng.sample(range(1, len(stream)), 5))
        pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
    lazy = Splice.open("chat", {"messages": CHAT, "stream": True, "max_tokens": 500}, 30)
    eager = Splice.open("chat", {"messages": CHAT, "stream": True, "max_tokens": 500}, 30)
    assert lazy is not None and eager is not None
    eager.limit = 10**9  # a context limit: every event is parsed (the fast path is off)
    out_lazy = b"".join(lazy.feed(p) for p in pieces)
    out_eager = b"".join(eager.feed(p) for p in pieces)
    assert out_lazy == out_eager == stream  # the first leg passes unchanged either way
    assert lazy._raw  # the fast path kept events unparsed
    assert lazy.tokens == eager.tokens  # counted by token_events, the same as parsed
    assert lazy.text == eager.text and lazy.finished == eager.finished and lazy.tokens == eager.tokens
    assert lazy.next_body() == eager.next_body()


def test_kept_bytes_are_bounded():
    s = Splice.open("chat", {"messages": CHAT, "stream": True}, 30)
    assert s is not None
    event = b'data: {"id":"a","choices":[{"index":0,"delta":{"content":"' + b"x" * 1000 + b'"}}]}\n\n'
    for _ in range(3 * RAW_LIMIT // len(event)):
        s.feed(event)
        assert s._raw_len <= RAW_LIMIT
    assert s.text == "x" * 1000 * (3 * RAW_LIMIT // len(event))


def test_token_events_substring_shortcut_agrees_with_the_regexes():
    rng = random.Random(1)
    for event in _events(rng, 200):
        slow = 1 if tokens._GENERATED.search(event) and not (
            tokens._EMPTY.search(event) and (b'"role"' in event or tokens._ENDING.search(event))) else 0
        assert tokens.token_events(event) == slow


@pytest.mark.parametrize("body", [{"model": "m", "messages": CHAT, "stream": True},
                                  {"model": "m", "messages": CHAT, "stream": True,
                                   "stream_options": {"include_usage": True}}])
def test_vllm_usage_field_added_to_the_bytes_equals_the_round_trip(body):
    s = Splice.open("chat", body, 10)
    assert s is not None
    raw = json.dumps(body).encode() + b"\n"
    sent = json.loads(s.exact_body(raw))
    want = dict(body, stream_options={**body.get("stream_options", {}), "include_usage": True,
                                      "continuous_usage_stats": True})
    assert sent == want


@pytest.mark.parametrize("raw", [b"{not json", b'{"a": NaN}', b'"\\ud800"', b"[" * 5000 + b"]" * 5000,
                                 b'{"n": ' + b"9" * 5000 + b"}", b"\xff\xfe"])
def test_fast_decode_accepts_and_refuses_what_json_does(raw):
    try:
        want: object = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        want = type(exc)
    try:
        got: object = _loads(raw)
    except (ValueError, RecursionError) as exc:
        got = type(exc)
    if isinstance(want, float):  # NaN
        assert isinstance(got, float) and got != got
    elif isinstance(want, type):
        assert got is want
    else:
        assert got == want


def test_parse_errors_read_as_before():
    from kvroute.gateway.openai import PROXIED, RequestParsing

    with pytest.raises(ClientError, match="not valid JSON: Expecting property name enclosed in double quotes"):
        RequestParsing.parse(RequestParsing.__new__(RequestParsing), b"{not json", PROXIED["/v1/chat/completions"], {})


def test_local_histogram_exposition_equals_prometheus_clients():
    ref_registry, local_registry = CollectorRegistry(), CollectorRegistry()
    ref = Histogram("kvroute_e2e_seconds", "Request latency at the gateway", buckets=LATENCY_BUCKETS,
                    registry=ref_registry)
    local = LocalHistogram("kvroute_e2e_seconds", "Request latency at the gateway")

    class Collector:
        def collect(self):
            yield local.family()

    local_registry.register(Collector())
    rng = random.Random(2)
    for v in [*LATENCY_BUCKETS, 0.0, 500.0, *(rng.expovariate(5) for _ in range(300))]:
        ref.observe(v)
        local.observe(v)
    assert generate_latest(local_registry) == generate_latest(ref_registry)


def test_field_names_are_lowered_once_and_the_cache_is_bounded():
    from kvroute.gateway import httpmsg

    assert httpmsg.field_name(b"Content-Type") == "content-type"
    assert httpmsg.field_name(b"X-\xe9t\xc9") == "x-\xe9t\xe9"  # latin-1, lowered as str.lower does
    assert httpmsg.field_name(b"Content-Type") is httpmsg.field_name(b"Content-Type")  # from the cache
    for i in range(2 * httpmsg._NAMES_MAX):  # a client inventing names cannot grow it past its bound
        assert httpmsg.field_name(b"X-Made-Up-%d" % i) == f"x-made-up-{i}"
    assert len(httpmsg._NAMES) <= httpmsg._NAMES_MAX


@pytest.mark.parametrize("body", [b'{"model": "m", "messages": [], "max_tokens": 0}',
                                  b'{"model": "m", "messages": [], "max_completion_tokens": true}',
                                  b'{"model": "m", "messages": [], "n": 129}',
                                  b'{"model": "m", "messages": [], "max_tokens": 2147483648}'])
def test_count_fields_are_refused_with_their_name(body):
    from kvroute.gateway.openai import PROXIED, RequestParsing

    with pytest.raises(ClientError) as bad:
        RequestParsing.parse(RequestParsing.__new__(RequestParsing), body, PROXIED["/v1/chat/completions"], {})
    name = json.loads(body).keys() - {"model", "messages"}
    assert bad.value.param in name and "must be an integer from 1 to" in str(bad.value)


def test_branch_totals_are_summed_from_the_per_policy_counts_in_first_decided_order():
    """One count per decision (issue 25h): /admin/policy's per-branch totals are summed when read."""
    from kvroute.gateway.metrics import GatewayMetrics

    m = GatewayMetrics(None)  # the runtime is read only at scrape time
    for policy, branch in [("auto", "b"), ("auto", "a"), ("auto", "b"), ("lmetric", "a"), ("lmetric", "c")]:
        m.count_branch(policy, branch)
    assert m.branch_by_policy == {("auto", "b"): 2, ("auto", "a"): 1, ("lmetric", "a"): 1, ("lmetric", "c"): 1}
    assert list(m.branch_counts.items()) == [("b", 2), ("a", 2), ("c", 1)] and m.last_branch == "c"


def test_token_ratio_scale_is_the_plain_mean_of_the_replicas_ratios():
    r = tokens.TokenRatio(alpha=0.3)
    rng = random.Random(5)
    for _ in range(200):
        r.observe(f"r{rng.randrange(5)}", rng.randrange(20, 400), rng.randrange(10, 900))
    assert r.scale == sum(r.ratios.values()) / len(r.ratios)


def test_request_counts_read_as_before_from_the_nested_counts():
    """Counted by route, then policy, then status (issue 25i); read back keyed by (route, status, policy)."""
    from kvroute.gateway.metrics import GatewayMetrics

    m = GatewayMetrics(None)
    rng = random.Random(3)
    expected: dict[tuple[str, int, str], int] = {}
    for _ in range(300):
        key = (rng.choice(["chat", "completions"]), rng.choice([200, 429, 499, 502]), rng.choice(["rr", "auto"]))
        m.count_request(*key)
        expected[key] = expected.get(key, 0) + 1
    assert m.request_counts == expected
    from kvroute.gateway.metrics import _HotCollector

    family = next(f for f in _HotCollector(m).collect() if f.name == "kvroute_requests")
    exported = {(s.labels["route"], int(s.labels["status"]), s.labels["policy"]): s.value for s in family.samples}
    assert exported == expected  # what /metrics exports


@pytest.mark.parametrize("pieces", [[b"x" * 10], [b"ab", b"cd", b"ef"], [b""]])
def test_take_returns_the_whole_body_only_once_it_has_all_arrived(pieces):
    """``UpstreamResponse.take`` (issue 25i) against a real server on 127.0.0.1 that sends the body in
    pieces: None while some is missing, then the body once, and the connection goes back to the pool."""
    import asyncio

    from kvroute.gateway.upstream import UpstreamPool

    body = b"".join(pieces)

    async def main() -> None:
        gate = asyncio.Event()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                             if line.lower().startswith(b"content-length")))
                await reader.readexactly(n)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + pieces[0])
                await writer.drain()
                if len(pieces) > 1:
                    await gate.wait()
                    for piece in pieces[1:]:
                        writer.write(piece)
                        await writer.drain()
                        await asyncio.sleep(0.01)

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        pool = UpstreamPool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        try:
            for _ in range(2):  # the second time on the pooled connection
                gate.clear()
                resp = await pool.post("/v1/x", b"{}", [], connect_s=2, first_byte_s=2, idle_s=2)
                await asyncio.sleep(0.05)
                if len(pieces) > 1:
                    assert resp.take() is None  # the rest has not been sent
                    gate.set()
                    await asyncio.sleep(0.2)
                assert resp.take() == body
                assert resp.take() is None  # taken once
                resp.release()
                assert len(pool._idle) == 1  # read to its end: kept alive
        finally:
            pool.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_bucket_search_and_rounding_written_out_agree_with_bisect_and_round():
    """The histogram's bucket search and the token ratio's rounding, written out for the compiled
    build (tenth round), give what ``bisect.bisect_left`` and ``round`` give: on every bound, between
    bounds, beyond them, on halves (to even) and on a NaN (bucket 0, as bisect puts it)."""
    import bisect
    import math

    from kvroute.gateway.metrics import _N_BUCKETS, bucket_of

    assert _N_BUCKETS == len(LATENCY_BUCKETS)
    rng = random.Random(3)
    values = [*LATENCY_BUCKETS, *(math.nextafter(b, 0) for b in LATENCY_BUCKETS),
              *(math.nextafter(b, 1e9) for b in LATENCY_BUCKETS), -1.0, 0.0, 1e9, math.inf, math.nan,
              *(rng.expovariate(2) for _ in range(2000))]
    assert [bucket_of(v) for v in values] == [bisect.bisect_left(LATENCY_BUCKETS, v) for v in values]
    halves = [k / 2 for k in range(-41, 41)] + [2.0 ** 52 + 0.5, 2.0 ** 53, 0.49999999999999994, 1e300]
    spread = [rng.uniform(-1e7, 1e7) for _ in range(20000)] + [rng.uniform(0, 8) for _ in range(20000)]
    assert [tokens.round_even(x) for x in halves + spread] == [round(x) for x in halves + spread]
    for bad in (math.inf, math.nan):
        with pytest.raises((OverflowError, ValueError)):
            tokens.round_even(bad)
    ratio = tokens.TokenRatio()
    ratio.scale = 1.25  # 2 x 1.25 = 2.5 -> 2 (half to even), 6 x 1.25 = 7.5 -> 8
    assert (ratio.tokens(2), ratio.tokens(6), ratio.tokens(0), ratio.block_tokens(1)) == (2, 8, 0, 1)


def test_residency_without_a_key_is_the_headers_zone_or_none_and_the_request_id_line_is_one_field():
    """``Peering.accept`` with no key keeps request_zone's result (the header's zone, "" as None), and
    the x-request-id line is written into the head once, beside the other fields."""
    from kvroute.gateway.config import GatewayConfig
    from kvroute.gateway.httpmsg import Responder
    from kvroute.gateway.residency import request_zone
    from kvroute.gateway.runtime import Runtime
    from kvroute.model import Request

    peering = Runtime(GatewayConfig(replicas=[{"url": "http://127.0.0.1:9", "id": "a"}])).peering
    for zone in ("eu", "", None):
        req = Request(id="r1", arrival_s=0.0, prompt_tokens=4, max_output_tokens=4, residency=zone)
        peering.accept(req, {}, None)
        assert req.residency == request_zone(zone, None)

    class Conn:
        paused = False
        out: list[bytes] = []

        def write(self, data: bytes) -> None:
            self.out.append(data)

    conn = Conn()
    resp = Responder(conn, keep_alive=True)
    resp.id_line = b"x-request-id: client-1\r\n"
    resp.extra_headers.append(("x-kvroute-prefill", "p0"))
    resp.send(200, b"{}", fields=b"x-kvroute-replica: r0\r\n")
    head = conn.out[0].split(b"\r\n\r\n")[0].split(b"\r\n")
    assert head[0] == b"HTTP/1.1 200 OK"
    assert head.count(b"x-request-id: client-1") == 1 and b"x-kvroute-prefill: p0" in head
    assert b"x-kvroute-replica: r0" in head and b"Content-Length: 2" in head


def _passes_ref(name: bytes, access_log: bool) -> bool:
    from kvroute.gateway.hops import HOP_HEADERS

    lowered = name.decode("latin-1").lower()
    return lowered not in HOP_HEADERS and not (access_log and lowered == "x-request-id")


def test_response_fields_judge_each_name_whatever_came_at_its_place_before():
    """The positional cache (``hops._LAST_NAMES``) never changes what passes: heads whose names repeat,
    change case, move, grow past the cache's bound or shrink are judged as by lowering each name."""
    from kvroute.gateway import hops

    names = [b"Content-Type", b"content-type", b"Date", b"date", b"Server", b"X-Request-Id", b"x-request-id",
             b"Connection", b"Transfer-Encoding", b"X-Engine", b"x-engine", b"Keep-Alive", b"TE", b"Te",
             b"Content-Length", b"X-A", b"X-B"]
    rng = random.Random(11)
    heads = [[(b"Content-Type", b"application/json"), (b"Content-Length", b"12"), (b"Date", b"d"), (b"Server", b"s")]]
    heads += [[(rng.choice(names), b"v%d" % i) for i in range(rng.randint(0, 8))] for _ in range(400)]
    heads.append([(b"X-Many-%d" % i, b"v") for i in range(hops._LAST_MAX + 10)])  # past the bound
    heads += [heads[0]] * 3
    for access_log in (False, True, False):
        for head in heads:
            want = b"".join(b"%b: %b\r\n" % (n, v) for n, v in head if _passes_ref(n, access_log))
            assert b"".join(hops.response_fields(head, access_log)) == want, (head, access_log)
    assert all(len(last) <= hops._LAST_MAX for last in hops._LAST_NAMES)


def test_a_connections_field_names_follow_whatever_came_at_their_place_before():
    """``FieldNames.key`` gives ``field_name``'s answer for every field of every head, however the names
    of one head differ from the last one's; it holds at most one entry per field of a head."""
    from kvroute.gateway import httpmsg

    names = [b"Host", b"host", b"Content-Type", b"Content-Length", b"content-length", b"Cookie", b"X-\xe9T",
             b"Authorization", b"X-Request-Id", b"x-request-id"]
    rng = random.Random(5)
    cache = httpmsg.FieldNames()
    for _ in range(500):
        head = [rng.choice(names) for _ in range(rng.randint(0, 9))]
        assert [cache.key(i, n) for i, n in enumerate(head)] == [httpmsg.field_name(n) for n in head]
        assert len(cache.names) == len(cache.keys) <= 9


def test_a_kept_alive_client_and_engine_changing_their_fields_are_proxied_field_for_field():
    """Over real HTTP on 127.0.0.1: one kept-alive client connection sends heads whose field names change
    case, order and presence from request to request, and the engine answers with changing fields too;
    each request reaches the engine with its own end-to-end fields and each answer the client with its own
    (hop-by-hop ones dropped both ways), whatever the positional caches held from the one before."""
    import http.client

    from tests.fake_upstream import OK_JSON, FaultyDeployment

    answers = [[(b"Content-Type", b"application/json"), (b"X-Engine", b"a"), (b"Server", b"up")],
               [(b"x-engine", b"b"), (b"content-type", b"application/json"), (b"Connection", b"keep-alive")],
               [(b"Server", b"up"), (b"X-Other", b"c"), (b"Content-Type", b"text/plain")],
               [(b"Content-Type", b"application/json"), (b"X-Engine", b"d"), (b"Server", b"up")]]
    served = 0

    async def script(head, body, w):
        nonlocal served
        fields = b"".join(b"%b: %b\r\n" % f for f in answers[served % len(answers)])
        served += 1
        w.write(b"HTTP/1.1 200 OK\r\n%bContent-Length: %d\r\n\r\n%b" % (fields, len(OK_JSON), OK_JSON))
        await w.drain()
        return True

    sends = [[("Host", "gw"), ("Content-Type", "application/json"), ("X-Client", "1")],
             [("content-type", "application/json"), ("host", "gw"), ("X-Client", "2"), ("X-Extra", "e")],
             [("Host", "gw"), ("X-Client", "3"), ("Keep-Alive", "5"), ("Content-Type", "application/json")],
             [("Host", "gw"), ("Content-Type", "application/json"), ("X-Client", "4")]]
    dep = FaultyDeployment([script])
    try:
        conn = http.client.HTTPConnection("127.0.0.1", dep.gateway.port, timeout=10)
        body = json.dumps({"model": "m", "prompt": "hi"}).encode()
        for i, fields in enumerate(sends * 2):
            conn.putrequest("POST", "/v1/completions", skip_host=True, skip_accept_encoding=True)
            for name, value in fields:
                conn.putheader(name, value)
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            r = conn.getresponse()
            assert r.status == 200 and r.read() == OK_JSON
            got = {k.lower(): v for k, v in r.getheaders()}
            answer = answers[i % len(answers)]
            for name, value in answer:
                if _passes_ref(name, False):
                    assert got[name.decode().lower()] == value.decode(), (i, got)
            assert "server" not in got and "connection" not in got, (i, got)  # hop-by-hop: dropped
            assert ("x-engine" in got) == any(n.lower() == b"x-engine" for n, _ in answer), (i, got)
            head = dep.upstreams[0].heads[-1].lower()
            want = {(k.lower(), v) for k, v in fields if k.lower() not in ("host", "keep-alive")}
            for k, v in want:
                assert f"\r\n{k}: {v.lower()}\r\n".encode() in head, (i, head)
            assert b"keep-alive:" not in head and (b"x-extra" in head) == (i % 4 == 1), (i, head)
        conn.close()
    finally:
        dep.close()


@pytest.mark.parametrize("head, delimited", [
    (b"Content-Length: 2\r\n", True), (b"content-length: 2\r\n", True), (b"CONTENT-length: 2\r\n", True),
    (b"Transfer-Encoding: chunked\r\n", True), (b"TRANSFER-ENCODING: chunked\r\n", True),
    (b"X-Content-Lengt: 2\r\n", False), (b"", False)])
def test_a_response_is_delimited_by_its_length_or_chunking_however_the_field_is_spelled(head, delimited):
    """``_Conn.on_headers_complete`` (eleventh round: the usual spellings compared before lowering) reads a
    body delimited by Content-Length or chunking in any case of the field's name and keeps the connection;
    without either the body runs to the close (RFC 9112 §6.3) and the connection is not kept. Against a
    real server on 127.0.0.1."""
    import asyncio

    from kvroute.gateway.upstream import UpstreamPool

    body = b"ok"
    framed = b"2\r\nok\r\n0\r\n\r\n" if b"chunked" in head else body

    async def main() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)
            writer.write(b"HTTP/1.1 200 OK\r\n" + head + b"\r\n" + framed)
            await writer.drain()
            if not delimited:
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        pool = UpstreamPool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        try:
            resp = await pool.post("/v1/x", b"{}", [], connect_s=2, first_byte_s=2, idle_s=2)
            assert await resp.read() == body
            resp.release()
            assert len(pool._idle) == (1 if delimited else 0)
        finally:
            pool.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_a_method_is_read_as_text_as_llhttp_gave_it():
    from kvroute.gateway.httpmsg import method_name

    for raw in (b"POST", b"GET", b"HEAD", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"post"):
        assert method_name(raw) == raw.decode("ascii")


def test_round_robin_turns_without_calling_pick_as_the_plugin_would(router_for):
    """Plain round robin's rule takes the turn from the picker's compiled counter (``compose.Rule.turns``, no
    interpreted pick per decision): the same order, a dry run (``Router.decide``) that moves nothing, the turn
    counted over the candidates left after exclusions; a subclass with its own pick keeps being called."""
    from kvroute.model import Endpoint
    from kvroute.policy import Router, build_policy
    from kvroute.policy.builtin.pickers import RoundRobin
    from kvroute.policy.compose import Pipeline
    from kvroute.policy.state import Turns
    from tests.conftest import make_request

    router = router_for("round_robin", n=3)
    policy = router.policy
    assert isinstance(policy, Pipeline) and isinstance(policy.rules[0].turns, Turns)
    assert [router.decide(make_request(f"d{i}")).target for i in range(3)] == ["e0"] * 3  # dry runs: no turn taken
    assert [router.route(make_request(f"r{i}")).target for i in range(4)] == ["e0", "e1", "e2", "e0"]
    req = make_request("x")
    req.exclude = ("e2",)  # two candidates left; the counter is at 4
    assert router.route(req).target == "e0"
    assert policy.rules[0].turns.next == 5

    calls = []

    class Counted(RoundRobin):
        def pick(self, st, eps, values):
            calls.append(len(eps))
            return super().pick(st, eps, values)

    counted = Counted()
    assert counted.turns is None  # its own pick: the rule must call it
    plain = build_policy("round_robin")
    assert isinstance(plain, Pipeline)
    rule = plain.rules[0]
    swapped = type(rule)(rule.branch, rule.when, rule.among, rule.scorers, rule.normalised, counted, plugins=(counted,),
                         turns=counted.turns)
    plain.rules = (swapped,)
    r2 = Router(plain, [Endpoint("a"), Endpoint("b")])
    assert [r2.route(make_request(f"c{i}")).target for i in range(3)] == ["a", "b", "a"] and calls == [2, 2, 2]
