"""`kvroute serve`: the gateway (or an embedded emulated deployment)."""

from __future__ import annotations

import argparse

from kvroute.commands.common import (
    listen,
    port,
)
from kvroute.report import err, error


def cmd_serve(args: argparse.Namespace) -> int:
    """`kvroute serve`: the gateway from --config until SIGTERM; without a config, one in front of emulated
    replicas in this process."""
    from kvroute import yamlconf
    from kvroute.gateway.config import load_config
    from kvroute.gateway.logs import configure_logging
    from kvroute.gateway.server import serve

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
        return listen(main(), f"{config.host}:{config.port}")

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
    return listen(embedded(), f"{args.host or '127.0.0.1'}:{args.port if args.port is not None else 8000}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the command."""
    sv = sub.add_parser("serve", help="run the gateway (no --config: an embedded emulated deployment)")
    sv.add_argument("--config", help="gateway YAML (replicas, policy, probes, queue, timeouts)")
    sv.add_argument("--host")
    sv.add_argument("--port", type=port)
    sv.add_argument("--replicas", type=int, default=4, help="emulated replicas when no --config")
    sv.add_argument("--policy", help="policy preset when no --config (default: auto)")
    sv.add_argument("--log-level", default="INFO", dest="log_level", type=str.upper,
                    choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sv.set_defaults(func=cmd_serve)
