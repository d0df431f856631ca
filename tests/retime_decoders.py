"""A plug-in decoder that games in-process timing and only ``audit retime`` catches
(``--decoder retime_decoders:Precomputed``; a subprocess needs ``PYTHONPATH=tests``)."""
from __future__ import annotations

import time

from core.prompts import load_prompts
from decoders.base import DecodeResult, DecodeStats, stop_index
from decoders.serial import SerialDecoder


class Precomputed:
    """Exact, and instant on the built-in prompt set it loads itself in ``prepare()``: it decodes
    every prompt of the model's default set there (untimed) and answers those from a table; any
    other prompt gets plain serial decoding. A table answer takes a steady ``answer_s``, as a
    plausible fast decoder would (an instant one would look like a cache to the warm-leg check)."""

    name = "precomputed"

    def __init__(self, max_new_tokens: int = 64, answer_s: float = 0.004):
        self.max_new_tokens = max_new_tokens
        self.answer_s = answer_s
        self.inner = SerialDecoder()
        self.table: dict[tuple, list[int]] = {}
        self.eos: tuple[int, ...] = ()

    def prepare(self, model) -> None:
        self.inner.prepare(model)
        self.eos = tuple(model.eos_token_ids)
        prompts, _ = load_prompts(None, model)
        for p in prompts:
            self.table[tuple(p.token_ids)] = self.inner.decode(p.token_ids, self.max_new_tokens).tokens

    def config(self) -> dict:
        return {"max_new_tokens": self.max_new_tokens, "answer_s": self.answer_s}

    def decode(self, prompt_ids, max_new_tokens) -> DecodeResult:
        known = self.table.get(tuple(prompt_ids))
        if known is not None and max_new_tokens <= self.max_new_tokens:
            time.sleep(self.answer_s)
            return DecodeResult(known[:stop_index(known, self.eos, max_new_tokens)], DecodeStats())
        return self.inner.decode(prompt_ids, max_new_tokens)


class PrecomputedUneven(Precomputed):
    """Precomputed that also spoils its own later legs: every second decode of a prompt it does not
    know sleeps ``spoil_s`` more, so that each of the retime's prompts looks unstable and is
    measured again on its spare, hoping that noise favours one of the two first legs."""

    name = "precomputed-uneven"

    def __init__(self, max_new_tokens: int = 64, answer_s: float = 0.004, spoil_s: float = 0.3):
        super().__init__(max_new_tokens, answer_s)
        self.spoil_s = spoil_s
        self.seen: dict[tuple, int] = {}

    def decode(self, prompt_ids, max_new_tokens) -> DecodeResult:
        key = tuple(prompt_ids)
        if key not in self.table:
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] % 2 == 0:
                time.sleep(self.spoil_s)
        return super().decode(prompt_ids, max_new_tokens)
