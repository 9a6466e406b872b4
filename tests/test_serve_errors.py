"""`kvroute serve` / `emulate` mistakes end in one line naming the input, exit code 2."""

import socket

import pytest

from kvroute.cli import main


@pytest.mark.parametrize("argv, says", [
    (["serve", "--port", "99999"], "99999 is not a port"),
    (["serve", "--port", "http"], "'http' is not a port number"),
    (["serve", "--log-level", "LOUD"], "invalid choice: 'LOUD'"),
    (["emulate", "--port", "-1"], "-1 is not a port"),
])
def test_bad_arguments_exit_2_naming_them(argv, says, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and says in capsys.readouterr().err


def test_a_busy_port_is_one_line_and_exit_2(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["emulate", "--port", str(port)]) == 2
        assert main(["serve", "--replicas", "1", "--port", str(port)]) == 2
    out = capsys.readouterr().err
    assert out.count(f"cannot listen on 127.0.0.1:{port}") == 2 and "Traceback" not in out


def test_a_config_without_replicas_refuses_to_start(tmp_path, capsys):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("port: 0\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    assert "lists no replicas" in capsys.readouterr().err
