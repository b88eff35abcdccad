"""`draftverify demo`'s prompts and its table: each prompt answered by autoregressive decoding and by each method,
the methods that cannot run on the target left out with the line that says what to build."""

from __future__ import annotations

import typer

from draftverify.errors import MissingDrafts

DEMO_PROMPTS = {  # one of each kind of request: open chat, code, a summary of text in the prompt
    "chat": "Explain in a few sentences why the sky is blue.",
    "code": "Write a Python function is_palindrome(s) that ignores case and spaces. Add a docstring.",
    "summary": "Summarize in two sentences: The town council met on Tuesday to discuss the new library. The library "
    "will open next spring on Main Street. It will have a reading room, a children's corner and free internet. The "
    "council said the library will cost two million dollars, paid by the state and by local donors.",
}


def runnable(engine, specs) -> list:
    """The specs that run on this target (each warmed up on a short prompt); one whose drafts were never built for
    it is left out with the one line that says how to build them."""
    runnable = []
    for spec in specs:
        try:
            engine.generate(
                "Hello", method=spec.name, preset=spec.preset, max_new_tokens=8, chat=True, **dict(spec.options)
            )
        except MissingDrafts as exc:
            typer.echo(f"{spec.label}: left out: {exc}", err=True)
        else:
            runnable.append(spec)
    return runnable


def run(engine, text: str, specs, max_new_tokens: int) -> list:
    """One run of a prompt: the autoregressive result, then each method's."""
    ar = engine.generate(text, method="autoregressive", max_new_tokens=max_new_tokens, chat=True)
    return [ar] + [
        engine.generate(
            text, method=spec.name, preset=spec.preset, max_new_tokens=max_new_tokens, chat=True, **dict(spec.options)
        )
        for spec in specs
    ]


def row(name: str, runs: list[list], methods: int) -> tuple[list[str], bool]:
    """A prompt's table row (medians over the runs) and whether every method's output was identical in every run."""
    from statistics import median

    row, same = [name, f"{median(run[0].stats.tokens_per_s for run in runs):.1f}"], True
    for i in range(1, methods + 1):
        identical = all(run[i].tokens == run[0].tokens for run in runs)
        same &= identical
        row += [
            f"{median(run[i].stats.tokens_per_s for run in runs):.1f}",
            f"{median(run[0].stats.wall_s / run[i].stats.wall_s for run in runs):.2f}x",
            "yes" if identical else "NO",
        ]
    return row, same
