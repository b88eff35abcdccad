#!/usr/bin/env bash
# Add the optional llama.cpp bench peers (`llamacpp`, `llamacpp-f32`, `llamacpp-prompt-lookup`) to .venv,
# then write the default model in the GGUF types people download (Q4_K_M, Q5_K_M, Q6_K, Q8_0) with
# llama.cpp's own quantizer, cached under ~/.cache/draftverify/gguf-quantized for tests and benchmarks
# (`python -m draftverify.bench.quantize TYPE` prints the path of one; SKIP_QUANTIZE=1 skips them).
# llama-cpp-python ships as source only: the first run compiles it into a wheel kept under
# ~/.cache/draftverify/wheels, so later installs take seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
VERSION=0.3.36
wheels="${XDG_CACHE_HOME:-$HOME/.cache}/draftverify/wheels"
# llama.cpp's AMX backend (ggml_backend_amx_mul_mat) segfaults in the first forward on some CPUs with AMX
# (ggml-org/llama.cpp#20824, open): here, on an Intel Xeon with AMX, it crashed on the default model's first decode.
# On such a CPU llama.cpp is built as for this CPU (-march=native) less AMX's int8 tiles (its AMX backend needs
# them), and its wheel is kept apart from a build with them.
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
  export CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8"
  wheels="$wheels/no-amx-int8"
fi
mkdir -p "$wheels"
if ! ls "$wheels"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
  echo "building llama-cpp-python $VERSION from source once (it compiles llama.cpp: minutes)..." >&2
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" python -m pip wheel --no-cache-dir --no-deps "llama-cpp-python==$VERSION" -w "$wheels"  # no pip cache: CMAKE_ARGS must reach the build
fi
python -m pip install -q --no-deps --force-reinstall "$wheels"/llama_cpp_python-"$VERSION"-*.whl  # this build, not one already in .venv
python -m pip install -q "diskcache>=5.6.1" "jinja2>=2.11.3"  # its runtime needs
python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'ready: add llamacpp,llamacpp-f32,llamacpp-prompt-lookup to draftverify bench --methods')"
if [ "${SKIP_QUANTIZE:-0}" != 1 ]; then
  echo "the default model as Q4_K_M, Q5_K_M, Q6_K and Q8_0 (llama.cpp's quantizer, once):" >&2
  python -m draftverify.bench.quantize Q4_K_M Q5_K_M Q6_K Q8_0
fi
