#!/usr/bin/env bash
# Set up (first run only) and run the whole test suite, the real default model included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1
exec python -m pytest -q -p no:cacheprovider "$@"
