#!/usr/bin/env bash
# Set up (first run only) and run the demo: autoregressive vs auto on a chat, a code and a summary prompt (default model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1
exec draftverify demo "$@"
