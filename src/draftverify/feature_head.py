"""The feature head: a feature-level draft head (EAGLE family, Li et al. 2024; FR-Spec's frequency-ranked vocabulary).

The head does not read tokens alone: at position t it reads the target's final hidden state
f_t (what the target's LM head turns into the logits for token t + 1) together with the
embedding of token t + 1, and predicts f_{t+1}; the target's own frozen LM head, restricted
to the `vocab` most frequent tokens of the training replies (FR-Spec), turns that into draft
logits. For later draft positions it reads its own predicted features (EAGLE).

    x_t  = fc([norm(f_t) ; norm(embed(token_{t+1}))])   # 2H -> H
    f'_t = norm(decoder_layer(x_t | x_<t))       # one Llama-style layer with its own KV cache
    draft logits for token t + 2 = lm_head[vocab] @ f'_t

Embeddings and LM head are the target's (never stored): a head is bound to its target and
refused on any other. Files: `feature_draft.json` (config, target identity, the vocabulary)
and `model.safetensors` (the head's own weights). Its KV cache is `feature_head_cache.HeadCache`.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from draftverify.backend.linear import QUANT_ROWS, Packs
from draftverify.backend.ops import cpu_kernels, rms_norm, rotate_half
from draftverify.errors import DraftVerifyError, require
from draftverify.util import atomic_path, atomic_write, describe_identity, same_weights

# SDPA's backends for the head's attention on a GPU: not cuDNN's, which recent torch prefers on Hopper in bf16 and
# which builds a plan for each new shape, while drafting meets a new cache length every round
NO_PLAN_PER_SHAPE = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

CONFIG_FILE = "feature_draft.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    vocab: tuple[int, ...]  # target token ids the head can draft, most frequent first
    target: dict  # Loaded.identity of the target it was trained for

    @classmethod
    def for_target(cls, target, vocab: list[int], width: int | None = None) -> "HeadConfig":
        """The head's shapes for `target`: its attention's and norms', an MLP `width` wide (None: the target's)."""
        c = target.model.config
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        theta = getattr(c, "rope_theta", None) or (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return cls(
            c.hidden_size,
            width or c.intermediate_size,
            heads,
            getattr(c, "num_key_value_heads", heads),
            head_dim,
            float(theta),
            float(getattr(c, "rms_norm_eps", 1e-6)),
            tuple(int(v) for v in vocab),
            target.identity,
        )


class FeatureHead(nn.Module):
    """The feature head; `bind(target)` attaches the target's embeddings and restricted LM head."""

    LINEARS = ("fc", "q", "kv", "o", "gate_up", "down")

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = c = config
        h, d = c.hidden_size, c.head_dim
        self.norm_feature = nn.RMSNorm(h, eps=c.rms_eps)  # both inputs at one scale (EAGLE-3): the target's
        self.norm_embed = nn.RMSNorm(h, eps=c.rms_eps)  # final norm leaves features far larger than embeddings
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.norm_in = nn.RMSNorm(h, eps=c.rms_eps)
        self.q = nn.Linear(h, c.num_heads * d, bias=False)
        self.kv = nn.Linear(h, 2 * c.num_kv_heads * d, bias=False)
        self.o = nn.Linear(c.num_heads * d, h, bias=False)
        self.norm_post = nn.RMSNorm(h, eps=c.rms_eps)
        self.gate_up = nn.Linear(h, 2 * c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, h, bias=False)
        self.norm_out = nn.RMSNorm(h, eps=c.rms_eps)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.register_buffer("vocab", torch.tensor(c.vocab, dtype=torch.long), persistent=False)
        self.name = "feature-head"  # the folder's name once loaded
        self._fast: dict | None = None  # prepacked linears for drafting (`pack`)
        self._inputs: tuple | None = None  # the one-call `inputs` kernel's arguments after features, tokens, table
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin tables by position (`rope_rows`)
        self.embed: torch.Tensor | None = None  # [V, H] the target's, frozen (None: read by rows, `embed_tokens`)
        self._embed_rows = None  # a GGUF target's embedding lookup: ids -> rows (`bind`)
        self.lm_head: torch.Tensor | None = None  # [N, H] the target's LM head rows of `vocab`, frozen

    def bind(self, target) -> "FeatureHead":
        """Attach the target's (a `loading.Loaded`) embeddings and LM head, refusing a target it was not trained for."""
        identity = target.identity  # hashes the tokenizer's vocabulary: formed once
        require(
            same_weights(self.config.target, identity),
            f"this feature head was trained for {describe_identity(self.config.target)}, "
            f"not {describe_identity(identity)}: "
            "build one for this target with `draftverify make-draft --kind head`",
        )
        embedding, head = target.model.get_input_embeddings(), target.model.get_output_embeddings()
        if hasattr(embedding, "rows"):  # a GGUF model's embedding (loading.gguf_model): rows dequantized on demand,
            self.embed, self._embed_rows = None, embedding.forward  # never its whole fp32 table
            lm_head = head(self.vocab).contiguous()  # the same bits as the table's rows
        else:
            self.embed, self._embed_rows = embedding.weight.detach(), None
            lm_head = head.weight.detach()[self.vocab.to(head.weight.device)].contiguous()
        self.to(device=lm_head.device, dtype=lm_head.dtype)
        self.lm_head = lm_head
        return self

    @property
    def identity(self) -> dict:
        """The head's own weights in the form of a model identity (`util.same_weights`): what a file made for this
        head (a SpecDec++ acceptance head) is checked against. The fingerprint probes its input layer."""
        return {
            "model_type": "feature-head",
            "num_hidden_layers": 1,
            "hidden_size": self.config.hidden_size,
            "vocab_size": len(self.config.vocab),
            "embedding_fingerprint": round(self.fc.weight[:64].float().sum().item(), 3),
        }

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The target's embedding rows of `tokens` [...] -> [..., H]."""
        return F.embedding(tokens, self.embed) if self._embed_rows is None else self._embed_rows(tokens)

    def pack(self) -> "FeatureHead":
        """Draft through the static path's kernels in eval mode: its linears and its rows of the target's LM head
        on rounded copies (`backend.linear.PackedLinear` with `draft`: Q8_0 blocks, in the q8 tiles at any row count
        where the CPU has AVX-512 VNNI, else for few rows; a draft's precision changes what it proposes,
        never what is accepted), its norms and attention on the target's one-pass kernels. For inference only:
        the packed copies do not follow later changes of the weights."""
        if self._fast is None and self.fc.weight.device.type == "cpu":
            self._packs = Packs()  # the head's own weights: nothing to share with another model's
            self._fast = {name: self._packs.linear([getattr(self, name)], draft=True) for name in self.LINEARS}
            self._fast["qkv"] = self._packs.linear([self.q, self.kv], draft=True)  # q|k|v: `rope_attention`'s layout
            self._fast["lm_head"] = self._lm_head(self.lm_head.shape[0])
            fc = self._fast["fc"].quant
            # `inputs` in one call: its arguments after features, token ids and embedding table, read once
            if fc is not None and (self.embed is None or self.embed.is_contiguous()):
                self._inputs = (self.norm_feature.weight, self.norm_embed.weight, self.norm_feature.eps, fc)
        return self

    def _lm_head(self, n: int):
        """The packed rows of the target's LM head for the head's n most frequent tokens (FR-Spec: a prefix)."""
        return self._packs.linear([SimpleNamespace(weight=self.lm_head[:n], bias=None, out_features=n)], draft=True)

    def _linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        fast = self._fast.get(name) if self._fast is not None and not self.training else None
        if fast is None:
            return getattr(self, name)(x) if name != "lm_head" else x @ self.lm_head.T
        return fast(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)

    def init_from(self, target, layer: int = -1) -> None:
        """Start from a target decoder layer's weights (a better start than random: same feature space); a narrower
        MLP starts from the layer's first units."""
        src = target.model.get_decoder().layers[layer]
        a, m, width = src.self_attn, src.mlp, self.config.intermediate_size
        with torch.no_grad():
            self.q.weight.copy_(a.q_proj.weight)
            self.kv.weight.copy_(torch.cat([a.k_proj.weight, a.v_proj.weight]))
            self.o.weight.copy_(a.o_proj.weight)
            self.gate_up.weight.copy_(torch.cat([m.gate_proj.weight[:width], m.up_proj.weight[:width]]))
            self.down.weight.copy_(m.down_proj.weight[:, :width])
            self.norm_in.weight.copy_(src.input_layernorm.weight)
            self.norm_post.weight.copy_(src.post_attention_layernorm.weight)
            self.norm_out.weight.copy_(target.model.get_decoder().norm.weight)
            h = self.config.hidden_size  # fc starts as the sum of the normalised feature and embedding
            self.fc.weight.zero_()
            self.fc.weight[:, h:].copy_(torch.eye(h))
            self.fc.weight[:, :h].copy_(torch.eye(h))

    # -- the layer, on [B, T, H] inputs with explicit key/value sets -------------------------------

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., T, head_dim] for integer positions [..., T]."""
        angles = positions.to(self.inv_freq.dtype).unsqueeze(-1) * self.inv_freq  # [..., T, d/2]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(self.fc.weight.dtype), angles.sin().to(self.fc.weight.dtype)

    def rope_rows(self, positions: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope` [T, head_dim] for positions [T], read from tables grown on demand (drafting): views of them for a
        `range` (a catch-up) or equal positions (the nodes of one tree level), else a gather each."""
        ints = not isinstance(positions, torch.Tensor)
        end = (max(positions) if ints else int(positions.max())) + 1
        if self._rope is None or self._rope[0].shape[0] < end:
            self._rope = self.rope(
                torch.arange(max(end, 2 * (0 if self._rope is None else self._rope[0].shape[0]), 256))
            )
        cos, sin = self._rope
        if isinstance(positions, range) and positions.step == 1:
            return cos[positions.start : positions.stop], sin[positions.start : positions.stop]
        if ints and min(positions) == end - 1:  # all equal: one row, repeated (stride 0)
            return cos[end - 1].expand(len(positions), -1), sin[end - 1].expand(len(positions), -1)
        index = torch.as_tensor(positions, device=cos.device)
        return cos[index], sin[index]

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        norm = getattr(self, name)
        if self.training:  # in fp32 under a bf16 autocast too (`make-draft --train-dtype`): the norm's own dtype
            return norm(x.to(norm.weight.dtype))
        if self._fast is None:
            return norm(x)
        return rms_norm(x.contiguous(), norm.weight, norm.eps)  # drafting: the static path's one-pass kernel

    def inputs(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[..., H] features and [...] next tokens -> [..., H] layer inputs."""
        if (
            self._inputs is not None
            and not self.training
            and features.dim() == 2
            and features.shape[0] <= QUANT_ROWS
            and features.dtype == torch.float32
        ):  # drafting: one call, the bits of the op-by-op path (which takes fc's copy here)
            table, ids = self.embed, tokens
            if table is None:  # the rows alone, as a table of their own (the bits the whole table holds)
                table, ids = self.embed_tokens(tokens.view(-1)), torch.arange(tokens.numel())
            return cpu_kernels().head_inputs(features.contiguous(), ids, table, *self._inputs)
        return self._linear(
            "fc",
            torch.cat(
                [self._norm("norm_feature", features), self._norm("norm_embed", self.embed_tokens(tokens))],
                dim=-1,
            ),
        )

    def qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T, H] -> q [B, heads, T, d], k and v [B, kv heads, T, d], rotated."""
        c = self.config
        b, t, _ = x.shape
        y = self._norm("norm_in", x)
        q = self._linear("q", y).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        k, v = self._linear("kv", y).view(b, t, 2, c.num_kv_heads, c.head_dim).permute(2, 0, 3, 1, 4)
        cos, sin = self.rope(positions)
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # broadcast over heads
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def finish(
        self, x: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of q over keys/values (mask: bool [T, S], True = may attend), MLP, final norm -> [B, T, H]."""
        c = self.config
        b, _, t, _ = q.shape
        with sdpa_kernel(NO_PLAN_PER_SHAPE) if q.is_cuda else nullcontext():
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, enable_gqa=c.num_heads != c.num_kv_heads
            )
        return self.after_attention(x, out.transpose(1, 2).reshape(b, t, c.num_heads * c.head_dim))

    def after_attention(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Output projection of the attention [B, T, heads * d], MLP, final norm -> [B, T, H]."""
        x = x + self._linear("o", attended)
        gate, up = self._linear("gate_up", self._norm("norm_post", x)).chunk(2, dim=-1)
        x = x + self._linear("down", F.silu(gate) * up)
        return self._norm("norm_out", x)

    def logits(self, features: torch.Tensor, n: int = 0) -> torch.Tensor:
        """[..., H] predicted features -> [..., n] logits over the head's n most frequent tokens (0: all N)."""
        if not n or n == self.lm_head.shape[0]:
            return self._linear("lm_head", features)
        if self._fast is None or self.training:
            return features @ self.lm_head[:n].T
        key = f"lm_head[:{n}]"  # FR-Spec's smaller head: a prefix of the rows, packed as the whole is
        if key not in self._fast:
            self._fast[key] = self._lm_head(n)
        return self._linear(key, features)

    def top(self, features: torch.Tensor, n: int, k: int) -> tuple[list[list[int]], list[list[float]]]:
        """Per row of predicted features [m, H]: the k most likely of the head's n most frequent tokens (target
        ids, most likely first) and their probabilities under the softmax over those n."""
        logits = self.logits(features, n).float()
        kernels = cpu_kernels() if self._fast is not None else None  # packed: on a CPU
        if kernels is not None:  # one pass, no dispatch
            return kernels.top_probs(logits.contiguous(), self.vocab[:n], k)
        top, idx = logits.topk(k, dim=-1)
        return self.vocab[idx].tolist(), (top - logits.logsumexp(-1, keepdim=True)).exp().tolist()

    # -- files -------------------------------------------------------------------------------------

    def save(self, folder: Path, dtype: torch.dtype = torch.float32) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in self.state_dict().items()}
        with atomic_path(folder / WEIGHTS_FILE) as tmp:
            save_file(tensors, str(tmp))
        atomic_write(folder / CONFIG_FILE, json.dumps(asdict(self.config), indent=1))

    @classmethod
    def load(cls, folder: Path) -> "FeatureHead":
        from safetensors.torch import load_file

        folder = Path(folder)
        try:
            raw = json.loads((folder / CONFIG_FILE).read_text())
            head = cls(HeadConfig(**{**raw, "vocab": tuple(raw["vocab"])}))
            head.load_state_dict({k: v.float() for k, v in load_file(str(folder / WEIGHTS_FILE)).items()})
            head.name = folder.name
        except (OSError, ValueError, TypeError, RuntimeError) as exc:
            raise DraftVerifyError(
                f"cannot load the feature head in {folder} ({type(exc).__name__}): rebuild it with "
                "`draftverify make-draft --kind head`"
            ) from exc
        return head.eval().requires_grad_(False)


def is_feature_head(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()
