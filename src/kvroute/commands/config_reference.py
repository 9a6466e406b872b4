"""`kvroute config-reference`: the generated configuration reference."""

from __future__ import annotations

import argparse

from kvroute.report import console, err, error


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


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the command."""
    cr = sub.add_parser("config-reference",
                        help="every gateway and scenario config key as Markdown tables (type, default, meaning)")
    cr.add_argument("--write", nargs="?", const="", metavar="FILE",
                    help="rewrite the generated section of FILE (default: docs/configuration.md of this checkout)")
    cr.add_argument("--check", nargs="?", const="", metavar="FILE",
                    help="exit 1 when FILE's generated section differs from the models")
    cr.set_defaults(func=cmd_config_reference)
