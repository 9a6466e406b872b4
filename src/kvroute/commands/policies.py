"""`kvroute policies`: the presets, their parameters and plugins."""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from kvroute.report import console, err, error


def cmd_policies(args: argparse.Namespace) -> int:
    """`kvroute policies`: the presets (or with --plugins the plugins) as a table, JSON or Markdown; --write
    regenerates docs/policies.md."""
    from pathlib import Path

    from kvroute.errors import ConfigError
    from kvroute.policy.listing import describe_presets, presets_markdown
    from kvroute.policy.registry import plugin_table

    try:
        if args.write is not None:
            path = Path(args.write or Path(__file__).resolve().parents[3] / "docs" / "policies.md")
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


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the command."""
    sp = sub.add_parser("policies", help="list policy presets")
    sp.add_argument("--json", action="store_true", help="machine-readable output: params and plugins of each")
    sp.add_argument("--plugins", action="store_true", help="list the plugins presets are composed of")
    sp.add_argument("--markdown", action="store_true", help="print docs/policies.md")
    sp.add_argument("--write", nargs="?", const="", metavar="FILE",
                    help="write docs/policies.md (default: the checkout's)")
    sp.set_defaults(func=cmd_policies)
