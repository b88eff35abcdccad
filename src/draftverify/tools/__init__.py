"""The offline tools, each a CLI command, built on the runtime and never imported by it.

- `make_draft`: `draftverify make-draft`, a small draft model distilled from a target.
- `search_layers`: `draftverify search-layers`, the self-speculative skip-set search.
- `train_acceptance_head`: `draftverify train-acceptance-head`, the SpecDec++ acceptance head
  (not the feature head of `make_draft`, an EAGLE-style drafter).
- `pareto`: `draftverify pareto`, the SpecDec++ verification-rate vs discard-rate view of a bench run.
"""
