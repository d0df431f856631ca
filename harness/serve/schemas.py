"""What a request may ask: OpenAI's request bodies as pydantic models, and the checks that turn
anything this server cannot honour into a clear 400.

Decoding is exact, one sequence per request: greedy, or under the seeded sampler the request's
temperature, top_k, top_p, min_p and seed define (``request_sampler``; temperature absent or 0 is
greedy, the seed defaults to 0). Every other control must be at its neutral value (or absent) and
every field the server does not know is refused rather than ignored: a client never gets an answer
computed differently from what it asked for without being told.
"""
from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from core.sampling import GREEDY, Sampler, SamplerError

Strict = ConfigDict(strict=True, extra="forbid")


class BadRequest(Exception):
    """A request this server cannot honour: answered 400 with ``message`` (and ``param``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = Strict
    include_usage: bool | None = None


class TextPart(BaseModel):
    model_config = Strict
    type: str
    text: str


class Message(BaseModel):
    """One chat message. ``content`` is required for every role: without ``tool_calls`` (tools are
    not supported) OpenAI requires it of an assistant message too. ``role`` is checked by
    ``chat_messages`` against ``ROLES``."""

    model_config = ConfigDict(strict=True, extra="forbid")
    role: str
    content: str | list[TextPart]
    name: str | None = None


class Sampling(BaseModel):
    """The fields both endpoints share; ``request_sampler`` turns the sampling ones into a sampler."""

    model_config = Strict
    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | int | None = None
    top_p: float | int | None = None
    top_k: int | None = None
    min_p: float | int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | int | None = None
    frequency_penalty: float | int | None = None
    logit_bias: dict[str, float | int] | None = None
    seed: int | None = None  # the sampler's seed (default 0); greedy decoding draws nothing
    user: str | None = None


class CompletionBody(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    best_of: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None


class ChatBody(Sampling):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None


@dataclass(frozen=True)
class Limits:
    """What the server was started with: the name requests must give and the bounds on max_tokens."""

    served_model_name: str
    default_max_tokens: int
    max_new_tokens_limit: int
    vocab_size: int | None = None


# field: (the values that mean "one sequence, plain text, nothing beyond the sampler", what to say otherwise)
GREEDY_ONLY = {
    "n": ((None, 1), "one choice per request (n must be 1 or absent)"),
    "best_of": ((None, 1), "one choice per request (best_of must be 1 or absent)"),
    "presence_penalty": ((None, 0), "penalties change the greedy answer and are not implemented"),
    "frequency_penalty": ((None, 0), "penalties change the greedy answer and are not implemented"),
    "echo": ((None, False), "echo is not supported (the prompt's ids are in prompt_token_ids)"),
    "logprobs": ((None, False), "logprobs are not implemented"),
    "top_logprobs": ((None, 0), "logprobs are not implemented"),
    "suffix": ((None, ""), "suffix (insertion) is not supported"),
    "stop": ((None, [], ""), "stop sequences are not supported: decoding stops after EOS or max_tokens"),
    "logit_bias": ((None, {}), "logit_bias changes the greedy answer and is not supported"),
    "tools": ((None, []), "tools are not supported"),
    "tool_choice": ((None, "none"), "tools are not supported"),
}


def is_value(value, allowed) -> bool:
    """``value`` is ``allowed``, with None and booleans compared by identity (so that 0 is not False)."""
    if allowed is None or isinstance(allowed, bool) or isinstance(value, bool):
        return value is allowed
    return value == allowed


def check_supported(body: Sampling, limits: Limits) -> None:
    """Refuse anything that is not greedy, one sequence, the served model, max_tokens in bounds."""
    for field, (allowed, why) in GREEDY_ONLY.items():
        value = getattr(body, field, None)
        if not any(is_value(value, a) for a in allowed):
            raise BadRequest(f"{field}={value!r}: {why}", field)
    fmt = getattr(body, "response_format", None)
    if fmt not in (None, {"type": "text"}):
        raise BadRequest(f"response_format={fmt!r}: only plain text is supported", "response_format")
    if body.model is not None and body.model != limits.served_model_name:
        raise BadRequest(f"model {body.model!r} is not served here: this server serves "
                         f"{limits.served_model_name!r}", "model")


# the sampling fields and the value that switches each off
NEUTRAL = {"temperature": 0, "top_k": 0, "top_p": 1, "min_p": 0}


def request_sampler(body: Sampling, samples: bool) -> Sampler:
    """The sampler a request asks for (``core.sampling``): temperature (absent: 0, greedy), top_k,
    top_p, min_p, seed (absent: 0). ``samples``: whether the decoder can sample at all. A filter
    given at temperature 0 would be silently ignored, so it is refused."""
    asked = {f: getattr(body, f) for f in NEUTRAL if getattr(body, f) is not None}
    active = [f for f, v in asked.items() if v != NEUTRAL[f]]
    if active and not samples:
        raise BadRequest(f"{active[0]}={asked[active[0]]!r}: sampling is not implemented by this server's decoder "
                         "(it decodes greedily: leave the sampling fields out or at their neutral values)", active[0])
    if not asked.get("temperature") and active:
        raise BadRequest(f"{active[0]}={asked[active[0]]!r} has no effect at temperature 0 (greedy): give a "
                         "temperature above 0 to sample", active[0])
    if not asked.get("temperature"):
        return GREEDY
    try:
        return Sampler(**{k: v for k, v in asked.items()}, seed=0 if body.seed is None else body.seed)
    except SamplerError as exc:
        raise BadRequest(str(exc), str(exc).split(" ", 1)[0]) from None


def max_new_tokens(body: Sampling, limits: Limits) -> int:
    """max_tokens (chat: or max_completion_tokens), 1..limit; absent: the server's default."""
    field, value = "max_tokens", body.max_tokens
    if isinstance(body, ChatBody) and body.max_completion_tokens is not None:
        if value is not None and value != body.max_completion_tokens:
            raise BadRequest("max_tokens and max_completion_tokens differ: give one", "max_completion_tokens")
        field, value = "max_completion_tokens", body.max_completion_tokens
    if value is None:
        return limits.default_max_tokens
    if not 1 <= value <= limits.max_new_tokens_limit:
        raise BadRequest(f"{field}={value}: must be between 1 and {limits.max_new_tokens_limit} "
                         "(this server's --max-new-tokens-limit)", field)
    return value


def completion_prompt(body: CompletionBody, limits: Limits) -> str | list[int]:
    """The one prompt of a completion request: text, or token ids (checked against the vocabulary)."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise BadRequest(f"{len(prompt)} prompts in one request: batched prompts are not supported, "
                             "send one prompt per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, list):
        bad = [t for t in prompt if t < 0 or (limits.vocab_size is not None and t >= limits.vocab_size)]
        if bad:
            raise BadRequest(f"prompt token id {bad[0]} is outside the vocabulary "
                             f"(0..{(limits.vocab_size or 0) - 1})", "prompt")
    if len(prompt) == 0:
        raise BadRequest("the prompt is empty: greedy decoding needs at least one prompt token", "prompt")
    return prompt


# the roles the chat template is given as they are (ChatML and Qwen's templates know these three)
ROLES = ("system", "user", "assistant")
# OpenAI's other roles, and why this server refuses them rather than render or drop them
OTHER_ROLES = {
    "developer": "the chat template has no developer role: send these instructions as a 'system' message",
    "tool": "tool messages are not supported (tools are not supported)",
    "function": "function messages are not supported (tools are not supported)",
}


def chat_messages(body: ChatBody) -> list[dict]:
    """The messages as plain dicts for the chat template: roles system, user and assistant only,
    text parts joined, other parts refused."""
    if not body.messages:
        raise BadRequest("messages is empty", "messages")
    out = []
    for i, m in enumerate(body.messages):
        if m.role not in ROLES:
            why = OTHER_ROLES.get(m.role, f"the role must be one of {', '.join(map(repr, ROLES))}")
            raise BadRequest(f"messages[{i}]: role {m.role!r} is not supported: {why}", "messages")
        content = m.content
        if isinstance(content, list):
            if not content:
                raise BadRequest(f"messages[{i}]: content is an empty list of parts (give at least one "
                                 "text part, or a string)", "messages")
            kinds = {p.type for p in content} - {"text"}
            if kinds:
                raise BadRequest(f"messages[{i}]: content parts of type {sorted(kinds)} are not supported "
                                 "(text only)", "messages")
            content = "".join(p.text for p in content)
        out.append({"role": m.role, "content": content, **({"name": m.name} if m.name else {})})
    return out


def include_usage(body: Sampling) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)
