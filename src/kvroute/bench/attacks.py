"""The attacks of ``kvroute bench hostile`` (``bench/hostile.py`` measures them): cheap,
unauthenticated things a client can do to an HTTP server — bodies aborted mid-way, pipelined
requests whose answers are never read, unterminated trailers, silent or idle or slow-header
connection floods, tiny chunks. Each runs from its own address (127.0.0.2), is bounded in
connections, bytes and time, and returns what the attacker saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

ATTACKER = "127.0.0.2"  # every attack's source address; the prober and the load are 127.0.0.1
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
MiB = 1 << 20


def _chat(text: str, **extra: object) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4,
                       **extra}).encode()


async def _connect(port: int, source: str = ATTACKER) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def _send(w: asyncio.StreamWriter, data: bytes, stall_s: float) -> bool:
    """Write and wait until the peer took it; False when it stopped taking bytes for ``stall_s``
    or closed."""
    w.write(data)
    try:
        await asyncio.wait_for(w.drain(), stall_s)
    except (TimeoutError, ConnectionError):
        return False
    return True


async def _answer(r: asyncio.StreamReader, wait_s: float) -> str:
    """The status line the server sent, if any, within ``wait_s``."""
    try:
        line = await asyncio.wait_for(r.readline(), wait_s)
    except (TimeoutError, ConnectionError):
        return "none"
    return line.decode("latin-1").strip() or "closed without an answer"


def _close(writers: list[asyncio.StreamWriter]) -> None:
    for w in writers:
        w.close()


# -- the attacks: each returns what the attacker observed ------------------------------------------

async def aborted_bodies(port: int, clients: int = 10, size: int = 16 * MiB, rounds: int = 3,
                         wait_answer_s: float = 0.0) -> dict:
    """``clients`` connections each announce ``size`` bytes of body and send all but the last,
    then go away, ``rounds`` times (issue 24 item 1); with ``wait_answer_s``, each waits that long
    for the server's answer (its body deadline) before going away."""
    sent = 0
    piece = b"x" * MiB
    answers: dict[str, int] = {}
    for _ in range(rounds):
        conns = await asyncio.gather(*(_connect(port) for _ in range(clients)))

        async def one(w: asyncio.StreamWriter) -> int:
            if not await _send(w, HEAD + b"Content-Length: %d\r\n\r\n" % size, 5):
                return 0
            n = 0
            while n < size - 1:
                k = min(MiB, size - 1 - n)
                if not await _send(w, piece[:k], 5):
                    break
                n += k
            return n
        sent += sum(await asyncio.gather(*(one(w) for _, w in conns)))
        if wait_answer_s:
            for status in await asyncio.gather(*(_answer(r, wait_answer_s) for r, _ in conns)):
                answers[status[:12]] = answers.get(status[:12], 0) + 1
        else:
            await asyncio.sleep(0.3)
        _close([w for _, w in conns])
        await asyncio.sleep(0.5)
    return {"body_mb_sent": round(sent / MiB), **({"answers": answers} if answers else {})}


async def pipelined_metrics(port: int, total: int = 1_700_000, hold_s: float = 5.0) -> dict:
    """1.7 MB of pipelined ``GET /metrics`` (47,000 requests), the connection then held ``hold_s``
    with no answer ever read (issue 24 item 2): a server that answers on regardless piles the
    answers up in its memory and spends its CPU on them."""
    r, w = await _connect(port)
    one = b"GET /metrics HTTP/1.1\r\nHost: gw\r\n\r\n"
    batch = one * (65536 // len(one))
    sent = 0
    while sent < total and await _send(w, batch, hold_s):
        sent += len(batch)
    await asyncio.sleep(hold_s)
    w.close()
    return {"requests_sent": sent // len(one)}


async def pipelined_answers(port: int, n: int = 200, answer: int = MiB, hold_s: float = 3.0) -> dict:
    """``n`` pipelined requests each asking for a 1 MiB answer, none read (issue 24 item 2)."""
    r, w = await _connect(port)
    body = _chat("z", pad_bytes=answer)
    w.write((HEAD + b"Content-Length: %d\r\n\r\n%b" % (len(body), body)) * n)
    await asyncio.sleep(hold_s)
    w.close()
    return {"answers_asked_mb": round(n * answer / MiB)}


async def pipelined_bodies(port: int, n: int = 200, size: int = MiB) -> dict:
    """``n`` pipelined requests of ``size`` bytes each, answers never read."""
    r, w = await _connect(port)
    body = _chat("y" * size)
    one = HEAD + b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    sent = 0
    while sent < n and await _send(w, one, 2.0):
        sent += 1
    w.close()
    return {"requests_sent": sent}


async def unterminated_trailer(port: int, total: int = 100 * MiB, stall_s: float = 2.0) -> dict:
    """A chunked body whose trailer section opens a field that never ends (issue 24 item 3)."""
    r, w = await _connect(port)
    t0 = time.perf_counter()
    await _send(w, HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nX-Trailer: ", stall_s)
    piece = b"a" * 65536
    sent = 0
    while sent < total and await _send(w, piece, stall_s):
        sent += len(piece)
    answer = await _answer(r, 1.0)
    w.close()
    return {"trailer_mb_taken": round(sent / MiB, 1), "answer": answer, "s": round(time.perf_counter() - t0, 2)}


async def silent_flood(port: int, n: int = 4096, hold_s: float = 12.0, addresses: int = 1) -> dict:
    """``n`` connections that never send a byte, held ``hold_s`` (issue 24 item 4), from
    ``addresses`` source addresses (127.0.0.2 on); counts those refused at once and those the
    server closed, and when."""
    t0 = time.perf_counter()
    outcome: dict[str, list[float]] = {"refused": [], "closed": []}

    async def watch(r: asyncio.StreamReader) -> None:
        with contextlib.suppress(ConnectionError):
            data = await r.read(200)
            kind = "refused" if data.startswith(b"HTTP/1.1 503") or data.startswith(b"HTTP/1.1 429") else "closed"
            outcome[kind].append(time.perf_counter() - t0)

    writers: list[asyncio.StreamWriter] = []
    tasks: list[asyncio.Task[None]] = []
    failed = 0
    for _ in range(n):
        try:
            r, w = await asyncio.wait_for(_connect(port, f"127.0.0.{2 + len(writers) % addresses}"), 5)
        except (OSError, TimeoutError):
            failed += 1
            continue
        writers.append(w)
        tasks.append(asyncio.create_task(watch(r)))
    await asyncio.sleep(max(0.0, hold_s - (time.perf_counter() - t0)))
    for t in tasks:
        t.cancel()
    _close(writers)
    closed = sorted(outcome["closed"])
    return {"refused": len(outcome["refused"]), "closed_by_server": len(closed), "connect_failed": failed,
            "median_close_s": round(closed[len(closed) // 2], 1) if closed else None}


async def idle(port: int, n: int = 2000, hold_s: float = 5.0) -> dict:
    """``n`` connections that send nothing, held ``hold_s``."""
    writers = [w for _, w in await asyncio.gather(*(_connect(port) for _ in range(n)), return_exceptions=False)]
    await asyncio.sleep(hold_s)
    _close(writers)
    return {}


async def slow_headers(port: int, n: int = 200, hold_s: float = 5.0) -> dict:
    """``n`` connections that send one header line a second and never end the head."""
    conns = await asyncio.gather(*(_connect(port) for _ in range(n)))
    for _, w in conns:
        w.write(HEAD)
    for i in range(int(hold_s)):
        await asyncio.sleep(1.0)
        for _, w in conns:
            if not w.is_closing():
                w.write(b"X-Drip-%d: 1\r\n" % i)
    _close([w for _, w in conns])
    return {}


async def tiny_chunks(port: int, n: int = 80_057) -> dict:
    """One request whose body comes as ``n`` one-byte chunks; the answer is awaited."""
    r, w = await _connect(port)
    body = _chat("x" * (n - len(_chat(""))))
    t0 = time.perf_counter()
    w.write(HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(b"1\r\n%c\r\n" % b for b in body) + b"0\r\n\r\n")
    answer = await _answer(r, 60)
    w.close()
    return {"chunks": len(body), "answer": answer, "answer_s": round(time.perf_counter() - t0, 2)}
