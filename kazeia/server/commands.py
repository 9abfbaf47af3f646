"""`kazeia serve` and `kazeia wyoming`: their flags, the settings made from them, and running them.

The flags of the settings both servers share come from `ServerConfig` and `Limits` (their defaults
are the flags' defaults); the Wyoming server's utterance options from `SynthesisOptions` (one flag
per field, as `kazeia say`'s). Settings are checked before the model loads. Importing this module
needs no server extra; running a server does (a one-line error names the extra otherwise).
Non-goals: the other commands (kazeia/cli.py), the servers themselves (app.py, wyoming.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable

from ..options import SynthesisOptions
from .config import ADMISSIONS, Limits, ServerConfig, WyomingSettings

WYOMING_HELP = {  # what a Wyoming server's options mean there, where it differs from `kazeia say`
    "voice": "voice when a request names none (default: the first one listed)",
    "language": "language (name or code) when a request names none (default: auto)",
    "seed": "every utterance's seed: the same text, the same audio (default: random)",
}


def defaults(settings) -> dict:
    """A settings dataclass's field defaults, the flags' defaults."""
    return {f.name: f.default for f in dataclasses.fields(settings)}


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """`kazeia serve`'s own flags, then the shared ones."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=port, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("KAZEIA_API_KEY"),
        help="require Authorization: Bearer KEY on every request but the demo page and /health "
        "(default: $KAZEIA_API_KEY, else none)",
    )
    p.add_argument(
        "--allowed-origin",
        "--allowed-origins",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="web page origins (https://app.example) that may call the server, with CORS; repeatable or "
        "comma-separated",
    )
    p.add_argument(
        "--model-alias",
        action="append",
        default=[],
        metavar="NAME",
        help="another model id to answer to, besides tts-1, tts-1-hd and gpt-4o-mini-tts; repeatable",
    )
    p.add_argument("--served-model-name", help="the model id clients send (default: hub id or directory name)")
    p.add_argument(
        "--allow-ignore-eos",
        action="store_true",
        help="let requests set ignore_eos (frames past the end of speech, for benchmarks); refused otherwise",
    )
    _server_args(p, websocket=True)
    ray = p.add_argument_group("scale-out on Ray Serve (the ray extra; docs/scale-out.md)")
    ray.add_argument("--replicas", type=int, help="serve this many replicas of the app behind Ray Serve's proxy")
    ray.add_argument(
        "--ray-address", help="join the Ray cluster at this address (default: start a local one, stopped on exit)"
    )
    ray.add_argument("--min-replicas", type=int, help="autoscale between --min-replicas and --max-replicas")
    ray.add_argument("--max-replicas", type=int, help="(the autoscaler aims at --max-batch requests per replica)")


def add_wyoming_args(p: argparse.ArgumentParser, option_flags: Callable) -> None:
    """`kazeia wyoming`'s own flags, the shared ones, and every utterance's options
    (`option_flags(parser, options, title, skip, helps)`: one flag per field, as for `kazeia say`)."""
    p.add_argument(
        "--uri",
        default="tcp://127.0.0.1:10200",
        help="where to listen: tcp://HOST:PORT or unix://PATH (default: %(default)s; tcp://0.0.0.0:10200 for the LAN)",
    )
    p.add_argument(
        "--zeroconf",
        nargs="?",
        const="",
        metavar="NAME",
        help="announce the service on the LAN for Home Assistant's discovery, under NAME (default: the machine's); "
        "needs the zeroconf package",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=defaults(WyomingSettings)["idle_s"],
        help="seconds a connection with nothing generating stays open (default: %(default)s)",
    )
    _server_args(p, websocket=False)
    # --max-new-tokens is the server's bound and default (a shared flag); long text is as for HTTP
    title = "every utterance's options (sampling defaults from generation_config.json)"
    option_flags(p, SynthesisOptions, title, ("long_text", "max_new_tokens"), WYOMING_HELP)


def _server_args(p: argparse.ArgumentParser, websocket: bool) -> None:
    """The flags of the settings `kazeia serve` and `kazeia wyoming` share (ServerConfig, Limits)."""
    server, limits = defaults(ServerConfig), defaults(Limits)
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
    p.add_argument(
        "--admission",
        choices=ADMISSIONS,
        default=server["admission"],
        help="answer 503 with Retry-After to a new utterance: 'measured', while a stream is behind real time "
        "or where this server's measured pace says one more would not keep it; 'behind', only the first; "
        "'all', never (but for a full queue) (default: %(default)s)",
    )
    p.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="take requests as soon as the model is loaded, without first running it once per preset voice "
        "(the first listener of each voice then waits longer: ~60 ms on a 2-vCPU Zen 3)",
    )
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
    p.add_argument(
        "--first-chunk-frames",
        type=int,
        default=server["first_chunk_frames"],
        help="frames in the first streamed chunk (default: %(default)s)",
    )
    p.add_argument(
        "--chunk-frames",
        type=int,
        default=server["chunk_frames"],
        help="frames in each later streamed chunk (default: %(default)s)",
    )
    p.add_argument(
        "--max-chunk-frames",
        type=int,
        default=server["max_chunk_frames"],
        help="frames a later chunk may take when its stream has fallen behind, so that its vocoder catches "
        "up (e.g. 16 with --max-batch > 1 on few cores; the audio's last bits then depend on timing; "
        "default: exactly --chunk-frames)",
    )
    p.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set any other bound of a request (docs/server.md lists them), e.g. client_stall_s=10; repeatable",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def limit_values(given: list[str]) -> dict:
    """`--limit NAME=VALUE` flags -> Limits fields, each value of its field's type."""
    kinds = {name: type(value) for name, value in defaults(Limits).items()}
    values: dict = {}
    for item in given:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in kinds:
            raise ValueError(f"--limit {item!r}: use NAME=VALUE, NAME one of: {', '.join(kinds)}")
        try:
            if kinds[name] is bool:
                if value.strip().lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError
                values[name] = value.strip().lower() in ("true", "1", "yes", "on")
            else:
                values[name] = kinds[name](value)
        except ValueError:
            what = {int: "an integer", float: "a number", bool: "true or false"}[kinds[name]]
            raise ValueError(f"--limit {name}: expects {what}, not {value!r}") from None
    return values


def port(value: str) -> int:
    number = int(value)
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1 to 65535, not {number}")
    return number


def server_config(args, name: str | None, **only) -> ServerConfig:
    """The settings `kazeia serve` and `kazeia wyoming` share, from their flags (checked here, before
    the model loads); `only`: the others."""
    name = name or (os.path.basename(os.path.normpath(args.model)) if os.path.isdir(args.model) else args.model)
    default = defaults(Limits)
    tokens = args.max_input_tokens
    if tokens is None:
        tokens = max(default["max_input_tokens"], args.max_input_chars)
    flagged = dict(
        max_input_chars=args.max_input_chars,
        max_input_tokens=tokens,
        # Room for an input of that many characters, each JSON-escaped (12 bytes: a surrogate pair).
        max_body_bytes=max(default["max_body_bytes"], 12 * args.max_input_chars),
        max_new_tokens=args.max_new_tokens,
        max_voices=args.max_voices,
        # A Wyoming client cannot ask for options: its server's --ignore-eos is the operator's.
        allow_ignore_eos=getattr(args, "allow_ignore_eos", True),
    )
    limits = Limits(**{**flagged, **limit_values(args.limit)})  # --limit has the last word
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
        admission=args.admission,
        warm_up=args.warm_up,
        **only,
    )


def serve(args, load: Callable) -> int:
    """`kazeia serve`: the settings checked, then the model loaded (`load(args)`) and served."""
    try:
        from . import (
            app,  # noqa: F401  (the server extra, imported now for a clear error)
            serve,
        )
    except ImportError as e:
        return missing_extra("serve", "server", e)
    config = serve_config(args)  # checked before the model loads
    if args.replicas is None:
        ray_only = [f for f in ("ray_address", "min_replicas", "max_replicas") if getattr(args, f) is not None]
        if ray_only:
            raise ValueError(f"--{ray_only[0].replace('_', '-')} needs --replicas N (serving on Ray)")
        serve(load(args), config, host=args.host, port=args.port, log_level=args.log_level)
        return 0
    try:
        from . import rayserve
    except ImportError as e:
        return missing_extra("serve --replicas", "ray", e)
    from . import guarded

    logging.basicConfig(format="%(levelname)s:     %(name)s: %(message)s", level=args.log_level.upper())
    rayserve.run(load, args, guarded(config, args.host))
    return 0


def serve_config(args) -> ServerConfig:
    """`kazeia serve`'s settings, from its flags."""
    return server_config(
        args,
        args.served_model_name,
        model_aliases=(*defaults(ServerConfig)["model_aliases"], *args.model_alias),
        allowed_origins=tuple(o.strip() for arg in args.allowed_origin for o in arg.split(",") if o.strip()),
        api_key=args.api_key or None,
        ws_idle_s=args.ws_idle_timeout,
    )


def wyoming(args, load: Callable, options: SynthesisOptions) -> int:
    """`kazeia wyoming`: the settings checked (`options`: every utterance's, from the flags), then
    the model loaded and served."""
    try:
        from .wire import filter_logs
        from .wyoming import WyomingService, check_uri
    except ImportError as e:
        return missing_extra("wyoming", "wyoming", e)
    import asyncio
    import importlib.util
    import logging

    if args.zeroconf is not None and importlib.util.find_spec("zeroconf") is None:
        raise ValueError("--zeroconf needs the zeroconf package (LGPL-2.1, not a kazeia extra): pip install zeroconf")
    check_uri(args.uri)
    config = server_config(args, None)
    settings = WyomingSettings(options, args.idle_timeout)
    logging.basicConfig(format="%(levelname)s: %(name)s: %(message)s", level=args.log_level.upper())
    filter_logs()  # client text in a log line is escaped (server/wire.py)
    service = WyomingService(load(args), config, settings)
    asyncio.run(service.run(args.uri, args.zeroconf))
    return 0


def missing_extra(command: str, extra: str, error: ImportError) -> int:
    print(
        f"kazeia: error: {command} needs the {extra} extra ({error.name} is missing): pip install 'kazeia[{extra}]'",
        file=sys.stderr,
    )
    return 2
