"""The SpecDec++ acceptance-prediction head and the draft-length policy that uses it.

Huang et al. 2024, "SpecDec++: Boosting Speculative Decoding via Adaptive Candidate Lengths".
A small network f_theta on the draft's final hidden state e_i (read at drafted token Y_i)
predicts p_hat_i = sigmoid(f_theta(e_i)), the chance that Y_i is accepted given that
Y_1..Y_{i-1} were. Drafting stops as soon as the predicted chance that at least one drafted
token is rejected, 1 - prod_i p_hat_i, exceeds a threshold h (Algorithm 2), or at a hard cap.

f_theta is a (D+1)-layer ResNet: D residual blocks e + SiLU(W e + b), then a linear map to one
logit (D = 0 is a linear head). A head file is one safetensors file whose metadata holds the
settings, the training report and the identity of the draft/target pair it was trained for;
loading it for another pair is refused.
"""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftverify.errors import DraftVerifyError, require
from draftverify.policies import DraftPolicy
from draftverify.util import atomic_path, describe_identity, same_weights

HEAD_FORMAT = "draftverify.specdec-head.v1"
DEFAULT_H = 0.7  # the paper's best single setting (with w_rej = 6, D = 3)
DEFAULT_CAP = 20  # the paper's hard cap on the number of candidate tokens


class ResBlock(nn.Module):
    """e -> e + SiLU(W e + b)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        return e + nn.functional.silu(self.linear(e))


class AcceptanceHead(nn.Module):
    """f_theta: D residual blocks then a linear map to one logit per hidden state."""

    def __init__(self, hidden_size: int, depth: int = 0):
        super().__init__()
        require(hidden_size >= 1, f"head hidden size {hidden_size} must be positive")
        require(0 <= depth <= 8, f"head depth D={depth} must lie in 0..8 (the paper uses 0..4)")
        self.hidden_size, self.depth = hidden_size, depth
        self.blocks = nn.Sequential(*[ResBlock(hidden_size) for _ in range(depth)])
        self.out = nn.Linear(hidden_size, 1)
        self.settings: dict = {}  # training settings and report, filled by training or loading
        self.trained_for: dict = {}  # {"draft": identity, "target": identity}, filled by loading

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        """e [..., H] -> acceptance logits [...]."""
        return self.out(self.blocks(e)).squeeze(-1)

    @torch.no_grad()
    def accept_prob(self, e: torch.Tensor) -> float:
        """p_hat for one hidden state e [H] (any dtype or device): `forward` as matrix-vector products, since it runs
        once per drafted token, where a module call's fixed costs are most of the time."""
        weight = self.out.weight
        x = e.to(weight.device, weight.dtype)
        for block in self.blocks:
            x = x + F.silu(torch.addmv(block.linear.bias, block.linear.weight, x))
        logit = torch.addmv(self.out.bias, weight, x).item()
        return 1.0 / (1.0 + math.exp(-logit)) if logit > -700 else 0.0


class AcceptanceHeadPolicy(DraftPolicy):
    """SpecDec++ stopping rule: stop once 1 - prod(p_hat_i) > h, or after `cap` tokens.

    `keep_drafting(n, logits, hidden)` gets the draft's hidden state at the input that produced
    the n-th draft, i.e. the state e_{n-1} reading draft n-1 (for n = 1 it reads the last
    accepted token, which needs no prediction). So, as in Algorithm 2, the prediction for draft
    n-1 decides whether draft n, already sampled from the same forward, is the last one: it
    costs no extra draft forward. The rule looks only at the draft, so sampling stays exact.
    """

    needs_hidden = True

    def __init__(self, head: AcceptanceHead, h: float = DEFAULT_H, cap: int = DEFAULT_CAP):
        require(0 < h < 1, f"threshold h={h} must lie strictly between 0 and 1 (the paper uses 0.1..0.9)")
        require(cap >= 1, f"draft cap {cap} must be at least 1")
        self.head, self.h, self.cap = head, h, cap
        self.all_accepted = 1.0  # prod of p_hat_i over this round's drafts so far

    def max_length(self) -> int:
        return self.cap

    def keep_drafting(self, n: int, logits: torch.Tensor, hidden: torch.Tensor | None) -> bool:
        require(hidden is not None, "the SpecDec++ policy needs the draft's hidden states: call forward(hidden=True)")
        if n == 1:  # a new round: `hidden` reads the last accepted token
            self.all_accepted = 1.0
        else:
            self.all_accepted *= self.head.accept_prob(hidden)
        return n < self.cap and 1.0 - self.all_accepted <= self.h

    def judge(self, n: int, producer: torch.Tensor) -> bool:
        """`keep_drafting` for a drafter that hands the state that *produced* draft n (a feature head: its
        predicted feature, from which draft n is its most likely token; the head file is trained on those states,
        `acceptance_data.label_head_chains`). p_hat_n is then draft n's own, the first draft's included."""
        if n == 1:
            self.all_accepted = 1.0
        self.all_accepted *= self.head.accept_prob(producer)
        return n < self.cap and 1.0 - self.all_accepted <= self.h


# -- files -------------------------------------------------------------------------------


def save_head(path: str | Path, head: AcceptanceHead, draft_identity: dict, target_identity: dict) -> Path:
    """Write the head, its settings and the pair's identity to one safetensors file, atomically."""
    from safetensors.torch import save_file

    metadata = {
        "format": HEAD_FORMAT,
        "hidden_size": str(head.hidden_size),
        "depth": str(head.depth),
        "settings": json.dumps(head.settings),
        "draft": json.dumps(draft_identity),
        "target": json.dumps(target_identity),
    }
    state = {k: v.detach().float().cpu().contiguous() for k, v in head.state_dict().items()}
    with atomic_path(path) as tmp:
        save_file(state, tmp, metadata=metadata)
    return Path(path)


def load_head(
    path: str | Path, draft_identity: dict | None = None, target_identity: dict | None = None, target: str = "..."
) -> AcceptanceHead:
    """Read a head file; refuse a corrupt file or one trained for another draft/target pair (`target`: the target's
    path, which the refusal's command names)."""
    from safetensors import safe_open

    path = Path(path)
    require(
        path.is_file(), f"acceptance head {path} does not exist: train one with `draftverify train-acceptance-head`"
    )
    fix = "retrain it with `draftverify train-acceptance-head`"
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            state = {k: fh.get_tensor(k) for k in fh.keys()}
        require(meta.get("format") == HEAD_FORMAT, f"{path} is not a draftverify acceptance head: {fix}")
        head = AcceptanceHead(int(meta["hidden_size"]), int(meta["depth"]))
        head.load_state_dict(state, strict=True)
        head.settings = json.loads(meta["settings"])
        trained_for = {"draft": json.loads(meta["draft"]), "target": json.loads(meta["target"])}
    except DraftVerifyError:
        raise
    except Exception as exc:  # truncated file, bad header, missing keys, wrong shapes, bad JSON
        raise DraftVerifyError(f"acceptance head {path} is corrupt ({type(exc).__name__}): {fix}") from None
    for role, identity in (("draft", draft_identity), ("target", target_identity)):
        if identity is not None:
            require(
                same_weights(trained_for[role], identity),
                f"acceptance head {path} was trained for another {role} model "
                f"({describe_identity(trained_for[role])}, here {describe_identity(identity)}): train a head for this "
                f"pair with `draftverify train-acceptance-head --target {shlex.quote(target)} --draft DRAFT --out "
                "head.safetensors` (DRAFT: the draft this run uses) and pass -o head=head.safetensors",
            )
    head.trained_for = trained_for
    return head.eval().requires_grad_(False)
