"""`kvroute emulate`: an engine replica emulated in real time."""

from __future__ import annotations

import argparse

from kvroute.argtypes import positive_int
from kvroute.commands.common import (
    listen,
    port,
)
from kvroute.report import err, error


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
        from kvroute.replicas import events_extra_installed

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

    return listen(main(), f"{args.host}:{args.port}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the command."""
    em = sub.add_parser("emulate", help="an engine replica emulated in real time behind the OpenAI API")
    em.add_argument("--host", default="127.0.0.1")
    em.add_argument("--port", type=port, default=8001)
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
    em.add_argument("--bootstrap-port", type=port, dest="bootstrap_port",
                    help="SGLang prefill engines: serve the KV bootstrap on this port too (SGLang's default 8998)")
    em.add_argument("--kv-link-gb-s", type=float, default=25.0, dest="kv_link_gb_s",
                    help="simulated KV-transfer link, GB/s (decode engines)")
    em.add_argument("--empty-text", type=float, default=0.0, dest="empty_text", metavar="SHARE",
                    help="share of stream events sent with empty text, their text coming with a later event, "
                         "and chat's role in an event of its own (vLLM's detokenizer; 0-1, default 0)")
    em.add_argument("--max-model-len", type=positive_int, dest="max_model_len", metavar="N",
                    help="context limit in tokens: listed in /v1/models, longer requests refused 400 (vLLM)")
    em.add_argument("--block-tokens", type=positive_int, default=64, dest="block_tokens",
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
