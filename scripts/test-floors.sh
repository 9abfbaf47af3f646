#!/usr/bin/env bash
# Run the server tests on the lowest versions pyproject.toml admits for the `server` extra, so that
# no floor there is untested. Needs .venv (scripts/install.sh --test): .venv-floors holds only the
# server packages at their floors (each "name>=X" installed as "name==X", without dependencies);
# everything else (torch, pydantic, the test tools, Kazeia itself) comes from .venv, after them
# on sys.path.
set -euo pipefail
cd "$(dirname "$0")/.."

mapfile -t floors < <(.venv/bin/python - <<'PY'
import re, tomllib
extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["server"]
for requirement in extra:
    name, floor = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([^,;\s]+)", requirement).groups()
    print(f"{name}=={floor}")
PY
)
rm -rf .venv-floors
python3 -m venv .venv-floors
.venv-floors/bin/python -m pip install --quiet --no-deps "${floors[@]}"
site() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
printf '%s\n%s\n' "$PWD" "$(site .venv/bin/python)" > "$(site .venv-floors/bin/python)/zz-kazeia-floors.pth"
echo "server tests on: ${floors[*]}"
.venv-floors/bin/python -m pytest -q -p no:cacheprovider tests/test_server_*.py tests/test_examples.py
