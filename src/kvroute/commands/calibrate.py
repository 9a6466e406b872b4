"""`kvroute calibrate`: measure live engines and fit a hardware profile."""

from __future__ import annotations

import argparse

from rich.table import Table

from kvroute.argtypes import non_negative_int, positive_float, positive_int
from kvroute.commands.common import (
    int_list,
    unwritable,
)
from kvroute.report import console, err, error


def cmd_calibrate(args: argparse.Namespace) -> int:
    """`kvroute calibrate`: measure running engines (prefill lengths, batch sizes, contexts), fit a hardware
    profile's step-time constants and write it with the fit's error per point."""
    from kvroute.calibrate import CalibrationError, Sweep, fit_profile, measure, write_profile

    why = unwritable(args.out, False)
    if why:
        return error(f"--out {args.out}: cannot write there: {why}")
    sweep = Sweep(args.prefill_lengths, args.batch_sizes, args.contexts, args.decode_tokens, args.repeats,
                  args.timeout, warm_contexts=args.warm_contexts, warm_lengths=args.warm_lengths,
                  noise_probes=args.noise_probes,
                  # engines sharing cores: how a step started beside busy ones runs (calibrate/newcomer_probe.py)
                  newcomer_rounds=2 if args.host_cores else 0,
                  mixed_rounds=3,  # two prompts in one step against one: h_cv (calibrate/mixed_probe.py)
                  max_repeats=max(args.repeats, args.max_repeats))  # check and repeat (calibrate/repeat_check.py)
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
        what = (f"prefill {pt['prefill']}" + (f" after {pt['cached']}" if "cached" in pt else "")
                if "prefill" in pt else f"decode x{pt['decode']} @ {pt['ctx']}")
        measured = pt.get("ttft_s", pt.get("expect_s"))
        table.add_row(what, f"{measured * 1000:.2f} ms", f"{pt['fit_s'] * 1000:.2f} ms", f"{pt['error']:+.1%}")
    console.print(table)
    fields = ("c0_s", "c_prefill_s", "c_decode_s", "c_attn_s", "c_prefill_attn_s", "ttft_overhead_s")
    console.print(", ".join(f"{f} {getattr(profile, f):.3g}" for f in fields))
    noise = report["noise"]
    console.print(f"engine noise: step log-sigma {noise['step_sigma']:.3f} ({noise['step_points']} prefill repeats), "
                  f"extra per-request delay mean {noise['api_delay_s'] * 1000:.2f} ms ({noise['probes']} probes)")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the command."""
    ca = sub.add_parser("calibrate", help="measure live engines together and fit a hardware profile for simulate")
    ca.add_argument("--url", action="append", required=True, help="an engine's base URL (repeat for each)")
    ca.add_argument("--out", required=True, help="the profile YAML to write (use it as --profile PATH)")
    ca.add_argument("--model", help="model name in requests (default: the first engine's first /v1/models id)")
    ca.add_argument("--name", default="calibrated", help="the profile's name")
    ca.add_argument("--hardware", help="what the engines run on, for the profile's record")
    ca.add_argument("--prefill-lengths", type=int_list, default=(128, 512, 1024, 2048), dest="prefill_lengths",
                    metavar="N,N,...", help="prompt lengths in tokens (default 128,512,1024,2048)")
    ca.add_argument("--batch-sizes", type=int_list, default=(1, 2, 4), dest="batch_sizes", metavar="N,N,...",
                    help="decode batch sizes per engine (default 1,2,4)")
    ca.add_argument("--contexts", type=int_list, default=(128, 1024), metavar="N,N,...",
                    help="decode context lengths in tokens (default 128,1024)")
    ca.add_argument("--decode-tokens", type=positive_int, default=24, dest="decode_tokens",
                    help="tokens generated per decode measurement (default 24)")
    ca.add_argument("--repeats", type=positive_int, default=3,
                    help="repeats of the prefill, warm prefill and decode points (default 3)")
    ca.add_argument("--max-repeats", type=positive_int, default=5, dest="max_repeats", metavar="N",
                    help="more repeats, up to N, while leaving one out moves a kind of point by over 5 %% (default 5; "
                         "--max-repeats 1: exactly --repeats)")
    ca.add_argument("--warm-contexts", type=int_list, default=(512, 1536), dest="warm_contexts", metavar="N,N,...",
                    help="warm prefills: cached prompt lengths in tokens (default 512,1536)")
    ca.add_argument("--warm-lengths", type=int_list, default=(96, 256), dest="warm_lengths", metavar="N,N,...",
                    help="warm prefills: new tokens after the cached prompt (default 96,256: past llama.cpp's 64-row "
                         "attention tile)")
    ca.add_argument("--noise-probes", type=non_negative_int, default=8, dest="noise_probes", metavar="N",
                    help="rounds of a tiny prompt on every engine, for the per-request delay's spread (default 8)")
    ca.add_argument("--max-batched-tokens", type=positive_int, dest="max_batched_tokens",
                    help="the engines' per-step token budget (default: llama-server's 2048, else 8192, vLLM's "
                         "API server on an H100/H200; vLLM takes 2048 on CPU, an A100 or a GPU under 70 GiB, "
                         "16384 from 160 GiB: give it here)")
    ca.add_argument("--kv-tokens", type=positive_int, dest="kv_tokens",
                    help="KV capacity per engine (default: from the engine)")
    ca.add_argument("--max-running", type=positive_int, dest="max_running",
                    help="concurrent sequences per engine (default: llama-server's slots, else 256)")
    ca.add_argument("--timeout", type=positive_float, default=120.0, help="seconds allowed for any one request")
    ca.add_argument("--host-cores", type=positive_int, dest="host_cores", metavar="N",
                    help="the engines all run on one machine with N cores: divide every time by "
                         "max(1, engines / N), the sharing simulate adds back with `host_cores`")
    ca.set_defaults(func=cmd_calibrate)
