"""Side-by-side timing of a candidate decoder against the serial control, in one process.

Per prompt: an untimed warm-up of both on a different prompt of the same length (``warmup_ids``:
token ids drawn from the run's seed and the prompt's index, never from the prompt itself), then
``legs`` timed decodes of each in ABBA order. Only a decoder that declares itself an instrument
(``instrument = True``, never scored by the audit) gets the untimed ``prepare_prompt`` call. Each
leg is timed around the whole decode with the device synchronised on both ends; CUDA legs also
record the allocator's peak. Every raw value goes to the stream; the ratio of a prompt counts the
candidate's first leg (``core.schema.prompt_ratio``), so its first encounter with the prompt.
A leg whose decode built a runtime (``decoders.runtime.sizing.builds`` moved: static state and
graphs allocated inside the timed decode, because the decoder was not sized for it beforehand)
is followed by a ``violation`` record, which fails the audit: its time measures a build.

In-process integrity is ``harness.watch``: the ``Watch`` that ``time_prompt`` consults before and
after every leg.
"""
from __future__ import annotations

import random
import statistics

import torch

from core.schema import abba_roles, prompt_ratio
from decoders.runtime.sizing import builds as runtime_builds
from harness.clock import Clock
from harness.watch import Watch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sampling_kwargs(sampler) -> dict:
    """The keyword a decode takes for ``sampler``: none when greedy (decoders that do not sample
    take no ``sampler``), else ``sampler=``."""
    return {} if sampler is None or sampler.greedy else {"sampler": sampler}


def timed_decode(decoder, prompt_ids, max_new_tokens, device, clock: Clock, sampler=None) -> dict:
    """One leg: wall time around the decode, device synchronised; peak memory where measurable."""
    cuda = device.type == "cuda"
    kwargs = sampling_kwargs(sampler)
    if cuda:
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    t0 = clock.now()
    result = decoder.decode(prompt_ids, max_new_tokens, **kwargs)
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


def is_instrument(decoder) -> bool:
    """A benchmark instrument declares itself (``instrument = True``); the header records the mark
    and the audit never scores such a run."""
    return getattr(decoder, "instrument", False) is True


def warmup_ids(seed: int, index: int, length: int, vocab_size: int, prompt_ids: list[int]) -> list[int]:
    """The warm-up prompt of prompt ``index``: ``length`` ids drawn from (seed, index) alone. A
    derivation from the prompt's content could be inverted by a decoder to learn the timed prompt
    during the warm-up; the prompt is read only to refuse a draw equal to it."""
    rng = random.Random(f"qwen35-exact/warmup/{seed}/{index}")
    while True:
        ids = [rng.randrange(vocab_size) for _ in range(length)]
        if ids != list(prompt_ids):
            return ids


# --------------------------------------------------------------------------- one prompt


def time_prompt(prompt, warmup: list[int], decoders: dict, max_new_tokens: int, legs: int, warmup_tokens: int,
                device: torch.device, clock: Clock, watch: Watch | None = None, on_leg=None,
                sampler=None) -> list[dict]:
    """Warm both decoders up on ``warmup`` (another prompt of the same length), then run ``legs``
    legs of each in ABBA order, every decode under ``sampler`` (None: greedy). Returns the leg records in the order they ran, each followed by
    the violation records its integrity check found (when ``watch`` is given: then the Watch's
    copies of them, as made)."""
    records = []
    kwargs = sampling_kwargs(sampler)
    if watch is not None:
        watch.begin_records()
    for role in ("control", "candidate"):
        decoder = decoders[role]
        prepare_prompt = getattr(decoder, "prepare_prompt", None)
        if is_instrument(decoder) and callable(prepare_prompt):
            # untimed per-prompt preparation, for instruments only (the audit never scores them):
            # a scored decoder doing work here would be hiding it from the clock; what an
            # instrument prepares (the control's stream) depends on the sampler
            prepare_prompt(prompt.token_ids, max_new_tokens, **kwargs)
        if warmup_tokens > 0:
            decoder.decode(warmup, min(warmup_tokens, max_new_tokens), **kwargs)
    if watch is not None:
        records += watch.check(f"after the warm-up of prompt {prompt.id}", clock, records)
    seen = {"control": 0, "candidate": 0}
    for order, role in enumerate(abba_roles(legs)):
        built = runtime_builds()
        leg = timed_decode(decoders[role], prompt.token_ids, max_new_tokens, device, clock, sampler)
        built = runtime_builds() - built
        rec = {"type": "leg", "prompt_id": prompt.id, "role": role, "leg": seen[role], "order": order, **leg}
        seen[role] += 1
        records.append(rec)
        if watch is not None:
            watch.note_record(rec)
        if built:
            violation = built_in_leg(rec, built)
            records.append(violation)
            if watch is not None:
                watch.note_record(violation)
        if watch is not None:
            records += watch.check(f"after leg {role}#{rec['leg']} of prompt {prompt.id}", clock, records)
        if on_leg:
            on_leg(rec)
    # the harness's own copies: what it measured, whatever a decoder did to the list it held
    return records if watch is None else list(watch.ledger)


def built_in_leg(rec: dict, built: int) -> dict:
    """The violation record of a leg whose decode built runtimes (``decoders.runtime.sizing``):
    its time includes allocating static state and capturing graphs, which ``reserve`` exists to
    do before timing, so the leg measures a build, not a decode."""
    return {"type": "violation", "at": f"in leg {rec['role']}#{rec['leg']} of prompt {rec['prompt_id']}",
            "problem": f"the {rec['role']} built {built} runtime(s) (static state and graphs) inside this timed "
                       "leg, so the leg's time includes the build: the decoder did not reserve room for this "
                       "decode before timing (reserve() in decoders.base)"}


def summarize_prompt(prompt_id: str, legs: list[dict]) -> dict:
    """The harness's own per-prompt summary of its leg records (the audit recomputes it from the
    raw legs): ratio = control median / the candidate's first leg; the candidate's median stays."""
    ctl = [r["wall_s"] for r in legs if r["role"] == "control"]
    cand = [r["wall_s"] for r in legs if r["role"] == "candidate"]
    first = next(r["wall_s"] for r in legs if r["role"] == "candidate" and r["leg"] == 0)
    c_med, k_med = statistics.median(ctl), statistics.median(cand)
    c_tok = len(next(r for r in legs if r["role"] == "control")["tokens"])
    k_tok = len(next(r for r in legs if r["role"] == "candidate")["tokens"])
    return {
        "type": "summary",
        "prompt_id": prompt_id,
        "control_median_s": c_med,
        "candidate_median_s": k_med,
        "candidate_first_s": first,
        "ratio": prompt_ratio(ctl, first),
        "control_tokens_per_s": c_tok / c_med,
        "candidate_tokens_per_s": k_tok / k_med,
    }
