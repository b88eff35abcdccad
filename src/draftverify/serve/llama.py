"""llama-server compatibility where it costs nothing: its request fields, /tokenize, /detokenize, /props.

Fields (unless the server runs with `--strict`, which refuses them as unknown, as for any other):
`n_probs` is honoured as OpenAI logprobs (completions: `logprobs = n_probs`; chat: `logprobs: true,
top_logprobs = n_probs`) when the request gives no logprobs of its own, 0 meaning none;
`cache_prompt` and `id_slot` are accepted and ignored: every request starts from a fresh cache
(the prefill resets it) in whichever batch slot is free, so there is no prompt cache to reuse
and no slot to pick.

Routes, in llama-server's shapes: `POST /tokenize` {"content", "add_special" (false),
"with_pieces" (false)} -> {"tokens": [ids]} or, with pieces, {"tokens": [{"id", "piece"}]};
`POST /detokenize` {"tokens": [ids]} -> {"content"}; `GET /props` -> the default generation
settings, `total_slots` (the batch size), `model_path`, `chat_template` and `build_info`.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from pydantic import Field, ValidationError

from draftverify.errors import DraftVerifyError, require
from draftverify.serve.api_error import ApiError
from draftverify.serve.http import read_body
from draftverify.serve.protocol import _field_error, _Strict


def check_template(tokenizer, template: str) -> str:
    """A chat template that renders a short conversation, else a one-line error naming the problem."""
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=True, tokenize=False
        )
    except Exception as exc:  # jinja2's syntax and render errors, and whatever the template raises
        first = str(exc).partition("\n")[0]
        raise DraftVerifyError(
            f"the chat template does not render ({type(exc).__name__}: {first}): fix the file"
        ) from exc
    require("u" in text, "the chat template leaves out the messages' content: render each message's content")
    return template


class TokenizeRequest(_Strict):
    content: str
    add_special: bool = False
    parse_special: bool = True  # llama-server's; special tokens in the text are always parsed here
    with_pieces: bool = False


class DetokenizeRequest(_Strict):
    tokens: list[int] = Field(default_factory=list)


async def _parse(request: Request, model):
    service = request.app.state.service
    raw = await read_body(request, service.config.max_body_bytes)
    try:
        return service, model.model_validate(json.loads(raw))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON ({exc}): send a JSON object", code="invalid_json") from exc
    except ValidationError as exc:
        raise _field_error(exc.errors()[0], model) from exc


routes = APIRouter()


@routes.post("/tokenize")
async def tokenize(request: Request):
    """llama-server's /tokenize: the content's token ids (with each one's text when `with_pieces`)."""
    service, req = await _parse(request, TokenizeRequest)
    tokenizer = service.engine.target.tokenizer
    ids = list(tokenizer(req.content, add_special_tokens=req.add_special)["input_ids"]) if req.content else []
    if req.with_pieces:
        return {"tokens": [{"id": t, "piece": tokenizer.decode([t])} for t in ids]}
    return {"tokens": ids}


@routes.post("/detokenize")
async def detokenize(request: Request):
    """llama-server's /detokenize: the text of token ids (special tokens included, as llama-server writes them)."""
    service, req = await _parse(request, DetokenizeRequest)
    vocab = service.engine.target.model.get_input_embeddings().num_embeddings
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise ApiError(
            400, f"token id {bad[0]} is outside the vocabulary 0..{vocab - 1}: send valid ids", param="tokens"
        )
    return {"content": service.engine.target.tokenizer.decode(req.tokens)}


@routes.get("/props")
async def props(request: Request):
    """llama-server's /props: what a request gets by default, the slots, the model and its chat template."""
    from draftverify import __version__

    service = request.app.state.service
    config, target = service.config, service.engine.target
    n_predict = min(config.default_max_tokens, config.max_tokens or config.default_max_tokens)
    params = {"n_predict": n_predict, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": -1}
    return {
        "default_generation_settings": {
            "n_ctx": service.engine.target_runner.max_length,
            "params": {**params, "max_tokens_cap": config.max_tokens, "method": next(iter(service.methods))},
        },
        "total_slots": config.max_batch,
        "model_alias": service.model_name,
        "model_path": str(target.source) if target.source is not None else target.name,
        "chat_template": config.chat_template or getattr(target.tokenizer, "chat_template", None) or "",
        "methods": list(service.methods),
        "build_info": f"draftverify {__version__}",
    }
