#!/usr/bin/env bash
# Set up (first run only) and run the whole test suite, the real default model included.
# The tests run in one process per core (pytest-xdist; at most 4, each loads the default model once), each test
# file whole on one of them, in its own order; the files go out longest first (tests/conftest.py), so the workers
# end together. DV_TEST_WORKERS=1 runs them all in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1
workers=${DV_TEST_WORKERS:-$(python -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}
if [ "$workers" -gt 1 ]; then
  # --max-worker-restart=0: a test that kills its worker (a native crash) fails the run there and then; xdist's
  # default starts another worker, which re-ran the crashing file, and once left the controller waiting forever
  exec python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile --no-loadscope-reorder \
    --max-worker-restart=0 "$@"
fi
exec python -m pytest -q -p no:cacheprovider "$@"
