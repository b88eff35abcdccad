"""The draft store and `build-drafts`: lookup by identity and arithmetic, atomic publish, methods finding stored
artifacts without flags, the one-line error, a resumed build, and a whole build on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from draftverify import Engine
from draftverify.drafters.acceptance_head import AcceptanceHead, save_head
from draftverify.drafters.skipsets import SkipSet, save_skip_set
from draftverify.errors import DraftVerifyError
from draftverify.feature_head import FeatureHead, HeadConfig
from draftverify.loading import default_feature_head, store
from draftverify.tools import build_drafts as bd

WORDS = ["apple", "river", "stone", "cloud", "green", "quick", "seven", "paper"]


@pytest.fixture
def root(tmp_path, monkeypatch):
    """The user's store, in a temporary folder (the shipped root stays searched after it)."""
    folder = tmp_path / "drafts"
    monkeypatch.setattr(store, "user_root", lambda: folder)
    return folder


def a_head(target, seed: int = 0) -> FeatureHead:
    torch.manual_seed(seed)
    head = FeatureHead(HeadConfig.for_target(target, list(range(target.model.config.vocab_size)))).bind(target)
    head.init_from(target)
    return head.eval()


def put(root, target, arithmetic: str, **artifacts) -> None:
    """Publish a build of `target` holding `artifacts` (name -> writer(path)) the way build-drafts does."""
    dest = root / store.target_key(target.identity) / arithmetic
    staging = store.staging_folder(dest)
    for name, write in artifacts.items():
        write(staging / bd.FILES[name])
    manifest = {"target": target.identity, "arithmetic": arithmetic, "artifacts": {n: bd.FILES[n] for n in artifacts}}
    if "acceptance" in artifacts:
        manifest["acceptance_for"] = FeatureHead.load(staging / "head").identity
    store.write_manifest(staging, manifest)
    store.publish(staging, dest)


def skip_writer(target, skip=SkipSet((1,), (2,))):
    return lambda path: save_skip_set(path, skip, target.identity)


def test_lookup_keys_by_identity_and_arithmetic(tiny, root):
    a, b = tiny("llama", seed=0), tiny("llama", seed=1)
    put(root, a, "q8", skipset=skip_writer(a))
    found = store.find(a.identity, "q8", "skipset")
    assert found is not None and found.parent.parent.name == store.target_key(a.identity)
    assert store.find(a.identity, "fp32", "skipset") is None  # another arithmetic
    assert store.find(b.identity, "q8", "skipset") is None  # other weights
    assert store.find(a.identity, "q8", "head") is None  # not built
    near = {**a.identity, "embedding_fingerprint": a.identity["embedding_fingerprint"] + 0.01}  # an fp16 copy
    assert store.find(near, "q8", "skipset") == found
    assert store.target_key(a.identity) != store.target_key(b.identity)
    no_tokenizer = {k: v for k, v in a.identity.items() if k != "tokenizer"}  # what a method's runner gives
    assert store.target_key(no_tokenizer) == store.target_key(a.identity)


def test_the_shipped_artifacts_are_a_read_only_root_of_the_same_lookup():
    from draftverify.loading.defaults import SHIPPED_FEATURE_HEAD

    identity = json.loads((SHIPPED_FEATURE_HEAD / "feature_draft.json").read_text())["target"]  # the default model's
    roots = [store.SHIPPED_ROOT]
    for arithmetic in ("q8", "fp32"):
        assert store.find(identity, arithmetic, "head", roots=roots) == SHIPPED_FEATURE_HEAD.resolve()
        head = FeatureHead.load(SHIPPED_FEATURE_HEAD)
        accept = store.find(identity, arithmetic, "acceptance", drafter=head.identity, roots=roots)
        assert accept is not None and accept.name == "feature.safetensors"
        assert store.find(identity, arithmetic, "skipset", roots=roots).parent.name == "skipsets"
    assert store.find(identity, "q8", "acceptance", drafter={**head.identity, "hidden_size": 1}, roots=roots) is None
    assert store.store_roots()[-1] == store.SHIPPED_ROOT  # searched after the user's builds


def test_a_half_written_build_is_never_read_and_publish_replaces(tiny, root):
    a = tiny("llama")
    dest = root / store.target_key(a.identity) / "fp32"
    staging = store.staging_folder(dest)  # a build killed before its rename
    save_skip_set(staging / "skipset.json", SkipSet((1,), ()), a.identity)
    store.write_manifest(staging, {"target": a.identity, "artifacts": {"skipset": "skipset.json"}})
    work = dest.parent / ".fp32.build"  # and a build's work folder
    work.mkdir()
    store.write_manifest(work, {"target": a.identity, "artifacts": {"skipset": "skipset.json"}})
    assert store.find(a.identity, "fp32", "skipset") is None
    store.publish(staging, dest)
    assert store.find(a.identity, "fp32", "skipset") == (dest / "skipset.json").resolve()
    put(root, a, "fp32", skipset=skip_writer(a, SkipSet((), (3,))))  # a rebuild replaces it whole
    assert json.loads((dest / "skipset.json").read_text())["mlp"] == [3]
    assert sorted(p.name for p in dest.parent.iterdir()) == [".fp32.build", "fp32"]  # no old copy left behind
    (dest / "manifest.json").write_text("{not json")
    assert store.find(a.identity, "fp32", "skipset") is None  # a corrupt manifest is no build


def test_methods_find_stored_artifacts_without_flags(tiny, root):
    a = tiny("llama")
    head = a_head(a)
    acceptance = AcceptanceHead(a.model.config.hidden_size, 0)
    put(
        root, a, "fp32", head=lambda p: head.save(p), skipset=skip_writer(a),
        acceptance=lambda p: save_head(p, acceptance, head.identity, a.identity),
    )  # fmt: skip
    assert Engine(a).method("self-speculative").skip == SkipSet((1,), (2,))
    found = default_feature_head(a, "fp32")
    assert found is not None and found.identity == head.identity
    assert found.name == f"{store.target_key(a.identity)}/fp32/head"  # what describe_drafts and records name
    assert default_feature_head(a, "q8") is None  # nothing built in q8 for it
    engine = Engine(a, feature_head=found)
    ids = engine.encode("apple river")
    ar = engine.generate(ids, method="autoregressive", max_new_tokens=12, eos_token_id=[])
    r = engine.generate(ids, method="specdec-pp", max_new_tokens=12, eos_token_id=[])
    assert r.tokens == ar.tokens and engine.method("specdec-pp")._head is not None


def test_missing_artifacts_say_how_to_build_them(tiny, root):
    a, other = tiny("llama", seed=3), tiny("llama", seed=4)
    with pytest.raises(DraftVerifyError, match=r"^no skip set for .*build-drafts --target .*\(about 90 minutes\)$"):
        Engine(a).method("self-speculative")
    assert Engine(a).method("self-speculative", strategy="heuristic").skip.size > 0  # other strategies need none
    engine = Engine(a, other)  # no feature head: specdec-pp drafts with the model and has no head for the pair
    with pytest.raises(DraftVerifyError, match=r"^no feature head for .*build-drafts"):
        engine.generate(engine.encode("apple"), method="specdec-pp", max_new_tokens=4)
    engine = Engine(a, feature_head=a_head(a))  # a feature head but no acceptance head for it
    with pytest.raises(DraftVerifyError, match=r"^no acceptance head for .*build-drafts"):
        engine.generate(engine.encode("apple"), method="specdec-pp", max_new_tokens=4)


def fake_stages(monkeypatch, calls: list, fail: set):
    """Stages that write tiny artifacts at once, record their calls and raise where `fail` says (a kill)."""

    def stage(name, write):
        def run(build):
            calls.append(name)
            if name in fail:
                raise KeyboardInterrupt(f"killed during {name}")
            write(build, build.artifact(name))
            return {"stage": name}

        return run

    def head(build, path):
        a_head(build.target).save(path)

    def acceptance(build, path):
        drafter = FeatureHead.load(build.artifact("head")).identity
        save_head(path, AcceptanceHead(build.target.model.config.hidden_size), drafter, build.target.identity)

    def skipset(build, path):
        save_skip_set(path, SkipSet((0,), ()), build.target.identity)

    for name, write in (("head", head), ("acceptance", acceptance), ("skipset", skipset)):
        monkeypatch.setitem(bd.STAGE_RUNNERS, name, stage(name, write))


def test_an_interrupted_build_resumes_without_redoing_finished_stages(tiny, root, monkeypatch):
    a = tiny("llama", seed=5)
    calls = []
    fake_stages(monkeypatch, calls, fail={"acceptance"})
    engine, quiet = Engine(a), lambda _: None
    with pytest.raises(KeyboardInterrupt):
        bd.build_drafts(a, engine, root=root, log=quiet, progress=False)
    assert calls == ["head", "acceptance"] and store.find(a.identity, "fp32", "head") is None  # nothing published
    with pytest.raises(DraftVerifyError, match="--resume"):
        bd.build_drafts(a, engine, root=root, log=quiet, progress=False)
    fake_stages(monkeypatch, calls, fail=set())
    dest = bd.build_drafts(a, engine, root=root, resume=True, log=quiet, progress=False)
    assert calls == ["head", "acceptance", "acceptance", "skipset"]  # the head was not trained again
    manifest = store.read_manifest(dest)
    assert set(manifest["artifacts"]) == {"head", "acceptance", "skipset"} and manifest["budget_minutes"] == 90
    assert manifest["built_now"] == ["head", "acceptance", "skipset"] and not (dest.parent / ".fp32.build").exists()
    # --only rebuilds one stage and keeps the others; a new feature head drops the acceptance head trained for the old
    bd.build_drafts(a, engine, bd.BuildSettings(stages=("skipset",)), root=root, log=quiet, progress=False)
    assert set(store.read_manifest(dest)["artifacts"]) == {"head", "acceptance", "skipset"}
    bd.build_drafts(a, engine, bd.BuildSettings(stages=("head",)), root=root, log=quiet, progress=False)
    assert set(store.read_manifest(dest)["artifacts"]) == {"head", "skipset"}
    with pytest.raises(DraftVerifyError, match="--only"):
        bd.BuildSettings(stages=("heads",))
    assert bd.BuildSettings().minutes("head") == pytest.approx(63)  # the default split of 90 minutes
    assert bd.BuildSettings(budget_minutes=20, stages=("skipset",)).minutes("skipset") == pytest.approx(20)


def test_a_whole_build_on_a_tiny_model(tiny, root, tmp_path):
    """Every stage for real, with the smallest settings: the methods then find what it built."""
    a = tiny("llama", seed=6, layers=2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{WORDS[i % 8]} {WORDS[i * 3 % 8]} {i}"}) + "\n" for i in range(24))
    )
    head = dict(gen_batch=8, max_new_tokens=16, max_prompt_tokens=64, heldout=4, vocab=60, batch_tokens=512)
    head |= dict(max_len=96, epochs=2, steps=4, lr=3e-3, warmup=2)
    settings = bd.BuildSettings(
        budget_minutes=2, prompts=prompts, acceptance_prompts=prompts, head=head,
        acceptance=dict(max_new_tokens=12, answer_batch=8, epochs=2, holdout=0.2),
        search=dict(trials=2, max_new_tokens=6, give_up=None),
    )  # fmt: skip
    lines = []
    dest = bd.build_drafts(a, Engine(a), settings, root=root, log=lines.append, progress=False)
    manifest = store.read_manifest(dest)
    assert set(manifest["artifacts"]) == {"head", "acceptance", "skipset"}
    assert len(manifest["stages"]["head"]["heldout_top1"]) == 3 and manifest["stages"]["skipset"]["trials"] == 2
    assert manifest["stages"]["head"]["kept_step"] == 4 <= manifest["stages"]["head"]["of_steps"]
    assert sum(line.startswith("[") and " start (" in line for line in lines) == 3
    engine = Engine(a, feature_head=default_feature_head(a, "fp32"))
    assert engine.feature_head is not None
    skip = manifest["stages"]["skipset"]["skip"]
    assert engine.method("self-speculative").skip == SkipSet(tuple(skip["attention"]), tuple(skip["mlp"]))
    ids = engine.encode("apple river 3")
    ar = engine.generate(ids, method="autoregressive", max_new_tokens=12, eos_token_id=[])
    assert engine.generate(ids, method="specdec-pp", max_new_tokens=12, eos_token_id=[]).tokens == ar.tokens


def test_every_shipped_build_is_whole_and_within_the_package_budget():
    """Each target's drafts in the package (`assets/drafts/<target key>/<arithmetic>/`): every artifact its manifest
    lists exists and loads (a feature head, an acceptance head's tensors, a skip set), and what they point at,
    together per target, stays within 40 MB."""
    from safetensors import safe_open

    from draftverify.feature_head import is_feature_head
    from draftverify.util import same_weights

    targets = [p for p in store.SHIPPED_ROOT.iterdir() if p.is_dir()]
    assert targets
    for target in targets:
        files: set = set()
        for folder in (p for p in target.iterdir() if p.is_dir()):
            manifest = store.read_manifest(folder)
            assert manifest is not None, folder
            for kind, relative in manifest["artifacts"].items():
                path = (folder / relative).resolve()
                assert path.exists(), (folder, kind)
                if kind == "head":
                    head = FeatureHead.load(path)
                    assert is_feature_head(path) and same_weights(head.config.target, manifest["target"])
                elif kind == "acceptance":
                    with safe_open(str(path), "pt") as f:
                        assert list(f.keys())
                else:
                    assert json.loads(path.read_text())
                files |= set(path.rglob("*")) if path.is_dir() else {path}
        assert sum(f.stat().st_size for f in files if f.is_file()) <= 40e6, target.name
