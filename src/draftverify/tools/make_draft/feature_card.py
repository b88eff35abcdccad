"""The model card (README.md) written beside a trained feature head: how it was built and how well it agrees."""

from __future__ import annotations

from draftverify.tools.replies import SAMPLED


def model_card(f: dict) -> str:
    acc = " / ".join(f"{a:.3f}" for a in f["heldout_top1"])
    sampled = f["training"].get("sampled", 0)
    replies = (
        "greedy"
        if not sampled
        else f"a greedy one and {sampled} sampled at T={SAMPLED['temperature']}, top-p {SAMPLED['top_p']} each"
    )
    templates = (
        f", and its greedy replies to {f['templates']} prompts written from the project's stdlib templates"
        if f.get("templates")
        else ""
    )
    init = f"\n- Started from the head in `{f['init']}` (its weights and vocabulary)" if f.get("init") else ""
    template_acc = (
        "\n- The same on held-out template prompts: " + " / ".join(f"{a:.3f}" for a in f["template_heldout_top1"])
        if f.get("template_heldout_top1")
        else ""
    )
    when = (
        f"resumed over several runs on {f['machine']} (each run logs its shards' and steps' times)"
        if f.get("resumed")
        else f"whole build {f['minutes']:.0f} minutes on {f['machine']}"
    )
    answered = f.get("prompt_sequences", f["sequences"]) // (1 + sampled)
    arithmetic = ("matmuls in bf16" if f.get("bf16") else "fp32") + (
        "; a resumed build's steps may mix" if f.get("resumed") else ""
    )
    schedule = (
        f"{f['of_steps']} steps of up to {f['batch_tokens']} tokens" if f.get("of_steps") else "steps (not yet timed)"
    )
    kept = (
        f"the weights of step {f['kept_step']}, the best held-out expected chain of the evaluations"
        if f.get("kept_step") is not None
        else "the last weights"
    )
    return f"""# Feature draft head for {f["target"]}

An EAGLE-style draft head (one decoder layer over the target's final hidden state and the next
token's embedding) with a frequency-ranked vocabulary of {f["vocab"]} tokens (FR-Spec), for
draftverify. It uses the target's own embeddings and LM head and is refused on any other model.

- Built with: `{f["command"]}`
- Data: the target's own replies to {answered} prompts of `{f["prompts"]}` ({replies}){templates}; \
{f["tokens"]} tokens with features;
  the benchmark sets were never used.{init}
- Vocabulary coverage of held-out reply tokens: {f["vocab_coverage"]:.1%}
- Training: {f["steps"]} of {schedule} ({arithmetic}); {when}
- Written: {kept}
- Held-out top-1 agreement with the target at draft depth 1 / 2 / ...: {acc}
  (expected accepted chain, greedy: {f["expected_chain"]:.2f} tokens per round before the bonus token){template_acc}
- Settings: `{f["training"]}`
"""
