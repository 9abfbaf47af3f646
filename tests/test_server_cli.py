"""`kazeia serve` refusals that need no running server (the load test runs the real command)."""

import sys
from types import SimpleNamespace

import pytest

from kazeia.cli import main


def test_serve_refuses_bad_limits_before_loading(tmp_path, capsys):
    missing = tmp_path / "nowhere"  # never loaded: the settings are checked first
    assert main(["serve", "--model", str(missing), "--queue-size", "0"]) == 2
    assert "queue_size must be an integer >= 1, got 0" in capsys.readouterr().err
    assert main(["serve", "--model", str(missing), "--max-new-tokens", "1"]) == 2
    assert "max_new_tokens must be >= 2" in capsys.readouterr().err


def test_serve_without_the_extra_says_how_to_get_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "kazeia.server", None)  # import kazeia.server -> ImportError
    assert main(["serve", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'kazeia[server]'" in err and err.startswith("kazeia: error:")


def test_base_checkpoints_are_refused_with_a_reason():
    pytest.importorskip("fastapi")
    from kazeia.server import ServerConfig, create_app

    with pytest.raises(ValueError, match="Base .* saved voices"):
        create_app(SimpleNamespace(model_type="base"), ServerConfig("base"))


def test_server_config_checks_its_fields():
    pytest.importorskip("fastapi")
    from kazeia.server import Limits, ServerConfig

    with pytest.raises(ValueError, match="model_name"):
        ServerConfig(" ")
    with pytest.raises(ValueError, match="chunk_frames"):
        ServerConfig("m", chunk_frames=0)
    with pytest.raises(ValueError, match="max_input_chars"):
        Limits(max_input_chars=0)
    with pytest.raises(ValueError, match="max_temperature"):
        Limits(max_temperature=0)
