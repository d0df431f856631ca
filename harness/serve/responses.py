"""OpenAI's response shapes: whole bodies, SSE chunks and error bodies, as plain dicts.

Every choice carries the extension field ``token_ids`` (the emitted ids) and every body, or the
first chunk of a stream, ``prompt_token_ids`` and ``sampler`` (``core.sampling.Sampler.to_json``:
what decided the tokens, greedy at temperature 0), so that an answer can be checked by ``audit
tokens --sampling`` or against any reference.
"""
from __future__ import annotations

import json

COMPLETION, CHAT = "text_completion", "chat.completion"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def head(kind: str, rid: str, created: int, model: str, chunk: bool = False) -> dict:
    return {"id": rid, "object": kind + (".chunk" if chunk and kind == CHAT else ""), "created": created,
            "model": model}


def whole(kind: str, rid: str, created: int, model: str, gen, sampler) -> dict:
    """A non-streaming answer, decoded under ``sampler``."""
    choice = {"index": 0, "finish_reason": gen.finish_reason, "logprobs": None, "token_ids": list(gen.token_ids)}
    if kind == CHAT:
        choice["message"] = {"role": "assistant", "content": gen.text}
    else:
        choice["text"] = gen.text
    return {**head(kind, rid, created, model), "choices": [choice],
            "usage": usage(len(gen.prompt_ids), len(gen.token_ids)), "prompt_token_ids": list(gen.prompt_ids),
            "sampler": sampler.to_json()}


def chunk(kind: str, rid: str, created: int, model: str, text: str | None, token_ids: list[int],
          finish_reason: str | None = None, role: bool = False) -> dict:
    """One streamed piece: ``text`` (None: an empty delta), its ids, and the finish on the last."""
    choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None, "token_ids": token_ids}
    if kind == CHAT:
        delta = {} if text is None else {"content": text}
        choice["delta"] = {"role": "assistant", **delta} if role else delta
    else:
        choice["text"] = text or ""
    return {**head(kind, rid, created, model, chunk=True), "choices": [choice]}


def usage_chunk(kind: str, rid: str, created: int, model: str, gen) -> dict:
    """stream_options.include_usage: the last chunk before [DONE], with no choices."""
    return {**head(kind, rid, created, model, chunk=True), "choices": [],
            "usage": usage(len(gen.prompt_ids), len(gen.token_ids))}


def sse(data: dict | str) -> str:
    """One server-sent event: ``data: JSON`` and a blank line (``[DONE]`` as it is)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "server_error"}


def error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
