"""tests/conftest.py's ``UNTRACED`` list (tests run without coverage's tracer): every entry names a
test function that exists, so a renamed test does not silently go back under the tracer, and the
marker really stops the tracer while such a test runs."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.conftest import UNTRACED

ROOT = Path(__file__).resolve().parent.parent


def test_every_untraced_entry_names_a_test_that_exists():
    for entry in UNTRACED:
        path, name = entry.split("::")
        tree = ast.parse((ROOT / path).read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in names, f"{entry}: no such test function"


@pytest.mark.no_cover
def test_a_no_cover_test_runs_without_a_tracer(request):
    """Under `pytest --cov` the tracer is off in a no_cover test (pytest-cov pauses it); without
    --cov there is none anyway."""
    assert sys.gettrace() is None
