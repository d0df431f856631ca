"""Side-by-side timing of a candidate decoder against the serial control, in one process.

Per prompt: an untimed warm-up of both (``warmup_tokens`` new tokens), then ``legs`` timed
decodes of each in ABBA order. Each leg is timed around the whole decode with the device
synchronised on both ends; CUDA legs also record the allocator's peak. Every raw value goes
to the stream; statistics (medians, ratios) are computed separately from those values.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from core.schema import abba_roles


@dataclass
class Clock:
    """Monotonic seconds since the run began, shared by every leg of a run."""

    origin: float

    @classmethod
    def start(cls) -> "Clock":
        return cls(time.perf_counter())

    def now(self) -> float:
        return time.perf_counter() - self.origin


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_decode(decoder, prompt_ids, max_new_tokens, device, clock: Clock) -> dict:
    """One leg: wall time around the decode, device synchronised; peak memory where measurable."""
    cuda = device.type == "cuda"
    if cuda:
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    t0 = clock.now()
    result = decoder.decode(prompt_ids, max_new_tokens)
    synchronize(device)
    t1 = clock.now()
    return {
        "t_start": t0,
        "t_end": t1,
        "wall_s": t1 - t0,
        "tokens": [int(t) for t in result.tokens],
        "peak_mem_bytes": int(torch.cuda.max_memory_allocated(device)) if cuda else None,
        "stats": result.stats.to_json(),
    }


def time_prompt(prompt, decoders: dict, max_new_tokens: int, legs: int, warmup_tokens: int,
                device: torch.device, clock: Clock, on_leg=None) -> list[dict]:
    """Warm up both decoders on the prompt, then run ``legs`` legs of each in ABBA order.
    Returns the leg records in the order they ran."""
    for role in ("control", "candidate"):
        # untimed per-prompt preparation, used only by benchmark instruments (which the audit
        # refuses to score): a real decoder that did work here would be hiding it from the clock
        prepare_prompt = getattr(decoders[role], "prepare_prompt", None)
        if callable(prepare_prompt):
            prepare_prompt(prompt.token_ids, max_new_tokens)
        if warmup_tokens > 0:
            decoders[role].decode(prompt.token_ids, min(warmup_tokens, max_new_tokens))
    records, seen = [], {"control": 0, "candidate": 0}
    for order, role in enumerate(abba_roles(legs)):
        leg = timed_decode(decoders[role], prompt.token_ids, max_new_tokens, device, clock)
        rec = {"type": "leg", "prompt_id": prompt.id, "role": role, "leg": seen[role], "order": order, **leg}
        seen[role] += 1
        records.append(rec)
        if on_leg:
            on_leg(rec)
    return records


def summarize_prompt(prompt_id: str, legs: list[dict]) -> dict:
    """The harness's own per-prompt summary (the audit recomputes it from the raw legs)."""
    ctl = [r["wall_s"] for r in legs if r["role"] == "control"]
    cand = [r["wall_s"] for r in legs if r["role"] == "candidate"]
    c_med, k_med = statistics.median(ctl), statistics.median(cand)
    c_tok = len(next(r for r in legs if r["role"] == "control")["tokens"])
    k_tok = len(next(r for r in legs if r["role"] == "candidate")["tokens"])
    return {
        "type": "summary",
        "prompt_id": prompt_id,
        "control_median_s": c_med,
        "candidate_median_s": k_med,
        "ratio": c_med / k_med,
        "control_tokens_per_s": c_tok / c_med,
        "candidate_tokens_per_s": k_tok / k_med,
    }
