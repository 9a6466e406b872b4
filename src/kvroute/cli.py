"""`kvroute` command line: parse, run the command (kvroute/commands/), turn errors into one line."""

from __future__ import annotations

import contextlib
import sys

from kvroute.report import error


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse ``argv``, run the command and return its exit code (2 for bad input, 130 on Ctrl-C),
    never a traceback for user errors."""
    from kvroute.commands import build_parser
    from kvroute.commands.common import check_outputs

    args = build_parser().parse_args(argv)
    bad_output = check_outputs(args)
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
