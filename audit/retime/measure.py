"""Timing the two workers, ABBA, on the audit's clock: warm-ups, legs, spares for unstable or
loaded prompts, a second look when the first falls short.

The clock is an object with ``now()`` (seconds, monotonic) held by the ``Measurement``: the
command passes ``PerfClock`` (``time.perf_counter``), tests with scripted workers a fake clock
that the worker advances, so no test sleeps.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from core.schema import LEG_SPREAD_LIMIT, ROLES, abba_roles

from audit import checks
from audit.pipeline import log
from audit.processes import cpu_sample, leg_cpu, peak_rss
from audit.report import fmt_ratio
from audit.retime.fresh import FreshPrompt
from audit.retime.judge import verified_ratio
from audit.retime.load import describe_load, leg_walls, loaded_against_control, others_load, waited
from audit.retime.quiet import NoProbe, Quiet
from audit.retime.workers import WorkerError
from audit.stream import PromptRun


class Clock(Protocol):
    def now(self) -> float: ...


class PerfClock:
    """The audit's own clock, in its own process."""

    def now(self) -> float:
        return time.perf_counter()


class Progress:
    """Legs timed so far, with an ETA, on stderr: a bar on a terminal (tqdm), lines otherwise."""

    def __init__(self, total: int, clock: Clock):
        self.total, self.done, self.clock, self.started = total, 0, clock, clock.now()
        self.bar = None
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="leg", desc="retime", file=sys.stderr, leave=False, disable=None)
        except ImportError:
            pass

    def grow(self, legs: int) -> None:
        self.total += legs
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def step(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)

    def eta(self) -> str:
        elapsed = self.clock.now() - self.started
        if not self.done:
            return "ETA -"
        return f"{self.done}/{self.total} legs, ETA {elapsed / self.done * (self.total - self.done):.0f} s"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass(frozen=True)
class Measurement:
    """Everything a retime's timing needs, named once."""

    workers: dict  # role -> Worker (or a stand-in with the same methods)
    max_new_tokens: int
    legs: int
    warmup_tokens: int
    clock: Clock
    instrument: bool = False  # the candidate says it is one: it gets its untimed per-prompt preparation
    progress: Progress | None = None
    quiet: Quiet | NoProbe = field(default_factory=NoProbe)  # the GPU's idle wait (a CPU: none)


@dataclass
class Measured:
    """What a retime has timed so far; kept when a worker fails part way."""

    ran: list[tuple[FreshPrompt, PromptRun]] = field(default_factory=list)  # the prompts that count
    remeasured: list[dict] = field(default_factory=list)  # replaced by their spares, counting nowhere
    second_look: dict | None = None  # why a second look was taken, once it was

    @property
    def timed(self) -> list[PromptRun]:
        return [p for _, p in self.ran]


def request(m: Measurement, role: str, prompt_ids: list[int], max_new_tokens: int) -> tuple[float, float, list[int], dict]:
    """(t_start, t_end, tokens, measures): the audit's clock around one request to ``role`` and its
    answer. Between requests both sides are stopped: the GPU is quiet (``audit.retime.quiet``)
    before the side is resumed and the clock starts, and once it has answered and is stopped again,
    the time the GPU stays busy with work it left behind is its own: ``t_end`` is its answer plus
    that time (``gpu_after_s``). ``measures``: what other work took meanwhile
    (``audit.processes.leg_cpu``), how often another process stopped and continued the timed
    worker (since its last request) or the audit (``continued_by_others``, ``audit_continued``),
    the GPU's wait before the leg (``gpu_before_s``), the side's peak resident memory so far
    (``peak_rss_bytes``, where /proc tells) and what its worker says of its allocator
    (``alloc_retries``)."""
    timed = m.workers[role]
    gpu_before = m.quiet.wait()
    timed.resume()
    try:
        before = cpu_sample(timed.tree)
        audit_before = timed.audit_continues.count
        t0 = m.clock.now()
        timed.send(prompt_ids, max_new_tokens)
        tokens = timed.tokens()
        t1 = m.clock.now()
        audit_continued = timed.audit_continues.count - audit_before
        after = cpu_sample(timed.tree)
    finally:
        timed.pause()
    gpu_after = m.quiet.wait()
    return t0, t1 + gpu_after, tokens, {
        **leg_cpu(before, after), "continued_by_others": timed.continues_by_others(),
        "audit_continued": audit_continued, "gpu_before_s": gpu_before, "gpu_after_s": gpu_after,
        "peak_rss_bytes": peak_rss(timed.tree), "alloc_retries": getattr(timed, "alloc_retries", None)}


def prepare(m: Measurement, fp: FreshPrompt) -> None:
    """An instrument's untimed per-prompt preparation, resumed and stopped as a request is."""
    candidate = m.workers["candidate"]
    m.quiet.wait()
    candidate.resume()
    try:
        candidate.prepare_prompt(fp.token_ids, m.max_new_tokens)
    finally:
        candidate.pause()
    m.quiet.wait()


def time_prompt(m: Measurement, fp: FreshPrompt, origin: float, opens: str = "control") -> PromptRun:
    """An untimed warm-up of both sides on the prompt's warm-up ids (and, for an instrument, its
    untimed preparation on the prompt, as ``harness time`` gives it), then ABBA legs, the side
    ``opens`` first: each side's first leg, the two the verified ratio compares, comes first on
    every other prompt."""
    try:
        for role in ROLES:
            if m.warmup_tokens:
                request(m, role, fp.warmup_ids, m.warmup_tokens)
        if m.instrument:
            prepare(m, fp)
        p = PromptRun(fp.id, 0, fp.token_ids, warmup_ids=fp.warmup_ids)
        seen = {role: 0 for role in ROLES}
        for order, role in enumerate(abba_roles(m.legs, opens)):
            t0, t1, tokens, measures = request(m, role, fp.token_ids, m.max_new_tokens)
            p.legs.append({"type": "leg", "prompt_id": fp.id, "role": role, "leg": seen[role], "order": order,
                           "t_start": t0 - origin, "t_end": t1 - origin, "wall_s": t1 - t0, "tokens": tokens,
                           **measures})
            seen[role] += 1
            if m.progress is not None:
                m.progress.step()
    except WorkerError as exc:
        exc.prompt_id = fp.id
        raise
    return p


def remeasure_reason(p: PromptRun) -> str | None:
    """Why a prompt is measured again on its spare: the control's legs unstable, or its control
    loaded. The candidate's own unstable legs never buy it another draw: it knows how its first leg
    went and could spoil its second whenever the first was slow, keeping only its lucky first legs."""
    control = checks.prompt_spreads(p)["control"]
    if control is not None and control > LEG_SPREAD_LIMIT:
        return f"control legs unstable ({control:.0%})"
    if loaded_against_control(p):
        return describe_load(p)
    return None


def time_fresh(m: Measurement, prompts: list[FreshPrompt], out: Measured) -> None:
    """Per prompt: its timing, or, if its control's legs spread past the limit or its control ran
    loaded, its spare's, the first kept in ``out.remeasured``. A spare is timed at most once."""
    origin = m.clock.now()
    done = len(out.ran)
    for n, fp in enumerate(prompts, start=done + 1):
        tag = f"retime [{n}/{done + len(prompts)}]"
        opens = ROLES[(n - 1) % 2]
        p = time_prompt(m, fp, origin, opens)
        ratio = verified_ratio(p)
        eta = f"; {m.progress.eta()}" if m.progress is not None else ""
        log(f"{tag} {fp.id} ({len(fp.token_ids)} tokens, like {fp.mirrors}): ratio {fmt_ratio(ratio)}{eta}")
        reason = remeasure_reason(p)
        if reason and fp.spare is not None:
            out.remeasured.append({"id": fp.id, "replaced_by": fp.spare.id, "mirrors": fp.mirrors, "ratio": ratio,
                                   "reason": reason, "leg_spread": checks.prompt_spreads(p), "waited": waited(p),
                                   "others_load": others_load(p), "walls": leg_walls(p)})
            log(f"{tag} {fp.id}: {reason}, measured again on its spare {fp.spare.id}")
            if m.progress is not None:
                m.progress.grow(2 * m.legs)
            fp = fp.spare
            p = time_prompt(m, fp, origin, opens)
            log(f"{tag} {fp.id}: ratio {fmt_ratio(verified_ratio(p))}")
        out.ran.append((fp, p))


def time_looks(m: Measurement, looks: tuple[list[FreshPrompt], list[FreshPrompt]], out: Measured,
               falls_short: Callable[[list[PromptRun]], str | None]) -> None:
    """The first look; then, if ``falls_short`` says why the first look would fail the claim, the
    second look, recorded in ``out.second_look``; the judgement is on all of them."""
    first, second = looks
    time_fresh(m, first, out)
    why = falls_short(out.timed)
    if not (why and second):
        return
    out.second_look = {"first_median_ratio": checks.median_ratio([verified_ratio(p) for p in out.timed]),
                       "first_prompts": len(out.ran), "prompts": len(second), "reason": why}
    log(f"the first {len(out.ran)} fresh prompts: {why}; a second look, at {len(second)} more, before judging")
    if m.progress is not None:
        m.progress.grow(2 * m.legs * len(second))
    time_fresh(m, second, out)
