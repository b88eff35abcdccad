"""`make-draft` on tiny models: training lowers the loss, a built draft loads with plain transformers
and is lossless as a draft, tokenizers and targets must match, and an interrupted build resumes."""

from __future__ import annotations

import json
import shutil
import traceback

import pytest
import torch

from draftverify.engine import Engine
from draftverify.errors import DraftVerifyError
from draftverify.loading import Loaded, load_draft
from draftverify.tools.make_draft.build import DraftConfig, build_draft, write_folder
from draftverify.tools.make_draft.data import chat_ids, generated_records
from draftverify.tools.make_draft.train import candidate_layer_sets, collate, distill_loss, init_draft, trainable

TINY = dict(
    layers=2,
    max_shards=3,
    gen_batch=4,
    max_new_tokens=8,
    heldout_prompts=3,
    batch_tokens=300,
    max_len=160,
    eval_every=2,
    budget_minutes=30,
)
PROMPTS = ["Hello there, how are you?", "def add(a, b):", "Write a poem about the sea."]


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def built(tiny, tmp_path_factory):
    """One draft built (and its work folder) for the tests that only read it."""
    target = tiny("llama", layers=4)
    out = tmp_path_factory.mktemp("draft")
    facts = build_draft(target, out, DraftConfig(**TINY, steps=3), log=quiet, progress=False)
    return target, out, facts


def test_candidate_layer_sets_are_distinct_and_in_range():
    sets = candidate_layer_sets(30, 4)
    assert sets["first"] == (0, 1, 2, 3) and sets["spread"] == (0, 10, 19, 29) and sets["ends"] == (0, 1, 28, 29)
    assert len(set(sets.values())) == len(sets)
    with pytest.raises(DraftVerifyError, match="--layers 30"):
        candidate_layer_sets(30, 30)


def test_training_steps_lower_the_loss(tiny):
    target = tiny("llama", layers=4)
    prompts = [chat_ids(target.tokenizer, [{"role": "user", "content": p}], True) for p in PROMPTS]
    records = generated_records(target, prompts, max_new_tokens=12, k=8, sample=False)
    model = init_draft(target, (0, 3))
    batch = collate(records, max_len=128, device=model.device)
    optimizer = torch.optim.AdamW(trainable(model), lr=3e-3)
    losses = []
    for _ in range(8):
        loss, _ = distill_loss(model, batch)
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert losses[-1] < 0.7 * losses[0], losses
    # Only the copied layers and the norm move; the embeddings and head stay the target's.
    assert torch.equal(model.get_input_embeddings().weight, target.model.get_input_embeddings().weight)


def test_built_draft_loads_with_plain_transformers(built):
    from transformers import AutoModelForCausalLM

    target, out, facts = built
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 2
    assert (out / "README.md").is_file() and (out / "tokenizer.json").is_file()
    card = (out / "README.md").read_text()
    assert (
        f"**{facts['heldout']['agreement']:.3f}**" in card
        and f"**{facts['relative_forward_cost']['ratio']:.2f}x**" in card
    )
    ids = torch.tensor([[3, 4, 5, 6]])
    assert torch.allclose(model(ids).logits, load_draft(str(out), target).model(ids).logits, atol=1e-5)


def slim_copy(target, folder, into):
    """The form the project ships: the same draft without embeddings, in fp16."""
    facts = json.loads((folder / "draftverify.json").read_text())["facts"]
    write_folder(load_draft(str(folder), target).model, target, into, facts, share_embeddings=True, save_dtype="fp16")
    return into


@pytest.mark.parametrize("slim", [False, True])
def test_built_draft_is_lossless_in_the_engine(built, tmp_path, slim):
    target, out, _ = built
    if slim:
        out = slim_copy(target, out, tmp_path / "slim")
        assert (out / "model.safetensors").stat().st_size < 0.7 * (built[1] / "model.safetensors").stat().st_size
    engine = Engine(target, load_draft(str(out), target))
    for prompt in PROMPTS:
        ar = engine.generate(prompt, method="autoregressive", max_new_tokens=16)
        spec = engine.generate(prompt, method="speculative", max_new_tokens=16, policy="constant", k=3)
        assert spec.tokens == ar.tokens
        assert spec.stats.draft_forwards > 0


def test_mismatched_tokenizer_is_refused(built):
    target, out, _ = built
    other = target.tokenizer.__class__.from_pretrained(out)
    other.add_tokens(["<extra>"])
    with pytest.raises(DraftVerifyError, match="tokenizers differ"):
        load_draft(str(out), Loaded(target.model, other, name="other"))


def test_slim_draft_refuses_another_target(built, tiny, tmp_path):
    target, out, _ = built
    slim = slim_copy(target, out, tmp_path / "slim")
    with pytest.raises(DraftVerifyError, match="built for another target"):
        load_draft(str(slim), tiny("llama", seed=1, layers=4))
    (slim / "draftverify.json").write_text("{not json")
    with pytest.raises(DraftVerifyError, match="corrupt"):
        load_draft(str(slim), target)


def test_interrupted_build_resumes_to_the_same_weights(built, tmp_path):
    from safetensors.torch import load_file

    target, _, _ = built
    first = tmp_path / "interrupted"
    build_draft(target, first / "out", DraftConfig(**TINY, steps=2), log=quiet, progress=False)
    state = torch.load(first / "out" / ".make-draft" / "checkpoint.pt", weights_only=True)
    assert state["step"] == 2
    with pytest.raises(DraftVerifyError, match="--resume"):
        build_draft(target, first / "out", DraftConfig(**TINY, steps=4), log=quiet, progress=False)
    build_draft(target, first / "out", DraftConfig(**TINY, steps=4), resume=True, log=quiet, progress=False)
    assert torch.load(first / "out" / ".make-draft" / "checkpoint.pt", weights_only=True)["step"] == 4

    whole = tmp_path / "whole"
    shutil.copytree(first / "out" / ".make-draft" / "data", whole / "work" / "data")  # same data, made once
    build_draft(target, whole / "out", DraftConfig(**TINY, steps=4), work=whole / "work", log=quiet, progress=False)
    a, b = load_file(first / "out" / "model.safetensors"), load_file(whole / "out" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_corrupt_checkpoint_is_refused(built, tmp_path):
    target, _, _ = built
    out = tmp_path / "out"
    build_draft(target, out, DraftConfig(**TINY, steps=1), log=quiet, progress=False)
    (out / ".make-draft" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(DraftVerifyError, match="corrupt"):
        build_draft(target, out, DraftConfig(**TINY, steps=2), resume=True, log=quiet, progress=False)


def test_cli_builds_a_draft(built, tmp_path):
    from typer.testing import CliRunner

    from draftverify.cli import app

    target, _, _ = built
    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    result = CliRunner().invoke(
        app,
        [
            "make-draft",
            "--target",
            str(tmp_path / "target"),
            "--out",
            str(tmp_path / "d"),
            "--layer-ids",
            "0,3",
            "--steps",
            "2",
            "--gen-batch",
            "4",
            "--max-new-tokens",
            "6",
            "--data",
            "chat",
            "--budget-minutes",
            "0.3",
            "--share-embeddings",
        ],
    )
    assert result.exit_code == 0, result.output + "".join(traceback.format_exception(*result.exc_info))
    assert "draftverify.json" in {p.name for p in (tmp_path / "d").iterdir()}


def shard_records(folder) -> list[list]:
    """The records of each data shard of a build's work folder, in shard order."""
    from draftverify.tools.make_draft.data import TrainingRecord

    shards = sorted((folder / "data").glob("shard-*.pt"))
    return [[TrainingRecord(**r) for r in torch.load(path, weights_only=True)["records"]] for path in shards]


def test_prompts_replies_are_the_engines_and_later_passes_are_sampled(tiny, tmp_path):
    """With --prompts the chat data is the target's replies to the file's prompts, decoded by the engine: each
    record is prompt + the engine's greedy reply, one target row per reply token; once every training prompt was
    answered, further shards sample."""
    target = tiny("llama", layers=4)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS + ["Name three colours.", "What is 2 + 2?"]))
    config = DraftConfig(**{**TINY, "heldout_prompts": 2, "max_shards": 3, "data": "chat", "gen_batch": 2}, steps=1)
    facts = build_draft(target, tmp_path / "out", config, prompts=prompts, log=quiet, progress=False)
    assert facts["data"]["replies-greedy"]["sequences"] == 3  # 3 training prompts, 2 a shard: 2 greedy shards
    assert set(facts["data"]) == {"replies-greedy", "replies-sampled"} and facts["prompts"] == str(prompts)

    engine = Engine(target)
    shards = shard_records(tmp_path / "out" / ".make-draft")
    for r in shards[0] + shards[1]:
        prompt = r.ids[: r.start + 1].tolist()
        reply = engine.generate(prompt, method="autoregressive", max_new_tokens=TINY["max_new_tokens"]).tokens
        assert r.ids[r.start + 1 :].tolist() == reply and r.logp.shape[0] == len(reply)
    answered = {tuple(r.ids[: r.start + 1].tolist()) for r in shards[0] + shards[1]}
    assert {tuple(r.ids[: r.start + 1].tolist()) for r in shards[2]} <= answered  # the second pass: same prompts
    card = (tmp_path / "out" / "README.md").read_text()
    assert "`replies-greedy` / `replies-sampled`" in card and "`chat-greedy`" not in card


def test_init_starts_from_a_draft_and_refuses_another_shape(built, tmp_path):
    """--init: training starts from that draft's layers and weights (no steps: the same weights come out); a
    layer count that differs from the draft's is refused."""
    from safetensors.torch import load_file

    target, out, _ = built
    config = DraftConfig(**{**TINY, "max_shards": 1}, steps=0)
    facts = build_draft(target, tmp_path / "again", config, init=out, log=quiet, progress=False)
    assert facts["layers"] == json.loads((out / "draftverify.json").read_text())["facts"]["layers"]
    assert facts["init"] == str(out)
    a, b = load_file(out / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(DraftVerifyError, match="pass --layers 2"):
        build_draft(target, tmp_path / "other", DraftConfig(**{**TINY, "layers": 3}, steps=0), init=out, log=quiet)
