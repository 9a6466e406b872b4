"""Prometheus metrics of the gateway, in a registry of its own (several gateways per process
in tests stay apart).

What every request touches — the request and branch counters and the latency histograms — is
counted in plain Python numbers (:class:`LocalHistogram`, dicts of counts) and turned into
metric families only when ``/metrics`` is scraped: prometheus_client's own children take a lock
and check their state at each increment, several microseconds per request on the hot path, for a
gateway whose counters are only ever touched from its one event-loop thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

disable_created_metrics()  # *_created series double the exposition for no operational use

# floats: a float bound compared with a float observation is a native compare in the compiled build (an int
# bound took CPython's slow mixed compare); the exposition writes str(float(bound)) either way. Typed
# tuple[float, ...]: a fixed-length tuple type is a C struct in the compiled build, boxed into a new tuple
# of 14 new floats at every use (each observe: ~2,000 instructions; sixth round, docs/hot-path.md)
LATENCY_BUCKETS: Final[tuple[float, ...]] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                                             60.0, 120.0)
_N_BUCKETS: Final = 14  # len(LATENCY_BUCKETS), a native constant


def bucket_of(value: float) -> int:
    """``bisect.bisect_left(LATENCY_BUCKETS, value)`` — the number of bounds below ``value`` — written
    out as the same binary search (``a[mid] < x``, so a NaN lands in bucket 0 as it does there): the
    compiled build compares native floats, where the call to bisect's C function parsed its arguments
    and compared boxed floats (~750 instructions per observation, callgrind, tenth round, docs/hot-path.md)."""
    lo, hi = 0, _N_BUCKETS
    while lo < hi:
        mid = (lo + hi) >> 1
        if LATENCY_BUCKETS[mid] < value:
            lo = mid + 1
        else:
            hi = mid
    return lo


class GatewayMetrics:
    """The gateway's Prometheus registry: request, branch, latency, retry and queue counters, plus gauges read
    live from the runtime at scrape time."""

    def __init__(self, runtime) -> None:
        self.registry = r = CollectorRegistry()
        # the hot path's: plain counts, exported at scrape time (_HotCollector)
        # route -> policy -> status -> requests; the status as a number (str() at scrape time, not per request).
        # Nested, not keyed by a (route, status, policy) tuple: a tuple made per request is hashed and compared
        # item by item on every lookup, where the route and policy names are the same str objects each time
        # (cached hashes, compared by identity) and the status a small int (issue 25's ninth round)
        self._requests: dict[str, dict[str, dict[int, int]]] = {}
        self._branches: dict[str, dict[str, int]] = {}  # policy -> branch -> decisions (nested, as above)
        self.ttft = LocalHistogram("kvroute_ttft_seconds", "Time to first byte of the response body, at the gateway")
        self.e2e = LocalHistogram("kvroute_e2e_seconds", "Request latency at the gateway")
        self.queue_wait = LocalHistogram("kvroute_lb_queue_wait_seconds", "Time held in the LB queue")
        r.register(_HotCollector(self))
        self.probe_failures = Counter("kvroute_probe_failures", "Failed probes", ["replica"], registry=r)
        self.retries = Counter("kvroute_retries", "Upstream attempts retried on another replica", ["reason"],
                               registry=r)
        self.continuations = Counter("kvroute_continuations", "Streams carried on to another replica by "
                                     "continuation (reason: migrate, recover; result: continued, completed, "
                                     "refused at the limit or when not continuable, failed)", ["reason", "result"],
                                     registry=r)
        self.stall_ejections = Counter("kvroute_stall_ejections", "Replicas ejected because none of their streams "
                                       "progressed for the stall threshold (gateway/outlier.py)", ["replica"],
                                       registry=r)
        self.policy_errors = Counter("kvroute_policy_errors", "Routing decisions that raised (answered 503)",
                                     registry=r)
        self.rejected = Counter("kvroute_queue_rejected", "Requests refused by the LB queue", ["reason"],
                                registry=r)
        r.register(_LiveCollector(runtime))
        self._children: dict[tuple, object] = {}  # label lookups cost more than the increment
        # the latest decision's branch: which mechanism is in charge (GET /admin/policy)
        self.last_branch = ""

    def _child(self, metric, *labels):
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def count_request(self, route: str, status: int, policy: str) -> None:
        """Count one answered request by route, status code and policy."""
        by_policy = self._requests.get(route)
        if by_policy is None:
            by_policy = self._requests[route] = {}
        by_status = by_policy.get(policy)
        if by_status is None:
            by_status = by_policy[policy] = {}
        by_status[status] = by_status.get(status, 0) + 1

    @property
    def request_counts(self) -> dict[tuple[str, int, str], int]:
        """Answered requests by (route, status code, policy)."""
        return {(route, status, policy): n for route, by_policy in self._requests.items()
                for policy, by_status in by_policy.items() for status, n in by_status.items()}

    def count_branch(self, policy: str, branch: str) -> None:
        """Count one routing decision by the policy branch that made it (one count per decision:
        the per-branch totals are summed when read, ``branch_counts``). Nested by policy, not keyed
        by a (policy, branch) tuple made per decision (twelfth round, docs/hot-path.md)."""
        by_branch = self._branches.get(policy)
        if by_branch is None:
            by_branch = self._branches[policy] = {}
        by_branch[branch] = by_branch.get(branch, 0) + 1
        self.last_branch = branch

    @property
    def branch_by_policy(self) -> dict[tuple[str, str], int]:
        """Decisions by (policy, branch), each policy's branches in the order they first decided."""
        return {(policy, branch): n for policy, by_branch in self._branches.items() for branch, n in by_branch.items()}

    @property
    def branch_counts(self) -> dict[str, int]:
        """Decisions per branch over every policy that ran (GET /admin/policy): the policies in the
        order they first decided, each one's branches in the order they first decided."""
        out: dict[str, int] = {}
        for (_, branch), n in self.branch_by_policy.items():
            out[branch] = out.get(branch, 0) + n
        return out

    def watch_http(self, server) -> None:
        """Export the HTTP server's refusals (``HTTPServer.rejections``) as ``kvroute_http_rejected``."""
        self.registry.register(_RejectionCollector(server))

    def render(self) -> bytes:
        """The registry in Prometheus text format, for ``GET /metrics``."""
        return generate_latest(self.registry)


class LocalHistogram:
    """A Prometheus histogram (``LATENCY_BUCKETS``) kept as plain counts: ``observe`` is a binary search
    and two additions, no lock (one event-loop thread observes); :meth:`family` builds the
    exposition at scrape time."""

    __slots__ = ("name", "doc", "counts", "sum")

    def __init__(self, name: str, doc: str):
        self.name, self.doc = name, doc
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)  # per bucket (not cumulative), +Inf last
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one observation (seconds)."""
        self.counts[bucket_of(value)] += 1  # le-buckets: a value on a bound counts there
        self.sum += value

    def family(self) -> HistogramMetricFamily:
        """The histogram as a metric family (cumulative buckets, sum)."""
        cumulative, total = [], 0
        for bound, n in zip((*LATENCY_BUCKETS, float("inf")), self.counts):
            total += n
            cumulative.append(("+Inf" if bound == float("inf") else str(float(bound)), total))
        fam = HistogramMetricFamily(self.name, self.doc)
        fam.add_metric([], cumulative, sum_value=self.sum)
        return fam


class _HotCollector:
    """The hot path's counts as metric families, at scrape time."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        m = self.m
        requests = CounterMetricFamily("kvroute_requests", "Requests by route, status code and policy",
                                       labels=["route", "status", "policy"])
        for (route, status, policy), n in sorted(m.request_counts.items()):
            requests.add_metric([route, str(status), policy], n)
        yield requests
        branches = CounterMetricFamily("kvroute_policy_branch", "Routing decisions by policy branch",
                                       labels=["policy", "branch"])
        for pair, n in sorted(m.branch_by_policy.items()):
            branches.add_metric(list(pair), n)
        yield branches
        for hist in (m.ttft, m.e2e, m.queue_wait):
            yield hist.family()


class _RejectionCollector:
    """Requests and connections the HTTP server refused, by status and reason (read at scrape time;
    the server's reference is looked up each time, so a replaced server is followed)."""

    def __init__(self, server) -> None:
        self.server = server

    def collect(self):
        family = CounterMetricFamily("kvroute_http_rejected", "Requests and connections refused by the HTTP "
                                     "server before reaching a handler, by status and reason",
                                     labels=["status", "reason"])
        for (status, reason), n in sorted(self.server.rejections.counts.items()):
            family.add_metric([str(status), reason], n)
        yield family


class _LiveCollector:
    """Gauges read from the runtime at scrape time: queue depth, in-flight, circuit, health."""

    def __init__(self, runtime) -> None:
        self.rt = runtime

    def collect(self):
        rt = self.rt
        depth = GaugeMetricFamily("kvroute_lb_queue_depth", "Requests waiting in the LB queue")
        depth.add_metric([], len(rt.queue))
        yield depth
        inflight = GaugeMetricFamily("kvroute_inflight", "Router-side in-flight requests", labels=["replica"])
        circuit = GaugeMetricFamily("kvroute_circuit_state", "0 closed, 1 open, 2 half-open", labels=["replica"])
        healthy = GaugeMetricFamily("kvroute_replica_healthy", "1 if the replica passes probes", labels=["replica"])
        running = GaugeMetricFamily("kvroute_replica_running", "Running requests at the last probe",
                                    labels=["replica"])
        waiting = GaugeMetricFamily("kvroute_replica_waiting", "Waiting requests at the last probe",
                                    labels=["replica"])
        kv = GaugeMetricFamily("kvroute_replica_kv_usage", "KV-cache usage at the last probe, 0..1 "
                               "(absent when the engine does not export it)", labels=["replica"])
        rtt = GaugeMetricFamily("kvroute_replica_probe_rtt_seconds", "Probe round trip, EWMA", labels=["replica"])
        engine = GaugeMetricFamily("kvroute_replica_engine", "1 for the engine type probes detected",
                                   labels=["replica", "engine"])
        restarts = CounterMetricFamily("kvroute_replica_restarts", "Engine restarts detected by probes",
                                       labels=["replica"])
        sent = CounterMetricFamily("kvroute_replica_requests", "Attempts sent to the replica (retries and "
                                   "continuation legs each count)", labels=["replica"])
        errors = CounterMetricFamily("kvroute_replica_errors", "Attempts that failed because of the replica "
                                     "(connect errors, timeouts, 5xx, broken streams, stalls)", labels=["replica"])
        tokens = CounterMetricFamily("kvroute_replica_tokens", "Tokens of the requests the replica served: prompt "
                                     "(the gateway's count) and completion (the engine's usage, else its stream "
                                     "events)", labels=["replica", "kind"])
        probes = CounterMetricFamily("kvroute_replica_probes", "Probes sent to the replica (adaptive rate: "
                                     "probe.interval_s while it has work, up to probe.idle_interval_s while idle)",
                                     labels=["replica"])
        probe_bytes = CounterMetricFamily("kvroute_replica_probe_bytes", "Bytes of the replica's metrics read by "
                                          "probes", labels=["replica"])
        ratio = GaugeMetricFamily("kvroute_prefix_hit_ratio", "Expected cached share of routed prompt tokens")
        source = GaugeMetricFamily("kvroute_replica_kv_source", "1 for where the replica's prefix index comes "
                                   "from: events, stale (events lost, approximate until rebuilt), approximate",
                                   labels=["replica", "source"])
        lag = GaugeMetricFamily("kvroute_replica_kv_event_lag_seconds", "Receive time minus publish time of the "
                                "replica's last KV-event batch", labels=["replica"])
        ev_counts = CounterMetricFamily("kvroute_kv_events", "KV-event stream counts per replica (kind: stored, "
                                        "removed, gaps, replays, malformed_*, unknown_events, out_of_order, ...)",
                                        labels=["replica", "kind"])
        for ep in rt.router.all_endpoints:
            up = rt.upstreams[ep.id]
            inflight.add_metric([ep.id], ep.inflight)
            circuit.add_metric([ep.id], int(up.breaker.state))
            healthy.add_metric([ep.id], 1 if ep.healthy else 0)
            restarts.add_metric([ep.id], up.restarts)
            sent.add_metric([ep.id], up.requests)
            errors.add_metric([ep.id], up.errors)
            tokens.add_metric([ep.id, "prompt"], up.prompt_tokens)
            tokens.add_metric([ep.id, "completion"], up.completion_tokens)
            probes.add_metric([ep.id], up.probes)
            probe_bytes.add_metric([ep.id], up.probe_bytes)
            reading = up.reading
            if reading is not None:
                running.add_metric([ep.id], reading.running)
                waiting.add_metric([ep.id], reading.waiting)
                engine.add_metric([ep.id, reading.engine], 1)
                if reading.kv_usage is not None:
                    kv.add_metric([ep.id], reading.kv_usage)
            if up.streak.rtt_ewma_s is not None:
                rtt.add_metric([ep.id], up.streak.rtt_ewma_s)
            ks = rt.kv_source(ep.id)
            source.add_metric([ep.id, ks["source"]], 1)
            if ks.get("lag_s") is not None:
                lag.add_metric([ep.id], ks["lag_s"])
            if "ranks" in ks:
                for kind in ("stored", "removed", "ignored", "unknown_parent"):
                    ev_counts.add_metric([ep.id, kind], sum(r[kind] for r in ks["ranks"]))
                for kind, n in ks["counters"].items():
                    ev_counts.add_metric([ep.id, kind], n)
        total = rt.prompt_tokens_routed
        ratio.add_metric([], rt.hit_tokens_routed / total if total else 0.0)
        prompt = CounterMetricFamily("kvroute_prompt_tokens", "Estimated prompt tokens routed")
        prompt.add_metric([], total)
        hits = CounterMetricFamily("kvroute_prefix_hit_tokens",
                                   "Prompt tokens the router expected cached on the chosen replica")
        hits.add_metric([], rt.hit_tokens_routed)
        yield prompt
        yield hits
        key_requests = CounterMetricFamily("kvroute_key_requests", "Requests admitted per API key", labels=["key"])
        key_tokens = CounterMetricFamily("kvroute_key_tokens", "Tokens admitted per API key (prompt estimate + "
                                         "max_tokens)", labels=["key"])
        key_limited = CounterMetricFamily("kvroute_key_limited", "Requests refused by a key's limits", labels=["key"])
        for k in rt.keys.keys.values():
            key_requests.add_metric([k.name], k.used_requests)
            key_tokens.add_metric([k.name], k.used_tokens)
            key_limited.add_metric([k.name], k.limited)
        yield from (key_requests, key_tokens, key_limited)
        state = rt.router.policy_state()
        if state:  # stateful policy plugins only (an ES tuner's weights, a detector's window)
            gauge = GaugeMetricFamily("kvroute_policy_state", "Numeric state of the policy's plugins",
                                      labels=["key"])
            for key, value in state.items():
                gauge.add_metric([key], value)
            yield gauge
        yield from (inflight, circuit, healthy, running, waiting, kv, rtt, engine, restarts, ratio, source, lag,
                    ev_counts, sent, errors, tokens, probes, probe_bytes)
