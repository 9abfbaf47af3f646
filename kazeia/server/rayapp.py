"""The application of `kazeia serve --replicas`, for Ray Serve's own tools: `serve run` and config files.

    serve run kazeia.server.rayapp:build model=/models/base replicas=2 threads=4 voices_dir=/shared/voices

Each argument is a `kazeia serve` flag without its dashes (`max_batch=4` is `--max-batch 4`; a
switch such as `allow_ignore_eos=true` is given or not), read by the same parser, so the replicas
are those `kazeia serve --replicas` deploys. Where Ray's proxy listens is Ray Serve's setting
(`http_options`), not `--port`; `host` still says which Host names a request may give (a loopback
`host`, the default, accepts loopback names only: give the address clients use). Non-goals:
starting or stopping a cluster (`serve run`, `serve deploy` and `serve shutdown` do).
"""

from __future__ import annotations

import argparse

from ..cli import _load, build_parser
from . import guarded
from .commands import serve_config
from .rayserve import application, scale_from


def switches(parser: argparse.ArgumentParser) -> set[str]:
    """The `serve` flags that take no value (`--offline`), by destination name."""
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    return {a.dest for a in serve._actions if a.nargs == 0 and a.dest != "help"}


def build(args: dict):
    """The Ray Serve application for `args` (flag name -> value, as `serve run` passes them)."""
    parser, argv = build_parser(), ["serve"]
    switched = switches(parser)
    for key, value in args.items():
        flag = "--" + str(key).replace("_", "-")
        if key in switched:
            argv += [flag] if str(value).strip().lower() in ("true", "1", "yes", "on") else []
        else:
            argv += [flag, str(value)]
    parsed = parser.parse_args(argv)
    if parsed.replicas is None:
        parsed.replicas = 1
    config = guarded(serve_config(parsed), parsed.host)
    return application(_load, parsed, config, scale_from(parsed, config, None))
