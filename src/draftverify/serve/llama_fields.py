"""llama-server's request fields, turned into what the OpenAI request models take (`llama.py` has the rest of
the compatibility). Imports no other serve module but the error, so the request parser can use it."""

from __future__ import annotations

from draftverify.serve.api_error import ApiError

MAX_LOGPROBS = 20  # OpenAI's limit on logprobs and top_logprobs, as the request models check


def llama_fields(data: dict, kind: str) -> dict:
    """The request without llama-server's fields, `n_probs` turned into OpenAI's logprobs fields."""
    data = dict(data)
    for name, kinds in (("cache_prompt", (bool,)), ("id_slot", (int,)), ("n_probs", (int,))):
        value = data.get(name)
        if name in data and not (type(value) in kinds and (name != "n_probs" or 0 <= value <= MAX_LOGPROBS)):
            want = "true or false" if name == "cache_prompt" else "an integer"
            want = f"an integer 0..{MAX_LOGPROBS}" if name == "n_probs" else want
            raise ApiError(400, f"{name}: give {want}", param=name, code="invalid_value")
    n_probs = data.pop("n_probs", 0)
    data.pop("cache_prompt", None)
    data.pop("id_slot", None)
    if n_probs and kind == "chat" and "logprobs" not in data and "top_logprobs" not in data:
        data.update(logprobs=True, top_logprobs=n_probs)
    elif n_probs and kind != "chat" and "logprobs" not in data:
        data["logprobs"] = n_probs
    return data
