#!/usr/bin/env bash
# The one test command: builds .venv from pinned requirements (first run only), then runs pytest.
#   tests/run.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
if [[ ! -x $venv/bin/python || tests/requirements.txt -nt $venv/.installed || tests/overrides.txt -nt $venv/.installed ]]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q uv==0.9.5
  "$venv/bin/python" -m uv pip install --python "$venv/bin/python" \
    -r tests/requirements.txt --override tests/overrides.txt -e ".[bench]"
  touch "$venv/.installed"
fi
exec "$venv/bin/python" -m pytest "$@"
