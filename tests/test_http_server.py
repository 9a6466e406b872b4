"""The gateway's HTTP server under hostile input: smuggling, header injection, lenient numbers,
resource limits and timeouts, hostile JSON — over raw sockets on 127.0.0.1, answered as the
reference servers (uvicorn, aiohttp) answer: 400 (or the documented limit) and close."""

import json
import socket
import time

import httpx
import pytest

from tests.fake_upstream import FaultyDeployment, http_response, replies

HOST = b"Host: gw\r\n"
LIMITS = {"header_timeout_s": 0.6, "body_timeout_s": 0.6, "keepalive_timeout_s": 0.6, "max_connections": 64,
          "max_headers": 100, "max_head_bytes": 64 * 1024}


@pytest.fixture(scope="module")
def gw():
    dep = FaultyDeployment([replies(http_response())], http=LIMITS)
    yield dep
    counters = dep.settle()
    errors = dep.gateway.http.errors
    dep.close()
    assert counters == (0, 0, 0) and errors == 0


def exchange(dep, payload: bytes, timeout: float = 5.0, pause: float = 0.0) -> tuple[bytes, bool]:
    """Send raw bytes; return everything the server wrote and whether it closed the connection."""
    port = dep.gateway.port
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        if pause:
            time.sleep(pause)
        return read_to_close(s)


def read_to_close(s: socket.socket) -> tuple[bytes, bool]:
    """Everything the server writes on ``s`` until it closes (FIN or reset) or the socket's timeout
    passes; and whether it closed."""
    out = b""
    while True:
        try:
            data = s.recv(65536)
        except TimeoutError:
            return out, False
        except ConnectionResetError:
            return out, True
        if not data:
            return out, True
        out += data


def statuses(raw: bytes) -> list[int]:
    return [int(part[:3]) for part in raw.split(b"HTTP/1.1 ")[1:] if part[:3].isdigit()]


def body(payload: bytes) -> bytes:
    return b"POST /v1/completions HTTP/1.1\r\n" + HOST + payload


def health(payload: bytes) -> bytes:
    return b"GET /health HTTP/1.1\r\n" + HOST + payload


JSON = b'{"prompt": "hi", "max_tokens": 1}'
SMUGGLE = b"GET /smuggled HTTP/1.1\r\nHost: gw\r\n\r\n"
REJECTED = {
    # request smuggling: a front proxy that frames by the other header sees one request; a lenient
    # server sees two. Each must be refused, and the trailing request never served.
    "CL + TE chunked": health(b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
                              % (5 + len(SMUGGLE))) + SMUGGLE,
    "two different CL": health(b"Content-Length: 0\r\nContent-Length: %d\r\n\r\n" % len(SMUGGLE)) + SMUGGLE,
    "TE chunked, identity": health(b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n") + SMUGGLE,
    "TE xchunked + CL": health(b"Transfer-Encoding: xchunked\r\nContent-Length: %d\r\n\r\n0\r\n\r\n"
                               % (5 + len(SMUGGLE))) + SMUGGLE,
    "TE gzip, chunked": health(b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n") + SMUGGLE,
    "obs-fold": health(b"X-A: a\r\n Content-Length: %d\r\n\r\n" % len(SMUGGLE)) + SMUGGLE,
    # header injection toward the engine
    "bare LF in a value": body(b"X-A: a\nGET /smuggled-admin HTTP/1.1\r\nContent-Length: 34\r\n\r\n" + JSON),
    "bare LF in a name": body(b"X-A\nB: c\r\nContent-Length: 34\r\n\r\n" + JSON),
    "bare CR in a value": body(b"X-A: a\rb\r\nContent-Length: 34\r\n\r\n" + JSON),
    "NUL in a value": body(b"X-A: a\x00b\r\nContent-Length: 34\r\n\r\n" + JSON),
    "DEL in a value": body(b"X-A: a\x7fb\r\nContent-Length: 34\r\n\r\n" + JSON),
    "space before colon": body(b"Content-Length : 34\r\n\r\n" + JSON),
    # lenient numbers
    "CL with NBSP": body(b"Content-Length: \xa034\r\n\r\n" + JSON),
    "CL with VT": body(b"Content-Length: 34\x0b\r\n\r\n" + JSON),
    "CL 5,000 digits": body(b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n"),
    "CL superscript digit": body(b"Content-Length: \xb3\r\n\r\n"),
    "CL negative": body(b"Content-Length: -1\r\n\r\n"),
    "chunk size 0x39": body(b"Transfer-Encoding: chunked\r\n\r\n0x22\r\n" + JSON + b"\r\n0\r\n\r\n"),
    "chunk size 3_9": body(b"Transfer-Encoding: chunked\r\n\r\n2_2\r\n" + JSON + b"\r\n0\r\n\r\n"),
    "chunk size with spaces": body(b"Transfer-Encoding: chunked\r\n\r\n 22 \r\n" + JSON + b"\r\n0\r\n\r\n"),
    "chunk size -2": body(b"Transfer-Encoding: chunked\r\n\r\n-2\r\nab\r\n0\r\n\r\n") + SMUGGLE,
    "chunk size overflow": body(b"Transfer-Encoding: chunked\r\n\r\n" + b"f" * 100 + b"\r\n"),
    "all bare LF": b"POST /v1/completions HTTP/1.1\nHost: gw\nContent-Length: 34\n\n" + JSON,
    "no Host in HTTP/1.1": b"POST /v1/completions HTTP/1.1\r\nContent-Length: 34\r\n\r\n" + JSON,
    "two Host headers": body(b"Host: other\r\nContent-Length: 34\r\n\r\n" + JSON),
    "HTTP/2.0 request line": b"GET /health HTTP/2.0\r\n" + HOST + b"\r\n",
    # kept alive like HTTP/1.1 by a header: the version is then asked, not inferred (httpconn.on_headers_complete)
    "HTTP/2.0 kept alive": b"GET /health HTTP/2.0\r\n" + HOST + b"Connection: keep-alive\r\n\r\n",
    "HTTP/0.9 proxy-kept alive": b"GET /health HTTP/0.9\r\n" + HOST + b"Proxy-Connection: keep-alive\r\n\r\n",
    "lower-case method": b"get /health HTTP/1.1\r\n" + HOST + b"\r\n",
    "control char in target": b"GET /hea\x01lth HTTP/1.1\r\n" + HOST + b"\r\n",
}
EXPECTED = {"TE gzip, chunked": 501, "HTTP/2.0 request line": 505, "HTTP/2.0 kept alive": 505}


@pytest.mark.parametrize("case", list(REJECTED))
def test_hostile_framing_is_refused_and_the_connection_closed(gw, case):
    before = gw.upstreams[0].requests
    out, closed = exchange(gw, REJECTED[case])
    assert statuses(out) == [EXPECTED.get(case, 400)], out[:300]
    assert closed and b'"error"' in out
    assert gw.upstreams[0].requests == before  # nothing reached the engine
    assert httpx.get(f"{gw.url}/health").status_code == 200


def test_forwarded_heads_carry_no_hop_by_hop_headers(gw):
    r = httpx.post(f"{gw.url}/v1/completions", content=JSON, timeout=5,
                   headers={"Connection": "keep-alive, X-Secret-Hop", "X-Secret-Hop": "1", "Keep-Alive": "5",
                            "Proxy-Authorization": "x", "TE": "trailers", "X-End-To-End": "kept"})
    assert r.status_code == 200
    head = gw.upstreams[0].heads[-1].lower()
    assert b"x-end-to-end: kept" in head
    for name in (b"x-secret-hop", b"keep-alive:", b"proxy-authorization", b"\r\nte:", b"connection: keep-alive,"):
        assert name not in head, head


def test_trailers_after_the_last_chunk_are_accepted(gw):
    payload = body(b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                   + b"%x\r\n%b\r\n0\r\nX-Checksum: 1\r\n\r\n" % (len(JSON), JSON))
    out, _ = exchange(gw, payload)
    assert statuses(out) == [200]


def test_head_limits_hold_however_the_head_arrives(gw):
    big = body(b"X-Big: " + b"a" * 70_000 + b"\r\nContent-Length: 34\r\n\r\n" + JSON)
    assert statuses(exchange(gw, big)[0]) == [431]  # in one read
    many = body(b"".join(b"X-H%d: v\r\n" % i for i in range(101)) + b"Content-Length: 34\r\n\r\n" + JSON)
    assert statuses(exchange(gw, many)[0]) == [431]
    port = gw.gateway.port
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # an unterminated header line
        s.sendall(body(b"X-Endless: "))
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            for _ in range(100):
                s.sendall(b"a" * 4096)
                time.sleep(0.001)
        assert b"431" in s.recv(1000)


def test_oversized_bodies_are_413_whether_announced_or_chunked(gw):
    limit = gw.gateway.config.max_body_bytes
    out, closed = exchange(gw, body(b"Content-Length: %d\r\n\r\n" % (limit + 1)))
    assert statuses(out) == [413] and closed
    # chunked: the size is known only once the body passes the limit. The server answers 413 and closes
    # with the rest unread; whether the client's own writes meet that close depends on timing and on how
    # much the kernel buffers (tcp_rmem's ceiling is 32 MiB on the CI machine: a whole 24 MiB body fitted
    # once, the writes all succeeded before the close, "DID NOT RAISE"). So: one piece past the limit —
    # a reset while writing it is allowed —, then the 413 and the close must come, then writing must fail.
    refused = gw.gateway.http.rejections.counts.get((413, "body_too_large"), 0)
    mib = 1 << 20
    piece = b"%x\r\n%b\r\n" % (mib, b"x" * mib)
    with socket.create_connection(("127.0.0.1", gw.gateway.port), timeout=30) as s:
        s.sendall(body(b"Transfer-Encoding: chunked\r\n\r\n"))
        sent = 0
        try:
            while sent <= limit:
                s.sendall(piece)
                sent += mib
        except (ConnectionResetError, BrokenPipeError):
            assert sent == limit, sent  # refused only once the body passed the limit: in its last piece
        out, closed = read_to_close(s)
        assert statuses(out) == [413] and closed, (out[:200], closed)
        with pytest.raises((ConnectionResetError, BrokenPipeError)):  # nothing more is read
            for _ in range(64):
                s.sendall(piece)
    assert gw.gateway.http.rejections.counts[(413, "body_too_large")] == refused + 1


@pytest.mark.parametrize("partial, expect", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nX-Slow: ", 408),  # slowloris: head never ends
    (body(b"Content-Length: 34\r\n\r\n{\"prompt\""), 408),  # half-sent body
    (b"", None),  # an idle connection is closed without a word
])
def test_slow_and_idle_clients_are_timed_out(gw, partial, expect):
    t0 = time.monotonic()
    out, closed = exchange(gw, partial, timeout=5)
    assert closed and time.monotonic() - t0 < 3  # limits are 0.6 s here
    assert statuses(out) == ([expect] if expect else [])


def test_keep_alive_connection_idles_out_after_a_response(gw):
    out, closed = exchange(gw, b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n", timeout=5)
    assert statuses(out) == [200] and closed


def test_connections_beyond_the_limit_get_503(gw):
    port = gw.gateway.port
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(LIMITS["max_connections"])]
    for s in held:  # each mid-request: none can make room (silent or idle ones would be closed for it)
        s.sendall(b"GET /health HTTP/1.1\r\n")
    try:
        deadline = time.monotonic() + 3
        while len(gw.gateway.http.connections) < len(held) and time.monotonic() < deadline:
            time.sleep(0.01)
        out, closed = exchange(gw, b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
        assert statuses(out) == [503] and closed
    finally:
        for s in held:
            s.close()


def test_many_tiny_chunks_cost_linear_time_and_leave_the_loop_free(gw):
    n = 80_057  # 480 KB sent as one-byte chunks took the old parser ~58 s of CPU
    text = ("x" * (n - 30)).encode()
    data = b'{"prompt": "' + text + b'", "max_tokens": 1}'
    chunks = b"".join(b"1\r\n%c\r\n" % b for b in data) + b"0\r\n\r\n"
    payload = body(b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n") + chunks
    out, _ = exchange(gw, payload, timeout=20)
    assert statuses(out) == [200]


HOSTILE_JSON = {
    "nested 100,000 deep": (b'{"prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    "5,000-digit integer": (b'{"prompt": "a", "seed": ' + b"9" * 5000 + b"}", None),
    "max_tokens 10**400": (b'{"prompt": "a", "max_tokens": 1' + b"0" * 400 + b"}", "max_tokens"),
    "max_tokens a string": (b'{"prompt": "a", "max_tokens": "5"}', "max_tokens"),
    "max_tokens true": (b'{"prompt": "a", "max_tokens": true}', "max_tokens"),
    "stream a string": (b'{"prompt": "a", "stream": "yes"}', "stream"),
    "n zero": (b'{"prompt": "a", "n": 0}', "n"),
    "n a float": (b'{"prompt": "a", "n": 1.5}', "n"),
    "token id -1": (b'{"prompt": [1, -1, 3]}', "prompt"),
    "token id 2**32": (b'{"prompt": [1, 4294967296]}', "prompt"),
    "nested prompt list": (b'{"prompt": [[[[1]]]]}', "prompt"),
}


@pytest.mark.parametrize("case", list(HOSTILE_JSON))
def test_hostile_json_is_a_400_naming_the_field(gw, case):
    raw, param = HOSTILE_JSON[case]
    r = httpx.post(f"{gw.url}/v1/completions", content=raw, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and (param is None or param in err["message"])


def test_unknown_fields_pass_through(gw):
    r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "a", "vendor_knob": {"x": 1}}, timeout=5)
    assert r.status_code == 200 and json.loads(gw.upstreams[0].bodies[-1])["vendor_knob"] == {"x": 1}


def test_an_absolute_form_target_is_served_like_its_path(gw):
    # RFC 9112 §3.2.2: a server must accept the absolute form (what a client sends to a proxy)
    for target in (b"http://gw/health", b"HTTP://gw:8080/health?x=1", b"https://gw/health"):
        out, _ = exchange(gw, b"GET " + target + b" HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
        assert statuses(out) == [200], (target, out[:200])
    out, _ = exchange(gw, b"POST http://gw/v1/completions HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n"
                          b"Content-Length: %d\r\n\r\n%b" % (len(JSON), JSON))
    assert statuses(out) == [200] and gw.upstreams[0].heads[-1].startswith(b"POST /v1/completions ")


def test_repeated_cookie_fields_are_joined_with_a_semicolon(gw):
    payload = body(b"Cookie: a=1\r\nCookie: b=2, c\r\nX-List: 1\r\nX-List: 2\r\nConnection: close\r\n"
                   b"Content-Length: %d\r\n\r\n%b" % (len(JSON), JSON))
    out, _ = exchange(gw, payload)
    assert statuses(out) == [200]
    head = gw.upstreams[0].heads[-1].lower()
    assert b"\r\ncookie: a=1; b=2, c\r\n" in head and b"\r\nx-list: 1, 2\r\n" in head, head


def test_refusals_are_counted_by_status_and_reason(gw):
    def rejected() -> dict[str, float]:
        text = httpx.get(f"{gw.url}/metrics").text
        return {line.split("{", 1)[1].split("}")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("kvroute_http_rejected_total{")}
    before = rejected()
    exchange(gw, REJECTED["TE gzip, chunked"])
    exchange(gw, REJECTED["two Host headers"])
    exchange(gw, body(b"".join(b"X-H%d: v\r\n" % i for i in range(101)) + b"\r\n"))
    after = rejected()
    for labels in ('reason="transfer_coding",status="501"', 'reason="host",status="400"',
                   'reason="too_many_headers",status="431"'):
        assert after.get(labels, 0) == before.get(labels, 0) + 1, (labels, after)
