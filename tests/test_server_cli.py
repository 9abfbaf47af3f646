"""`kazeia serve` refusals that need no running server (the load test runs the real command)."""

import sys

import pytest

from kazeia.cli import main
from kazeia.streaming import ChunkSchedule


def test_serve_refuses_bad_limits_before_loading(tmp_path, capsys):
    missing = tmp_path / "nowhere"  # never loaded: the settings are checked first
    assert main(["serve", "--model", str(missing), "--queue-size", "0"]) == 2
    assert "queue_size must be an integer >= 1, got 0" in capsys.readouterr().err
    assert main(["serve", "--model", str(missing), "--max-new-tokens", "1"]) == 2
    assert "max_new_tokens must be >= 2" in capsys.readouterr().err
    assert main(["serve", "--model", str(missing), "--text-timeout", "0"]) == 2
    assert "text_timeout must be a number of seconds > 0, got 0.0" in capsys.readouterr().err


def test_serve_without_the_extra_says_how_to_get_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "kazeia.server", None)  # import kazeia.server -> ImportError
    assert main(["serve", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'kazeia[server]'" in err and err.startswith("kazeia: error:")


def test_a_voices_dir_that_cannot_be_made_stops_a_base_server(engines, tmp_path):
    pytest.importorskip("fastapi")
    from kazeia.server import ServerConfig, create_app

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="voices directory"):
        create_app(engines["0.6B-base"], ServerConfig("base", voices_dir=blocker / "voices"))
    create_app(engines["0.6B-custom"], ServerConfig("custom", voices_dir=blocker / "voices"))  # never used there


def test_server_config_checks_its_fields():
    pytest.importorskip("fastapi")
    from kazeia.server import Limits, ServerConfig

    with pytest.raises(ValueError, match="model_name"):
        ServerConfig(" ")
    with pytest.raises(ValueError, match="chunk_frames"):
        ServerConfig("m", chunk_frames=0)
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="max_chunk_frames"):
            ServerConfig("m", max_chunk_frames=bad)
    assert ServerConfig("m").schedule.limit(7) == 4  # the schedule's own sizes unless asked
    assert ServerConfig("m", chunk_frames=6, max_chunk_frames=3).schedule.limit(1) == 6  # raised to chunk_frames
    assert ServerConfig("m", max_chunk_frames=16).schedule.limit(0) == 1  # the first chunk never grows
    from kazeia.cli import build_parser
    from kazeia.server.commands import server_config

    for command in ("serve", "wyoming"):
        args = build_parser().parse_args([command, "--model", "m", "--max-chunk-frames", "12"])
        assert server_config(args, None).schedule == ChunkSchedule(1, 4, 12)
    assert server_config(build_parser().parse_args(["serve", "--model", "m"]), None).max_chunk_frames is None
    with pytest.raises(ValueError, match="max_input_chars"):
        Limits(max_input_chars=0)
    with pytest.raises(ValueError, match="max_temperature"):
        Limits(max_temperature=0)
    with pytest.raises(ValueError, match="max_upload_bytes"):
        Limits(max_upload_bytes=0)
    with pytest.raises(ValueError, match="max_reference_s"):
        Limits(max_reference_s=0)
    with pytest.raises(ValueError, match="text_timeout"):
        ServerConfig("m", text_timeout=float("nan"))
    for origin in ("https://app.example/", "app.example", "ftp://app.example", "https://app.example/path", ""):
        with pytest.raises(ValueError, match="scheme://host"):
            ServerConfig("m", allowed_origins=(origin,))
    assert (
        ServerConfig("m", allowed_origins=("*", "http://localhost:3000")).allowed_origins[1] == "http://localhost:3000"
    )
    with pytest.raises(ValueError, match="at least 8 characters"):
        ServerConfig("m", api_key="short")
    with pytest.raises(ValueError, match="max_connections"):
        ServerConfig("m", max_connections=0)
    with pytest.raises(ValueError, match="ws_idle_s"):
        ServerConfig("m", ws_idle_s=0)


def test_serve_checks_its_security_options_before_loading(tmp_path, capsys):
    missing = str(tmp_path / "nowhere")
    assert main(["serve", "--model", missing, "--allowed-origins", "https://a.example, https://b.example/"]) == 2
    assert "'https://b.example/' must be '*' or scheme://host[:port]" in capsys.readouterr().err
    assert main(["serve", "--model", missing, "--api-key", "1234567"]) == 2
    assert "api_key must be a string of at least 8 characters" in capsys.readouterr().err


def test_serve_takes_long_inputs_only_with_max_input_chars(engines):
    """`kazeia serve` keeps OpenAI's 4096 characters by default (a 400 naming `input`); with
    --max-input-chars 20000 a 20,000-character multilingual input is spoken, in segments, as the
    engine speaks it: its token limit follows, unless --max-input-tokens sets one apart."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from server_support import assert_pcm_equal, offline_pcm

    from kazeia.cli import build_parser
    from kazeia.server import create_app
    from kazeia.server.commands import server_config

    sentences = "A long article is read aloud in one voice. 今天天气很好，我们去公园散步吧！ Wir kaufen z. B. Brot. "
    text = (sentences * (20_000 // len(sentences) + 1))[:20_000]
    engine = engines["0.6B-custom"]
    assert len(engine.tokenizer.text_ids(text)) > 4096
    options = {"voice": "ryan", "seed": 6, "max_new_tokens": 3}
    body = {"input": text, "response_format": "pcm", **options}
    refused = {(): "characters", ("--max-input-chars", "20000", "--max-input-tokens", "4096"): "tokens"}
    for flags in [*refused, ("--max-input-chars", "20000")]:
        config = server_config(build_parser().parse_args(["serve", "--model", "tiny-custom", *flags]), None)
        with TestClient(create_app(engine, config)) as client:
            r = client.post("/v1/audio/speech", json=body)
        if flags in refused:
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == "input", r.text
            assert f"{refused[flags]} long; this server accepts at most 4096" in error["message"], error
            continue
        assert r.status_code == 200, r.text
        assert_pcm_equal(r.content, offline_pcm(engine, text, **options))
