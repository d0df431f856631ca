"""Teacher-forced serial replay through the pristine path, greedy or under a seeded sampler.

The control (serial decoding) is: prefill the prompt with ``logits_to_keep=1``, then one token
per HF forward with a DynamicCache, ``argmax`` (first index on ties), stop after EOS or N tokens.
``PristineSerial`` makes exactly those calls, written here rather than imported, so the audit
does not depend on the code it judges. Under a sampler (the stream header's ``sampler``,
``core.sampling``) the control's token at absolute position p (prompt length + index) is
``sampler.pick(logits, p)`` of the same logits instead of the argmax; the sampler is a
definition shared with the decoders, not code of theirs.

Sharing work: a stream's verified part is, by definition, a prefix of the serial greedy stream,
and after its first divergence nothing more is checked. So every leg of a prompt is checked
against ONE walk along the greedy path: at each position the walk computes the logits once and
settles every stream still agreeing with it. Distinct streams cost nothing extra; identical legs
are collapsed before the walk. The walk goes only as far as some stream still needs it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from core.sampling import GREEDY, Sampler, allowed_mask, gumbel

TOPK = 5

# reasons, and the finding they belong to
NOT_ARGMAX = "emitted token is not the argmax"
NOT_PICK = "emitted token is not the sampler's pick"
TOKEN_REASONS = (NOT_ARGMAX, NOT_PICK)
ENDS_EARLY = "stream ends before N without an EOS; serial decoding continues"
AFTER_EOS = "stream continues after an EOS; serial decoding stops there"
TOO_LONG = "stream is longer than N"
STOP_REASONS = (ENDS_EARLY, AFTER_EOS, TOO_LONG)


@dataclass
class Divergence:
    """A stream's first wrong position. Under a sampler, ``greedy`` is the control's token there
    (the sampler's pick), and ``top5``, ``margin`` and ``emitted_logit`` are in the sampler's
    scores (``pick_and_top``), where the pick is the largest."""

    position: int  # 0-based index among the new tokens
    emitted: int | None  # None: the stream has no token here
    greedy: int | None  # the control's token; None: serial decoding has stopped before here
    top5: list  # [[token_id, logit], ...] of the logits at this position ([] when none exist)
    margin: float | None  # top-1 minus top-2 logit (None when no logits exist)
    reason: str
    # the emitted token's own logit (None when it has none: a stop divergence, or an id outside
    # the vocabulary); not part of audit.json, which reports the margin alone
    emitted_logit: float | None = None
    sampled: bool = False  # the control sampled (its messages say so)

    @property
    def check(self) -> str:
        return "stop" if self.reason in STOP_REASONS else "exactness"

    def to_json(self, leg: str) -> dict:
        return {"leg": leg, "position": self.position, "emitted": self.emitted, "greedy": self.greedy,
                "top5": self.top5, "margin": self.margin, "reason": self.reason}


class PristineSerial:
    """HF forward + DynamicCache, one token per forward: the same calls serial decoding makes."""

    def __init__(self, model):
        self.lm = model.backbone
        self.device = model.device
        self.cache = None

    @torch.inference_mode()
    def start(self, prompt_ids: list[int]) -> torch.Tensor:
        self.cache = DynamicCache(config=self.lm.config)
        ids = torch.tensor([prompt_ids], device=self.device)
        out = self.lm(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        ids = torch.tensor([[token]], device=self.device)
        out = self.lm(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]


def greedy_and_top(logits: torch.Tensor) -> tuple[int, list, float | None]:
    """argmax (first index on ties, as serial decoding takes it), the top-5, top-1/top-2 margin."""
    greedy = int(logits.argmax(-1).item())
    k = min(TOPK, logits.numel())
    vals, idx = torch.topk(logits.float(), k)
    top = [[int(i), float(v)] for v, i in zip(vals.tolist(), idx.tolist())]
    margin = float(vals[0] - vals[1]) if k > 1 else None
    return greedy, top, margin


def logit_of(logits: torch.Tensor, token: int) -> float | None:
    return float(logits[token]) if 0 <= token < logits.numel() else None


def sampler_scores(logits: torch.Tensor, sampler: Sampler, position: int) -> torch.Tensor:
    """What a sampled pick maximises, in logit units: ``logits[v] + T * G(seed, p, v)`` for the
    tokens the filter keeps, -inf for the others (float64). For reports only: the token itself is
    always ``sampler.pick``."""
    row = logits.reshape(-1)
    z = row.to(torch.float64, copy=True) / sampler.temperature
    noise = gumbel(sampler.seed, position, row.numel(), row.device)
    return torch.where(allowed_mask(row, sampler), (z + noise) * sampler.temperature, -math.inf)


def pick_and_top(logits: torch.Tensor, sampler: Sampler, position: int) -> tuple[int, list, float | None]:
    """The control's token at absolute ``position`` with the top-5 and top-1/top-2 margin of what
    it maximises: the logits when greedy (``greedy_and_top``), else ``sampler_scores`` (tokens the
    filter drops are left out)."""
    if sampler.greedy:
        return greedy_and_top(logits)
    token = sampler.pick(logits, position)
    scores = sampler_scores(logits, sampler, position)
    kept = int(torch.isfinite(scores).sum())
    vals, idx = torch.topk(scores, min(TOPK, kept))
    top = [[int(i), float(v)] for v, i in zip(vals.tolist(), idx.tolist())]
    margin = float(vals[0] - vals[1]) if len(top) > 1 else None
    return token, top, margin


def score_of(logits: torch.Tensor, token: int, sampler: Sampler, position: int) -> float | None:
    """``token``'s logit (greedy) or its sampler score; None outside the vocabulary or the filter."""
    if sampler.greedy:
        return logit_of(logits, token)
    if not 0 <= token < logits.numel():
        return None
    value = float(sampler_scores(logits, sampler, position)[token])
    return value if math.isfinite(value) else None


def teacher_forced_logits(stepper, prompt_ids: list[int], forced: list[int]) -> torch.Tensor:
    """The logits serial decoding computes after ``prompt_ids`` + ``forced``, whatever those tokens
    are: the prompt prefilled, then one forward per forced token, as the walk steps."""
    logits = stepper.start(prompt_ids)
    for token in forced:
        logits = stepper.step(token)
    return logits


def replay_prompt(stepper, prompt_ids: list[int], streams: list[tuple[int, ...]], max_new_tokens: int,
                  eos: set[int], progress=None, observe=None,
                  sampler: Sampler = GREEDY) -> tuple[dict[tuple, Divergence | None], list[int]]:
    """Check every distinct stream against serial decoding of ``prompt_ids`` under ``sampler``.

    Returns ({stream: first Divergence or None}, the control's tokens computed). Rules: at every
    position the emitted token is the control's (the argmax, or the sampler's pick at absolute
    position len(prompt) + index); a stream stops exactly where serial stops, right after the
    first EOS or at N tokens (so shorter than N means ending in EOS, no EOS before the last token,
    never longer than N). ``audit replay`` and ``audit tokens`` both judge with this function.
    ``observe(position, logits)``, when given, sees the logits of every position the walk
    computes, for callers that look at positions where no stream diverged.
    """
    result: dict[tuple, Divergence | None] = {s: None for s in streams}
    alive = list(dict.fromkeys(streams))
    greedy_path: list[int] = []
    if not alive:
        return result, greedy_path
    logits = stepper.start(prompt_ids)
    i = 0
    while True:
        position = len(prompt_ids) + i
        g, top, margin = pick_and_top(logits, sampler, position)
        greedy_path.append(g)
        if observe:
            observe(i, logits)
        still = []
        for s in alive:
            if len(s) == i:
                result[s] = Divergence(i, None, g, top, margin, ENDS_EARLY, sampled=not sampler.greedy)
            elif s[i] != g:
                result[s] = Divergence(i, s[i], g, top, margin, NOT_ARGMAX if sampler.greedy else NOT_PICK,
                                       score_of(logits, s[i], sampler, position), not sampler.greedy)
            else:
                still.append(s)
        alive = still
        if g in eos or i + 1 >= max_new_tokens:  # serial decoding ends after this token
            for s in alive:
                if len(s) > i + 1:
                    result[s] = Divergence(i + 1, s[i + 1], None, [], None, AFTER_EOS if g in eos else TOO_LONG,
                                           sampled=not sampler.greedy)
            break
        if not alive:
            break
        logits = stepper.step(g)
        i += 1
        if progress:
            progress(i)
    return result, greedy_path


@dataclass
class PromptReplay:
    divergences: dict[str, Divergence]  # leg label -> first divergence (exact legs absent)
    positions: int  # logits computed (forwards) for this prompt
    greedy: list[int]


def leg_streams(p) -> dict[str, tuple]:
    """Every leg's stream by label; a duplicated leg (itself a tamper finding) is still replayed,
    its n-th copy labelled with n primes, or ``'n`` past three (labels stay short however many
    copies a hostile file holds)."""
    labelled, copies = {}, {}
    for r in p.legs:
        base = f"{r['role']}#{r['leg']}"
        n = copies[base] = copies.get(base, -1) + 1
        labelled[base + ("'" * n if n <= 3 else f"'{n}")] = tuple(r["tokens"])
    return labelled


@dataclass(frozen=True)
class Walk:
    """One walk along the control's path: a prompt, the distinct streams it settles, N and the
    sampler. Plain data, so that a worker process (``audit.pool``) can be handed one."""

    label: str  # what logs and failures call it: a prompt id
    prompt_ids: tuple[int, ...]
    streams: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    sampler: Sampler = GREEDY


@dataclass
class Walked:
    """What a walk found: ``replay_prompt``'s results, the seconds it took, and where it ran."""

    results: dict[tuple, Divergence | None]
    greedy: list[int]
    seconds: float
    worker: int | None = None  # the pool worker that walked it; None: this process


def walk_one(stepper, walk: Walk, eos: set[int], bar=None, log=None) -> Walked:
    """One walk through ``stepper``. ``bar``: an ``audit.progress.Progress`` (or a worker's relay
    of one) ticked once per position and settled at the end."""
    ticked = 0

    def progress(i):
        nonlocal ticked
        if bar is not None:
            bar.tick()
            ticked += 1
        if log and i % 64 == 0:
            log(f"  {walk.label}: position {i}/{walk.max_new_tokens}")

    t0 = time.perf_counter()
    results, greedy = replay_prompt(stepper, list(walk.prompt_ids), list(walk.streams), walk.max_new_tokens, eos,
                                    progress, sampler=walk.sampler)
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.settle(expected_positions(walk.streams, walk.max_new_tokens), len(greedy), ticked)
    return Walked(results, greedy, seconds)


def walk_here(model):
    """A walker on ``model`` in this process: ``walker(walks, bar, log)`` walks them one after
    another and yields ``(index, Walked)`` for each. ``audit.pool.WorkerPool.walk`` is the other
    walker, over worker processes, yielding in the order the walks finish."""
    def walker(walks: list[Walk], bar=None, log=None):
        stepper, eos = PristineSerial(model), set(model.eos_token_ids)
        for i, walk in enumerate(walks):
            yield i, walk_one(stepper, walk, eos, bar, log)

    return walker


def prompt_walk(p, max_new_tokens: int, sampler: Sampler = GREEDY) -> Walk:
    return Walk(p.id, tuple(p.token_ids), tuple(dict.fromkeys(leg_streams(p).values())), max_new_tokens, sampler)


def prompt_replay(p, walked: Walked) -> PromptReplay:
    """A prompt's legs settled by its own walk."""
    divs = {label: walked.results[s] for label, s in leg_streams(p).items() if walked.results[s] is not None}
    return PromptReplay(divs, len(walked.greedy), walked.greedy)


def replay_one(stepper, p, max_new_tokens: int, eos: set[int], log=None, bar=None,
               sampler: Sampler = GREEDY) -> PromptReplay:
    """One prompt's walk along the control's path, settling every leg of it. ``bar``: an
    ``audit.progress.Progress`` ticked once per position."""
    return prompt_replay(p, walk_one(stepper, prompt_walk(p, max_new_tokens, sampler), eos, bar, log))


def expected_positions(streams, max_new_tokens: int) -> int:
    """Positions a walk computes at most to settle ``streams``: one past the longest, N at most."""
    longest = max((len(s) for s in streams), default=None)
    return 0 if longest is None else min(max_new_tokens, longest + 1)


def walked_positions(divergence: Divergence | None, full: int) -> int:
    """How many positions a walk computes to settle one stream: all of them if it is exact, else up
    to its first divergence (a stop-rule divergence is found without computing its position)."""
    if divergence is None:
        return full
    return divergence.position if divergence.reason in (AFTER_EOS, TOO_LONG) else divergence.position + 1


def replay_shared(walker, runs: list, log=None, bar=None) -> list[tuple[dict[str, PromptReplay], int, float]]:
    """Replay several runs recorded with one model: each distinct (prompt, N, sampler) is walked
    ONCE for the legs of every run that holds it. A stream's verdict depends only on the control's
    path, which is the same for every run of the same model, prompt, N and sampler, so sharing the
    walk changes no result. ``walker``: ``walk_here(model)`` or a worker pool's. Returns, per run, what
    ``replay_run`` would: ({prompt_id: PromptReplay}, tokens replayed, seconds); a shared walk's
    tokens are counted for every run it settled. A run's seconds are its share of the replay's wall
    time, in proportion to its walks' seconds (a shared walk's split by the positions each run
    needed): with workers the walks overlap, so their own seconds add up to more than the wall."""
    groups: dict[tuple, list[tuple[int, object]]] = {}
    for i, run in enumerate(runs):
        for p in run.prompts:
            groups.setdefault((tuple(p.token_ids), run.max_new_tokens, run.sampler), []).append((i, p))
    walks, members_of = [], []
    for (prompt_ids, max_new, sampler), members in groups.items():
        labelled = [(i, p, leg_streams(p)) for i, p in members]
        streams = tuple(dict.fromkeys(s for _, _, legs in labelled for s in legs.values()))
        walks.append(Walk(members[0][1].id, prompt_ids, streams, max_new, sampler))
        members_of.append(labelled)
    out = [({}, 0, 0.0) for _ in runs]
    t0, walked_seconds = time.perf_counter(), 0.0
    for n, (k, walked) in enumerate(walker(walks, bar, log), start=1):
        greedy, seconds = walked.greedy, walked.seconds
        walked_seconds += seconds
        for i, p, legs in members_of[k]:
            divs = {label: walked.results[s] for label, s in legs.items() if walked.results[s] is not None}
            # the positions this run's own walk would have computed, so its audit.json is the one
            # a separate audit writes (only the replay's seconds differ: a share of the walk's)
            own = max(walked_positions(walked.results[s], len(greedy)) for s in legs.values()) if legs else 0
            replayed, tokens, secs = out[i]
            replayed[p.id] = PromptReplay(divs, own, greedy[:own])
            out[i] = (replayed, tokens + own, secs + seconds * own / max(len(greedy), 1))
        if log:
            per = 1000 * seconds / len(greedy) if greedy else 0.0
            log(f"replay [{n}/{len(walks)}] {walks[k].label}: {len(greedy)} positions, {per:.1f} ms/token, "
                f"{len(walks[k].streams)} distinct stream(s) from {len(members_of[k])} run(s){where(walked.worker)}")
    wall = time.perf_counter() - t0
    share = wall / walked_seconds if walked_seconds > 0 else 0.0
    # each run's prompts in file order, whatever order the walks finished in
    return [({p.id: replayed[p.id] for p in run.prompts if p.id in replayed}, tokens, secs * share)
            for run, (replayed, tokens, secs) in zip(runs, out)]


def replay_run(walker, run, log=None, bar=None) -> tuple[dict[str, PromptReplay], int, float]:
    """Replay every prompt of a run through ``walker`` (``walk_here(model)`` or a worker pool's).
    Returns ({prompt_id: PromptReplay} in file order, tokens replayed, seconds). ``bar``: an
    ``audit.progress.Progress`` over ``planned_positions``."""
    walks = [prompt_walk(p, run.max_new_tokens, run.sampler) for p in run.prompts]
    out, total, t0 = {}, 0, time.perf_counter()
    for n, (i, walked) in enumerate(walker(walks, bar, log), start=1):
        p = run.prompts[i]
        rep = out[p.id] = prompt_replay(p, walked)
        total += rep.positions
        if log:
            log_prompt(log, n, len(walks), p, rep, walked.seconds, walked.worker)
    return {p.id: out[p.id] for p in run.prompts}, total, time.perf_counter() - t0


def planned_walks(runs: list, shared: bool = False) -> int:
    """How many walks the replay of ``runs`` hands out: one per prompt, or with ``shared`` one per
    distinct (prompt, N, sampler), as ``replay_shared`` walks them."""
    if not shared:
        return sum(len(run.prompts) for run in runs)
    return len({(tuple(p.token_ids), run.max_new_tokens, run.sampler) for run in runs for p in run.prompts})


def planned_positions(runs: list, shared: bool = False) -> int:
    """The positions the replay of ``runs`` computes at most: the progress bar's total. ``shared``:
    each distinct (prompt, N) counts once, as ``replay_shared`` walks it."""
    walks: dict = {}
    for i, run in enumerate(runs):
        for p in run.prompts:
            key = (tuple(p.token_ids), run.max_new_tokens, run.sampler) if shared else (i, p.id)
            walks.setdefault(key, (run.max_new_tokens, []))[1].extend(tuple(r["tokens"]) for r in p.legs)
    return sum(expected_positions(streams, n) for n, streams in walks.values())


def where(worker: int | None) -> str:
    """A log line's note of the pool worker that walked it (none for this process)."""
    return "" if worker is None else f" [worker {worker}]"


def log_prompt(log, n: int, count: int, p, rep: PromptReplay, seconds: float, worker: int | None = None) -> None:
    per = 1000 * seconds / rep.positions if rep.positions else 0.0
    divs = rep.divergences
    log(f"replay [{n}/{count}] {p.id}: {rep.positions} positions, {per:.1f} ms/token, "
        f"{len(set(leg_streams(p).values()))} distinct stream(s), "
        f"{'exact' if not divs else f'{len(divs)} leg(s) diverge'}{where(worker)}")
