"""What a method drafts with (`methods.base.Drafts`): the one declaration the engine, the CLI, the server and the
bench read."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from draftverify import Engine
from draftverify.engine import LazyDraft
from draftverify.errors import DraftVerifyError
from draftverify.feature_head import FeatureHead, HeadConfig
from draftverify.methods import METHODS
from draftverify.methods.base import Artifact, Drafts
from draftverify.methods.spec import drafts_of, loads_drafts, parse_specs

HEAD, MODEL = Artifact.FEATURE_HEAD, Artifact.DRAFT_MODEL


def test_the_engine_hands_the_first_draft_it_has():
    both = Drafts((HEAD, MODEL), required=True)
    assert both.choose(has_head=True) is HEAD and both.choose(has_head=False) is MODEL
    assert Drafts((MODEL,)).choose(has_head=True) is MODEL and Drafts().choose(has_head=True) is None
    assert Drafts((HEAD,)).choose(has_head=False) is None
    assert both.loads and Drafts(beside=(HEAD,)).loads
    assert not Drafts(beside=(Artifact.SKIP_SET,)).loads and not Drafts().loads


def test_a_declaration_that_cannot_hold_is_refused():
    with pytest.raises(DraftVerifyError, match="names what it drafts with"):
        Drafts(required=True)
    with pytest.raises(DraftVerifyError, match="a draft is one of"):
        Drafts((Artifact.SKIP_SET,))


def test_each_method_declares_what_it_drafts_with():
    assert METHODS["speculative"].drafts() == Drafts((HEAD, MODEL), required=True)
    assert METHODS["ouroboros"].drafts().draft == (HEAD, MODEL)
    specdec = METHODS["specdec-pp"]
    assert specdec.drafts().draft == (HEAD, MODEL) and specdec.drafts().beside == (Artifact.ACCEPTANCE_HEAD,)
    assert specdec.drafts(specdec.make_config(drafter="model")).draft == (MODEL,)
    assert METHODS["ouroboros-pp"].drafts().draft == (MODEL,)  # its sentence draft is the draft model's
    assert METHODS["self-speculative"].drafts() == Drafts(beside=(Artifact.SKIP_SET,))
    assert METHODS["autoregressive"].drafts() == Drafts() and METHODS["lookahead"].drafts() == Drafts()
    auto = METHODS["auto"]
    assert auto.drafts(auto.make_config(use="draft+lookup")) == Drafts((MODEL,))
    assert auto.drafts(auto.make_config(use="head+lookup")) == Drafts(beside=(HEAD,))
    assert not auto.drafts(auto.make_config(use="lookup")).required


def test_the_cli_and_the_server_load_drafts_only_for_a_spec_that_drafts_with_them():
    assert loads_drafts(parse_specs("autoregressive,speculative:k2"))
    assert not loads_drafts(parse_specs("autoregressive,lookahead,auto[use=context+lookup]"))
    assert loads_drafts(parse_specs("auto:head"))
    # generation knobs beside the method's options are not the method's to read
    assert drafts_of("speculative", None, {"k": 3, "response_format": {"type": "text"}}).required


def random_head(target) -> FeatureHead:
    torch.manual_seed(0)
    head = FeatureHead(HeadConfig.for_target(target, list(range(target.model.config.vocab_size)))).bind(target)
    head.init_from(target)
    return head.eval()


def test_the_engine_hands_each_method_the_draft_its_declaration_chooses(tiny):
    target = tiny("llama")
    loads = []

    def load():
        loads.append(1)
        return tiny("llama", seed=3, layers=2)

    engine = Engine(target, LazyDraft(load), feature_head=random_head(target))
    assert engine.method("speculative").draft_source is HEAD
    assert engine.method("auto").draft_source is None and engine.method("autoregressive").draft is None
    assert not loads  # no method so far drafts with the draft model: it is not loaded
    assert engine.method("specdec-pp", drafter="model").draft_source is MODEL and loads == [1]
    assert engine.method("auto", use="draft+lookup").draft_source is MODEL
    ar = engine.generate("Hello", method="autoregressive", max_new_tokens=8)
    assert engine.generate("Hello", method="auto", use="draft+lookup", max_new_tokens=8).tokens == ar.tokens


def test_the_methods_listing_says_what_each_drafts_with():
    from draftverify.cli import app

    out = CliRunner().invoke(app, ["methods"])
    assert out.exit_code == 0, out.output
    assert "speculative: drafts with the feature head or the draft model (required)" in out.output
    assert "self-speculative: drafts with the skip set" in out.output
    assert "autoregressive: drafts with nothing" in out.output
