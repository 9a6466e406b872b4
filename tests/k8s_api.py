"""A Kubernetes API server stand-in for discovery tests: serves recorded EndpointSlice list and
watch responses (tests/data/k8s/) over real HTTPS on 127.0.0.1, checks the bearer token, and
releases each scripted watch step only when the test says so."""

from __future__ import annotations

import asyncio
import json
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from kvroute.emulator.server import Faults, start_emulator

DATA = Path(__file__).parent / "data" / "k8s"


def recorded(name: str, **subs: object) -> str:
    """A recorded response with its placeholders ({IP_A}, {PORT}, ...) filled in."""
    text = (DATA / name).read_text()
    for k, v in subs.items():
        text = text.replace("{" + k + "}", str(v))
    return text


@dataclass
class Step:
    """One scripted answer: a status and body for a list, or lines for a watch (each released by
    ``gate`` when set; ``hold``: keep the watch open after its lines until the test ends)."""

    status: int = 200
    body: str = ""
    lines: list[str] = field(default_factory=list)
    gates: list[asyncio.Event] = field(default_factory=list)
    hold: bool = False


class FakeAPIServer:
    """Scripted lists, watches and pods; ``requests`` records each call's path and query."""

    def __init__(self, token: str, pods: dict[str, str] | None = None):
        self.token = token
        self.lists: list[Step] = []
        self.watches: list[Step] = []
        self.pods = pods or {}
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.closing = asyncio.Event()
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self, ssl_ctx: ssl.SSLContext | None) -> None:
        app = web.Application()
        app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", self._slices)
        app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}", self._pod)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=ssl_ctx)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        self.closing.set()
        if self._runner is not None:
            await self._runner.cleanup()

    def _authorized(self, request: web.Request) -> bool:
        return request.headers.get("Authorization") == f"Bearer {self.token}"

    async def _slices(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.path, dict(request.query)))
        if not self._authorized(request):
            return web.json_response({"kind": "Status", "code": 401, "message": "Unauthorized"}, status=401)
        watch = request.query.get("watch") == "true"
        script = self.watches if watch else self.lists
        if not script:  # nothing more scripted: an idle watch (or list) that ends with the test
            await self.closing.wait()
            return web.Response(status=503)
        step = script.pop(0)
        if not watch or step.status != 200:
            return web.Response(status=step.status, text=step.body, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        for i, line in enumerate(step.lines):
            if i < len(step.gates):
                await step.gates[i].wait()
            await resp.write(line.encode() + b"\n")
        if step.hold:
            await self.closing.wait()
        await resp.write_eof()
        return resp

    async def _pod(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        name = request.match_info["name"]
        if name not in self.pods:
            return web.json_response({"kind": "Status", "code": 404, "message": f"pods \"{name}\" not found"},
                                     status=404)
        return web.Response(text=self.pods[name], content_type="application/json")


async def engines_on(ips: list[str], tries: int = 20):
    """One emulator on each loopback address, all on the same port (as pods behind one Service);
    returns (port, [(runner, emulator)])."""
    for _ in range(tries):
        runner, emu, port = await start_emulator(ips[0], 0, "h100-llama3.2-3b", "vllm", Faults())
        started = [(runner, emu)]
        try:
            for ip in ips[1:]:
                r, e, _ = await start_emulator(ip, port, "h100-llama3.2-3b", "vllm", Faults())
                started.append((r, e))
        except OSError:  # that port is taken on another address: try another
            for r, _ in started:
                await r.cleanup()
            continue
        return port, started
    raise RuntimeError("no port free on every address")


def pods_json(**subs: object) -> dict[str, str]:
    """The recorded pods, by name, as JSON texts."""
    pods = json.loads(recorded("pods.json", **subs))
    return {name: json.dumps(p) for name, p in pods.items()}
