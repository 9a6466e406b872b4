"""Local TCP ports for components started on 127.0.0.1 (benchmarks, live runs, tests): pick free
ones, then wait until something answers there."""

from __future__ import annotations

import contextlib
import socket
import time
import urllib.error
import urllib.request

HOST = "127.0.0.1"


def free_ports(k: int) -> list[int]:
    """``k`` distinct ports free on 127.0.0.1 right now (all held open while choosing, so none
    repeats; another process may still take one before the caller binds it)."""
    socks = [socket.socket() for _ in range(k)]
    try:
        for s in socks:
            s.bind((HOST, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """One port free on 127.0.0.1 right now."""
    return free_ports(1)[0]


def hold_port() -> socket.socket:
    """A port of 127.0.0.1 kept for a server that binds it later: a socket bound with SO_REUSEADDR that never
    listens. Meanwhile a connection there is refused, and the kernel gives the port to no other ``bind(0)`` and
    to no outgoing connection as its source port, while a server that binds with SO_REUSEADDR itself (asyncio's
    and aiohttp's servers, the gateway's, HAProxy, nats-server) can take it. Close it once that server listens,
    or when done. (:func:`free_ports` closes its sockets before it returns: under concurrent test suites another
    process's connection took such a port before the server bound it — "address in use".)"""
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((HOST, 0))
    except OSError:
        s.close()
        raise
    return s


def wait_for_port(port: int, timeout_s: float = 20.0, host: str = HOST) -> None:
    """Return once a TCP connection to ``host:port`` succeeds; TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s:g} s") from None
            time.sleep(0.05)


def wait_for_http(url: str, timeout_s: float = 20.0) -> None:
    """Return once a GET of ``url`` answers 200 (e.g. a ``/health`` page); TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError, urllib.error.URLError):  # not listening yet
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{url} did not answer 200 within {timeout_s:g} s")
        time.sleep(0.05)
