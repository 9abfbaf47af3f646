"""The `kazeia` command: say, voices, serve, wyoming, quantize, random-checkpoint.

Thin: parse arguments, call the engine, write files, print figures. The options' flags are made from
the options dataclasses (kazeia/options.py: one flag per field); the work of `say` (streamed to its
file with a progress bar, stopped cleanly by Ctrl-C) is in say.py, the servers' flags and settings
in server/commands.py. Bad input exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

from .options import StreamOptions, SynthesisOptions
from .segment import LongTextOptions
from .server.commands import add_serve_args, add_wyoming_args, serve, wyoming

DEFAULT_MODEL = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"
GREEDY = dict(do_sample=False, subtalker_dosample=False)  # --greedy


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
    p.add_argument(
        "--vocoder-dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16", "int8"],
        help="the vocoder's precision (default: %(default)s, the exact audio; bfloat16 is faster on CPUs with "
        "bfloat16 dot products; int8, on the CPU, runs most of it as integer products, faster still)",
    )
    p.add_argument("--offline", action="store_true", help="use only the local hub cache for hub ids")
    p.add_argument("--threads", type=int, help="CPU threads for each of the two stages (default: half the cores)")
    p.add_argument(
        "--tokenizer-regex",
        default="qwen2",
        choices=list(SPLIT_REGEXES),
        help="text split regex (default: %(default)s; see docs)",
    )


def option_flags(
    parser: argparse.ArgumentParser, options, title: str, skip: tuple[str, ...] = (), helps: dict | None = None
) -> None:
    """A group `title` of one flag per field of an options dataclass but `skip` (--top-k for top_k;
    a switch gets --x/--no-x), with its description (or `helps`' for its name); unset flags leave the
    default. An options field (long_text) gets a group of its own, one flag per field of its own."""
    group = parser.add_argument_group(title)
    for name, (kind, help) in options.describe().items():
        if name in skip:
            continue
        if hasattr(kind, "describe"):
            option_flags(parser, kind, help)
            continue
        flag, help = "--" + name.replace("_", "-"), (helps or {}).get(name, help)
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help)
        else:
            group.add_argument(flag, type=kind, help=help)
    if "do_sample" in options.names() and "do_sample" not in skip:
        group.add_argument("--greedy", action="store_true", help="shorthand for --no-do-sample --no-subtalker-dosample")


def options_from(args, kind):
    """The options `kind` (SynthesisOptions or StreamOptions) the flags give: the fields set, --greedy
    applied, the long-text flags as its LongTextOptions."""
    given = {name: getattr(args, name) for name in kind.names() if getattr(args, name, None) is not None}
    if getattr(args, "greedy", False):
        given.update(GREEDY)
    if "long_text" in kind.names() and any(hasattr(args, name) for name in LongTextOptions.names()):
        text = {name: getattr(args, name) for name in LongTextOptions.names() if getattr(args, name, None) is not None}
        given["long_text"] = LongTextOptions(**text)
    return kind(**given)


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as the command's others: one line on stderr naming the flag and what
    it takes, status 2 (the usage is `--help`'s, unchanged)."""

    KINDS = {"int": "an integer", "float": "a number", "port": "a port number"}

    def error(self, message: str):  # type: ignore[override]
        kind = re.fullmatch(r"(argument \S+: )invalid (\w+) value: (.*)", message)
        if kind is not None and kind.group(2) in self.KINDS:
            message = f"{kind.group(1)}expects {self.KINDS[kind.group(2)]}, not {kind.group(3)}"
        self.exit(2, f"kazeia: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kazeia", description="Qwen3-TTS speech synthesis.")
    sub = parser.add_subparsers(dest="command", required=True)

    say = sub.add_parser("say", help="synthesize text to an audio file")
    say.add_argument("text", nargs="?", help="the text to speak; - reads standard input (with --stream: as it arrives)")
    say.add_argument("--text-file", help="read the text to speak from this UTF-8 file (- for standard input)")
    _model_args(say)
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
    say.add_argument("--subtitles", help="also write the segments' timestamps as subtitles: a .srt or .vtt file")
    option_flags(say, StreamOptions, "speech (sampling defaults from the checkpoint's generation_config.json)")

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
    add_serve_args(srv)

    wyo = sub.add_parser(
        "wyoming", help="serve the Wyoming protocol for Home Assistant, speaking streamed text as it arrives"
    )
    _model_args(wyo)
    add_wyoming_args(wyo, option_flags)

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


def _load(args, huge_pages: bool = True):
    """The engine the arguments name. `huge_pages=False` for one-shot commands: on a VM, faulting the
    weights into huge pages can cost ~2 s a GB, more than a short text gains (kazeia/hugepages.py)."""
    from .engine import Engine

    return Engine.load(
        args.model,
        device=args.device,
        dtype=args.dtype,
        vocoder_dtype=args.vocoder_dtype,
        tokenizer_regex=args.tokenizer_regex,
        offline=args.offline or None,
        threads=args.threads,
        huge_pages=huge_pages,
    )


def _say(args) -> int:
    from .say import say
    from .subtitles import FORMATS

    if args.subtitles and os.path.splitext(args.subtitles)[1].lower() not in FORMATS:
        raise ValueError(f"--subtitles {args.subtitles!r} must end in .srt or .vtt")
    if (args.text is None) == (args.text_file is None):
        raise ValueError("give the text to speak, or --text-file FILE, but not both")
    streamed = [name for name in StreamOptions.names() if name not in SynthesisOptions.names()]
    given = [name for name in streamed if getattr(args, name, None) is not None]
    if given and not args.stream:
        raise ValueError(f"--{given[0].replace('_', '-')} applies with --stream only")
    options = options_from(args, StreamOptions)  # checked before the model loads
    return say(_load(args, huge_pages=False), args, options)


def _voices(args) -> int:
    if args.action == "create":
        return _create_voice(args)
    given = [flag for flag, value in (("--audio", args.audio), ("--text", args.text), ("-o", args.output)) if value]
    if given or args.x_vector_only:
        raise ValueError(f"{(given or ['--x-vector-only'])[0]} belongs to `kazeia voices create`")
    engine = _load(args, huge_pages=False)
    print(f"model type: {engine.model_type}")
    none = "clone one with `kazeia voices create`" if engine.model_type == "base" else "describe it with --instruct"
    print("voices: " + (", ".join(engine.voices) or f"(none: {none})"))
    print("languages: " + ", ".join(engine.languages))
    return 0


def _serve(args) -> int:
    return serve(args, _load)


def _wyoming(args) -> int:
    return wyoming(args, _load, options_from(args, SynthesisOptions))


def _create_voice(args) -> int:
    if not args.audio or not args.output:
        raise ValueError("kazeia voices create needs --audio REF_AUDIO and -o VOICE_FILE")
    engine = _load(args, huge_pages=False)
    voice = engine.create_voice(args.audio, ref_text=args.text, x_vector_only=args.x_vector_only)
    voice.save(args.output)
    mode = "ICL" if voice.mode == "icl" else "x-vector-only"
    frames = f", {voice.ref_frames} reference frames" if voice.ref_frames else ""
    print(f"{args.output}: {mode} voice for {voice.model.describe()}{frames}", file=sys.stderr)
    return 0


def _quantize(args) -> int:
    from .prepare import quantize

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
