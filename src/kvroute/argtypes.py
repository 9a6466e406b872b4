"""argparse types shared by the commands and the benches that register their own flags.

In the base layer so that kvroute.bench (below kvroute.commands) can use them too: a count given
as 0 or a negative number is argparse's one line and exit 2, never an empty table or a traceback.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def _integer(text: str, least: int, says: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{text!r}: {says}")
    return value


def positive_int(text: str) -> int:
    """argparse type: one positive integer."""
    return _integer(text, 1, "must be a positive integer")


def non_negative_int(text: str) -> int:
    """argparse type: an integer of 0 or more (0 meaning "none", e.g. no noise probes)."""
    return _integer(text, 0, "must be 0 or a positive integer")


def odd_positive_int(text: str) -> int:
    """argparse type: an odd positive integer (a count whose median is one of its members, e.g. seeds)."""
    value = _integer(text, 1, "must be an odd positive integer")
    if value % 2 == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an odd positive integer (the median of an even "
                                         "number of verdicts is not one verdict)")
    return value


def int_at_least(least: int) -> Callable[[str], int]:
    """argparse type: an integer of ``least`` or more (a count with a floor, e.g. a plan's requests per run)."""
    def parse(text: str) -> int:
        return _integer(text, least, f"must be an integer of {least} or more")
    parse.__name__ = f"int_at_least_{least}"  # argparse names the type in its messages
    return parse


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number above 0 (seconds, rates)."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number above 0")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number of 0 or more (a delay, a tolerance)."""
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number of 0 or more")
    return value
