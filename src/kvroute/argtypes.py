"""argparse types shared by the commands and the benches that register their own flags.

In the base layer so that kvroute.bench (below kvroute.commands) can use them too: a count given
as 0 or a negative number is argparse's one line and exit 2, never an empty table or a traceback.
"""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: one positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive integer")
    return value
