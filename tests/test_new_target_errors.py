"""A method that needs something built for a new target says so in one line that names the command to run on that
target's own path (self-speculative's skip set, specdec-pp's and ouroboros-pp's acceptance head)."""

import pytest

from draftverify.drafters.acceptance_head import AcceptanceHead, load_head, save_head
from draftverify.drafters.skipsets import make_skip_set
from draftverify.errors import DraftVerifyError
from draftverify.loading import default_model_path, load_model
from draftverify.loading.hf import model_source


def test_no_skip_set_names_the_search_to_run_on_the_target():
    model = load_model().model  # a GGUF file: its path is what --model takes
    assert model_source(model) == str(default_model_path())
    with pytest.raises(DraftVerifyError) as err:
        make_skip_set("searched", model, None)
    message = str(err.value)
    assert f"`draftverify search-layers --model {default_model_path()} --out skip.json`" in message
    assert "\n" not in message


def test_a_head_for_another_pair_names_the_training_to_run_on_the_target(tiny, tmp_path):
    target, draft, other = tiny("llama"), tiny("llama", seed=1, layers=2), tiny("llama", seed=2, layers=2)
    path = save_head(tmp_path / "h.safetensors", AcceptanceHead(64, depth=1), draft.identity, target.identity)
    with pytest.raises(DraftVerifyError) as err:
        load_head(path, other.identity, target.identity, target="/models/new model.gguf")
    message = str(err.value)
    assert "`draftverify train-acceptance-head --target '/models/new model.gguf' --draft DRAFT" in message
    assert message.endswith("pass -o head=head.safetensors") and "\n" not in message
