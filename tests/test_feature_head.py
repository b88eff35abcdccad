"""The feature draft head: training matches drafting, drafting with it is lossless, builds resume."""

from __future__ import annotations

import json
import traceback

import pytest
import torch
import torch.nn.functional as F
from phrase_sampling import broken_rule, second_token_pvalue

from draftverify import Engine
from draftverify.errors import DraftVerifyError
from draftverify.feature_head import FeatureHead, HeadConfig
from draftverify.feature_head_cache import HeadCache
from draftverify.loading import load_draft
from draftverify.models import Runner
from draftverify.sampling import Sampling
from draftverify.tools.make_draft.feature_head import HeadTraining, build_head
from draftverify.tools.make_draft.feature_losses import head_losses, rollout, rollout_mask
from draftverify.tools.make_draft.features import FeatureCache, FeaturePlan, generate

WORDS = ["apple", "river", "stone", "cloud", "green", "quick", "seven", "paper"]
TINY = dict(
    gen_batch=8,
    max_new_tokens=24,
    max_prompt_tokens=64,
    heldout=4,
    vocab=60,
    batch_tokens=512,
    max_len=96,
    epochs=30,
    budget_minutes=2.0,
    lr=3e-3,
    warmup=5,
)


def quiet(_):
    pass


def random_head(target, seed: int = 0, vocab: list[int] | None = None) -> FeatureHead:
    torch.manual_seed(seed)
    vocab = vocab or list(range(target.model.config.vocab_size))
    head = FeatureHead(HeadConfig.for_target(target, vocab)).bind(target)
    head.init_from(target)
    with torch.no_grad():
        head.fc.weight.add_(0.3 * torch.randn_like(head.fc.weight))
    return head.eval()


@pytest.fixture(scope="module")
def built(tiny, tmp_path_factory):
    """A head trained for a few seconds on a tiny target's replies to 48 prompts."""
    target = tiny("llama", layers=2)
    folder = tmp_path_factory.mktemp("head")
    prompts = folder / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{WORDS[i % 8]} {WORDS[i * 3 % 8]} {i}"}) + "\n" for i in range(48))
    )
    facts = build_head(target, folder / "out", prompts, HeadTraining(**TINY), log=quiet, progress=False)
    return target, folder / "out", prompts, facts


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


@pytest.mark.parametrize("backend", ["static", "eager"])
def test_speculative_and_ouroboros_with_the_head_are_lossless(built, backend):
    target, out, _, _ = built
    engine = Engine(target, load_draft(str(out), target), backend=backend)
    accepted = 0
    for prompt in ("apple river 3", "cloud stone seven", "paper"):
        ids = engine.encode(prompt, chat=True)
        ar = engine.generate(ids, method="autoregressive", max_new_tokens=30, eos_token_id=[])
        options_list = ({}, {"nodes": 12}, {"preset": "chain", "nodes": 5}, {"k": 2, "nodes": 4})
        for method, options in [("speculative", o) for o in options_list] + [("ouroboros", {})]:
            r = engine.generate(ids, method=method, max_new_tokens=30, eos_token_id=[], **options)
            assert r.tokens == ar.tokens, (backend, prompt, method, options)
            accepted += r.stats.accepted
    assert accepted > 20  # the trained head agrees with its target: the accepted paths' features are exercised


def test_a_long_prompt_feeds_the_head_only_its_latest_positions(built, monkeypatch):
    """The head's catch-up is capped (feature.CATCH_UP; auto's head at auto.HEAD_CATCH_UP): a prompt longer than the
    cap, and rounds sat out in `auto`, feed only the latest positions; the head still drafts and output is AR's."""
    from draftverify.drafters import feature
    from draftverify.methods import auto

    monkeypatch.setattr(feature, "CATCH_UP", 6)
    monkeypatch.setattr(auto, "HEAD_CATCH_UP", 5)  # auto's head feeds fewer
    fed = []
    forward = feature.HeadCache.forward

    def catch_up(self, f, t, p, mask=None):  # the catch-up forwards (an expansion passes its tree mask)
        if mask is None:
            fed.append(len(t))
        return forward(self, f, t, p, mask)

    monkeypatch.setattr(feature.HeadCache, "forward", catch_up)
    target, out, _, _ = built
    engine = Engine(target, load_draft(str(out), target))
    ids = engine.encode("apple river 3 cloud stone seven paper apple river", chat=True)
    assert len(ids) > 6
    ar = engine.generate(ids, method="autoregressive", max_new_tokens=30, eos_token_id=[])
    runs = (("speculative", {"preset": "chain"}, 6), ("auto", {"use": "head+context", "probe": 3}, 5))
    for method, options, most in runs:
        fed.clear()
        r = engine.generate(ids, method=method, max_new_tokens=30, eos_token_id=[], **options)
        assert r.tokens == ar.tokens and max(fed) == most, (method, fed)
    fixed = engine.generate(ids, method="speculative", preset="chain", nodes=3, max_new_tokens=30, eos_token_id=[])
    assert (
        fixed.tokens == ar.tokens and fixed.stats.drafted > 0
    )  # a fixed tree size: the head drafts after a capped catch-up


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


def test_the_head_is_refused_on_another_target(built, tiny):
    _, out, _, _ = built
    with pytest.raises(DraftVerifyError, match="make-draft --kind head"):
        load_draft(str(out), tiny("llama", seed=5, layers=2))


def test_built_head_has_a_card_and_learned(built):
    _, out, _, facts = built
    card = (out / "README.md").read_text()
    assert "Built with" in card and f"{facts['heldout_top1'][0]:.3f}" in card and "whole build" in card
    assert facts["heldout_top1"][0] > 0.3, facts["heldout_top1"]


def test_bf16_training_computes_the_fp32_loss_and_gradients_closely(tiny):
    """`--train-dtype bf16` runs the matmuls in bf16 and keeps the norms, weights and loss in fp32: the same
    loss and gradient direction as fp32 to bf16's precision (not a different objective)."""
    target = tiny("llama", layers=2)
    head = random_head(target).train()
    torch.manual_seed(1)
    ids = torch.randint(0, target.model.config.vocab_size, (3, 20))
    feats = 4 * torch.randn(3, 19, target.model.config.hidden_size)
    args = (ids, feats, torch.tensor([20, 17, 12]), torch.tensor([4, 6, 2]), 3, 0.1)
    grads, losses = [], []
    for bf16 in (False, True):
        head.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = head_losses(head, *args)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(torch.cat([p.grad.flatten() for p in head.parameters() if p.grad is not None]))
    assert losses[1] == pytest.approx(losses[0], rel=1e-3)
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0) > 0.999
    with pytest.raises(DraftVerifyError, match="--train-dtype"):
        HeadTraining(train_dtype="fp16")


def test_interrupted_build_resumes_to_the_same_weights(built, tmp_path):
    target, _, prompts, _ = built
    settings = {**TINY, "epochs": 2}
    whole = build_head(target, tmp_path / "a", prompts, HeadTraining(**settings, steps=6), log=quiet, progress=False)
    build_head(target, tmp_path / "b", prompts, HeadTraining(**settings, steps=3), log=quiet, progress=False)
    with pytest.raises(DraftVerifyError, match="--resume"):
        build_head(target, tmp_path / "b", prompts, HeadTraining(**settings, steps=6), log=quiet, progress=False)
    resumed = build_head(
        target, tmp_path / "b", prompts, HeadTraining(**settings, steps=6), resume=True, log=quiet, progress=False
    )
    assert resumed["steps"] == whole["steps"] == 6
    assert "resumed over several runs" in (tmp_path / "b" / "README.md").read_text()
    a = FeatureHead.load(tmp_path / "a").state_dict()
    b = FeatureHead.load(tmp_path / "b").state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_bad_prompt_file_gets_a_one_line_error(built, tmp_path):
    target, _, _, _ = built
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "fine"}\nnot json\n')
    with pytest.raises(DraftVerifyError, match="line 2 is not a JSON object"):
        build_head(target, tmp_path / "x", bad, HeadTraining(**TINY), log=quiet, progress=False)


def test_cli_builds_a_head(built, tmp_path):
    from typer.testing import CliRunner

    from draftverify.cli import app

    target, _, prompts, _ = built
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    result = CliRunner().invoke(
        app,
        [
            "make-draft",
            "--kind",
            "head",
            "--target",
            str(tmp_path / "target"),
            "--prompts",
            str(prompts),
            "--out",
            str(tmp_path / "h"),
            "--vocab",
            "50",
            "--epochs",
            "1",
            "--gen-batch",
            "16",
            "--max-new-tokens",
            "8",
            "--heldout",
            "4",
            "--budget-minutes",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output + "".join(traceback.format_exception(*result.exc_info))
    assert {"feature_draft.json", "model.safetensors", "README.md"} <= {p.name for p in (tmp_path / "h").iterdir()}
    result = CliRunner().invoke(app, ["make-draft", "--kind", "head", "--out", str(tmp_path / "h2")])
    assert result.exit_code != 0 and "--prompts" in str(result.exception)


def test_batched_replies_match_model_generate_and_feature_t_gives_token_t_plus_1(tiny):
    target = tiny("llama", layers=2)
    prompts = [[1, 5, 9, 13], [2, 7], [3, 3, 8, 21, 4, 6]]
    runners = [Runner(target.model) for _ in prompts]
    assert runners[0].static is not None
    ours = generate(target, prompts, 12, runners=runners)
    stock = generate(target, prompts, 12)
    for a, b, p in zip(ours, stock, prompts):
        assert a.ids.tolist() == b.ids.tolist() and a.start == b.start == len(p)
        assert a.features.shape == (len(a.ids) - 1, target.model.config.hidden_size)
        assert torch.allclose(a.features.float(), b.features.float(), atol=2e-2)
        greedy = (a.features.float() @ target.model.get_output_embeddings().weight.T).argmax(-1)
        assert greedy[a.start - 1 :].tolist() == a.ids[a.start :].tolist()  # feature t: what produced token t + 1
    sampled = generate(target, prompts, 12, seeds=[7, 8, 9], runners=runners)
    again = generate(target, prompts, 12, seeds=[7, 8, 9], runners=runners)
    assert [s.ids.tolist() for s in sampled] == [s.ids.tolist() for s in again]
    assert [s.ids.tolist() for s in sampled] != [s.ids.tolist() for s in ours]
    by_generate = [
        generate(target, prompts, 12, seeds=[7, 8, 9]) for _ in range(2)
    ]  # model.generate samples too, seeded
    assert [s.ids.tolist() for s in by_generate[0]] == [s.ids.tolist() for s in by_generate[1]]


def test_sampled_replies_join_each_shard_and_an_older_plan_still_fits(tiny, tmp_path):
    target = tiny("llama", layers=2)
    plan = dict(target=target.identity, prompts="p:12", seed=0, heldout=2, max_prompt_tokens=64, max_new_tokens=6)
    texts = [f"{WORDS[i % 8]} {WORDS[i * 5 % 8]}" for i in range(12)]
    cache = FeatureCache(tmp_path, FeaturePlan(**plan, sampled=2))
    cache.fill(target, texts, 5, deadline=float("inf"), log=quiet)
    shards = [cache.load(p) for p in cache.shards()]
    assert [len(s) for s in shards] == [
        15,
        15,
    ]  # 10 training prompts in batches of 5, a greedy and 2 sampled replies each
    assert all(
        s[i].ids[: s[i].start].tolist() == s[i + 5].ids[: s[i + 5].start].tolist() for s in shards for i in range(5)
    )
    assert len(cache.heldout()) == 2  # held out: greedy only
    old = tmp_path / "old"
    FeatureCache(old, FeaturePlan(**plan))
    stored = json.loads((old / "features" / "plan.json").read_text())
    del stored["sampled"]  # a cache made before the setting existed
    (old / "features" / "plan.json").write_text(json.dumps(stored))
    FeatureCache(old, FeaturePlan(**plan))
    with pytest.raises(DraftVerifyError, match="another target or settings"):
        FeatureCache(old, FeaturePlan(**plan, sampled=1))


def test_template_prompts_add_data_beside_the_prompts_and_init_starts_from_a_head(built, tiny, tmp_path):
    """`--templates N` answers N prompts written from the stdlib templates into a folder of its own (the replies to
    --prompts stay usable); `--init HEAD` starts from that head's weights and vocabulary."""
    target, out, prompts, facts = built
    settings = {**TINY, "max_prompt_tokens": 256}
    plain = build_head(
        target,
        tmp_path / "a",
        prompts,
        HeadTraining(**settings, steps=0),
        work=tmp_path / "w",
        log=quiet,
        progress=False,
    )
    more = build_head(
        target,
        tmp_path / "b",
        prompts,
        HeadTraining(**settings, templates=24, steps=0),
        work=tmp_path / "w2",
        init=out,
        log=quiet,
        progress=False,
    )
    assert len(list((tmp_path / "w2" / "features-templates").glob("shard-*.pt"))) >= 1
    assert plain["prompt_sequences"] == more["prompt_sequences"] == plain["sequences"] < more["sequences"]
    assert (
        more["template_heldout_top1"] is not None and "stdlib templates" in (tmp_path / "b" / "README.md").read_text()
    )
    start, head = FeatureHead.load(out), FeatureHead.load(tmp_path / "b")
    assert head.config.vocab == start.config.vocab
    assert all(torch.equal(a, b) for a, b in zip(start.state_dict().values(), head.state_dict().values()))
    with pytest.raises(DraftVerifyError, match="another target or settings"):  # another count is another data set
        build_head(
            target,
            tmp_path / "c",
            prompts,
            HeadTraining(**settings, templates=12, steps=0),
            work=tmp_path / "w2",
            resume=True,
            log=quiet,
            progress=False,
        )
    with pytest.raises(
        DraftVerifyError, match="make-draft --kind head"
    ):  # another target's head, refused before any data
        build_head(
            tiny("llama", seed=5, layers=2),
            tmp_path / "d",
            prompts,
            HeadTraining(**settings, steps=0),
            work=tmp_path / "w3",
            init=out,
            log=quiet,
            progress=False,
        )
    assert not (tmp_path / "w3" / "features" / "heldout.pt").exists()
