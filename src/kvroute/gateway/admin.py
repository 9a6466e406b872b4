"""The admin API: look at and change the replica set of a running gateway.

Runtime-only: changes live until the next SIGHUP reload or restart, which go back to the config
file. Every call needs the admin token (``auth.admin_token_env`` / ``admin_token_file``: the
admin API protected on its own, while clients send no key) or an API key with ``admin: true``;
with neither configured the API is off. GET calls answer HEAD too (headers only).

    GET    /admin/replicas              every replica with its indicators
    POST   /admin/replicas              add one (a replicas: entry of the config, as JSON)
    DELETE /admin/replicas/{id}         remove one (its in-flight requests finish)
    POST   /admin/replicas/{id}/drain   no new requests; in-flight ones finish
    POST   /admin/replicas/{id}/undrain take new requests again
    GET    /admin/policy                the active policy
    GET    /admin/discovery             each discovery source: its engines, synced, last error
    GET    /admin/fleet                 this instance's fleet sync: synced or local-view, siblings, and a
                                        fingerprint of each replica's event-built index
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from kvroute.gateway.auth import bearer
from kvroute.gateway.http import Request, Responder
from kvroute.replicas import ReplicaConfig

if TYPE_CHECKING:
    from kvroute.gateway.runtime import Runtime


def replica_view(rt: Runtime, name: str) -> dict[str, Any]:
    """One replica as the admin API shows it."""
    up = rt.upstreams[name]
    ep = up.endpoint
    return {"id": name, "url": up.config.url, "engine": up.engine, "region": ep.region,
            "healthy": ep.healthy, "answered": up.answered, "circuit": up.breaker.state.name.lower(),
            "drained": name in rt.drained,
            "running": ep.running, "waiting": ep.waiting, "kv_usage": ep.kv_usage, "inflight": ep.inflight,
            "probe_rtt_s": up.streak.rtt_ewma_s, "models": sorted(up.models) if up.models is not None else None,
            "restarts": up.restarts, "indexed_blocks": rt.router.prefix.blocks(name),
            "stalled": up.breaker.held, "requests": up.requests, "errors": up.errors,
            "kv_source": rt.kv_source(name)}


def handle_admin(rt: Runtime, request: Request, resp: Responder) -> None:
    """Authenticate as admin, then dispatch on method and path."""
    if not rt.keys.has_admin:
        resp.send_error(404, "the admin API is off: set auth.admin_token_env (or admin_token_file), or give a "
                        "key 'admin: true' under auth.keys", code="not_found")
        return
    presented = bearer(request.headers.get("authorization"))
    if not rt.keys.is_admin_token(presented):
        key = rt.keys.lookup(presented)
        if key is None:
            resp.send_error(401, "Incorrect or missing admin token or API key", code="invalid_api_key",
                            headers=[("WWW-Authenticate", "Bearer")])
            return
        if not key.admin:
            resp.send_error(403, f"key {key.name!r} is not an admin key", code="forbidden")
            return
    parts = request.path.strip("/").split("/")[1:]  # after "admin"
    method = request.method
    if parts == ["replicas"] and method == "GET":
        resp.send(200, json.dumps({"replicas": [replica_view(rt, n) for n in rt.upstreams]}).encode())
    elif parts == ["replicas"] and method == "POST":
        _add(rt, request, resp)
    elif parts == ["discovery"] and method == "GET":
        resp.send(200, json.dumps(rt.discovery.status() if rt.discovery is not None else {}).encode())
    elif parts == ["fleet"] and method == "GET":
        from kvroute.fleet.sync import index_fingerprints

        view = rt.fleet.view() if rt.fleet is not None else {"sync": "off", "event_index": index_fingerprints(rt)}
        resp.send(200, json.dumps(view).encode())
    elif parts == ["policy"] and method == "GET":
        m = rt.metrics  # which mechanism decided (the branch) and how often: `auto` explains itself here
        resp.send(200, json.dumps({"name": rt.policy_name, "config": rt.config.policy,
                                   "in_charge": m.last_branch, "branches": m.branch_counts,
                                   "state": rt.router.policy_state()}).encode())
    elif len(parts) in (2, 3) and parts[0] == "replicas":
        name = parts[1]
        if name not in rt.upstreams:
            resp.send_error(404, f"no replica {name!r}; replicas: {', '.join(rt.upstreams)}", code="not_found")
        elif len(parts) == 2 and method == "DELETE":
            rt.remove_replica(name)
            resp.send(200, json.dumps({"removed": name}).encode())
        elif len(parts) == 3 and parts[2] in ("drain", "undrain") and method == "POST":
            rt.set_drained(name, parts[2] == "drain")
            resp.send(200, json.dumps(replica_view(rt, name)).encode())
        else:
            resp.send_error(405, f"{method} {request.path} is not an admin call", code="method_not_allowed")
    else:
        resp.send_error(404, f"unknown admin call {method} {request.path}", code="not_found")


def _add(rt: Runtime, request: Request, resp: Responder) -> None:
    try:
        rc = rt.config.placed(ReplicaConfig.model_validate_json(request.body))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        resp.send_error(400, f"{where}: {first['msg']}", param=where)
        return
    if rc.name in rt.upstreams:
        resp.send_error(409, f"replica {rc.name!r} exists already", code="conflict")
        return
    rt.add_replica(rc)
    resp.send(201, json.dumps(replica_view(rt, rc.name)).encode())
