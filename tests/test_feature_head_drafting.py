"""Drafting with the feature head: it reproduces the training rollout, the packed path takes the fused kernel and
reads its inputs in one call, calibration and tree expansion price nodes as they should, and tree sampling keeps
the target's law."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from phrase_sampling import broken_rule, second_token_pvalue
from test_feature_head import random_head

from draftverify import Engine
from draftverify.feature_head_cache import HeadCache
from draftverify.models import Runner
from draftverify.sampling import Sampling
from draftverify.tools.make_draft.feature_losses import rollout, rollout_mask


def test_rollout_mask_is_a_draft_of_that_depth():
    m = rollout_mask(5, 3)  # step 3 at position 4: true inputs 0..2, step-2 input at 3, its own at 4
    assert m[4].nonzero().flatten().tolist() == [0, 1, 2, 5 + 3, 10 + 4]
    assert rollout_mask(4, 1).equal(torch.ones(4, 4, dtype=torch.bool).tril())


def test_drafting_reproduces_the_training_rollout(tiny):
    """What training calls rollout step s at position t is what the head's cache computes when it drafts
    s tokens deep from there: the training-time test trains the drafting the head does."""
    target = tiny("llama", layers=2)
    head = random_head(target)
    ids = torch.randint(3, 90, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        feats = target.model.get_decoder()(input_ids=ids).last_hidden_state  # [1, 20, H]
        outs = rollout(head, feats[:, :-1], ids[:, 1:], 3)
    p = 10  # true inputs at positions 0..p, then two drafted steps
    cache = HeadCache(head)
    out = cache.forward(feats[0, : p + 1], ids[0, 1 : p + 2], torch.arange(p + 1))
    got = [out[-1]]
    for d in (1, 2):
        got.append(cache.forward(got[-1][None], ids[0, p + 1 + d : p + 2 + d], torch.tensor([p + d]))[0])
    for s, g in enumerate(got):
        assert torch.allclose(g, outs[s][0, p + s], atol=1e-4), s


def test_packed_drafting_takes_the_fused_kernel_and_computes_the_layer(tiny):
    """Drafting on packed weights runs the layer through the target's fused kernel (rotate, store k/v, attend in one
    call, q/k/v in one product): the same features as the head's own rotary and attention on those weights, for a
    catch-up, a causal pair and a tree-masked expansion; and logits over a prefix of its vocabulary."""
    target = tiny("llama", layers=2)
    head = random_head(target).pack()
    ids = torch.randint(3, 90, (16,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        feats = target.model.get_decoder()(input_ids=ids[None]).last_hidden_state[0]
    fused, plain = HeadCache(head), HeadCache(head)
    assert fused.rope_attention is not None, "the compiled kernels are missing: this test would check nothing"
    plain.rope_attention = None
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two children
    for rows, positions, mask in (
        (slice(0, 10), torch.arange(10), None),
        (slice(10, 12), torch.arange(10, 12), None),
        (slice(12, 15), torch.tensor([12, 13, 13]), tree),
    ):
        a = fused.forward(feats[rows], ids[rows], positions, mask)
        b = plain.forward(feats[rows], ids[rows], positions, mask)
        assert torch.allclose(a, b, atol=1e-5), (rows, (a - b).abs().max())
    assert torch.allclose(fused.keys[:, :, :15], plain.keys[:, :, :15], atol=1e-5)
    x = feats[
        :3
    ]  # FR-Spec's smaller vocabulary: a prefix of the LM head's rows, on the packed path too (rounded: a draft's)
    exact = x @ head.lm_head[:20].T
    assert torch.allclose(head.logits(x, 20), exact, atol=0.03 * exact.abs().max().item()) and head.logits(
        x, 20
    ).shape == (3, 20)


def test_packed_drafting_reads_inputs_and_top_tokens_in_one_call_each(tiny):
    """Drafting's one-call input (norms, embedding, fc) gives the op-by-op path's bits; its top tokens are topk's with
    softmax probabilities (ties: the lower vocabulary position first); its rotary rows are the gathered ones."""
    from draftverify.backend.ops import cpu_kernels

    target = tiny("llama", layers=2)
    head = random_head(target, vocab=list(range(0, 96, 2))).pack()
    assert cpu_kernels() is not None and head._fast["fc"].quant is not None, (
        "no compiled kernels: this test would check nothing"
    )
    feats = torch.randn(5, head.config.hidden_size, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([3, 90, 7, 7, 41])
    plain = head._linear(
        "fc", torch.cat([head._norm("norm_feature", feats), head._norm("norm_embed", F.embedding(ids, head.embed))], -1)
    )
    assert torch.equal(head.inputs(feats, ids), plain)
    logits = head.logits(feats, 20)
    tokens, probs = head.top(feats, 20, 3)
    top, idx = logits.topk(3, dim=-1)
    assert tokens == head.vocab[idx].tolist()
    assert torch.allclose(torch.tensor(probs), (top - logits.logsumexp(-1, keepdim=True)).exp(), rtol=1e-5)
    tied = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    assert cpu_kernels().top_probs(tied, torch.tensor([10, 11, 12, 13, 14]), 4)[0] == [[11, 12, 14, 13]]
    for positions, index in ((range(4, 7), [4, 5, 6]), ([9, 9], [9, 9]), ([2, 8, 3], [2, 8, 3])):
        for view, row in zip(head.rope_rows(positions), head.rope_rows(torch.tensor(index))):
            assert torch.equal(view, row), positions


def test_calibration_scores_every_valued_node_against_the_emitted_tokens(tiny):
    """The head's calibration counts each node it valued whose parent lies on the emitted tokens, drafted or
    not (a bin whose nodes stop being drafted is still scored), right when it is the emitted token."""
    from types import SimpleNamespace

    from draftverify.drafters.feature import Acceptance, FeatureHeadDrafter

    target = tiny("llama", layers=2)
    drafter = FeatureHeadDrafter(random_head(target), Runner(target.model))
    drafter.calibration = Acceptance(prior=0.0)
    drafter.pending = []
    drafter.valued = {
        (): [(5, 0.35), (7, 0.35)],
        (5,): [(9, 0.7)],
        (7,): [(1, 0.7)],
        (5, 9): [(3, 0.7)],
    }  # parent -> children
    drafter.observe(None, [1, 2], None, SimpleNamespace(hidden=None, tokens=[5, 9]))  # the target emitted 5 then 9
    bins = drafter.calibration
    assert bins(0.35) == 0.5 and bins(0.7) == 1.0  # (5,) right, (7,) wrong; (5, 9) right; (7, 1) and (5, 9, 3) unknown
    assert sum(bins.trials) == 3 and drafter.valued == {}


def test_expansion_prices_a_new_node_at_the_row_it_would_take(tiny):
    """The head grows a level only if its best guess is worth the row it would take in the verification: on a
    curve whose second row is free and third dear, a chain stops at one node (it used to price every node at the
    second row's cost and grow levels the tree then left out); on a flat curve it grows to its depth."""
    from types import SimpleNamespace

    from draftverify.drafters.feature import FeatureHeadDrafter

    target = tiny("llama", layers=2)
    drafter = FeatureHeadDrafter(random_head(target), Runner(target.model), depth=4, width=1)
    drafter.calibration = lambda p: 0.5  # every guess: even odds, so a depth-2 node is worth 0.25 of a forward
    grown = {}
    # cost curves in seconds: forwards so dear that the head's own time (`expand_s`, measured) weighs nothing
    for name, table in {"flat": {1: 1.0, 2: 1.0, 4: 1.0}, "third row dear": {1: 1.0, 2: 1.01, 4: 3.0}}.items():
        drafter.costs, drafter.expand_s = table, 0.0
        drafter.cache = HeadCache(drafter.head, capacity=16)
        s = SimpleNamespace(others=0, stats=SimpleNamespace(draft_forwards=0))
        paths = drafter.expand(s, torch.randn(target.model.config.hidden_size), 5, 4)
        grown[name] = (s.stats.draft_forwards, len(paths[0]))
    assert grown == {"flat": (3, 4), "third row dear": (0, 1)}, grown


@pytest.mark.parametrize("method", ["speculative", "ouroboros"])
def test_tree_sampling_matches_the_target(tiny, monkeypatch, method):
    """Sampled decoding verifies the head's tree by multi-draft rejection sampling: the second token
    follows the target's exact law, and the classic wrong rule is caught. The head drafts only the
    four likeliest second tokens, so its guesses are often right and often wrong. Ouroboros over the head
    adds the root's phrases beside the tree: the prompt holds phrases after every token the target can sample first,
    and rows cost nothing, so they are verified whatever the first token was."""
    from draftverify.costs import Table
    from draftverify.drafters import feature

    target = tiny("llama", seed=0, layers=2, hidden=32)
    V = target.model.config.vocab_size
    sampling, n = Sampling(temperature=1.0, top_k=6), 1200

    def first_law(prompt):
        with torch.inference_mode():
            return sampling.probs(target.model(torch.tensor([prompt])).logits[0, -1])

    # ouroboros: the prompt holds a phrase after each token the target can sample first (grown until it does)
    prompt, starts = [5, 9, 14], set()
    while method == "ouroboros":
        support = set(first_law(prompt).nonzero().flatten().tolist())
        if support <= starts:
            break
        starts |= support
        phrases = [(a, (7 * a + 1) % V, (3 * a + 2) % V, (5 * a + 3) % V) for a in sorted(starts)]
        prompt = [t for phrase in phrases for t in phrase] + [5, 9, 14]
    if method == "ouroboros":
        monkeypatch.setattr(feature, "curve", lambda target, widths: Table({w: 1.0 for w in widths}))
    p1 = first_law(prompt)
    p2 = sum(p1[x] * first_law(prompt + [x]) for x in p1.nonzero().flatten().tolist())
    engine = Engine(target, random_head(target, seed=4, vocab=p2.topk(4).indices.tolist()))

    options = {"nodes": 6, "k": 2} if method == "speculative" else {"reuse": False, "lengthening": False}
    roots = []

    def pvalue():
        counts: dict[int, int] = {}
        for seed in range(n):
            r = engine.generate(
                prompt, method=method, max_new_tokens=3, temperature=1.0, top_k=6, seed=seed, eos_token_id=[], **options
            )
            counts[r.tokens[1]] = counts.get(r.tokens[1], 0) + 1
            roots.append(r.stats.extra.get("root_phrases", 0))
        return second_token_pvalue(target.model, prompt, sampling, counts)

    assert pvalue() > 1e-3
    assert method == "speculative" or sum(roots) > n // 2  # the root's phrases were verified in most requests
    broken_rule(monkeypatch)
    assert pvalue() < 1e-4
