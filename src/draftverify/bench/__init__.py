"""`draftverify bench`: every decoding method side by side on real prompt sets.

- `datasets`: the prompt sets in the shared data folder and user JSONL files -> `Prompt`s.
- `specs`: `--methods` read in the shared spec grammar (`draftverify.methods.spec`), plus the
  bench option `warm` and the peers (`hf-assisted`, `hf-prompt-lookup`, `hf-autoregressive`, llama.cpp).
- `runner`: the protocol (warm-up, interleaving, repeats, resume) and one record per generation.
- `oracle`: the SpecDec++ hindsight oracle and the forward-time cost model.
- `metrics`: the formulas (also in docs/metrics.md) over the records.
- `report`: results.json, results.csv, report.md and the plots.
"""
