"""draftverify: lossless draft-then-verify decoding for local causal LMs."""

from draftverify.engine import Engine, Result
from draftverify.errors import DraftVerifyError
from draftverify.loading import Loaded, load_draft, load_model, truncated_copy
from draftverify.models import Runner
from draftverify.sampling import Sampling
from draftverify.session import Session, Stopping
from draftverify.stats import Stats
from draftverify.verify import Verdict, verify_chain, verify_tree

__all__ = [
    "DraftVerifyError",
    "Engine",
    "Loaded",
    "Result",
    "Runner",
    "Sampling",
    "Session",
    "Stats",
    "Stopping",
    "Verdict",
    "load_draft",
    "load_model",
    "truncated_copy",
    "verify_chain",
    "verify_tree",
]
__version__ = "0.1.0"
