"""The `kvroute` commands, one module each; :func:`build_parser` registers them in help order.

A command module has ``add_parser(sub)``, which adds its parser (and its subcommands) with
``set_defaults(func=...)``; the function takes the parsed arguments and returns the exit code.
Commands are the top layer: they may import every other package, nothing imports them but
``kvroute.cli``.
"""

from __future__ import annotations

import argparse

from kvroute import __version__


class _Version(argparse.Action):
    """``--version``: the version and the build that runs — pure Python or mypyc-compiled modules
    (kvroute/buildinfo.py) — worked out only when asked (it imports the compiled modules' list)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, help: str | None = None):
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        from kvroute.buildinfo import describe

        print(f"kvroute {__version__} ({describe()})")  # on stdout, like argparse's own version action
        parser.exit()


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
    p.add_argument("--version", action=_Version, help="print the version and which build runs (pure or compiled)")
    sub = p.add_subparsers(dest="command", required=True)
    for module in (policies, bench, simulate, serve, epp, emulate, reproduce, calibrate, config_reference,
                   controller, live):
        module.add_parser(sub)
    add_plan(sub)
    demo.add_parser(sub)
    return p
