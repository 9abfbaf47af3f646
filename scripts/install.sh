#!/usr/bin/env bash
# Create .venv with Kazeia and its pinned dependencies.  --test adds the test tools and the
# reference implementation (qwen-tts 0.1.1, installed without its audio-codec extras) used as
# the parity oracle.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# A pinned torch takes the CPU wheel; an unpinned one would pull a multi-GB CUDA build.
.venv/bin/python -m pip install --quiet torch==2.13.0
if [ "${1:-}" = "--test" ]; then
  .venv/bin/python -m pip install --quiet -e '.[test]'
  .venv/bin/python -m pip install --quiet --no-deps qwen-tts==0.1.1
else
  .venv/bin/python -m pip install --quiet -e .
fi
