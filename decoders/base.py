"""The decoder protocol: prepare on a model once, then decode prompts (greedily, or with a sampler).

A decoder is one small object. ``prepare`` receives the loaded model (and may allocate static
state, capture graphs, measure costs); ``decode`` turns a prompt into at most ``max_new_tokens``
new tokens, stopping right after an EOS token, and returns them with statistics. Exactness means
the tokens equal what ``serial`` emits for the same prompt, always.

A decoder with static state sized in positions may also take ``reserve(positions)``: whoever
drives it (``harness time``, ``decoders.api``, ``harness serve``) calls it after ``prepare`` and
before anything is timed, with the longest ``len(prompt_ids) + max_new_tokens`` it will ask for,
so that no decode has to build state inside its own time.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass
class DecodeStats:
    """What a decode did. ``accepted_by_depth[d]`` counts accepted drafts made at depth d+1;
    ``accept_hist[k]`` counts verification rounds that accepted k drafts."""

    forwards: int = 0  # backbone forward calls (prefill, steps, verify windows, repairs)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    drafted_by_depth: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)
    accept_hist: Counter = field(default_factory=Counter)
    extra: dict = field(default_factory=dict)  # decoder-specific (times per phase, depth trace...)

    def record_round(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        for d in range(drafted):
            while len(self.drafted_by_depth) <= d:
                self.drafted_by_depth.append(0)
                self.accepted_by_depth.append(0)
            self.drafted_by_depth[d] += 1
            if d < accepted:
                self.accepted_by_depth[d] += 1
        self.accept_hist[accepted] += 1

    def to_json(self) -> dict:
        rounds = sum(self.accept_hist.values())
        return {
            "forwards": self.forwards,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "drafted_by_depth": list(self.drafted_by_depth),
            "accepted_by_depth": list(self.accepted_by_depth),
            "accept_hist": {str(k): v for k, v in sorted(self.accept_hist.items())},
            # tokens emitted per verification round (accepted drafts + the model's own token)
            "mean_accepted_length": (self.accepted + rounds) / rounds if rounds else None,
            **self.extra,
        }


@dataclass
class DecodeResult:
    tokens: list[int]
    stats: DecodeStats


@runtime_checkable
class Decoder(Protocol):
    name: str

    def prepare(self, model) -> None:
        """Bind to a loaded model (core.models.LoadedModel); may allocate and warm up."""

    def decode(self, prompt_ids: list[int], max_new_tokens: int) -> DecodeResult:
        """Greedy-decode at most ``max_new_tokens`` tokens after ``prompt_ids``, stopping after EOS.

        Optional: a keyword-only ``on_tokens`` (default None), called with each batch of newly
        emitted tokens as the decode goes (a step's token, a verify round's kept tokens), already
        cut at the stop: the batches concatenate to ``DecodeResult.tokens``. It changes no token.
        An exception it raises ends the decode; the next decode must still be exact. Decoders
        without it still work with ``decoders.api`` (their tokens come as one batch at the end).

        Sampling: a decoder with ``sampling = True`` also takes a keyword-only ``sampler``
        (``core.sampling.Sampler``; None or greedy is the greedy decode above). Each token is then
        the sampler's pick at its absolute position from logits bit-identical to the control's,
        so "exact" keeps its meaning: the tokens equal ``serial``'s under the same sampler."""

    def config(self) -> dict:
        """Settings that define this decoder's behaviour, recorded in the run header. A decoder's
        sizing (how many positions its state holds, its bytes) goes under one key, ``sizing``:
        it follows the lengths each process reserved, so ``audit retime`` does not compare it."""

    # Optional: ``reserve(positions: int) -> None``: make room, now, for every decode whose
    # ``len(prompt_ids) + max_new_tokens`` is at most ``positions`` (the decoder adds its own
    # margins), so that none of them allocates or rebuilds static state; it never shrinks what is
    # there. Called after ``prepare``, possibly again with more; a decode asked for more than was
    # reserved may still grow its state itself, in its own time. ``reserve_positions`` calls it.

    # Optional, for benchmark instruments only (``instrument = True``, never scored by the audit):
    # ``prepare_prompt(prompt_ids, max_new_tokens)``, which the harness calls untimed before a
    # prompt's legs for an instrument and for nothing else. An instrument with ``sampling = True``
    # also takes a keyword-only ``sampler`` there (None: greedy), the one its legs decode with,
    # since what it prepares (the control's stream) depends on it.


def reserve_positions(decoder, positions: int) -> None:
    """``decoder.reserve(positions)`` where the decoder has one (see ``Decoder``); else nothing."""
    reserve = getattr(decoder, "reserve", None)
    if callable(reserve):
        reserve(int(positions))


def stop_index(tokens: list[int], eos: tuple[int, ...] | set[int], limit: int) -> int:
    """Length of the emitted stream: up to and including the first EOS, at most ``limit``."""
    for i, t in enumerate(tokens[:limit]):
        if t in eos:
            return i + 1
    return min(len(tokens), limit)
