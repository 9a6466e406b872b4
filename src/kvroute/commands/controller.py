"""`kvroute controller`: the multi-region controller."""

from __future__ import annotations

import argparse

from kvroute.commands.common import (
    listen,
    port,
)
from kvroute.report import err, error


def cmd_controller(args: argparse.Namespace) -> int:
    """`kvroute controller`: the deployment controller (probes, /resolve, replica placement) from a deployment
    file until SIGTERM."""
    from kvroute import yamlconf
    from kvroute.controller import load_deployment, start_controller
    from kvroute.gateway.logs import configure_logging

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

    return listen(main(), f"{dep.host}:{dep.port}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the command."""
    ct = sub.add_parser("controller", help="probe gateways and replicas, fail over gateways, answer /resolve")
    ct.add_argument("--config", required=True, help="deployment YAML (regions, gateways, replicas)")
    ct.add_argument("--host")
    ct.add_argument("--port", type=port)
    ct.add_argument("--log-level", default="INFO", dest="log_level", type=str.upper,
                    choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    ct.set_defaults(func=cmd_controller)
