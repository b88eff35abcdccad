#!/usr/bin/env bash
# Run Spec-Bench's own evaluation scripts (evaluation/speed.py and evaluation/equal.py, from a checkout of
# https://github.com/hemingkx/Spec-Bench; its code is not part of draftverify) on the answer files that
# `draftverify bench --spec-bench-jsonl DIR` wrote: the speedup of METHOD over BASELINE per Spec-Bench task,
# Spec-Bench's mean accepted tokens, and whether the two answer files are equal.
#
#   scripts/spec-bench-eval.sh SPEC_BENCH_CHECKOUT ANSWERS_DIR BASELINE.jsonl METHOD.jsonl [TOKENIZER_DIR]
#
# TOKENIZER_DIR (what speed.py counts the baseline's tokens with): a folder that transformers'
# AutoTokenizer reads; default: the default model's converted folder under the cache root.
# speed.py's command line always runs its authors' own file list (its --mean-report flag is store_true with
# default True), so its get_single_speedup is called directly. Its baseline count is len(tokenizer(turn)) - 1
# per turn (it assumes a BOS token, which SmolLM2's tokenizer does not add): the baseline's tokens/s reads
# one token per turn low, the speedup as much high.
set -euo pipefail
if [ $# -lt 4 ]; then
  echo "usage: $0 SPEC_BENCH_CHECKOUT ANSWERS_DIR BASELINE.jsonl METHOD.jsonl [TOKENIZER_DIR]" >&2
  exit 2
fi
spec=$(cd "$1" && pwd); answers=$(cd "$2" && pwd); base=$3; method=$4
python=${PYTHON:-python}
[ -f "$spec/evaluation/speed.py" ] || { echo "$spec has no evaluation/speed.py: pass a Spec-Bench checkout" >&2; exit 2; }
for f in "$base" "$method"; do
  [ -f "$answers/$f" ] || { echo "$answers/$f does not exist: pass file names from ANSWERS_DIR" >&2; exit 2; }
done
tokenizer=${5:-$("$python" -c "
from draftverify.loading import default_model_path
from draftverify.loading.gguf import gguf_to_folder
path = default_model_path()
print(gguf_to_folder(path) if str(path).endswith('.gguf') else path)")}
cd "$spec/evaluation"
"$python" -c "import sys; from speed import get_single_speedup; get_single_speedup(*sys.argv[1:])" \
  "$answers/$method" "$answers/$base" "$tokenizer"
"$python" equal.py --file-path "$answers/" --jsonfile1 "$base" --jsonfile2 "$method"
