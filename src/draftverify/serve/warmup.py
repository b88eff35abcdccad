"""The server's start-up warm-up: what a first client would otherwise wait for is done before serving.

Each method answers a short chat turn, through the chat template the clients' turns go through (`--chat-template` or
the model's), so that:
- a method's pool file is loaded now (a bad one is refused before serving);
- what a method measures once (the cost curves, full ones: no client waits) is measured;
- the template is compiled and, with the prefix cache on, what every chat begins with (the template's opening, e.g.
  a default system prompt) is cached, so the first request prefills only its own turn, as later ones do.
Then structured output's view of the tokenizer is built, and the prefix cache's counters start from zero (they are
the clients')."""

from __future__ import annotations

import logging

from draftverify.constraints import warm

log = logging.getLogger("draftverify.serve")


def warm_up(engine, specs, instances, chat_template: str | None) -> list:
    """Warm `engine` up with each spec's method instance (see the module docstring) -> the instances whose phrase
    pool lives in a file."""
    engine.shared.full_curves = True
    prompt = warm_prompt(engine, chat_template)
    pooled = []
    for spec, method in zip(specs, instances):
        engine.generate(
            prompt, method=spec.name, preset=spec.preset, max_new_tokens=2, temperature=0.0, **dict(spec.options)
        )
        if getattr(method.config, "pool_file", None):
            log.info("pool %s: %d phrases", method.config.pool_file, len(method.pool))
            pooled.append(method)
    warm(engine.target.tokenizer, engine.eos_ids())
    if engine.prefix_cache is not None:
        engine.prefix_cache.reset_counters()
    return pooled


def warm_prompt(engine, chat_template: str | None) -> list[int]:
    """A short chat turn through `chat_template` (else the tokenizer's); one token where there is no template, or
    where the template does not render a lone user turn (it may ask for more: each request then says so itself)."""
    if not (chat_template or getattr(engine.target.tokenizer, "chat_template", None)):
        return [0]
    try:
        return engine.encode([{"role": "user", "content": "Hi"}], chat=True, chat_template=chat_template)
    except Exception as exc:  # jinja2's render errors, and whatever the template raises
        log.warning("warm-up without the chat template, which does not render a lone user turn: %s", exc)
        return [0]
