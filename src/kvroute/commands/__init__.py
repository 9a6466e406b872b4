"""The `kvroute` commands, one module each; :func:`build_parser` registers them in help order.

A command module has ``add_parser(sub)``, which adds its parser (and its subcommands) with
``set_defaults(func=...)``; the function takes the parsed arguments and returns the exit code.
Commands are the top layer: they may import every other package, nothing imports them but
``kvroute.cli``.
"""

from __future__ import annotations

import argparse

from kvroute import __version__


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of every kvroute command and its options."""
    from kvroute.commands import (
        bench,
        calibrate,
        config_reference,
        controller,
        demo,
        emulate,
        epp,
        live,
        policies,
        reproduce,
        serve,
        simulate,
    )
    from kvroute.plan.command import add_parser as add_plan

    p = argparse.ArgumentParser(prog="kvroute", description="KV-cache-aware load balancer for LLM inference")
    p.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for module in (policies, bench, simulate, serve, epp, emulate, reproduce, calibrate, config_reference,
                   controller, live):
        module.add_parser(sub)
    add_plan(sub)
    demo.add_parser(sub)
    return p
