"""The `kazeia` command: say, voices, serve, wyoming, quantize, random-checkpoint.

Thin: parse arguments, call the engine, write files, print figures (the work of `say`, streamed to
its file with a progress bar and stopped cleanly by Ctrl-C, is in say.py). Bad input exits with
status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from .sampling import SamplingOptions
from .segment import LongTextOptions
from .server.config import Limits, ServerConfig, WyomingSettings
from .streaming import ChunkSchedule

DEFAULT_MODEL = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"


def _model_args(p: argparse.ArgumentParser) -> None:
    from .checkpoint import DTYPES
    from .text import SPLIT_REGEXES

    p.add_argument(
        "--model",
        default=os.environ.get("KAZEIA_MODEL", DEFAULT_MODEL),
        help="checkpoint directory or hub id (default: $KAZEIA_MODEL or %(default)s)",
    )
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        help="talker and code-predictor weight precision (default: a prepared checkpoint's own, else float32)",
    )
    p.add_argument("--offline", action="store_true", help="use only the local hub cache for hub ids")
    p.add_argument("--threads", type=int, help="CPU threads for torch's kernels (default: one per core)")
    p.add_argument(
        "--tokenizer-regex",
        default="qwen2",
        choices=list(SPLIT_REGEXES),
        help="text split regex (default: %(default)s; see docs)",
    )


def _option_flags(group, options, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of an options dataclass but `skip` (--top-k for top_k; a switch gets
    --x/--no-x), with its description; unset flags leave the default."""
    for name, (kind, help) in options.describe().items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help)
        else:
            group.add_argument(flag, type=kind, help=help)


def _sampling_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    g = p.add_argument_group("sampling (defaults from the checkpoint's generation_config.json)")
    _option_flags(g, SamplingOptions, skip)
    g.add_argument("--greedy", action="store_true", help="shorthand for --no-do-sample --no-subtalker-dosample")


def _long_text_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("long text (segments, runaway guard, subtitles)")
    _option_flags(g, LongTextOptions)
    g.add_argument("--subtitles", help="also write the segments' timestamps as subtitles: a .srt or .vtt file")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kazeia", description="Qwen3-TTS speech synthesis.")
    sub = parser.add_subparsers(dest="command", required=True)

    say = sub.add_parser("say", help="synthesize text to an audio file")
    say.add_argument("text", nargs="?", help="the text to speak; - reads standard input (with --stream: as it arrives)")
    say.add_argument("--text-file", help="read the text to speak from this UTF-8 file (- for standard input)")
    _model_args(say)
    say.add_argument(
        "--voice",
        help="preset speaker (CustomVoice; see `kazeia voices`) or a voice file (Base: `kazeia voices create`)",
    )
    say.add_argument("--language", help="language name or auto (default: auto)")
    say.add_argument("--instruct", help="style instruction (1.7B CustomVoice) or voice description (VoiceDesign)")
    say.add_argument("--seed", type=int, help="sampling seed (same seed, same audio)")
    _speed_arg(say)
    say.add_argument(
        "--non-streaming-mode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="text layout: all text in the prompt (default for CustomVoice/VoiceDesign)",
    )
    say.add_argument(
        "-o",
        "--output",
        default="out.wav",
        help="audio file, written as it is generated, in the format of its extension (.wav, .flac, .mp3, "
        ".ogg); - writes raw 16-bit PCM to standard output (default: %(default)s)",
    )
    say.add_argument(
        "--stream",
        action="store_true",
        help="the first audio as soon as possible: standard input (-) read as it arrives, chunks of "
        "--first-chunk-frames then --chunk-frames",
    )
    say.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a progress bar on stderr: segments, seconds of audio, ETA and RTF (default: when stderr is a terminal)",
    )
    _chunk_args(say, ChunkSchedule.first, ChunkSchedule.rest)
    _long_text_args(say)
    _sampling_args(say)

    voices = sub.add_parser(
        "voices", help="list the voices and languages of a checkpoint, or clone a voice (Base checkpoints)"
    )
    voices.add_argument("action", nargs="?", default="list", choices=["list", "create"], help="(default: list)")
    _model_args(voices)
    clone = voices.add_argument_group("create: clone the voice of reference audio into a voice file")
    clone.add_argument("--audio", help="reference audio: WAV/FLAC/OGG/MP3, 3-10 s of one speaker")
    clone.add_argument("--text", help="transcript of the reference audio (ICL mode, the closest likeness)")
    clone.add_argument("--x-vector-only", action="store_true", help="use only the speaker embedding (no --text)")
    clone.add_argument("-o", "--output", help="voice file to write, e.g. me.voice")

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP/WebSocket API and the demo page")
    _model_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    srv.add_argument("--port", type=_port, default=8000, help="port to listen on (default: %(default)s)")
    srv.add_argument(
        "--api-key",
        default=os.environ.get("KAZEIA_API_KEY"),
        help="require Authorization: Bearer KEY on every request but the demo page and /health "
        "(default: $KAZEIA_API_KEY, else none)",
    )
    srv.add_argument(
        "--allowed-origin",
        "--allowed-origins",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="web page origins (https://app.example) that may call the server, with CORS; repeatable or "
        "comma-separated",
    )
    srv.add_argument(
        "--model-alias",
        action="append",
        default=[],
        metavar="NAME",
        help="another model id to answer to, besides tts-1, tts-1-hd and gpt-4o-mini-tts; repeatable",
    )
    srv.add_argument("--served-model-name", help="the model id clients send (default: hub id or directory name)")
    _server_args(srv, websocket=True)

    wyo = sub.add_parser(
        "wyoming", help="serve the Wyoming protocol for Home Assistant, speaking streamed text as it arrives"
    )
    _model_args(wyo)
    wyo.add_argument(
        "--uri",
        default="tcp://127.0.0.1:10200",
        help="where to listen: tcp://HOST:PORT or unix://PATH (default: %(default)s; tcp://0.0.0.0:10200 for the LAN)",
    )
    wyo.add_argument("--voice", help="voice when a request names none (default: the first one listed)")
    wyo.add_argument("--language", help="language (name or code) when a request names none (default: auto)")
    wyo.add_argument("--instruct", help="style instruction (1.7B CustomVoice) or voice description (VoiceDesign)")
    wyo.add_argument("--seed", type=int, help="every utterance's seed: the same text, the same audio (default: random)")
    _speed_arg(wyo)
    wyo.add_argument(
        "--zeroconf",
        nargs="?",
        const="",
        metavar="NAME",
        help="announce the service on the LAN for Home Assistant's discovery, under NAME (default: the machine's); "
        "needs the zeroconf package",
    )
    wyo.add_argument(
        "--idle-timeout",
        type=float,
        default=_defaults(WyomingSettings)["idle_s"],
        help="seconds a connection with nothing generating stays open (default: %(default)s)",
    )
    _server_args(wyo, websocket=False)
    _sampling_args(wyo, skip=("max_new_tokens",))  # --max-new-tokens is the server's bound and default

    qnt = sub.add_parser(
        "quantize", help="write a checkpoint prepared for one precision, which loads without converting anything"
    )
    qnt.add_argument("source", help="checkpoint directory or hub id")
    qnt.add_argument("target", help="new directory for the prepared checkpoint")
    qnt.add_argument("--dtype", required=True, choices=["int8", "int4", "bfloat16", "float16", "float32"])
    qnt.add_argument("--offline", action="store_true", help="use only the local hub cache for hub ids")

    rnd = sub.add_parser("random-checkpoint", help="write a random-weight checkpoint (tests, demos, benchmarks)")
    rnd.add_argument("directory")
    rnd.add_argument("--size", default="0.6B", choices=["0.6B", "1.7B"])
    rnd.add_argument("--kind", default="custom_voice", choices=["custom_voice", "voice_design", "base"])
    rnd.add_argument("--real-size", action="store_true", help="real dimensions (GBs) instead of tiny ones")
    rnd.add_argument("--seed", type=int, default=0)
    return parser


def _server_args(p: argparse.ArgumentParser, websocket: bool) -> None:
    """The flags of the settings `kazeia serve` and `kazeia wyoming` share (ServerConfig, Limits)."""
    server, limits = _defaults(ServerConfig), _defaults(Limits)
    live = "live WebSocket" if websocket else "streamed"
    flags = [
        ("--queue-size", server["queue_size"], int, "utterances waiting before 503"),
        ("--max-batch", server["max_batch"], int, "utterances generated at once, their frame steps batched"),
        (
            "--max-input-chars",
            limits["max_input_chars"],
            int,
            "longest input text in characters, OpenAI's by default; more also raises the body limit "
            "to 12 bytes a character",
        ),
        ("--max-new-tokens", limits["max_new_tokens"], int, "talker tokens per utterance at most"),
        (
            "--voices-dir",
            server["voices_dir"],
            str,
            "Base checkpoints: directory of the saved voices, created if missing",
        ),
        ("--text-timeout", server["text_timeout"], float, f"seconds a {live} text may pause before it fails"),
        ("--text-deadline", server["text_deadline"], float, f"seconds within which a {live} text must end"),
        ("--max-connections", server["max_connections"], int, "open connections at once; more are refused"),
        ("--max-voices", limits["max_voices"], int, "Base checkpoints: saved voices at most"),
    ]
    if websocket:
        flags.append(("--ws-idle-timeout", server["ws_idle_s"], float, "seconds an idle WebSocket stays open"))
    for flag, default, kind, help in flags:
        p.add_argument(flag, type=kind, default=default, help=f"{help} (default: %(default)s)")
    p.add_argument(
        "--max-input-tokens",
        type=int,
        help=f"longest input text in text tokens, spoken in segments (default: the larger of "
        f"{limits['max_input_tokens']} and --max-input-chars)",
    )
    _chunk_args(p, server["first_chunk_frames"], server["chunk_frames"])
    p.add_argument(
        "--max-chunk-frames",
        type=int,
        default=server["max_chunk_frames"],
        help="frames a later chunk may take when its stream has fallen behind, so that its vocoder catches "
        "up (e.g. 16 with --max-batch > 1 on few cores; the audio's last bits then depend on timing; "
        "default: exactly --chunk-frames)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _port(value: str) -> int:
    port = int(value)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1 to 65535, not {port}")
    return port


def _speed_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="pace of the speech, 0.25-4.0; the pitch stays (default: %(default)s, the audio untouched)",
    )


def _chunk_args(p: argparse.ArgumentParser, first: int, rest: int) -> None:
    p.add_argument("--first-chunk-frames", type=int, default=first, help="frames in the first streamed chunk")
    p.add_argument("--chunk-frames", type=int, default=rest, help="frames in each later streamed chunk")


def _defaults(settings) -> dict:
    """A settings dataclass's field defaults, the flags' defaults."""
    return {f.name: f.default for f in dataclasses.fields(settings)}


def _load(args):
    from .engine import Engine

    return Engine.load(
        args.model,
        device=args.device,
        dtype=args.dtype,
        tokenizer_regex=args.tokenizer_regex,
        offline=args.offline or None,
        threads=args.threads,
    )


def _sampling(args) -> dict:
    """The sampling flags that were given (the others: None), --greedy applied."""
    sampling = {name: getattr(args, name, None) for name in SamplingOptions.names()}
    if args.greedy:
        sampling.update(do_sample=False, subtalker_dosample=False)
    return sampling


def _say(args) -> int:
    from .say import say
    from .subtitles import FORMATS

    if args.subtitles and os.path.splitext(args.subtitles)[1].lower() not in FORMATS:
        raise ValueError(f"--subtitles {args.subtitles!r} must end in .srt or .vtt")
    if (args.text is None) == (args.text_file is None):
        raise ValueError("give the text to speak, or --text-file FILE, but not both")
    engine = _load(args)
    sampling = _sampling(args)
    given = {name: getattr(args, name) for name in LongTextOptions.names() if getattr(args, name) is not None}
    sampling["long_text"] = LongTextOptions(**given)
    return say(engine, args, sampling)


def _voices(args) -> int:
    if args.action == "create":
        return _create_voice(args)
    given = [flag for flag, value in (("--audio", args.audio), ("--text", args.text), ("-o", args.output)) if value]
    if given or args.x_vector_only:
        raise ValueError(f"{(given or ['--x-vector-only'])[0]} belongs to `kazeia voices create`")
    engine = _load(args)
    print(f"model type: {engine.model_type}")
    none = "clone one with `kazeia voices create`" if engine.model_type == "base" else "describe it with --instruct"
    print("voices: " + (", ".join(engine.voices) or f"(none: {none})"))
    print("languages: " + ", ".join(engine.languages))
    return 0


def _serve(args) -> int:
    try:
        from .server import (
            app,  # noqa: F401  (the server extra, imported now for a clear error)
            serve,
        )
    except ImportError as e:
        return _missing_extra("serve", "server", e)
    config = _server_config(  # checked before the model loads
        args,
        args.served_model_name,
        model_aliases=(*_defaults(ServerConfig)["model_aliases"], *args.model_alias),
        allowed_origins=tuple(o.strip() for arg in args.allowed_origin for o in arg.split(",") if o.strip()),
        api_key=args.api_key or None,
        ws_idle_s=args.ws_idle_timeout,
    )
    serve(_load(args), config, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _missing_extra(command: str, extra: str, error: ImportError) -> int:
    print(
        f"kazeia: error: {command} needs the {extra} extra ({error.name} is missing): pip install 'kazeia[{extra}]'",
        file=sys.stderr,
    )
    return 2


def _server_config(args, name: str | None, **only) -> ServerConfig:
    """The settings `kazeia serve` and `kazeia wyoming` share, from their flags (checked here, before
    the model loads); `only`: the others."""
    name = name or (os.path.basename(os.path.normpath(args.model)) if os.path.isdir(args.model) else args.model)
    default = _defaults(Limits)
    tokens = args.max_input_tokens
    if tokens is None:
        tokens = max(default["max_input_tokens"], args.max_input_chars)
    limits = Limits(
        max_input_chars=args.max_input_chars,
        max_input_tokens=tokens,
        # Room for an input of that many characters, each JSON-escaped (12 bytes: a surrogate pair).
        max_body_bytes=max(default["max_body_bytes"], 12 * args.max_input_chars),
        max_new_tokens=args.max_new_tokens,
        max_voices=args.max_voices,
    )
    return ServerConfig(
        name,
        args.queue_size,
        args.first_chunk_frames,
        args.chunk_frames,
        args.max_chunk_frames,
        limits,
        voices_dir=args.voices_dir,
        text_timeout=args.text_timeout,
        text_deadline=args.text_deadline,
        max_connections=args.max_connections,
        max_batch=args.max_batch,
        **only,
    )


def _wyoming(args) -> int:
    try:
        from .server.wyoming import WyomingService, check_uri
    except ImportError as e:
        return _missing_extra("wyoming", "wyoming", e)
    import asyncio
    import importlib.util
    import logging

    if args.zeroconf is not None and importlib.util.find_spec("zeroconf") is None:
        raise ValueError("--zeroconf needs the zeroconf package (LGPL-2.1, not a kazeia extra): pip install zeroconf")
    check_uri(args.uri)
    config = _server_config(args, None)
    sampling = {name: value for name, value in _sampling(args).items() if value is not None}
    settings = WyomingSettings(
        args.voice, args.language, args.instruct, args.seed, sampling, args.idle_timeout, speed=args.speed
    )
    logging.basicConfig(format="%(levelname)s: %(name)s: %(message)s", level=args.log_level.upper())
    service = WyomingService(_load(args), config, settings)
    asyncio.run(service.run(args.uri, args.zeroconf))
    return 0


def _create_voice(args) -> int:
    if not args.audio or not args.output:
        raise ValueError("kazeia voices create needs --audio REF_AUDIO and -o VOICE_FILE")
    engine = _load(args)
    voice = engine.create_voice(args.audio, ref_text=args.text, x_vector_only=args.x_vector_only)
    voice.save(args.output)
    mode = "ICL" if voice.mode == "icl" else "x-vector-only"
    frames = f", {voice.ref_frames} reference frames" if voice.ref_frames else ""
    print(f"{args.output}: {mode} voice for {voice.model.describe()}{frames}", file=sys.stderr)
    return 0


def _quantize(args) -> int:
    from .prepared import quantize

    started = time.perf_counter()
    path = quantize(args.source, args.target, args.dtype, offline=args.offline or None)
    took = time.perf_counter() - started
    print(f"wrote {path}, prepared for {args.dtype}, in {took:.1f} s; load it like any checkpoint", file=sys.stderr)
    return 0


def _random_checkpoint(args) -> int:
    from .testing import write_checkpoint

    path = write_checkpoint(args.directory, args.size, args.kind, tiny=not args.real_size, seed=args.seed)
    print(f"wrote a random-weight {args.size} {args.kind} checkpoint to {path}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run = {
        "say": _say,
        "voices": _voices,
        "serve": _serve,
        "wyoming": _wyoming,
        "quantize": _quantize,
        "random-checkpoint": _random_checkpoint,
    }[args.command]
    try:
        return run(args)
    except BrokenPipeError:  # the reader of `-o -` went away: stop quietly
        sys.stderr.close()
        return 141
    except (ValueError, OSError) as e:
        print(f"kazeia: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kazeia: interrupted", file=sys.stderr)
        return 130
