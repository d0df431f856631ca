"""The public Python API: open an exact decoder on a model, then generate text or token ids.

    from decoders.api import open_decoder
    dec = open_decoder("small", "spec")
    gen = dec.generate("def fib(n):", 64, on_token=lambda ids, text: print(text, end="", flush=True))
    gen.token_ids, gen.text, gen.finish_reason, gen.stats.tokens_per_s

The tokens are exactly the decoder's, and for an exact decoder exactly serial decoding's (greedy,
or with the same seeded sampler: ``sampler="qwen-thinking,seed=7"``): stop right after the first
EOS, or after ``max_new_tokens``. One generation runs at a time per ``ExactDecoder`` (a lock
serialises callers). A decoder with static state is sized up front for ``max_positions`` (prompt +
new tokens) and grows, before a generation's clock starts, when a request needs more.
docs/api.md describes it.
"""
from __future__ import annotations

import inspect
import threading
import time
from dataclasses import dataclass
from typing import Callable

from core.errors import UserError
from core.prompts import is_unicode
from core.sampling import Sampler, SamplerError
from decoders.base import reserve_positions

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DEVICE_TYPES = ("cpu", "cuda")


class Cancelled(Exception):
    """Raised by an ``on_token`` callback to stop the generation: ``finish_reason`` "cancelled"."""


class _CancelSet(Exception):
    """The ``cancel`` event was found set after a batch: unwinds the decode."""


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int
    new_tokens: int
    seconds: float  # the whole generate call's decode, by the API's clock
    time_to_first_token_s: float | None  # to the first emitted batch; None when nothing was emitted
    tokens_per_s: float
    drafted: int  # draft tokens proposed (0 for serial decoders, and for a cancelled generation)
    accepted: int  # draft tokens accepted
    mean_accepted_length: float | None  # tokens per verify round; None without verify rounds
    forwards: int  # backbone forward calls


@dataclass(frozen=True)
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (ended with an EOS) | "length" (max_new_tokens) | "cancelled"
    stats: GenerationStats
    sampler: Sampler | None = None  # what decided the tokens; None: greedy


def open_decoder(model: str = "small", name: str = "spec", *, device: str | None = None,
                 max_positions: int | None = None, sampler: Sampler | str | None = None,
                 **decoder_args) -> "ExactDecoder":
    """Pin the deterministic configuration, load ``model`` (a built-in name or a checkpoint
    directory) on ``device`` (default cuda if available, else cpu), build decoder ``name`` (a
    registered name or ``package.module:attr``) with ``decoder_args`` and prepare it, sized for
    generations of up to ``max_positions`` prompt + new tokens (None: the decoder's default).
    ``sampler``: the generations' default sampler (a ``core.sampling.Sampler`` or text for
    ``Sampler.parse``, e.g. ``"qwen-thinking,seed=7"``); None: greedy.
    Any bad input raises ``core.errors.UserError`` with one clear message."""
    from core import determinism  # imports torch: pinned before anything touches CUDA
    from core.models import check_fits, load_model, model_context
    from decoders import get_decoder

    determinism.pin()
    check_device(device)
    check_positions(max_positions)
    if not isinstance(model, str) or not model:
        raise UserError(f"model must be a built-in name or a checkpoint directory, not {model!r}")
    sampler = as_sampler(sampler)
    decoder = get_decoder(name, **decoder_args)  # before the load: a bad name costs no model load
    check_sampling(decoder, sampler)
    if max_positions is not None:  # from the config alone: a length beyond the context costs no load
        check_fits(model, model_context(model), max_positions, f"max_positions {max_positions}")
    loaded = load_model(model, device)
    try:
        decoder.prepare(loaded)
    except ValueError as exc:
        raise UserError(f"decoder {name!r} cannot run on {loaded.name}: {exc}") from None
    opened = ExactDecoder(decoder, loaded, sampler=sampler)
    if max_positions is not None:
        loaded.check_fits(max_positions, f"max_positions {max_positions}")
        opened.reserve(max_positions)
    return opened


def check_positions(max_positions) -> None:
    if max_positions is not None and (isinstance(max_positions, bool) or not isinstance(max_positions, int)
                                      or max_positions < 2):
        raise UserError(f"max_positions must be an integer >= 2 (prompt + new tokens), not {max_positions!r}")


def as_sampler(sampler) -> Sampler | None:
    """A ``Sampler``, or text for ``Sampler.parse``, as a Sampler; None stays None (greedy)."""
    if sampler is None or isinstance(sampler, Sampler):
        return sampler
    if not isinstance(sampler, str):
        raise UserError(f"sampler must be a core.sampling.Sampler or text such as 'qwen-thinking,seed=7', "
                        f"not {type(sampler).__name__}")
    try:
        return Sampler.parse(sampler)
    except SamplerError as exc:
        raise UserError(f"sampler: {exc}") from None


def check_sampling(decoder, sampler: Sampler | None) -> None:
    """A non-greedy sampler needs a decoder that samples (``sampling = True``)."""
    if sampler is not None and not sampler.greedy and not getattr(decoder, "sampling", False):
        raise UserError(f"decoder {decoder.name!r} decodes greedily only; it cannot sample "
                        f"({sampler.describe()})")


def check_device(device: str | None) -> None:
    """``cpu``, ``cuda`` or ``cuda:N`` (None: the default); anything else is refused up front."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in DEVICE_TYPES:
        raise UserError(f"device {device!r} is not supported: give cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device!r} requested but this machine has no CUDA GPU")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UserError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")


class ExactDecoder:
    """A prepared decoder bound to its model. ``clock`` (seconds, monotonic) times generations;
    ``sampler`` (a Sampler or its text) is the generations' default, None greedy."""

    def __init__(self, decoder, model, clock: Callable[[], float] = time.perf_counter,
                 sampler: Sampler | str | None = None):
        self.decoder = decoder
        self.model = model
        self.clock = clock
        self.sampler = as_sampler(sampler)
        check_sampling(decoder, self.sampler)
        self._lock = threading.Lock()
        self._streams = accepts_on_tokens(decoder)

    @property
    def name(self) -> str:
        return self.decoder.name

    @property
    def sampling(self) -> bool:
        """Whether the decoder samples (``sampling = True``): takes a non-greedy sampler."""
        return getattr(self.decoder, "sampling", False) is True

    def reserve(self, positions: int) -> None:
        """Size the decoder now for generations of up to ``positions`` prompt + new tokens
        (``decoders.base.reserve_positions``; nothing for a decoder without static state)."""
        check_positions(positions)
        with self._lock:
            reserve_positions(self.decoder, positions)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.model.eos_token_ids)

    # ------------------------------------------------------------------ text

    def tokenizer(self):
        if self.model.tokenizer is None:
            raise UserError(f"model {self.model.name} has no tokenizer: give the prompt as token ids")
        return self.model.tokenizer.get()

    def encode(self, text: str) -> list[int]:
        """Plain text to ids, no template (as `audit tokens` encodes a text prompt)."""
        if not isinstance(text, str):
            raise UserError(f"prompt text must be a string, not {type(text).__name__}")
        if not is_unicode(text):
            raise UserError("the prompt is not valid Unicode text (it holds a lone surrogate, e.g. from "
                            "bytes that are not UTF-8): no tokenizer takes it")
        return list(self.tokenizer().encode(text))

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Messages ``[{"role": ..., "content": ...}]`` through the tokenizer's chat template with
        the assistant's turn opened; a tokenizer without one gets Qwen's ChatML layout."""
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise UserError("chat messages must be a non-empty list of {'role': str, 'content': str}")
        if not all(is_unicode(m["content"]) and is_unicode(m["role"]) for m in messages):
            raise UserError("a chat message is not valid Unicode text (it holds a lone surrogate): "
                            "no tokenizer takes it")
        tok = self.tokenizer()
        template = None if getattr(tok, "chat_template", None) else CHATML_TEMPLATE
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                          chat_template=template, return_dict=False)
        except Exception as exc:  # noqa: BLE001 - jinja / tokenizer errors of a user's template
            raise UserError(f"cannot apply the chat template: {exc}") from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def text(self, ids: list[int]) -> str:
        """Ids to text, special tokens skipped."""
        return self.tokenizer().decode(list(ids), skip_special_tokens=True)

    # ------------------------------------------------------------------ generation

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            vocab = self.model.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
                raise UserError(f"prompt token ids must be integers in 0..{vocab - 1}")
            ids = list(prompt)
        else:
            raise UserError(f"prompt must be text or a list of token ids, not {type(prompt).__name__}")
        if not ids:
            raise UserError("the prompt is empty")
        return ids

    def generate(self, prompt, max_new_tokens: int = 256, *,
                 on_token: Callable[[list[int], str], None] | None = None,
                 cancel: threading.Event | None = None,
                 sampler: Sampler | str | None = None) -> Generation:
        """Decode at most ``max_new_tokens`` tokens after ``prompt`` (text or ids), with
        ``sampler`` (a Sampler or its text; None: the decoder's default, greedy unless
        ``open_decoder`` was given one).
        ``on_token(new_ids, new_text)`` sees each emitted batch as it comes; the concatenation
        of every ``new_text`` is ``Generation.text`` (text ending in an incomplete UTF-8
        sequence is held back; whatever is held at the end comes in a last call with no ids).
        Setting ``cancel``, or raising ``Cancelled`` from ``on_token``, stops the decode at the
        next batch (``finish_reason`` "cancelled"); another exception from ``on_token``
        propagates, and the decoder stays usable. A request longer than the decoder is sized for
        grows it first, outside the generation's time."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be a positive integer, not {max_new_tokens!r}")
        ids = self.prompt_ids(prompt)
        self.model.check_fits(len(ids) + max_new_tokens,
                              f"a prompt of {len(ids)} tokens + max_new_tokens {max_new_tokens}")
        sampler = self.sampler if sampler is None else as_sampler(sampler)
        check_sampling(self.decoder, sampler)
        with self._lock:
            reserve_positions(self.decoder, len(ids) + max_new_tokens)
            return self._generate(ids, max_new_tokens, on_token, cancel, sampler)

    def _generate(self, ids, max_new_tokens, on_token, cancel, sampler: Sampler | None = None) -> Generation:
        stream = _Stream(self, on_token, cancel)
        start = stream.start = self.clock()
        result, reason = None, None
        # greedy decodes take no sampler argument (decoders without sampling have none)
        kwargs = {"sampler": sampler} if sampler is not None and not sampler.greedy else {}
        try:
            if self._streams:
                result = self.decoder.decode(ids, max_new_tokens, on_tokens=stream.batch, **kwargs)
            else:
                result = self.decoder.decode(ids, max_new_tokens, **kwargs)
            tail = list(result.tokens)
            if tail[:len(stream.ids)] != stream.ids:
                raise RuntimeError(f"decoder {self.name!r} streamed tokens that differ from its result")
            if len(tail) > len(stream.ids):
                stream.batch(tail[len(stream.ids):])
        except (Cancelled, _CancelSet):
            reason = "cancelled"
        seconds = self.clock() - start
        text = stream.flush()
        tokens = list(stream.ids)
        if reason is None:
            reason = "stop" if tokens and tokens[-1] in self.eos_token_ids else "length"
        return Generation(ids, tokens, text, reason, self._stats(ids, tokens, seconds, stream.ttft, result),
                          sampler if kwargs else None)

    def _stats(self, ids, tokens, seconds, ttft, result) -> GenerationStats:
        st = result.stats if result is not None else None
        rounds = sum(st.accept_hist.values()) if st is not None else 0
        return GenerationStats(
            prompt_tokens=len(ids), new_tokens=len(tokens), seconds=seconds, time_to_first_token_s=ttft,
            tokens_per_s=len(tokens) / seconds if seconds > 0 else 0.0,
            drafted=st.drafted if st else 0, accepted=st.accepted if st else 0,
            mean_accepted_length=(st.accepted + rounds) / rounds if rounds else None,
            forwards=st.forwards if st else 0)


class _Stream:
    """One generation's emitted ids and the text already handed to ``on_token``."""

    def __init__(self, owner: ExactDecoder, on_token, cancel):
        self.owner, self.on_token, self.cancel = owner, on_token, cancel
        self.ids: list[int] = []
        self.sent = ""
        self.start = 0.0
        self.ttft: float | None = None
        self.textual = on_token is not None and owner.model.tokenizer is not None

    def batch(self, new: list[int]) -> None:
        new = [int(t) for t in new]
        if not new:
            return
        self.ids += new
        if self.ttft is None:
            self.ttft = self.owner.clock() - self.start
        piece = self._piece(final=False)
        if self.on_token is not None:
            self.on_token(new, piece)
        if self.cancel is not None and self.cancel.is_set():
            raise _CancelSet()

    def _piece(self, final: bool) -> str:
        """The text the ids emitted so far complete beyond what was sent: none while the decoded
        text ends in an incomplete UTF-8 sequence (shown as U+FFFD) or is not an extension."""
        if not self.textual and not final:
            return ""
        full = self.owner.text(self.ids) if self.owner.model.tokenizer is not None else ""
        if not final and full.endswith("\ufffd"):
            return ""
        if not full.startswith(self.sent):
            return ""
        piece, self.sent = full[len(self.sent):], full
        return piece

    def flush(self) -> str:
        """Text still held back goes out in a last call with no ids; returns the whole text."""
        if self.owner.model.tokenizer is None:
            return ""
        before = self.sent
        piece = self._piece(final=True)
        if piece and self.on_token is not None:
            self.on_token([], piece)
        return self.sent if self.sent.startswith(before) else self.owner.text(self.ids)


def accepts_on_tokens(decoder) -> bool:
    """Whether ``decoder.decode`` takes the optional ``on_tokens`` keyword (plug-ins may not)."""
    try:
        params = inspect.signature(decoder.decode).parameters
    except (TypeError, ValueError):
        return False
    return "on_tokens" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
