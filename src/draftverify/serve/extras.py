"""The OpenAI request fields that change the distribution or report on it.

`knobs` turns a validated request into `Engine.request`'s keyword arguments (`logits.KNOBS`, min_p);
`check_format` refuses a bad response_format before the request is queued (a 400 naming it);
`chat_logprobs` / `completion_logprobs` write the target's logprobs in OpenAI's two shapes
(`protocol.timings` writes llama-server's).
"""

from __future__ import annotations

from draftverify.errors import DraftVerifyError
from draftverify.serve.protocol import ApiError


def knobs(req, kind: str) -> dict:
    """The request's penalties, logit_bias, min_p, response_format and logprobs as `Engine.request` arguments."""
    out = {"min_p": req.min_p}
    if req.presence_penalty:
        out["presence_penalty"] = req.presence_penalty
    if req.frequency_penalty:
        out["frequency_penalty"] = req.frequency_penalty
    if req.logit_bias:
        out["logit_bias"] = dict(req.logit_bias)
    if req.response_format is not None and req.response_format.get("type") != "text":
        out["response_format"] = req.response_format
    if kind == "chat" and req.logprobs:
        out["top_logprobs"] = req.top_logprobs or 0
    elif kind != "chat" and req.logprobs is not None:
        out["top_logprobs"] = req.logprobs
    return out


def check_format(engine, fmt) -> None:
    """Build the request's grammar once now: an invalid schema is the client's 400, not a failed generation."""
    if fmt is None:
        return
    from draftverify.constraints import Grammar, parse_response_format

    try:
        parsed = parse_response_format(fmt)
        if parsed is not None:
            Grammar(parsed, engine.target.tokenizer, engine.eos_ids())
    except DraftVerifyError as exc:
        raise ApiError(400, f"response_format: {exc}", param="response_format", code="invalid_value") from exc


def _text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def chat_logprobs(tokenizer, logprobs) -> dict | None:
    """OpenAI chat's `choices[].logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    if logprobs is None:
        return None

    def entry(token: int, value: float) -> dict:
        text = _text(tokenizer, token)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs
        ]
    }


def completion_logprobs(tokenizer, logprobs, offset: int = 0) -> dict | None:
    """OpenAI completions' `choices[].logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    if logprobs is None:
        return None
    tokens = [_text(tokenizer, lp.token) for lp in logprobs]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{_text(tokenizer, t): v for t, v in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def logprobs_object(kind: str, tokenizer, logprobs, offset: int = 0) -> dict | None:
    return chat_logprobs(tokenizer, logprobs) if kind == "chat" else completion_logprobs(tokenizer, logprobs, offset)
