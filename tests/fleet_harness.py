"""Several gateway instances per region over real NATS (and HAProxy) on 127.0.0.1: the shared
set-up of tests/test_fleet*.py. nats-server and haproxy come from Debian's packages; ``make test``
installs them when missing (as root), and the tests skip only where they are absent locally."""

from __future__ import annotations

import shutil

import pytest

from kvroute.gateway.config import GatewayConfig, PeerConfig
from kvroute.gateway.server import Gateway
from kvroute.replicas import ReplicaConfig
from tests.test_peers import TOKEN, Mesh


def have(binary: str) -> bool:
    return (shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/usr/local/sbin")) is not None


needs_nats = pytest.mark.skipif(not have("nats-server"), reason="nats-server not installed (make test installs it)")
needs_haproxy = pytest.mark.skipif(not have("haproxy"), reason="haproxy not installed (make test installs it)")

FAST_FLEET = {"heartbeat_s": 0.05, "snapshot_every": 4, "timeout_s": 1.0, "reconnect_s": 0.2, "ping_interval_s": 1.0}


class FleetMesh(Mesh):
    """Gateway instances keyed by name (several per region), each in the region's fleet."""

    def instance(self, name: str, region: str, replicas: list[str], nats_url: str, peers: list[tuple[str, str]] = (),
                 mode: str = "local", policy="least_request", replica_region: str | None = None,
                 scope: str = "region", **overrides) -> Gateway:
        settings = {"probe": {"interval_s": 0.05, "timeout_s": 0.5}, "queue": {"max_wait_s": 5.0},
                    "timeouts": {"connect_s": 1.0, "first_byte_s": 5.0, "idle_s": 5.0, "non_stream_s": 5.0,
                                 "non_stream_total_s": 5.0},
                    "retry": {"backoff_s": 0.0}, **overrides}
        config = GatewayConfig(
            host="127.0.0.1", port=self.port(name), region=region, routing_mode=mode, policy=policy,
            replicas=[ReplicaConfig(url=u, id=f"{replica_region or region}-{i}", region=replica_region or region,
                                    engine="vllm") for i, u in enumerate(replicas)],
            peers=[PeerConfig(name=p, url=url, region=p) for p, url in peers],
            peer_auth={"token_env": "KVROUTE_TEST_PEER_TOKEN"} if peers else None,
            fleet={"nats_url": nats_url, "instance": name, "scope": scope, **FAST_FLEET}, **settings)
        gw = self.gateways[name] = Gateway(config)
        self.call(gw.start())
        return gw

    def mirrored(self, name: str) -> int:
        """Siblings' requests mirrored at ``name`` (read it inside ``wait_until``, which runs on the loop)."""
        return self.gateways[name].runtime.fleet.ledger.mirrored()

    def inflight(self, name: str) -> int:
        """Requests in flight at ``name``'s replicas, its own and its siblings' (on the loop too)."""
        return sum(e.inflight for e in self.gateways[name].runtime.router.endpoints)


def fleet_mesh(monkeypatch):
    """The body of a test module's fixture: a FleetMesh, closed afterwards."""
    monkeypatch.setenv("KVROUTE_TEST_PEER_TOKEN", TOKEN)
    m = FleetMesh()
    yield m
    m.close()
