"""The emulator as a prefill or decode engine, in vLLM's and SGLang's protocols.

What the gateway sends is what the engines get (docs/pd.md), and the emulator answers as they do:

* **vLLM** (NixlConnector): a body whose ``kv_transfer_params.do_remote_decode`` is true is a
  prefill leg — computed (``max_tokens`` 1), its KV offered under a request id, and the answer
  carries ``kv_transfer_params`` (``do_remote_prefill: true``, ``remote_engine_id``,
  ``remote_request_id``, ``remote_block_ids``, ``remote_host``, ``remote_port``, ``tp_size``).
  A body with ``do_remote_prefill: true`` is a decode leg: the emulator asks the engine at
  ``remote_host:remote_port`` for that request's KV over HTTP (``POST /_pd/pull``; vLLM reads it
  with NIXL), and a missing offer is an error, as a failed KV load is in vLLM.
* **SGLang**: ``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` in the body; what the
  engine does depends on its ``--disaggregation-mode`` (here ``--pd-role``). A prefill engine
  computes the prompt and publishes the room on its bootstrap port (``GET /_pd/room/ROOM``, a
  long poll); a decode engine waits there for the room (``bootstrap_timeout_s``), and a room
  whose prefill failed fails the decode request at once.

The transfer itself is simulated with the simulator's formula (:func:`~kvroute.policy.builtin.pd
.kv_transfer_s`): the tokens the decode engine lacks (prompt less its cached prefix) × the
profile's KV bytes per token over ``link_gb_s``, plus the measured round trip of the pull; the
decode engine admits the sequence only when its KV cache has room (``Seq.remote``), then
computes the last prompt token — its first token — and decodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvroute.errors import ServiceError
from kvroute.policy.builtin.pd import kv_transfer_s

PD_ROLES = ("mixed", "prefill", "decode")
DEFAULT_KV_BYTES = 131072  # per token, when the profile gives none (a 7-8B model in bf16: 128 KiB)


class PDRefused(ServiceError):
    """The request cannot be served in this role (or its KV could not be fetched)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Plan:
    """What one request's P/D fields mean for this engine: a token limit (prefill legs), a KV
    transfer before decoding (decode legs), what the answer carries, and what to do when the
    prefill is done or fails."""

    max_tokens: int | None = None
    remote: Callable[[int], float] | None = None
    done: Callable[[int], dict[str, Any]] = field(default=lambda _tokens: {})
    failed: Callable[[str], None] = field(default=lambda _why: None)


class PDEngine:
    """One emulator's prefill/decode side: its role, the KV it offers (vLLM) and its rooms
    (SGLang), and the client it fetches KV with."""

    def __init__(self, role: str = "mixed", kv_bytes_per_token: int | None = None, link_gb_s: float = 25.0,
                 bootstrap_timeout_s: float = 30.0, offer_ttl_s: float = 120.0, sglang: bool = False):
        if role not in PD_ROLES:
            raise ValueError(f"pd role must be one of {', '.join(PD_ROLES)}, got {role!r}")
        if link_gb_s <= 0:
            raise ValueError(f"link_gb_s must be > 0, got {link_gb_s}")
        self.role = role
        self.sglang = sglang  # SGLang's decode engines cannot prefill alone; vLLM's (kv_both) can
        self.kv_bytes = kv_bytes_per_token or DEFAULT_KV_BYTES
        self.link_gb_s = link_gb_s
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.offer_ttl_s = offer_ttl_s
        self.engine_id = uuid.uuid4().hex
        self.host = "127.0.0.1"
        self.port = 0
        self.bootstrap_port: int | None = None
        self.offers: dict[str, tuple[int, float]] = {}  # request id → (prompt tokens, expiry)
        self.rooms: dict[int, asyncio.Future[int]] = {}
        self.transfers = 0  # KV transfers this engine received (decode legs served)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        """Close the client used for pulls and room polls."""
        if self._session is not None:
            await self._session.close()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    def _transfer(self, rtt_s: float) -> Callable[[int], float]:
        def seconds(tokens: int) -> float:
            self.transfers += 1
            return kv_transfer_s(tokens, self.kv_bytes, self.link_gb_s, rtt_s)
        return seconds

    # -- requests ---------------------------------------------------------------------------------
    async def plan(self, body: dict[str, Any]) -> Plan | None:
        """The plan for a request's P/D fields (None: an ordinary request); PDRefused when this
        engine cannot serve it."""
        kv = body.get("kv_transfer_params")
        if isinstance(kv, dict):
            if kv.get("do_remote_decode"):
                return self._vllm_prefill()
            if kv.get("do_remote_prefill"):
                return await self._vllm_decode(kv)
        if "bootstrap_room" in body:
            room = body.get("bootstrap_room")
            if isinstance(room, bool) or not isinstance(room, int):
                raise PDRefused("bootstrap_room must be an integer")
            if self.role == "prefill":
                return self._sglang_prefill(room)
            if self.role == "decode":
                return await self._sglang_decode(body, room)
            raise PDRefused("bootstrap_room given to an engine in no disaggregation mode (start it with --pd-role)")
        if self.role == "decode" and self.sglang:
            raise PDRefused("an SGLang decode engine serves only requests with bootstrap_room")
        return None

    def _vllm_prefill(self) -> Plan:
        rid = uuid.uuid4().hex

        def done(tokens: int) -> dict[str, Any]:
            now = time.monotonic()
            self.offers = {k: v for k, v in self.offers.items() if v[1] > now}  # vLLM frees unclaimed blocks
            self.offers[rid] = (tokens, now + self.offer_ttl_s)
            return {"kv_transfer_params": {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": list(range(-(-tokens // 16))), "remote_engine_id": self.engine_id,
                "remote_request_id": rid, "remote_host": self.host, "remote_port": self.port, "tp_size": 1}}
        return Plan(max_tokens=1, done=done)

    async def _vllm_decode(self, kv: dict[str, Any]) -> Plan:
        host, port, rid = kv.get("remote_host"), kv.get("remote_port"), kv.get("remote_request_id")
        if not isinstance(host, str) or not isinstance(port, int) or not isinstance(rid, str):
            raise PDRefused("kv_transfer_params needs remote_host, remote_port and remote_request_id")
        t0 = time.monotonic()
        try:
            async with self._client().post(f"http://{host}:{port}/_pd/pull",
                                           json={"remote_request_id": rid,
                                                 "remote_engine_id": kv.get("remote_engine_id")},
                                           timeout=aiohttp.ClientTimeout(total=10)) as r:
                answer = await r.json(content_type=None)
                if r.status != 200:
                    raise PDRefused(f"KV transfer from {host}:{port} failed: {answer.get('error', r.status)}", 500)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise PDRefused(f"KV transfer from {host}:{port} failed: {exc or type(exc).__name__}", 500) from None
        return Plan(remote=self._transfer(time.monotonic() - t0))

    def _room(self, room: int) -> asyncio.Future[int]:
        fut = self.rooms.get(room)
        if fut is None:
            fut = self.rooms[room] = asyncio.get_running_loop().create_future()
        return fut

    def _sglang_prefill(self, room: int) -> Plan:
        fut = self._room(room)

        def done(tokens: int) -> dict[str, Any]:
            if not fut.done():
                fut.set_result(tokens)
            self._forget_later(room)
            return {}

        def failed(why: str) -> None:
            if not fut.done():
                fut.set_exception(PDRefused(f"prefill for room {room} failed: {why}", 500))
                fut.exception()  # retrieved: nobody may be waiting
            self._forget_later(room)
        return Plan(max_tokens=1, done=done, failed=failed)

    def _forget_later(self, room: int) -> None:
        asyncio.get_running_loop().call_later(self.offer_ttl_s, self.rooms.pop, room, None)

    async def _sglang_decode(self, body: dict[str, Any], room: int) -> Plan:
        host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
        if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int):
            raise PDRefused("bootstrap_host (a string) and bootstrap_port (an integer) are required")
        host = host.strip("[]")
        t0 = time.monotonic()
        url = f"http://{host}:{port}/_pd/room/{room}"
        try:
            async with self._client().get(url, params={"wait": str(self.bootstrap_timeout_s)},
                                          timeout=aiohttp.ClientTimeout(total=self.bootstrap_timeout_s + 5)) as r:
                answer = await r.json(content_type=None)
                if r.status != 200:
                    raise PDRefused(f"KV transfer from {host}:{port} failed: {answer.get('error', r.status)}", 500)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise PDRefused(f"KV bootstrap at {host}:{port} failed: {exc or type(exc).__name__}", 500) from None
        # the poll also waited for the prefill: the round trip is what is left beside that wait
        waited = answer.get("waited_s")
        rtt = time.monotonic() - t0 - (waited if isinstance(waited, int | float) else 0.0)
        return Plan(remote=self._transfer(max(0.0, rtt)))

    # -- the HTTP side a peer engine talks to ------------------------------------------------------
    async def pull(self, request: web.Request) -> web.Response:
        """vLLM-style: a decode engine takes the KV a prefill leg left here (once)."""
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "body is not JSON"}, status=400)
        rid = body.get("remote_request_id") if isinstance(body, dict) else None
        if body.get("remote_engine_id") not in (None, self.engine_id):
            return web.json_response({"error": f"engine {body.get('remote_engine_id')} is not this engine "
                                     f"({self.engine_id})"}, status=404)
        offer = self.offers.pop(rid, None) if isinstance(rid, str) else None
        if offer is None or offer[1] < time.monotonic():
            return web.json_response({"error": f"no KV held for request {rid}"}, status=404)
        return web.json_response({"tokens": offer[0]})

    async def room(self, request: web.Request) -> web.Response:
        """SGLang-style bootstrap: wait until the room's prefill is done (or failed)."""
        try:
            room = int(request.match_info["room"])
            wait = min(float(request.query.get("wait", "30")), 600.0)
        except ValueError:
            return web.json_response({"error": "room and wait must be numbers"}, status=400)
        fut = self._room(room)
        t0 = time.monotonic()
        try:
            tokens = await asyncio.wait_for(asyncio.shield(fut), wait)
        except TimeoutError:
            return web.json_response({"error": f"no prefill for room {room} within {wait:g} s"}, status=504)
        except PDRefused as exc:
            return web.json_response({"error": str(exc)}, status=409)
        self.rooms.pop(room, None)
        return web.json_response({"tokens": tokens, "waited_s": round(time.monotonic() - t0, 6)})


def add_routes(app: web.Application, pd: PDEngine) -> None:
    """The endpoints peers use: ``POST /_pd/pull`` (vLLM) and ``GET /_pd/room/{room}`` (SGLang)."""
    app.router.add_post("/_pd/pull", pd.pull)
    app.router.add_get("/_pd/room/{room}", pd.room)


async def start_bootstrap(runner: web.AppRunner, host: str, port: int) -> int:
    """Serve the same app on the SGLang bootstrap port too; returns the bound port."""
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server  # aiohttp keeps the bound socket here
    with contextlib.suppress(AttributeError, IndexError, TypeError):
        return int(server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    return port
