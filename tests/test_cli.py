"""The `kazeia` command, run in-process and once as a real console script."""

import hashlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf

from kazeia import Engine
from kazeia.audio import pcm16
from kazeia.cli import main


def test_say_writes_a_wav_and_reports_rtf(tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "out.wav"
    code = main(
        [
            "say",
            "Bonjour Kazeia.",
            "--model",
            str(tiny_checkpoints["0.6B-custom"]),
            "--voice",
            "serena",
            "--language",
            "french",
            "-o",
            str(out),
            "--seed",
            "3",
            "--max-new-tokens",
            "8",
        ]
    )
    assert code == 0
    audio, sr = sf.read(out, dtype="float32")
    assert sr == 24000 and len(audio) % 1920 == 0 and 1920 <= len(audio) <= 7 * 1920
    err = capsys.readouterr().err
    assert "RTF" in err and "seed 3" in err and " frames, 1 segment) in " in err
    # The file holds the engine's audio (16-bit PCM).
    expected = (
        Engine.load(tiny_checkpoints["0.6B-custom"])
        .synthesize("Bonjour Kazeia.", voice="serena", language="french", seed=3, max_new_tokens=8)
        .audio
    )
    assert np.max(np.abs(audio - expected)) < 1 / 16000


def test_greedy_flag_and_sampling_flags(tiny_checkpoints, tmp_path):
    model = str(tiny_checkpoints["1.7B-design"])
    a, b = tmp_path / "a.wav", tmp_path / "b.wav"
    args = ["say", "Hi.", "--model", model, "--instruct", "Calm voice.", "--greedy", "--max-new-tokens", "6"]
    assert main(args + ["-o", str(a), "--seed", "1"]) == 0
    assert main(args + ["-o", str(b), "--seed", "2"]) == 0
    assert a.read_bytes() == b.read_bytes()  # greedy: the seed does not matter


def test_voices(tiny_checkpoints, capsys):
    assert main(["voices", "--model", str(tiny_checkpoints["0.6B-custom"])]) == 0
    out = capsys.readouterr().out
    assert "serena" in out and "languages: auto" in out


def test_bad_input_exits_2_with_one_line(tiny_checkpoints, tmp_path, capsys):
    model = str(tiny_checkpoints["0.6B-custom"])
    cases = [
        ["say", "Hi.", "--model", model, "--voice", "nobody", "-o", str(tmp_path / "x.wav")],
        ["say", " ", "--model", model, "--voice", "serena", "-o", str(tmp_path / "x.wav")],
        ["say", "Hi.", "--model", model, "--voice", "serena", "--temperature", "-1"],
        ["say", "Hi.", "--model", str(tmp_path / "missing"), "--voice", "serena"],
        [
            "say",
            "Hi.",
            "--model",
            model,
            "--voice",
            "serena",
            "-o",
            str(tmp_path / "no" / "dir" / "x.wav"),
            "--max-new-tokens",
            "3",
        ],
    ]
    for argv in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("kazeia: error: ") and err.count("\n") == 1, err
    # The chunk schedule is a stream's: given without --stream it is refused, not ignored; a bad
    # one is refused before the model loads (the model path does not exist).
    say = ["say", "Hi.", "--model", model, "--voice", "serena", "-o", str(tmp_path / "x.wav")]
    for argv, words in (
        (say + ["--chunk-frames", "3"], "--chunk-frames applies with --stream only"),
        (say + ["--text-timeout", "3"], "--text-timeout applies with --stream only"),
        (say[:3] + [str(tmp_path / "missing")] + say[4:] + ["--stream", "--chunk-frames", "0"], "chunk_frames must be"),
        (say + ["--stream", "--chunk-frames", "4", "--max-chunk-frames", "2"], "max_chunk_frames must be"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("kazeia: error: ") and words in err and err.count("\n") == 1, err
    assert not (tmp_path / "x.wav").exists()


def test_random_checkpoint_and_console_script(tmp_path):
    exe = shutil.which("kazeia") or str(__import__("pathlib").Path(sys.executable).parent / "kazeia")
    ckpt = tmp_path / "demo"
    run = subprocess.run([exe, "random-checkpoint", str(ckpt)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = tmp_path / "demo.wav"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kazeia",
            "say",
            "Hello.",
            "--model",
            str(ckpt),
            "--voice",
            "ryan",
            "--max-new-tokens",
            "5",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert sf.info(out).samplerate == 24000
    run = subprocess.run([exe, "say", "Hello.", "--model", str(ckpt)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "voice is required" in run.stderr


@pytest.mark.parametrize("speed", ["1.0", "1.5"])
def test_say_gives_one_byte_stream_offline_streamed_and_in_any_chunks(tiny_checkpoints, tmp_path, speed):
    """`kazeia say` offline, `--stream`, `--stream` with odd chunk sizes and `--stream -o -`: the
    same 16-bit samples, byte for byte, and those of the engine's own synthesis."""
    model = str(tiny_checkpoints["0.6B-custom"])
    text = "Bonjour Kazeia. Je voudrais écouter les nouvelles du jour, puis la météo de demain matin."
    base = [sys.executable, "-m", "kazeia", "say", text, "--model", model, "--voice", "serena", "--language",
            "french", "--seed", "7", "--max-new-tokens", "40", "--speed", speed]  # fmt: skip
    ways = {"offline": [], "stream": ["--stream"], "odd chunks": ["--stream", "--first-chunk-frames", "1",
                                                                   "--chunk-frames", "7"]}  # fmt: skip
    got = {}
    for name, flags in ways.items():
        wav = tmp_path / f"{name}.wav"
        run = subprocess.run(base + flags + ["-o", str(wav)], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        audio, rate = sf.read(wav, dtype="int16")
        got[name] = audio.tobytes()
        assert rate == 24000
    assert "TTFB" in run.stderr and "RTF" in run.stderr
    pcm = subprocess.run(base + ["--stream", "-o", "-"], capture_output=True, timeout=300)
    assert pcm.returncode == 0, pcm.stderr
    got["stdout"] = pcm.stdout
    speech = Engine.load(model).synthesize(text, voice="serena", language="french", seed=7, max_new_tokens=40,
                                           speed=float(speed))  # fmt: skip
    got["synthesize"] = pcm16(speech.audio)
    digests = {name: hashlib.md5(data).hexdigest() for name, data in got.items()}
    assert len(set(digests.values())) == 1 and len(got["offline"]) > 0, digests


def test_stream_reads_standard_input_as_it_arrives(tiny_checkpoints, tmp_path):
    """`kazeia say --stream -`: text piped in pieces; the result equals the same text given at once."""
    model = str(tiny_checkpoints["0.6B-custom"])
    out = tmp_path / "live.wav"
    cmd = [
        sys.executable,
        "-m",
        "kazeia",
        "say",
        "-",
        "--model",
        model,
        "--voice",
        "ryan",
        "--seed",
        "9",
        "--max-new-tokens",
        "30",
        "--stream",
        "-o",
        str(out),
    ]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for piece in ["Tokens ", "arrive ", "one ", "by one."]:
        proc.stdin.write(piece)
        proc.stdin.flush()
    proc.stdin.close()
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    audio, _ = sf.read(out, dtype="int16")
    whole = Engine.load(model).stream(
        "Tokens arrive one by one.", voice="ryan", seed=9, max_new_tokens=30, non_streaming_mode=False
    )
    expected = np.concatenate([c.audio for c in whole])
    assert audio.tobytes() == np.frombuffer(pcm16(expected), "<i2").tobytes()


def test_hostile_command_lines_and_input_exit_2_before_any_work(tiny_checkpoints, tmp_path):
    """Invalid UTF-8 in argv or on standard input, numerically unsafe sampling and a port that
    cannot exist: one clear line and exit status 2, never a traceback (the port even before the
    model would load: the path does not exist)."""
    model, out = str(tiny_checkpoints["0.6B-custom"]), str(tmp_path / "x.wav")
    say = [sys.executable, "-m", "kazeia", "say", "--model", model, "--voice", "serena", "--max-new-tokens", "3"]
    cases = [
        (say + ["-o", out, b"caf\xff".decode("utf-8", "surrogateescape")], None, "not valid Unicode"),
        (say + ["-o", out, "-"], b"ok \xff then", "not valid UTF-8: byte 0xff at offset 3"),
        (say + ["--stream", "-o", out, "-"], b"ok \xe2\x82", "not valid UTF-8: byte 0xe2 at offset 3"),
        (say + ["-o", out, "--temperature", "1e-300", "Hi."], None, "temperature must be a number >= 0.001"),
        (say + ["-o", out, "--repetition-penalty", "1e-300", "Hi."], None, "repetition_penalty"),
        (say + ["-o", out, "--subtalker-temperature", "1e-300", "Hi."], None, "subtalker_temperature"),
        ([sys.executable, "-m", "kazeia", "serve", "--model", str(tmp_path / "absent"), "--port", "70000"], None,
         "a port is 1 to 65535, not 70000"),
    ]  # fmt: skip
    for argv, stdin, words in cases:
        run = subprocess.run(argv, input=stdin or b"", capture_output=True, timeout=300)
        err = run.stderr.decode("utf-8", "replace")
        assert run.returncode == 2 and words in err and "Traceback" not in err, (argv[-2:], err)


def test_say_a_text_file_with_subtitles_and_a_guard_warning(tiny_checkpoints, tmp_path, capsys):
    """A long text from a file: one WAV equal to the engine's, one subtitle per segment at its
    exact samples, and a warning since random weights leave the guard to end the segments."""
    from kazeia import LongTextOptions
    from kazeia.subtitles import srt

    text = "The first sentence is here. A second one follows it!\n\nUn autre paragraphe. 最后一句话。"
    source = tmp_path / "chapter.txt"
    source.write_text(text, encoding="utf-8")
    model, out, subtitles = str(tiny_checkpoints["0.6B-custom"]), tmp_path / "chapter.wav", tmp_path / "chapter.srt"
    long_text = ["--segment-tokens", "8", "--floor-frames", "3", "--frames-per-token", "1"]
    argv = ["say", "--text-file", str(source), "--model", model, "--voice", "ryan", "--seed", "4", "-o", str(out)]
    assert main(argv + long_text + ["--max-new-tokens", "100", "--subtitles", str(subtitles)]) == 0
    options = LongTextOptions(segment_tokens=8, floor_frames=3, frames_per_token=1)
    speech = Engine.load(model).synthesize(text, voice="ryan", seed=4, max_new_tokens=100, long_text=options)
    assert len(speech.segments) >= 3
    audio, _ = sf.read(out, dtype="float32")
    assert np.max(np.abs(audio - speech.audio)) < 1 / 16000
    assert subtitles.read_text(encoding="utf-8") == srt(speech.segments)
    err = capsys.readouterr().err
    guarded = sum(s.finish_reason == "guard" for s in speech.segments)
    assert f"runaway guard stopped {guarded} of {len(speech.segments)} segments" in err
    assert main(argv[:-1] + [str(tmp_path / "x.wav"), "--subtitles", str(tmp_path / "x.txt")]) == 2
    assert "must end in .srt or .vtt" in capsys.readouterr().err
    assert main(argv + ["Also a text."]) == 2
    assert "not both" in capsys.readouterr().err


def test_progress_bar_on_request_and_none_by_default(tiny_checkpoints, tmp_path, capsys):
    """--progress draws a bar over the segments on stderr, with the audio seconds and the RTF;
    without it (stderr is no terminal here) and with --no-progress, stderr has only the summary.
    The FLAC file, written chunk by chunk, holds the engine's audio."""
    from kazeia import LongTextOptions

    text = "The first sentence is here. A second one follows it! Un autre paragraphe. 最后一句话。"
    model, out = str(tiny_checkpoints["0.6B-custom"]), tmp_path / "bar.flac"
    argv = ["say", text, "--model", model, "--voice", "ryan", "--seed", "4", "-o", str(out), "--max-new-tokens", "100"]
    argv += ["--segment-tokens", "8", "--floor-frames", "3", "--frames-per-token", "1"]
    options = LongTextOptions(segment_tokens=8, floor_frames=3, frames_per_token=1)
    speech = Engine.load(model).synthesize(text, voice="ryan", seed=4, max_new_tokens=100, long_text=options)
    n = len(speech.segments)
    assert main(argv + ["--progress"]) == 0
    err = capsys.readouterr().err
    assert f"{n}/{n} [" in err and "segment/s" in err and f"{speech.metrics.audio_s:.1f} s audio, RTF " in err
    audio, rate = sf.read(out, dtype="float32")
    assert rate == 24000 and np.max(np.abs(audio - speech.audio)) < 1 / 16000
    for quiet in ([], ["--no-progress"]):
        assert main(argv + quiet) == 0
        err = capsys.readouterr().err
        assert "segment/s" not in err and "\r" not in err and err.startswith(f"{out}: "), err


def test_argument_errors_are_one_line_naming_the_flag(capsys):
    """A flag argparse refuses exits 2 with one line naming the flag and what it takes, not the
    whole usage; --help still prints the usage."""
    cases = [
        (["serve", "--port", "70000"], ["--port", "1 to 65535", "70000"]),
        (["say", "Hi.", "--temperature", "abc"], ["--temperature", "expects a number", "'abc'"]),
        (["wyoming", "--max-batch", "two"], ["--max-batch", "expects an integer", "'two'"]),
        (["say", "Hi.", "--dtype", "int3"], ["--dtype", "invalid choice", "int8"]),
        (["serve", "--no-such-flag"], ["unrecognized arguments: --no-such-flag"]),
    ]
    for argv, words in cases:
        with pytest.raises(SystemExit) as exit:
            main(argv)
        captured = capsys.readouterr()
        assert exit.value.code == 2 and captured.out == "", argv
        assert captured.err.startswith("kazeia: error: ") and captured.err.count("\n") == 1, captured.err
        assert all(w in captured.err for w in words), (argv, captured.err)
    with pytest.raises(SystemExit) as exit:
        main(["serve", "--help"])
    assert exit.value.code == 0 and capsys.readouterr().out.startswith("usage: kazeia serve")
