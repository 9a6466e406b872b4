"""Is a simulated run measuring routing, or only a growing queue? Checks before and after a run.

Before (``preflight``): how many requests can never fit a replica's KV cache (they will be
rejected), and the offered request and prompt-token rates against a rough estimate of what the
replicas can serve. After (``warnings``): the run's own served-vs-offered verdict
(``result["load"]``, from :meth:`kvroute.metrics.Recorder.load`) turned into plain lines that
name the fix. Every paper kvroute reproduces runs below saturation (reproduction.md, "When a
trace overloads the deployment"): a TTFT measured under a growing queue is a queue position.
"""

from __future__ import annotations

import math

from kvroute.perf.profile import HardwareProfile

PREFLIGHT_SCAN = 200_000  # requests looked at before a run (a longer trace is sampled by its head)
COMFORT_LOAD = 0.7  # what the suggested fixes aim for: ~70 % of the estimated capacity


def request_seconds(p: HardwareProfile, prompt: int, output: int, batch: float) -> float:
    """Engine time one request costs when the replica is busy, with no prefix reuse.

    Prefill runs in chunks of ``max_batched_tokens`` that share a step's fixed cost; its
    attention grows with the square of the prompt. Decoding shares each step among ``batch``
    sequences, so a request pays ``step / batch`` per output token. This is an estimate for a
    warning, not a model of the run: mixed prefill/decode steps and cache hits make real
    capacity higher, preemptions lower.
    """
    prefill = (p.c0_s * prompt / p.max_batched_tokens + p.c_prefill_s * prompt
               + p.c_prefill_attn_s * prompt * prompt / 2)
    ctx = prompt + output / 2
    step = p.step_time(decode=max(1, round(batch)), decode_ctx=batch * ctx)
    return prefill + output * step / batch


def idle_prefill_s(p: HardwareProfile, prompt: int) -> float:
    """Prefill time of one prompt on an idle replica: full chunks, quadratic attention."""
    chunks = -(-prompt // p.max_batched_tokens)
    return (p.ttft_overhead_s + p.c0_s * chunks + p.c_prefill_s * prompt
            + p.c_prefill_attn_s * prompt * prompt / 2)


def decode_batch(p: HardwareProfile, prompt: float, output: float) -> float:
    """Sequences a replica keeps decoding at once: slots, or KV memory, whichever binds first."""
    return max(1.0, min(float(p.max_running), p.kv_tokens / max(1.0, prompt + output / 2)))


def preflight(sc) -> dict:
    """Check a scenario's workload against its replicas before running it.

    Returns ``{"requests", "never_fit", "kv_tokens", "offered_rps", "prompt_tps",
    "capacity_rps", "load", "messages"}``; rates are absent for closed-loop workloads, whose
    offered rate depends on service.
    """
    setup = sc.setup()
    profiles = [r.profile for r in setup.replicas]
    kv = max(p.kv_tokens for p in profiles)
    out: dict = {"kv_tokens": kv, "replicas": len(profiles), "messages": []}
    wl = sc.make_workload()
    if wl.closed_loop:
        out["closed_loop"] = True
        return out
    fastest = min(profiles, key=lambda p: idle_prefill_s(p, 8192))
    slo_ttft = sc.slo.ttft_s
    n = never = too_slow = 0
    first = last = None
    prompt_sum = output_sum = 0
    fitting: list[tuple[int, int]] = []
    for s in wl.arrivals():
        t = s.req.arrival_s
        first = t if first is None else first
        last = t
        n += 1
        prompt_sum += s.req.prompt_tokens
        output_sum += s.output_tokens
        if idle_prefill_s(fastest, s.req.prompt_tokens) > slo_ttft:
            too_slow += 1
        if s.req.prompt_tokens + s.output_tokens > kv:
            never += 1
        else:
            fitting.append((s.req.prompt_tokens, s.output_tokens))
        if n >= PREFLIGHT_SCAN:
            break
    out.update(requests=n, never_fit=never, slo_ttft_unreachable=too_slow, closed_loop=False)
    msgs = out["messages"]
    msgs += trace_warnings(wl, n)
    if too_slow:
        msgs.append(f"{too_slow:,} of {n:,} requests ({too_slow / n:.0%}) cannot meet TTFT ≤ {slo_ttft:g} s even "
                    f"on an idle replica (their prefill alone takes longer on {fastest.name}), so goodput is "
                    f"capped at {1 - too_slow / n:.0%} of requests. Relax --slo-ttft or use faster hardware.")
    if never:
        msgs.append(f"{never:,} of {n:,} requests can never run: prompt + output exceed the largest "
                    f"replica's KV cache ({kv:,} tokens, profile {profiles[0].name}); they will fail as "
                    "'rejected'. Use a profile with more KV memory (--profile), or drop them from the trace.")
    window = (last - first) if n > 1 and first is not None and last is not None else 0.0
    if window <= 0 or not fitting:
        return out
    offered = n / window
    mean_p = sum(p for p, _ in fitting) / len(fitting)
    mean_o = sum(o for _, o in fitting) / len(fitting)
    capacity = 0.0
    for prof in profiles:
        batch = decode_batch(prof, mean_p, mean_o)
        per_req = sum(request_seconds(prof, p, o, batch) for p, o in fitting) / len(fitting)
        capacity += 1.0 / per_req
    load = offered / capacity
    out.update(offered_rps=round(offered, 6), prompt_tps=round(prompt_sum / window, 3),
               capacity_rps=round(capacity, 6), load=round(load, 3))
    if load > 0.9:
        msgs.append(f"offered {offered:.3g} req/s ({prompt_sum / window:,.0f} prompt tokens/s) against an "
                    f"estimated capacity of {capacity:.3g} req/s (no prefix reuse): {load:.1f}x. Expect a "
                    f"growing queue. {fix_hint(sc, load)}")
    return out


def trace_warnings(wl, requests: int) -> list[str]:
    """A trace that goes back in time, or yields no request at all: the run goes on, but says so."""
    lines = []
    path = getattr(wl, "path", None)
    first = getattr(wl, "first_unsorted", None)
    if first is not None:
        line, stamp, before = first
        lines.append(f"{path}:{line}: timestamps are not sorted ({wl.unsorted:,} of the {requests:,} requests read "
                     f"are stamped before a line above them; here {stamp} after {before}). A trace is replayed in "
                     "file order, so each such request arrives right after the one before it; sort the file by "
                     "timestamp to replay its own timing.")
    if requests == 0 and path is not None:
        dropped, skipped = getattr(wl, "dropped", 0), getattr(wl, "skipped", 0)
        why = (f"all {dropped:,} dropped by workload.max_prompt_tokens" if dropped
               else f"all {skipped:,} lines malformed and skipped" if skipped
               else "a header or blank lines only")
        lines.append(f"{path}: no requests in this trace ({why}); every result below is empty. "
                     "Check the file, or give another trace.")
    return lines


def fix_hint(sc, load: float) -> str:
    """What to change to bring the offered load to ~70 % of capacity."""
    factor = load / COMFORT_LOAD
    w = sc.workload
    replicas = sum(g.count for g in sc.replicas)
    more = math.ceil(replicas * factor)
    if w.rate:
        return f"Try --rate {w.rate / factor:.3g} or about {more} replicas."
    if w.kind in ("mooncake", "azure"):
        return f"Try --time-scale {w.time_scale * factor:.3g} or about {more} replicas."
    return f"Try fewer clients or about {more} replicas."


def warnings(label: str, result: dict, sc=None) -> list[str]:
    """Plain warning lines for one policy's result: unstable load, failures by reason."""
    lines = []
    load = result.get("load") or {}
    if load and not load.get("stable", True):
        ratio = load["offered_rps"] / load["served_rps"] if load.get("served_rps") else float("inf")
        hint = fix_hint(sc, ratio) if sc is not None and ratio != float("inf") else ""
        lines.append(f"{label}: UNSTABLE — {load['verdict']}. Latencies measure the queue, not the "
                     f"routing. {hint}".rstrip())
    failed = result.get("failed") or {}
    if failed:
        parts = ", ".join(f"{v:,} {k}" for k, v in failed.items())
        lines.append(f"{label}: {sum(failed.values()):,} requests failed ({parts}).")
    return lines


def topology_warnings(sc) -> list[str]:
    """Forwarding that can never happen: a blind policy never holds, and only held requests go
    to a peer, so ``forward: true`` leaves it region-local without saying so (issue 7)."""
    from kvroute.policy import build_policy

    lines = []
    for entry in sc.policy_list():
        setup = sc.setup(entry.topology)
        if not any(b.forward for b in setup.balancers) or len(setup.balancers) < 2:
            continue
        policy = build_policy(entry.preset, entry.params)
        if not policy.admission.forwards:
            lines.append(f"{entry.label}: forwarding can never trigger — its admission is "
                         f"'{policy.admission.name}', which never holds a request, and only held requests "
                         "are forwarded; its load balancers act region-local. To compare it as the papers "
                         "do, run it behind one global LB ({preset: ..., topology: global}) or give it "
                         "admission: pending.")
    return lines
