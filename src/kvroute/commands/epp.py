"""`kvroute epp`: the endpoint picker for a Gateway API InferencePool."""

from __future__ import annotations

import argparse

from kvroute.commands.common import (
    listen,
    port,
)
from kvroute.report import err, error


def cmd_epp(args: argparse.Namespace) -> int:
    """`kvroute epp`: the Gateway API inference extension's endpoint picker (Envoy ext_proc) over the
    gateway's Router, probes and discovery, until SIGTERM."""
    from kvroute import yamlconf
    from kvroute.gateway.config import load_config
    from kvroute.gateway.logs import configure_logging

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
    return listen(main(), f"{config.host}:{args.grpc_port}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the command."""
    epp = sub.add_parser("epp", help="endpoint picker for a Gateway API InferencePool (Envoy ext_proc over gRPC)")
    epp.add_argument("--config", required=True, help="gateway.yaml: policy, replicas and/or discovery")
    epp.add_argument("--grpc-port", type=port, default=9002, dest="grpc_port",
                     help="ext_proc gRPC port (the inference extension's default 9002)")
    epp.add_argument("--health-port", type=port, default=9003, dest="health_port",
                     help="a second gRPC port for health only (default 9003; health is also on the ext_proc port)")
    epp.add_argument("--http-port", type=port, default=None, dest="http_port",
                     help="HTTP port for /metrics, /livez, /readyz and the admin API (default: the config's port)")
    epp.add_argument("--fallbacks", type=int, default=2, choices=range(0, 8), metavar="0-7",
                     help="fallback endpoints listed after the chosen one, for the gateway's retries")
    epp.add_argument("--log-level", default="INFO", dest="log_level", type=str.upper,
                     choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    epp.set_defaults(func=cmd_epp)
