"""SpecDec++ over a feature head, and `speculative` over it, on CUDA: greedy output against autoregressive decoding's.

    python scripts/cuda_head_check.py MODEL_DIR OUT.json cuda

MODEL_DIR: a model of the default target's shape made by `scripts/cuda_probe.py make-model` (random weights, loaded
in fp32 here), with a random feature head and a random acceptance head made for it. Writes, per method and prompt,
whether the 48 greedy tokens equal autoregressive decoding's and the wall milliseconds a token. Random weights
accept nothing, so the times are each round's cost with nothing gained, not speedups."""

import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftverify import Engine
from draftverify.drafters.acceptance_head import AcceptanceHead, save_head
from draftverify.feature_head import FeatureHead, HeadConfig
from draftverify.loading import Loaded

path, out, device = sys.argv[1], sys.argv[2], sys.argv[3]
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
target = Loaded(model, AutoTokenizer.from_pretrained(path), "shape")
torch.manual_seed(0)
head = FeatureHead(HeadConfig.for_target(target, list(range(4096)))).bind(target)
head.init_from(target)
torch.manual_seed(1)
acc = save_head("/tmp/acc.safetensors", AcceptanceHead(model.config.hidden_size, 1), head.identity, target.identity)
engine = Engine(target, head)
prompts = ["Explain recursion to a child.", "Write a Python function that reverses a list."]
rows = []
for method, options in (("autoregressive", {}), ("speculative", {}), ("specdec-pp", {"head": str(acc)})):
    engine.generate(prompts[0], chat=True, method=method, max_new_tokens=8, **options)  # warm-up
    for prompt in prompts:
        ar = engine.generate(prompt, chat=True, method="autoregressive", max_new_tokens=48)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        o = engine.generate(prompt, chat=True, method=method, max_new_tokens=48, **options)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        rows.append(
            {
                "method": method,
                "prompt": prompt,
                "identical": o.tokens == ar.tokens,
                "ms_per_token": 1000 * wall / max(1, len(o.tokens)),
                "tokens": len(o.tokens),
                "target_forwards": o.stats.target_forwards,
                "drafted": o.stats.drafted,
            }
        )
        print(rows[-1], flush=True)
json.dump(
    {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__, "rows": rows},
    open(out, "w"),
    indent=1,
)
