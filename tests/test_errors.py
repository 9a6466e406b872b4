"""One error tree (issue 18): every exception class kvroute defines derives from KvrouteError, and
the command line turns any of them into one line with the right exit code."""

import importlib
import inspect
import pkgutil

import pytest

import kvroute
from kvroute import cli
from kvroute.commands import policies
from kvroute.errors import ClientError, ConfigError, KvrouteError, ServiceError, exit_code


def _modules():
    for info in pkgutil.walk_packages(kvroute.__path__, "kvroute."):
        if info.name.endswith("__main__"):
            continue
        yield importlib.import_module(info.name)


def test_every_exception_kvroute_defines_is_in_the_tree():
    stray = []
    for mod in _modules():
        for name, obj in vars(mod).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == mod.__name__
                    and not issubclass(obj, KvrouteError)):
                stray.append(f"{mod.__name__}.{name}")
    assert stray == []


def test_no_error_class_shadows_a_builtin():
    import builtins

    clash = [f"{mod.__name__}.{name}" for mod in _modules() for name, obj in vars(mod).items()
             if inspect.isclass(obj) and obj.__module__ == mod.__name__ and hasattr(builtins, name)]
    assert clash == []


@pytest.mark.parametrize(("exc", "code"), [(ConfigError("x"), 2), (ClientError("x"), 2), (ServiceError("x"), 1)])
def test_exit_code_by_branch(exc, code):
    assert exit_code(exc) == code


def test_cli_main_reports_an_uncaught_service_error_in_one_line(monkeypatch, capsys):
    def boom(args):
        raise ServiceError("engine at 127.0.0.1:1 refused")

    monkeypatch.setattr(policies, "cmd_policies", boom)  # what a command raises and does not catch itself
    assert cli.main(["policies"]) == 1
    err = capsys.readouterr().err
    assert "engine at 127.0.0.1:1 refused" in err and "Traceback" not in err


def test_gateway_logs_follow_stderr_after_the_stream_they_started_on_closed(monkeypatch, capsys):
    """Logging configured while stderr was a stream that closed since (a test's capture) writes to
    the stderr of now, instead of a '--- Logging error ---' report per line."""
    import io
    import logging
    import sys

    from kvroute.gateway.logs import configure_logging

    early = io.StringIO()
    monkeypatch.setattr(sys, "stderr", early)
    configure_logging("INFO")
    monkeypatch.undo()
    early.close()
    logging.getLogger("kvroute.test").info("a line after the first stream closed")
    err = capsys.readouterr().err
    assert "a line after the first stream closed" in err and "Logging error" not in err
