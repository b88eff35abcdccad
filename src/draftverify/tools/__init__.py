"""The offline tools, each a CLI command, built on the runtime and never imported by it.

- `make_draft`: `draftverify make-draft`, a small draft model distilled from a target.
- `search_layers`: `draftverify search-layers`, the self-speculative skip-set search.
- `train_head`: `draftverify train-head`, the SpecDec++ acceptance head.
- `pareto`: `draftverify pareto`, the SpecDec++ verification-rate vs discard-rate view of a bench run.
"""
