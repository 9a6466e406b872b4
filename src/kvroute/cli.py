"""`kvroute` command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from rich.table import Table

from kvroute import __version__
from kvroute.parallel import add_arguments as add_parallel
from kvroute.report import console, err, error, routing_table, run_simulation, write_json


def cmd_policies(args: argparse.Namespace) -> int:
    """`kvroute policies`: the presets (or with --plugins the plugins) as a table, JSON or Markdown; --write
    regenerates docs/policies.md."""
    from pathlib import Path

    from kvroute.errors import ConfigError
    from kvroute.policy.listing import describe_presets, presets_markdown
    from kvroute.policy.registry import plugin_table

    try:
        if args.write is not None:
            path = Path(args.write or Path(__file__).resolve().parents[2] / "docs" / "policies.md")
            if not path.parent.is_dir():
                return error(f"{path.parent}: no such directory; name the file, e.g. --write docs/policies.md")
            path.write_text(presets_markdown())
            err.print(f"wrote {path}")
            return 0
        if args.markdown:
            print(presets_markdown(), end="")
            return 0
        if args.json:
            out = plugin_table() if args.plugins else describe_presets()
            print(json.dumps(out, indent=2, default=str))
            return 0
        if args.plugins:
            table = Table(title="kvroute policy plugins")
            table.add_column("kind", style="bold cyan")
            table.add_column("plugin", style="bold")
            table.add_column("what it does")
            for kind, plugins in plugin_table().items():
                for name, summary in plugins.items():
                    table.add_row(kind, name, summary)
            console.print(table)
            return 0
        table = Table(title="kvroute policy presets")
        table.add_column("preset", style="bold cyan")
        table.add_column("what it does")
        table.add_column("source", style="dim")
        for name, d in describe_presets().items():
            table.add_row(name, d["description"], d["source"])
        console.print(table)
    except ConfigError as exc:  # a broken entry point or preset file
        return error(str(exc))
    return 0


def cmd_bench_routing(args: argparse.Namespace) -> int:
    """`kvroute bench routing`: decision cost per preset at 8K and 32K-token prompts, and the prefix index's
    memory."""
    from kvroute.bench import routing
    from kvroute.policy import PRESETS

    # No live progress bar: its refresh thread wakes every few ms and lands in the timed
    # decisions (issue 7 measured p99 ~4,100 µs with it, 46–580 µs without). One line per
    # preset, printed between timed loops, is all the process does besides measuring.
    done = iter(range(1, len(PRESETS) + 1))
    result = routing.run(decisions=args.decisions, seed=args.seed,
                         progress=lambda name: err.print(f"[dim]{next(done)}/{len(PRESETS)} {name}[/dim]"))
    console.print(routing_table(result))
    console.print(f"index memory: {result['index_bytes_per_block']:.1f} bytes/block   "
                  f"220 KB chat keyed+hashed+routed: {result['chat_220kb_ms']:.2f} ms (median)")
    write_json(args.json, result)
    return 0


def cmd_bench_sim_speed(args: argparse.Namespace) -> int:
    """`kvroute bench sim-speed`: simulated requests per wall second on the Mooncake conversation trace, and
    optionally a million-request run's time and peak RSS."""
    from pathlib import Path

    from kvroute.bench import sim_speed
    from kvroute.sim import scenario

    if not Path(scenario.resolve_trace(sim_speed.TRACE, "mooncake")).is_file():
        trace = scenario.DATA_DIR / sim_speed.TRACE
        return error(f"bench sim-speed replays the Mooncake conversation trace, not found at {trace}: traces "
                     "are looked up under $KVROUTE_TRACES (default: shared/data/traces beside a source checkout); "
                     f"set KVROUTE_TRACES to the folder that holds {sim_speed.TRACE}")
    result = sim_speed.run(progress=lambda msg: err.print(msg), with_million=not args.skip_million,
                           million_requests=args.million_requests)
    table = Table(title="simulator speed: Mooncake conversation trace, 16 replicas, ~70% load")
    table.add_column("preset")
    table.add_column("simulated requests / wall s", justify="right")
    table.add_column("wall s", justify="right")
    for name, r in result["per_preset"].items():
        table.add_row(name, f"{r['sim_requests_per_s']:,}", f"{r['wall_s']:.2f}")
    console.print(table)
    console.print(f"median: {result['sim_requests_per_s']:,.0f} simulated requests per wall second")
    if "million" in result:
        m = result["million"]
        console.print(f"{m['requests']:,}-request synthetic run: {m['wall_s']:.1f} s wall, "
                      f"peak RSS {m['peak_rss_mb']:,.0f} MB ({m['sim_requests_per_s']:,}/s)")
    write_json(args.json, result)
    return 0


def cmd_bench_gateway(args: argparse.Namespace) -> int:
    """`kvroute bench gateway`: throughput and added latency of the gateway against going direct to a stub
    upstream, per preset."""
    from kvroute.bench import gateway

    result = gateway.run(requests=args.requests, concurrency=args.concurrency, repeats=args.repeats,
                         presets=tuple(args.presets.split(",")), upstream_delay_ms=args.upstream_delay_ms,
                         baseline_src=args.baseline_src, progress=lambda m: err.print(m))
    variants = [("gateway", result)]
    if args.baseline_src:
        variants.append((f"baseline {args.baseline_src}", result["baseline"]))
    for label, rows in variants:
        for mode in ("nonstream", "stream"):
            table = Table(title=f"{label} vs direct, {mode} ({args.requests} requests × {args.repeats}, "
                                f"concurrency {args.concurrency}, upstream delay {args.upstream_delay_ms:g} ms, "
                                f"medians)")
            for col in ("preset", "via req/s", "direct req/s", "ratio (spread)", "gateway CPU µs/req (spread)",
                        "added p50 (spread)", "added p99 (spread)"):
                table.add_column(col, justify="left" if col == "preset" else "right")
            for name, r in rows[mode].items():
                lo, hi = r["rps_ratio_spread"]
                clo, chi = r["gateway_cpu_us_per_req_spread"]
                table.add_row(name, f"{r['gateway_rps']:,.0f}", f"{r['direct_rps']:,.0f}",
                              f"{r['rps_ratio']:.2f}x ({lo:.2f}–{hi:.2f})",
                              f"{r['gateway_cpu_us_per_req']:.0f} ({clo:.0f}–{chi:.0f})",
                              gateway.added_text(r, "p50"), gateway.added_text(r, "p99"))
            console.print(table)
    write_json(args.json, result)
    return 0


def cmd_bench_hostile(args: argparse.Namespace) -> int:
    """`kvroute bench hostile`: what each cheap attack costs the gateway (memory, CPU, /health
    latency for new clients), beside uvicorn and aiohttp; ``--check`` exits 1 when the gateway
    misses a bound."""
    from kvroute.bench import hostile

    attacks = tuple(a for a in args.attacks.split(",") if a)
    unknown = [a for a in attacks if a not in hostile.ATTACKS]
    if unknown:
        err.print(f"--attacks: unknown {', '.join(unknown)}; allowed: {', '.join(hostile.ATTACKS)}", markup=False)
        return 2
    result = hostile.run(attacks=attacks, baseline_src=args.baseline_src, with_references=not args.no_references,
                         progress=lambda m: err.print(m, markup=False))
    lim = hostile.LIMITS
    table = Table(title=f"each attack from {hostile.ATTACKER}, /health probed from 127.0.0.1 on a new connection "
                        f"every 20 ms; bounds: RSS +{lim['rss_mb']:.0f} MB, CPU {lim['cpu_s']:g} s, "
                        f"probe p99 {lim['probe_p99_ms']:.0f} ms, no failed probe")
    for col in ("attack", "server", "RSS +MB peak / after", "CPU s", "probe p99 ms", "probes failed",
                "within", "attacker saw"):
        table.add_column(col, justify="left" if col in ("attack", "server", "within", "attacker saw") else "right")
    missed = []
    for attack in attacks:
        for server, rows in result["servers"].items():
            r = rows[attack]
            ok = all(r["within"].values())
            if server == "gateway" and not ok:
                missed.append(attack)
            mark = "yes" if ok else "no: " + ", ".join(k for k, v in r["within"].items() if not v)
            p99 = r["probe"]["p99_ms"]
            table.add_row(attack, server, f"{r['rss_peak_growth_mb']:+.0f} / {r['rss_after_growth_mb']:+.0f}",
                          f"{r['cpu_s']:.2f}", "-" if p99 is None else f"{p99:.1f}",
                          f"{r['probe']['failed']}/{r['probe']['probes']}", mark, json.dumps(r["attack"]))
    console.print(table)
    write_json(args.json, result)
    if missed:
        err.print(f"the gateway missed a bound on: {', '.join(missed)}", markup=False)
    return 1 if args.check and missed else 0


SWEEP_DEFAULT_REQUESTS = 2000  # per sweep run, unless the scenario or --max-requests says otherwise


def _scenario_from_args(args: argparse.Namespace):
    from kvroute.sim.scenario import Scenario, load_scenario, parse_scenario, workload_flag

    sc = load_scenario(args.scenario) if args.scenario else Scenario()
    data = sc.model_dump(exclude_none=True)
    if args.workload:
        kind, path = workload_flag(args.workload)
        data["workload"]["kind"] = kind
        if path is not None:
            data["workload"]["path"] = path
    if args.replicas is not None:
        for g in data["replicas"]:
            g["count"] = args.replicas
    if args.profile:
        for g in data["replicas"]:
            g["profile"] = args.profile
    if args.policy:
        data["policies"] = [p.strip() for p in args.policy.split(",") if p.strip()]
    data["policies"] += getattr(args, "file_presets", [])  # registered from --policy-file
    for flag, key in (("time_scale", "time_scale"), ("rate", "rate")):
        if getattr(args, flag) is not None:
            data["workload"][key] = getattr(args, flag)
    if args.skip_bad:
        data["workload"]["skip_bad"] = True
    if args.max_requests is not None:
        data.setdefault("limits", {})["max_requests"] = args.max_requests
    if args.seed is not None:
        data["seed"] = args.seed
    for flag, key in (("slo_ttft", "ttft_s"), ("slo_tpot", "tpot_s"), ("slo_target", "target")):
        if getattr(args, flag) is not None:
            data.setdefault("slo", {})[key] = getattr(args, flag)
    if args.sweep and data.get("limits", {}).get("max_requests") is None:
        data.setdefault("limits", {})["max_requests"] = SWEEP_DEFAULT_REQUESTS
    return parse_scenario(data, args.scenario or "flags")


def cmd_simulate(args: argparse.Namespace) -> int:
    """`kvroute simulate`: run a scenario's policies (or a --sweep of loads) in the simulator and print, write
    and plot the comparison."""
    from kvroute.errors import ConfigError
    from kvroute.policyfiles import register_preset_file
    from kvroute.sim.scenario import ScenarioError
    from kvroute.workload.traces import TraceError

    try:
        args.file_presets = [register_preset_file(f) for f in args.policy_file or ()]
        for f in args.policy_file or ():  # the sweep's workers register them too
            from pathlib import Path

            from kvroute.parallel import add_prelude

            add_prelude("kvroute.policyfiles:register_preset_file_text", f, Path(f).read_text())
        sc = _scenario_from_args(args)
        sc.policy_list()
        sc.setup()
    except (ScenarioError, ConfigError) as exc:
        return error(str(exc))
    try:
        if args.sweep:
            from kvroute.parallel import ExecutorError, make_executor
            from kvroute.report import run_sweep

            try:
                executor = make_executor(args.workers, args.ray)
            except ExecutorError as exc:
                return error(str(exc))
            from kvroute.parallel import clear_prelude

            try:
                with executor:
                    run_sweep(sc, args.json, args.plots, executor)
            finally:
                clear_prelude()
        else:
            run_simulation(sc, args.json, args.plots)
    except (ScenarioError, TraceError) as exc:  # a bad trace line found while replaying
        return error(str(exc))
    return 0


def _unwritable(path: str, directory: bool) -> str | None:
    """Why ``path`` (a file, or a folder of files) cannot be written, or None. Creates the folders
    it needs, as the writer would, and tries a scratch file there; run before any work."""
    import tempfile
    from pathlib import Path

    p = Path(path)
    folder = p if directory else p.parent
    if not directory and p.is_dir():
        return "it is a directory"
    if directory and p.exists() and not p.is_dir():
        return "it is a file, not a directory"
    for parent in folder.parents if directory else (folder, *folder.parents):
        if parent.exists() and not parent.is_dir():
            return f"{parent} is a file, not a directory"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create the folder {folder}: {exc.strerror or exc}"
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".kvroute-write-check-"):
            pass
    except OSError as exc:
        return f"cannot create a file in {folder}: {exc.strerror or exc}"
    return None


OUTPUT_FLAGS = (("json", False), ("md", False), ("plots", True))  # argparse dest, is a folder


def _check_outputs(args: argparse.Namespace) -> int | None:
    """Exit 2 with one line when an output named on the command line cannot be written, before
    anything runs (so no run's results are lost to a typo in --json)."""
    for dest, directory in OUTPUT_FLAGS:
        path = getattr(args, dest, None)
        if not isinstance(path, str):
            continue
        why = _unwritable(path, directory)
        if why:
            return error(f"--{dest} {path}: cannot write there: {why}; choose another "
                         f"{'folder' if directory else 'path'}")
    return None


def _run_async(coro) -> None:
    import asyncio

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def _listen(coro, what: str) -> int:
    """Run a server until it stops; a socket that cannot be bound is a one-line error, exit 2."""
    try:
        _run_async(coro)
    except OSError as exc:
        return error(f"cannot listen on {what}: {exc.strerror or exc}")
    return 0


def _port(text: str) -> int:
    """argparse type: a TCP port, 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: allowed 0 (any free port) to 65535")
    return value


def cmd_serve(args: argparse.Namespace) -> int:
    """`kvroute serve`: the gateway from --config until SIGTERM; without a config, one in front of emulated
    replicas in this process."""
    from kvroute import yamlconf
    from kvroute.gateway.config import load_config
    from kvroute.gateway.server import configure_logging, serve

    configure_logging(args.log_level)
    if args.config:
        try:
            config = load_config(args.config)
        except yamlconf.ConfigFileError as exc:
            return error(str(exc))
        overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        config = config.model_copy(update=overrides)
        if not config.replicas and not config.discovery:
            return error(f"{args.config} lists no replicas and no discovery; add e.g. "
                         "replicas: [{url: http://10.0.0.5:8000, engine: vllm}]")

        async def main() -> None:
            await serve(config, args.config,
                        on_ready=lambda gw: err.print(f"kvroute gateway on http://{config.host}:{gw.port} "
                                                      f"({len(gw.runtime.upstreams)} replicas, "
                                                      f"policy {gw.runtime.policy_name})"))
        return _listen(main(), f"{config.host}:{config.port}")

    async def embedded() -> None:
        from kvroute.live.embedded import start_deployment
        from kvroute.shutdown import until_stopped

        dep = await start_deployment(replicas=args.replicas, policy=args.policy or "auto",
                                     host=args.host or "127.0.0.1", port=args.port if args.port is not None else 8000)
        err.print(f"kvroute gateway on {dep.url} in front of {len(dep.emulators)} emulated replicas "
                  f"(policy {dep.gateway.runtime.policy_name}). Try:\n"
                  f"  curl {dep.url}/v1/chat/completions -H 'content-type: application/json' "
                  "-d '{\"model\": \"emulated\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}'")
        await until_stopped()
        await dep.gateway.drain()
        await dep.stop()

    err.print(f"no --config: serving {args.replicas} emulated engines in this process (not real models)")
    return _listen(embedded(), f"{args.host or '127.0.0.1'}:{args.port if args.port is not None else 8000}")


def cmd_epp(args: argparse.Namespace) -> int:
    """`kvroute epp`: the Gateway API inference extension's endpoint picker (Envoy ext_proc) over the
    gateway's Router, probes and discovery, until SIGTERM."""
    from kvroute import yamlconf
    from kvroute.gateway.config import load_config
    from kvroute.gateway.server import configure_logging

    try:
        from kvroute.epp.server import serve_epp
    except ImportError as exc:
        return error(f"kvroute epp needs the k8s extra ({exc.name} is not installed): pip install 'kvroute[k8s]'")
    configure_logging(args.log_level)
    try:
        config = load_config(args.config)
    except yamlconf.ConfigFileError as exc:
        return error(str(exc))
    if args.http_port is not None:
        config = config.model_copy(update={"port": args.http_port})
    if not config.replicas and not config.discovery:
        return error(f"{args.config} lists no replicas and no discovery: the picker would have nothing to pick")

    async def main() -> None:
        await serve_epp(config, args.config, args.grpc_port, args.health_port, args.fallbacks,
                        on_ready=lambda epp: err.print(
                            f"kvroute epp: ext_proc on {epp.grpc_host}:{epp.grpc_port}, gRPC health on "
                            f"{epp.health_port}, metrics on http://{config.host}:{epp.gateway.port}/metrics "
                            f"(policy {epp.gateway.runtime.policy_name})"))
    return _listen(main(), f"{config.host}:{args.grpc_port}")


def cmd_emulate(args: argparse.Namespace) -> int:
    """`kvroute emulate`: one emulated engine (vLLM, SGLang or llama.cpp API and metrics, timing from a
    hardware profile), with optional injected faults."""
    from kvroute.emulator.server import Faults, start_emulator
    from kvroute.perf.loader import ProfileError, load_profile

    try:
        profile = load_profile(args.profile)
    except ProfileError as exc:
        return error(str(exc))
    if not 0.5 <= args.bytes_per_token <= 16:
        return error(f"--bytes-per-token must be from 0.5 to 16, got {args.bytes_per_token:g}")
    if args.kv_link_gb_s <= 0:
        return error(f"--kv-link-gb-s must be > 0, got {args.kv_link_gb_s:g}")
    if args.bootstrap_port is not None and (args.engine != "sglang" or args.pd_role != "prefill"):
        return error("--bootstrap-port is for SGLang prefill engines (--engine sglang --pd-role prefill)")
    faults = Faults()
    try:
        faults.update({"fail_rate": args.fail_rate, "hang": args.hang, "close_after_tokens": args.close_after_tokens,
                       "slowdown": args.slowdown, "close_after_stream": args.close_after_stream,
                       "ignore_disconnect": args.ignore_disconnect, "empty_text": args.empty_text})
    except ValueError as exc:  # name the flag the user typed, not the fault's field
        field = str(exc).split(" ", 1)[0]
        return error(f"--{field.replace('_', '-')}" + str(exc)[len(field):])
    kv_events = None
    if args.kv_events:
        from kvroute.emulator.kv_events import KVEventsOptions
        from kvroute.gateway.config import events_extra_installed

        try:
            events_extra_installed()
        except ValueError as exc:
            return error(str(exc).replace("replicas[].kv_events", "--kv-events"))
        for flag, value in (("--kv-events", args.kv_events), ("--kv-events-replay", args.kv_events_replay)):
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                return error(f"{flag} must be a ZMQ endpoint (tcp://*:PORT, ipc://PATH, inproc://NAME), got {value!r}")
        kv_events = KVEventsOptions(args.kv_events, args.kv_events_replay, args.kv_events_topic,
                                    args.kv_events_format, args.kv_events_hash == "bytes")
    elif args.kv_events_replay:
        return error("--kv-events-replay needs --kv-events (the PUB endpoint)")

    async def main() -> None:
        from kvroute.shutdown import until_stopped

        runner, emu, port = await start_emulator(args.host, args.port, profile, args.engine, faults, args.model,
                                                 args.bytes_per_token, args.pd_role, args.bootstrap_port,
                                                 args.kv_link_gb_s, max_model_len=args.max_model_len,
                                                 kv_events=kv_events, block_tokens=args.block_tokens)
        role = "" if args.pd_role == "mixed" else f" as a {args.pd_role} engine"
        boot = f", bootstrap on port {emu.pd.bootstrap_port}" if emu.pd.bootstrap_port else ""
        err.print(f"emulated {args.engine} replica ({profile.name}){role} on http://{args.host}:{port}{boot}")
        await until_stopped()
        await runner.cleanup()

    return _listen(main(), f"{args.host}:{args.port}")


def _positive_int(text: str) -> int:
    """argparse type: one positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive integer")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated positive integers, e.g. 128,512,2048."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be a positive integer")
    return values


def cmd_calibrate(args: argparse.Namespace) -> int:
    """`kvroute calibrate`: measure running engines (prefill lengths, batch sizes, contexts), fit a hardware
    profile's step-time constants and write it with the fit's error per point."""
    from kvroute.calibrate import CalibrationError, Sweep, fit_profile, measure, write_profile

    why = _unwritable(args.out, False)
    if why:
        return error(f"--out {args.out}: cannot write there: {why}")
    sweep = Sweep(args.prefill_lengths, args.batch_sizes, args.contexts, args.decode_tokens, args.repeats,
                  args.timeout)
    import asyncio

    try:
        m = asyncio.run(measure(args.url, args.model, sweep, log=lambda line: err.print(line)))
        hardware = args.hardware or f"measured: {len(args.url)} engine(s) loaded together"
        profile, report = fit_profile(m, args.name, hardware, args.max_batched_tokens, kv_tokens=args.kv_tokens,
                                      max_running=args.max_running, sweep=m.sweep or sweep,
                                      host_cores=args.host_cores)
    except (CalibrationError, ValueError) as exc:
        return error(str(exc))
    write_profile(args.out, profile, report)
    table = Table(title=f"{args.out}: RMS error {report['rms_error']:.1%}, max {report['max_error']:.1%}")
    for col in ("point", "measured", "fit", "error"):
        table.add_column(col, justify="right")
    for pt in report["points"]:
        what = f"prefill {pt['prefill']}" if "prefill" in pt else f"decode x{pt['decode']} @ {pt['ctx']}"
        measured = pt.get("ttft_s", pt.get("expect_s"))
        table.add_row(what, f"{measured * 1000:.2f} ms", f"{pt['fit_s'] * 1000:.2f} ms", f"{pt['error']:+.1%}")
    console.print(table)
    fields = ("c0_s", "c_prefill_s", "c_decode_s", "c_attn_s", "c_prefill_attn_s", "ttft_overhead_s")
    console.print(", ".join(f"{f} {getattr(profile, f):.3g}" for f in fields))
    return 0


def cmd_controller(args: argparse.Namespace) -> int:
    """`kvroute controller`: the deployment controller (probes, /resolve, replica placement) from a deployment
    file until SIGTERM."""
    from kvroute import yamlconf
    from kvroute.controller import load_deployment, start_controller
    from kvroute.gateway.server import configure_logging

    configure_logging(args.log_level)
    try:
        dep = load_deployment(args.config)
    except yamlconf.ConfigFileError as exc:
        return error(str(exc))
    dep = dep.model_copy(update={k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None})

    async def main() -> None:
        from kvroute.shutdown import until_stopped

        ctl, runner, port = await start_controller(dep)
        err.print(f"kvroute controller on http://{dep.host}:{port} ({len(dep.gateways)} gateways, "
                  f"{len(dep.replicas)} replicas)")
        await until_stopped()
        await runner.cleanup()
        await ctl.stop()

    return _listen(main(), f"{dep.host}:{dep.port}")


def _fidelity_cell(key: str, value: float) -> str:
    if key == "cached_share":
        return f"{value:.1%}"
    return f"{value:.2f}" if key == "throughput" else f"{value * 1000:.0f} ms"


def _fidelity_spread(key: str, lo: float, hi: float) -> str:
    """A min-max spread in the cell's unit, said once: "(380-460)"."""
    if key == "cached_share":
        return f"({lo:.0%}-{hi:.0%})"
    return f"({lo:.2f}-{hi:.2f})" if key == "throughput" else f"({lo * 1000:.0f}-{hi * 1000:.0f})"


def cmd_bench_pd(args: argparse.Namespace) -> int:
    """`kvroute bench pd`: aggregated vs disaggregated vs conditional serving on a chat and a long-prompt
    workload at several rates, in the simulator (goodput at the SLO, TPOT p99, transfer share of TTFT)."""
    from pathlib import Path

    from kvroute.bench import pd
    from kvroute.perf.loader import ProfileError, load_profile

    try:
        load_profile(args.profile)
    except ProfileError as exc:
        return error(str(exc))
    if not 0 < args.scale <= 1:
        return error(f"--scale must be in (0, 1], got {args.scale:g}")
    result = pd.run_bench(args.profile, args.seed, args.threshold, args.scale,
                          progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    table = pd.markdown(result)
    console.print(table, markup=False, highlight=False)
    write_json(args.json, result)
    if args.md:
        Path(args.md).write_text(table + "\n")
    return 0


def cmd_bench_fidelity(args: argparse.Namespace) -> int:
    """`kvroute bench fidelity`: the same workload on real engines and in the simulator, metric by metric."""
    import asyncio

    from kvroute.bench.fidelity import METRICS, Workload, calibrate_engines, run_fidelity
    from kvroute.calibrate import CalibrationError
    from kvroute.perf.loader import ProfileError, load_profile

    if args.profile is None:  # self-contained: calibrate these engines first, sharing counted
        args.host_cores = args.host_cores or os.cpu_count() or 1
        try:
            args.profile = asyncio.run(calibrate_engines(args.url, args.host_cores))
        except (CalibrationError, ValueError) as exc:
            return error(f"bench fidelity: calibrating the engines: {exc}")
        err.print(f"calibrated the engines ({args.host_cores} shared cores): {args.profile}")
    try:
        load_profile(args.profile)
    except ProfileError as exc:
        return error(str(exc))
    w = Workload(args.users, args.groups, args.system_tokens, (args.min_turns, args.max_turns), args.max_tokens,
                 args.seed)
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    try:
        out = asyncio.run(run_fidelity(args.url, args.profile, policies, w, log=lambda line: err.print(line),
                                       host_cores=args.host_cores, repeats=args.repeats))
    except (RuntimeError, OSError) as exc:
        return error(f"bench fidelity: {exc}")
    n = out["repeats"]
    table = Table(title=f"fidelity, live vs simulate ({args.profile}): median over {n} repeat(s) (min-max); "
                        "sim/live: of the medians; pooled: the p99 of all repeats' requests")
    table.add_column("policy")
    table.add_column("side")
    columns = [*METRICS[:2], ("ttft_p99_pooled", "TTFT p99 pooled"), *METRICS[2:]]
    for _, label in columns:
        table.add_column(label, justify="right")
    for policy, row in out["policies"].items():
        for side in ("live", "sim"):
            cells = []
            for key, _ in columns:
                if key == "ttft_p99_pooled":
                    cells.append(_fidelity_cell("ttft_p99", row[key][side]))
                    continue
                lo, hi = row[f"{side}_range"][key]
                spread = f" {_fidelity_spread(key, lo, hi)}" if n > 1 else ""
                cells.append(_fidelity_cell(key, row[side][key]) + spread)
            table.add_row(policy if side == "live" else "", side, *cells)
        ratios = [row["ttft_p99_pooled"]["sim_over_live"] if key == "ttft_p99_pooled" else row["sim_over_live"][key]
                  for key, _ in columns]
        table.add_row("", "sim/live", *("-" if r is None else f"×{r:.2f}" for r in ratios), end_section=True)
    console.print(table)
    for name, rank in (("median", out["ranking_ttft_p99"]), ("pooled", out["ranking_ttft_p99_pooled"])):
        console.print(f"TTFT p99 ({name}) ranking, live: {' < '.join(rank['live'])}; sim: {' < '.join(rank['sim'])}"
                      f" ({'same' if rank['live'] == rank['sim'] else 'different'})")
    console.print(f"{out['within_20pct']} of {out['compared']} sim/live ratios of the medians within 20 %; "
                  f"pooled TTFT p99: {out['pooled_p99_within_20pct']} of {out['pooled_p99_compared']}")
    failed = {p: row["errors"] for p, row in out["policies"].items() if any(row["errors"].values())}
    if failed:
        err.print(f"failed requests (summed over the repeats): {failed}")
    if args.json:
        write_json(args.json, out)
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    """`kvroute reproduce PAPER`: the paper's claims next to what kvroute measures, with whether each agrees
    and why not."""
    from pathlib import Path

    from kvroute.parallel import ExecutorError, make_executor
    from kvroute.reproduce import markdown, reproduce
    from kvroute.sim.scenario import ScenarioError

    try:
        with make_executor(args.workers, args.ray) as executor:
            result = reproduce(args.paper, quick=args.quick, executor=executor,
                               progress=lambda m: err.print(f"[dim]{m}[/dim]", highlight=False))
    except (ScenarioError, ExecutorError) as exc:
        return error(str(exc))
    table = Table(title=f"{result['title']}: paper vs kvroute" + (" (--quick)" if args.quick else ""))
    for col in ("claim", "paper", "kvroute", "agrees?", "why not"):
        table.add_column(col, overflow="fold")
    colour = {"yes": "green", "direction only": "yellow", "no": "red"}
    for r in result["rows"]:
        c = colour.get(r["agrees"])
        table.add_row(r["claim"], r["paper"], r["kvroute"], f"[{c}]{r['agrees']}[/{c}]" if c else r["agrees"],
                      r["why_not"])
    console.print(table)
    console.print(f"[dim]{result['wall_s']} s wall[/dim]")
    write_json(args.json, result)
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(markdown(result))
        console.print(f"wrote {args.md}")
    return 0


def cmd_config_reference(args: argparse.Namespace) -> int:
    """`kvroute config-reference`: print, --write or --check docs/configuration.md generated from the config
    models."""
    from pathlib import Path

    from kvroute import docs_gen

    if args.write is None and args.check is None:
        print(docs_gen.reference())
        return 0
    given = args.write if args.write is not None else args.check
    if given:
        path = Path(given)
    elif (docs_gen.DOC.parents[1] / "pyproject.toml").is_file():
        path = docs_gen.DOC
    else:
        return error(f"no source checkout around {docs_gen.DOC.parents[1]}: name the file, e.g. "
                     "--write docs/configuration.md")
    try:
        if args.write is not None:
            changed = docs_gen.write(path)
            console.print(f"wrote {path}" if changed else f"{path} is up to date")
            return 0
        text = path.read_text()
        if docs_gen.render_into(text) != text:
            err.print(f"{path} is out of date with the config models: run `kvroute config-reference --write`",
                      markup=False, soft_wrap=True)
            return 1
    except docs_gen.MarkerMissing as exc:
        return error(f"{path}: {exc}; put the two marker lines where the reference belongs")
    except OSError as exc:
        return error(f"{path}: {exc.strerror or exc}")
    console.print(f"{path} is up to date")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """`kvroute demo`: every preset routing sample chat turns, a short routing benchmark, a simulated
    three-region comparison and live runs over emulated replicas; JSON and plots go to --out."""
    from kvroute.demo import run_demo

    run_demo(args.out, args.decisions, args.sim_requests, args.live_policies.split(","), args.live_seconds,
             args.live_requests)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of every kvroute command and its options."""
    p = argparse.ArgumentParser(prog="kvroute", description="KV-cache-aware load balancer for LLM inference")
    p.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("policies", help="list policy presets")
    sp.add_argument("--json", action="store_true", help="machine-readable output: params and plugins of each")
    sp.add_argument("--plugins", action="store_true", help="list the plugins presets are composed of")
    sp.add_argument("--markdown", action="store_true", help="print docs/policies.md")
    sp.add_argument("--write", nargs="?", const="", metavar="FILE",
                    help="write docs/policies.md (default: the checkout's)")
    sp.set_defaults(func=cmd_policies)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    br = bench.add_parser("routing", help="decision cost per preset, index memory")
    br.add_argument("--json", metavar="FILE")
    br.add_argument("--decisions", type=int, default=2000, help="decisions per prompt size")
    br.add_argument("--seed", type=int, default=0)
    br.set_defaults(func=cmd_bench_routing)
    bk = bench.add_parser("kv-events", help="routing on engine KV events vs the approximate index; consumer cost")
    bk.add_argument("--presets", default="sglang_cache_aware,skywalker,lmetric",
                    help="cache-aware presets to compare, comma-separated")
    bk.add_argument("--publishers", type=int, default=64, help="engines publishing at once for the ingest part")
    bk.add_argument("--seed", type=int, default=0)
    bk.add_argument("--skip-routing", action="store_true", dest="skip_routing")
    bk.add_argument("--skip-ingest", action="store_true", dest="skip_ingest")
    bk.add_argument("--json", metavar="FILE")
    bk.set_defaults(func=lambda a: __import__("kvroute.bench.kv_events", fromlist=["command"]).command(a))

    sim = sub.add_parser("simulate", help="compare policies in the discrete-event simulator")
    sim.add_argument("scenario", nargs="?", help="scenario YAML, or the name of a bundled one (kvroute/scenarios/)")
    sim.add_argument("--workload", help="chat, tot, mixed, chat-poisson, mooncake, azure, openai, or a trace file")
    sim.add_argument("--replicas", type=int, help="replicas per replica group (per region)")
    sim.add_argument("--profile",
                     help="hardware profile for every replica: a YAML file or a bundled name (kvroute/profiles/)")
    sim.add_argument("--policy", help="comma-separated presets, e.g. round_robin,skywalker,lmetric")
    sim.add_argument("--policy-file", action="append", metavar="FILE", dest="policy_file",
                     help="a preset YAML file (name + filters/rules/cost/score, see docs/policies.md): "
                     "registered and added to the policies compared; repeatable")
    sim.add_argument("--time-scale", type=float, dest="time_scale", help="stretch trace inter-arrival times")
    sim.add_argument("--rate", type=float, help="Poisson arrival rate (requests/s) instead of trace times")
    sim.add_argument("--max-requests", type=int, dest="max_requests")
    sim.add_argument("--seed", type=int)
    sim.add_argument("--skip-bad", action="store_true", dest="skip_bad", help="skip and count malformed trace lines")
    sim.add_argument("--slo-ttft", type=float, dest="slo_ttft", metavar="S",
                     help="goodput SLO: time to first token ≤ S seconds (default 5)")
    sim.add_argument("--slo-tpot", type=float, dest="slo_tpot", metavar="S",
                     help="goodput SLO: time per output token ≤ S seconds (default 0.1)")
    sim.add_argument("--slo-target", type=float, dest="slo_target", metavar="F",
                     help="share of requests that must meet the SLO below the knee (default 0.9)")
    sim.add_argument("--sweep", action="store_true",
                     help="find each policy's capacity knee, then compare at 50/70/90%% of it")
    sim.add_argument("--json", metavar="FILE")
    sim.add_argument("--plots", metavar="DIR", help="write CDF, throughput, load-over-time and per-replica PNGs")
    add_parallel(sim)
    sim.set_defaults(func=cmd_simulate)

    bs = bench.add_parser("sim-speed", help="simulated requests per wall second; 1M-request run")
    bs.add_argument("--json", metavar="FILE")
    bs.add_argument("--skip-million", action="store_true", dest="skip_million")
    bs.add_argument("--million-requests", type=int, default=1_000_000, dest="million_requests")
    bs.set_defaults(func=cmd_bench_sim_speed)

    from kvroute.bench.plan import add_parser as add_bench_plan

    add_bench_plan(bench)

    from kvroute.bench.auto import add_parser as add_bench_auto

    add_bench_auto(bench)

    sv = sub.add_parser("serve", help="run the gateway (no --config: an embedded emulated deployment)")
    sv.add_argument("--config", help="gateway YAML (replicas, policy, probes, queue, timeouts)")
    sv.add_argument("--host")
    sv.add_argument("--port", type=_port)
    sv.add_argument("--replicas", type=int, default=4, help="emulated replicas when no --config")
    sv.add_argument("--policy", help="policy preset when no --config (default: auto)")
    sv.add_argument("--log-level", default="INFO", dest="log_level", type=str.upper,
                    choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sv.set_defaults(func=cmd_serve)

    epp = sub.add_parser("epp", help="endpoint picker for a Gateway API InferencePool (Envoy ext_proc over gRPC)")
    epp.add_argument("--config", required=True, help="gateway.yaml: policy, replicas and/or discovery")
    epp.add_argument("--grpc-port", type=_port, default=9002, dest="grpc_port",
                     help="ext_proc gRPC port (the inference extension's default 9002)")
    epp.add_argument("--health-port", type=_port, default=9003, dest="health_port",
                     help="a second gRPC port for health only (default 9003; health is also on the ext_proc port)")
    epp.add_argument("--http-port", type=_port, default=None, dest="http_port",
                     help="HTTP port for /metrics, /livez, /readyz and the admin API (default: the config's port)")
    epp.add_argument("--fallbacks", type=int, default=2, choices=range(0, 8), metavar="0-7",
                     help="fallback endpoints listed after the chosen one, for the gateway's retries")
    epp.add_argument("--log-level", default="INFO", dest="log_level", type=str.upper,
                     choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    epp.set_defaults(func=cmd_epp)

    em = sub.add_parser("emulate", help="an engine replica emulated in real time behind the OpenAI API")
    em.add_argument("--host", default="127.0.0.1")
    em.add_argument("--port", type=_port, default=8001)
    em.add_argument("--profile", default="h100-llama3.2-3b")
    em.add_argument("--engine", choices=["vllm", "sglang", "llamacpp"], default="vllm")
    em.add_argument("--model", default="emulated")
    em.add_argument("--fail-rate", type=float, default=0.0, dest="fail_rate", help="fraction answered 500")
    em.add_argument("--hang", action="store_true", help="accept requests and never answer")
    em.add_argument("--close-after-tokens", type=int, dest="close_after_tokens",
                    help="drop streams after this many tokens")
    em.add_argument("--slowdown", type=float, default=1.0, help="model time runs this many times slower")
    em.add_argument("--close-after-stream", action="store_true", dest="close_after_stream",
                    help="close the connection after every stream while advertising Keep-Alive (llama-server)")
    em.add_argument("--ignore-disconnect", action="store_true", dest="ignore_disconnect",
                    help="non-stream requests run to the end after the client left (llama-server)")
    em.add_argument("--bytes-per-token", type=float, default=4.0, dest="bytes_per_token",
                    help="the emulated tokenizer's UTF-8 bytes per prompt token (0.5-16; kvroute estimates 4)")
    em.add_argument("--pd-role", choices=["mixed", "prefill", "decode"], default="mixed", dest="pd_role",
                    help="prefill/decode disaggregation: the engine's role (SGLang's --disaggregation-mode; vLLM "
                    "engines read it from kv_transfer_params)")
    em.add_argument("--bootstrap-port", type=_port, dest="bootstrap_port",
                    help="SGLang prefill engines: serve the KV bootstrap on this port too (SGLang's default 8998)")
    em.add_argument("--kv-link-gb-s", type=float, default=25.0, dest="kv_link_gb_s",
                    help="simulated KV-transfer link, GB/s (decode engines)")
    em.add_argument("--empty-text", type=float, default=0.0, dest="empty_text", metavar="SHARE",
                    help="share of stream events sent with empty text, their text coming with a later event, "
                         "and chat's role in an event of its own (vLLM's detokenizer; 0-1, default 0)")
    em.add_argument("--max-model-len", type=_positive_int, dest="max_model_len", metavar="N",
                    help="context limit in tokens: listed in /v1/models, longer requests refused 400 (vLLM)")
    em.add_argument("--block-tokens", type=_positive_int, default=64, dest="block_tokens",
                    help="tokens per KV-cache block (the gateway's block_tokens must match for KV events)")
    em.add_argument("--kv-events", dest="kv_events", metavar="ENDPOINT",
                    help="publish KV-cache events as vLLM does, e.g. tcp://*:5557 (binds with a *, else connects)")
    em.add_argument("--kv-events-replay", dest="kv_events_replay", metavar="ENDPOINT",
                    help="the replay ROUTER endpoint, e.g. tcp://*:5558")
    em.add_argument("--kv-events-topic", dest="kv_events_topic", default="", help="the events' topic frame")
    em.add_argument("--kv-events-format", dest="kv_events_format", choices=["map", "array"], default="map",
                    help="events as maps with a type key (vLLM >= 0.26) or positional arrays (legacy)")
    em.add_argument("--kv-events-hash", dest="kv_events_hash", choices=["int", "bytes"], default="int",
                    help="block hashes as 64-bit ints (vLLM's default) or 32-byte digests")
    em.set_defaults(func=cmd_emulate)

    bg = bench.add_parser("gateway", help="gateway vs direct throughput and added latency")
    bg.add_argument("--json", metavar="FILE")
    bg.add_argument("--requests", type=int, default=20000)
    bg.add_argument("--concurrency", type=int, default=32)
    bg.add_argument("--repeats", type=int, default=3)
    bg.add_argument("--presets", default="round_robin,sglang_cache_aware,skywalker,lmetric")
    bg.add_argument("--upstream-delay-ms", type=float, default=0.0,
                    help="upstream wait before answering (an engine's TTFT); default 0")
    bg.add_argument("--baseline-src", metavar="DIR",
                    help="also measure a gateway imported from this source tree (e.g. a git worktree's src/ of "
                         "an older commit), interleaved in the same run")
    bg.set_defaults(func=cmd_bench_gateway)

    bh = bench.add_parser("hostile", help="what hostile clients cost the gateway, beside uvicorn and aiohttp")
    bh.add_argument("--json", metavar="FILE")
    from kvroute.bench.hostile import ATTACKS  # no I/O: a table of names and coroutines

    bh.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated; default: all of " +
                    ", ".join(ATTACKS))
    bh.add_argument("--baseline-src", metavar="DIR", help="also attack a gateway imported from this source tree")
    bh.add_argument("--no-references", action="store_true", help="skip uvicorn and aiohttp")
    bh.add_argument("--check", action="store_true", help="exit 1 when the gateway misses one of the bounds")
    bh.set_defaults(func=cmd_bench_hostile)
    bp = bench.add_parser("pd", help="aggregated vs disaggregated vs conditional prefill/decode, simulated")
    bp.add_argument("--profile", default="h100-llama3.2-3b", help="hardware profile of the four engines")
    bp.add_argument("--seed", type=int, default=0)
    bp.add_argument("--threshold", type=int, default=512, help="conditional: split when the decode engine would "
                    "compute at least this many uncached tokens (llm-d's nonCachedTokens)")
    bp.add_argument("--scale", type=float, default=1.0, help="share of each run's requests (quick runs: 0.2)")
    bp.add_argument("--json")
    bp.add_argument("--md", help="also write the table to this Markdown file")
    bp.set_defaults(func=cmd_bench_pd)
    bf = bench.add_parser("fidelity", help="one workload live through the gateway and in simulate, side by side")
    bf.add_argument("--url", action="append", required=True, help="an engine's base URL (repeat for each)")
    bf.add_argument("--profile", help="the simulator's profile (from `kvroute calibrate`; default: calibrate the "
                    "engines first with --host-cores)")
    bf.add_argument("--host-cores", type=_positive_int, dest="host_cores", metavar="N",
                    help="the engines share one machine with N cores: the simulator slows a step by max(1, "
                         "engines stepping / N) (pair it with a profile from `calibrate --host-cores N`; "
                         "default: this machine's cores when no --profile is given, else unshared)")
    bf.add_argument("--policies", default="round_robin,sglang_cache_aware,lmetric,skywalker")
    bf.add_argument("--users", type=int, default=12)
    bf.add_argument("--groups", type=int, default=3, help="user groups, each sharing one system prompt")
    bf.add_argument("--system-tokens", type=int, default=1500, dest="system_tokens")
    bf.add_argument("--min-turns", type=int, default=4, dest="min_turns")
    bf.add_argument("--max-turns", type=int, default=6, dest="max_turns")
    bf.add_argument("--max-tokens", type=int, default=16, dest="max_tokens")
    bf.add_argument("--seed", type=int, default=0, help="repeat i uses seed S + i, live and simulated alike")
    bf.add_argument("--repeats", type=_positive_int, default=3, metavar="N",
                    help="run every policy N times live (interleaved) and in simulate; report medians, min-max "
                         "and pooled TTFT p99 (default 3)")
    bf.add_argument("--json", metavar="FILE")
    bf.set_defaults(func=cmd_bench_fidelity)
    from kvroute.fleet import command as fleet_command  # several instances per region (kvroute/fleet)

    fleet_command.register(bench)
    rp = sub.add_parser("reproduce", help="a paper's claims beside kvroute's simulated numbers")
    rp.add_argument("paper", choices=["skywalker", "gorgo-v1", "gorgo-v2", "lmetric", "cascadeinfer"])
    rp.add_argument("--quick", action="store_true", help="fewer requests per run (≤ 3 minutes per paper)")
    rp.add_argument("--json", metavar="FILE")
    rp.add_argument("--md", metavar="FILE", help="write the table as Markdown")
    add_parallel(rp)
    rp.set_defaults(func=cmd_reproduce)

    ca = sub.add_parser("calibrate", help="measure live engines together and fit a hardware profile for simulate")
    ca.add_argument("--url", action="append", required=True, help="an engine's base URL (repeat for each)")
    ca.add_argument("--out", required=True, help="the profile YAML to write (use it as --profile PATH)")
    ca.add_argument("--model", help="model name in requests (default: the first engine's first /v1/models id)")
    ca.add_argument("--name", default="calibrated", help="the profile's name")
    ca.add_argument("--hardware", help="what the engines run on, for the profile's record")
    ca.add_argument("--prefill-lengths", type=_int_list, default=(128, 512, 1024, 2048), dest="prefill_lengths",
                    metavar="N,N,...", help="prompt lengths in tokens (default 128,512,1024,2048)")
    ca.add_argument("--batch-sizes", type=_int_list, default=(1, 2, 4), dest="batch_sizes", metavar="N,N,...",
                    help="decode batch sizes per engine (default 1,2,4)")
    ca.add_argument("--contexts", type=_int_list, default=(128, 1024), metavar="N,N,...",
                    help="decode context lengths in tokens (default 128,1024)")
    ca.add_argument("--decode-tokens", type=int, default=24, dest="decode_tokens",
                    help="tokens generated per decode measurement (default 24)")
    ca.add_argument("--repeats", type=int, default=2, help="repeats of each prefill length (default 2)")
    ca.add_argument("--max-batched-tokens", type=int, dest="max_batched_tokens",
                    help="the engines' per-step token budget (default: llama-server's 2048, else 8192)")
    ca.add_argument("--kv-tokens", type=int, dest="kv_tokens", help="KV capacity per engine (default: from the engine)")
    ca.add_argument("--max-running", type=int, dest="max_running",
                    help="concurrent sequences per engine (default: llama-server's slots, else 256)")
    ca.add_argument("--timeout", type=float, default=120.0, help="seconds allowed for any one request")
    ca.add_argument("--host-cores", type=_positive_int, dest="host_cores", metavar="N",
                    help="the engines all run on one machine with N cores: divide every time by "
                         "max(1, engines / N), the sharing simulate adds back with `host_cores`")
    ca.set_defaults(func=cmd_calibrate)

    cr = sub.add_parser("config-reference",
                        help="every gateway and scenario config key as Markdown tables (type, default, meaning)")
    cr.add_argument("--write", nargs="?", const="", metavar="FILE",
                    help="rewrite the generated section of FILE (default: docs/configuration.md of this checkout)")
    cr.add_argument("--check", nargs="?", const="", metavar="FILE",
                    help="exit 1 when FILE's generated section differs from the models")
    cr.set_defaults(func=cmd_config_reference)

    ct = sub.add_parser("controller", help="probe gateways and replicas, fail over gateways, answer /resolve")
    ct.add_argument("--config", required=True, help="deployment YAML (regions, gateways, replicas)")
    ct.add_argument("--host")
    ct.add_argument("--port", type=_port)
    ct.add_argument("--log-level", default="INFO", dest="log_level", type=str.upper,
                    choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    ct.set_defaults(func=cmd_controller)

    from kvroute.live.command import add_parser as add_live

    add_live(sub)

    from kvroute.plan.command import add_parser as add_plan

    add_plan(sub)

    demo = sub.add_parser("demo", help="the main job: walk-through, benchmark, simulation, gateway")
    demo.add_argument("--out", default="out", help="folder for JSON results and plots")
    demo.add_argument("--decisions", type=int, default=500)
    demo.add_argument("--sim-requests", type=int, default=3000, dest="sim_requests")
    demo.add_argument("--live-policies", default="round_robin,sglang_cache_aware,skywalker,lmetric",
                      dest="live_policies")
    demo.add_argument("--live-seconds", type=float, default=10.0, dest="live_seconds",
                      help="time limit per policy for the live run")
    demo.add_argument("--live-requests", type=int, default=400, dest="live_requests")
    demo.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse ``argv``, run the command and return its exit code (2 for bad input, 130 on Ctrl-C),
    never a traceback for user errors."""
    args = build_parser().parse_args(argv)
    bad_output = _check_outputs(args)
    if bad_output is not None:
        return bad_output
    from kvroute.errors import KvrouteError, exit_code
    from kvroute.policyfiles import load_entry_points

    try:
        load_entry_points()  # presets and plugins shipped outside kvroute, before any config names them
        return args.func(args)
    except KvrouteError as exc:  # whatever a command did not catch itself: one line, never a traceback
        return error(str(exc), exit_code(exc))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader left (`kvroute policies --json | head`): nothing more to say to anyone. Point
        # stdout at /dev/null so the interpreter's final flush does not raise again.
        import os

        with contextlib.suppress(OSError, ValueError):  # stdout without a file descriptor: nothing to do
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ModuleNotFoundError as exc:
        if exc.name not in ("numpy", "matplotlib"):
            raise
        return error(f"this command needs the simulator's extra ({exc.name} is not installed): "
                     "pip install 'kvroute[sim]'")


if __name__ == "__main__":
    sys.exit(main())
