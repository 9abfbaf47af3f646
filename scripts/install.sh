#!/usr/bin/env bash
# Create .venv with Kazeia and its pinned dependencies.  --test adds the test tools, the system
# packages some tests drive, and the reference implementation (qwen-tts 0.1.1, installed without its
# audio-codec extras) used as the parity oracle.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages used only by tests (one per line in this list; see tests/ for who uses which).
TEST_SYSTEM_PACKAGES=(
  chromium         # tests/test_server_browser.py: the demo page in a headless browser
  chromium-driver  # the same, driven through Selenium
  espeak-ng        # tests/clone_support.py: real speech as reference audio for voice cloning
)

python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# A pinned torch takes the CPU wheel; an unpinned one would pull a multi-GB CUDA build.
.venv/bin/python -m pip install --quiet torch==2.13.0
if [ "${1:-}" = "--test" ]; then
  if [ ${#TEST_SYSTEM_PACKAGES[@]} -gt 0 ]; then
    missing=()
    for pkg in "${TEST_SYSTEM_PACKAGES[@]}"; do
      dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    if [ ${#missing[@]} -gt 0 ]; then
      if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
      else
        echo "install.sh: not root, cannot install ${missing[*]}; the tests that need them will be skipped" >&2
      fi
    fi
  fi
  .venv/bin/python -m pip install --quiet -e '.[test,ray]'  # ray: tests/test_ray.py
  .venv/bin/python -m pip install --quiet --no-deps qwen-tts==0.1.1
else
  .venv/bin/python -m pip install --quiet -e .
fi
