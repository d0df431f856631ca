"""Adaptive draft depth: pick each round's depth d to maximise expected tokens per unit time.

Pure policy, no tensors: it sees costs, measured round times and acceptance outcomes, nothing
else, so it can change without touching the runtime (and is tested on its own, tests/test_policy.py).

  E(d) = 1 + sum_{i=1..d} prod_{k=1..i} a_k      expected tokens from a round of depth d
  T(0) = c_step                                    a plain exact step
  T(d) = d * c_draft + c_verify[d + 1]             d chained head steps + a window of d + 1 rows

T(d) as written is the start-up measurement (``Costs``), op by op. A real round costs more: its
catch-up rows, the host's work between ops, the rollback. So ``RoundTimes`` learns each depth's
whole round time from the decode itself (host clock, sync point to sync point) and the policy
trades on that, with T(d) as its prior: worth ``prior_rounds`` rounds, then a running mean that
turns into an exponential moving average over ``horizon`` rounds. A depth not yet timed takes its
prior scaled by the nearest timed drafting depth's measured/prior ratio. Depth 0 is timed too, so
where drafting costs more than it yields the plain step wins on measured times.

a_k estimates P(draft k accepted | drafts 1..k-1 accepted) from observed drafts only (those after
the first rejection are never seen): hits and trials per depth, decayed by ``forget`` per round so
that it follows the text, with ``strength`` pseudo-observations of a prior (``prior`` for depth 1,
depth k-1's estimate for depth k) so that one round moves it quickly but not all the way. When depth 0 wins it keeps
winning without new evidence, so after a run of depth-0 rounds it probes depth 1: ``choose()``
returns 1 with ``probing`` set, and the caller drafts one token beside a plain step and reports
whether the step's token equals it (``update(1, hit)``), so a probe never costs a verify window,
only the draft. The run starts
at ``explore_first`` rounds and doubles after each probe up to ``explore_every``, and starts again
short whenever drafting resumes or a draft is accepted: one unlucky miss early in a decode then
costs a few plain steps, not ``explore_every`` of them, while at zero acceptance the probes soon
come only every ``explore_every`` steps, or less often when their price asks. A probe is priced:
its loss

  L = min(n_calls * c_draft, max(0, T(1) - (1 + a_1) * T(0))) + first_draft

(its draft, n_calls head forwards to catch up the rows since the last draft, the step beside it
being what depth 0 costs anyway; less when a depth-1 round is expected to come close to paying, so
a head near paying is probed soon; plus, while nothing has been drafted, the head's prompt rows,
which the decode's first draft makes and a decode that never drafts skips) may take at most
``explore_share`` of the run of plain steps before it: the run lasts at least
L / (explore_share * T(0)) rounds, however long that is. Once probes have been timed
(``observe_probe``: the probe round's wall time less a plain step's), L is at least what they
really added. Where a head step is dear against a step (a CPU: ~0.3 steps on tiny; a small model
on a GPU, where a catch-up and a draft are launch-bound: ~2 steps) probes wait past
``explore_first`` and ``explore_every``; where it is cheap (the 9B shape on a GPU: ~0.05 steps)
the doubling run rules.

Confidence stopping (``calibration`` set): a drafting round's depth is not fixed in advance.
After each draft the caller asks ``draft_more`` with the head's probability of every draft so
far (its confidence), and one more is drafted while

  P(1..k) * a_{k+1}  >=  rate * (T(k+1) - T(k))

with P(1..k) the product of the drafts' calibrated acceptances (``Calibration``: per tenth of
confidence, learned from the decode's own rounds), a_{k+1} the depth's acceptance above and rate
the best tokens per second the policy prices now: the next draft's expected tokens against what
it and its verify row cost at that rate. A round where the head is sure goes deep, one where it
hesitates stops early, whatever the depth that pays on average.

Depth 0 costs what a plain step costs: a plain round re-prices only depth 0 against the best
drafting rate, which it cannot change (only ``update`` and a drafting round's ``observe`` do), and
a run of plain rounds is decided once for up to as many rounds as remain before a probe could be
due (``plain_rounds``) and its time reported in one ``observe(0, seconds, rounds)``, so the
caller's loop can step like fast-serial's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Costs:
    step: float  # seconds of a plain (fast-serial) step
    draft: float  # seconds of one chained head step
    verify: dict[int, float]  # window rows -> seconds
    head_prefill: float = 0.0  # seconds of the head's rows for a prompt (a decode's first draft makes them)

    def round_time(self, depth: int) -> float:
        return self.step if depth == 0 else depth * self.draft + self.verify[depth + 1]

    @classmethod
    def from_reps(cls, reps: dict) -> "Costs":
        """The fastest of each op's timed reps, from ``{"step": [..], "draft": [..],
        "verify": {w: [..]}, "head_prefill": [..]}`` (window keys may be JSON strings; no
        head_prefill reps: 0)."""
        return cls(step=min(reps["step"]), draft=min(reps["draft"]),
                   verify={int(w): min(v) for w, v in reps["verify"].items()},
                   head_prefill=min(reps.get("head_prefill") or [0.0]))


@dataclass
class RoundTimes:
    """Seconds per round at each depth 0..max_depth, learned online with ``costs`` as the prior."""

    costs: Costs
    max_depth: int
    prior_rounds: float = 3.0  # how many measured rounds the start-up cost is worth
    horizon: float = 16.0  # rounds the moving average spans once past the prior
    # a round counts as at most this multiple of its depth's estimate: on a CPU one interrupted
    # plain step (another process, a page fault) would otherwise lift T(0) past a drafting depth's
    # price, and the policy would draft where it cannot pay; a lasting change still gets through
    outlier: float = 2.0
    estimate: list[float] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)  # measured rounds per depth

    def __post_init__(self):
        if self.prior_rounds < 0 or self.horizon < 1 or not self.outlier > 1:
            raise ValueError("prior_rounds must be >= 0, horizon >= 1 and outlier > 1")
        if not self.estimate:
            self.estimate = [self.costs.round_time(d) for d in range(self.max_depth + 1)]
            self.rounds = [0] * (self.max_depth + 1)

    def observe(self, depth: int, seconds: float, count: int = 1) -> None:
        """``count`` measured rounds of ``depth``, ``seconds`` each: per round the estimate moves
        1/(rounds + prior_rounds) of the way to it (1/horizon at most), so the prior fades like an
        average's first terms; a round slower than ``outlier`` times the estimate (before the
        first) counts as that much."""
        if not 0 <= depth <= self.max_depth or not seconds > 0 or count < 1:
            raise ValueError(f"observe({depth}, {seconds}, {count}) out of range")
        seconds = min(seconds, self.outlier * self.estimate[depth])
        for _ in range(count):
            self.rounds[depth] += 1
            rate = 1.0 / min(self.rounds[depth] + self.prior_rounds, self.horizon)
            self.estimate[depth] += rate * (seconds - self.estimate[depth])

    def times(self) -> list[float]:
        """The estimate per depth; an untimed drafting depth takes the nearest timed drafting
        depth's ratio to its prior (the deeper one on a tie), an untimed depth 0 its prior."""
        out = list(self.estimate)
        timed = [d for d in range(1, self.max_depth + 1) if self.rounds[d]]
        if timed:
            for d in range(1, self.max_depth + 1):
                if not self.rounds[d]:
                    near = min(timed, key=lambda t: (abs(t - d), -t))
                    out[d] = self.costs.round_time(d) * self.estimate[near] / self.costs.round_time(near)
        return out


CONFIDENCE_BINS = 10  # a draft's confidence counts in tenths


def confidence_bin(confidence: float) -> int:
    """The tenth a confidence (a probability) falls in: 0..CONFIDENCE_BINS - 1, 1.0 in the last."""
    return min(CONFIDENCE_BINS - 1, max(0, int(confidence * CONFIDENCE_BINS)))


@dataclass
class Calibration:
    """P(a draft is accepted | its confidence's tenth, every draft before it accepted), learned
    from the decode's rounds: per tenth, hits and trials decayed by ``forget`` per round, with
    ``strength`` pseudo-observations of the tenth's midpoint as its prior (a head's probability of
    its own draft is a fair first guess; the rounds correct it, for heads that are over- or
    under-confident alike)."""

    # half an observation: the first rounds of a tenth decide it (a random head's drafts are
    # all unsure, the instrument's all right: the midpoint prior must not hold them back long)
    strength: float = 0.5
    forget: float = 0.995
    hits: list[float] = field(default_factory=lambda: [0.0] * CONFIDENCE_BINS)
    trials: list[float] = field(default_factory=lambda: [0.0] * CONFIDENCE_BINS)

    def accept(self, confidence: float) -> float:
        b = confidence_bin(confidence)
        prior = (b + 0.5) / CONFIDENCE_BINS
        return (self.hits[b] + prior * self.strength) / (self.trials[b] + self.strength)

    def update(self, confidences: list[float], accepted: int) -> None:
        """A round verified drafts with these confidences and kept the first ``accepted``: drafts
        1..accepted + 1 were observed (the rest came after a rejection)."""
        self.hits = [h * self.forget for h in self.hits]
        self.trials = [t * self.forget for t in self.trials]
        for k, c in enumerate(confidences[:accepted + 1]):
            b = confidence_bin(c)
            self.trials[b] += 1.0
            self.hits[b] += 1.0 if k < accepted else 0.0

    def state(self) -> list[float]:
        return [round(self.accept((b + 0.5) / CONFIDENCE_BINS), 4) for b in range(CONFIDENCE_BINS)]


@dataclass
class DepthPolicy:
    costs: Costs
    max_depth: int
    # acceptance assumed before any evidence: low enough that a head that predicts nothing costs
    # two 2-row windows before the policy settles at depth 0, high enough that a good head is
    # drafting deeper within a few rounds (the hierarchical prior carries its evidence down)
    prior: float = 0.3
    strength: float = 2.0  # pseudo-observations behind the prior
    forget: float = 0.97  # per-round decay of old observations
    explore_every: int = 64  # the longest run of depth-0 rounds between probes, unless their price asks more
    explore_first: int = 8  # the first such run (it doubles after each probe)
    explore_share: float = 0.01  # the most a probe's draft may cost of the plain run before it
    fixed: int | None = None  # a fixed depth (no adaptation), e.g. for benchmarks
    online: bool = True  # trade on measured round times (``observe``); False: on ``costs`` alone
    times: RoundTimes | None = None
    hits: list[float] = field(default_factory=list)
    trials: list[float] = field(default_factory=list)
    zero_run: int = 0
    probing: bool = False  # the last choose() was a probe: draft 1 beside a plain step, no window
    drafted: bool = False  # a draft was made (``update``): the head has its prompt rows
    first_draft: float | None = None  # seconds the decode's first draft adds (None: costs.head_prefill)
    catch_up_calls: Callable[[int], int] | None = None  # head forwards for k pending rows (None: 1)
    explore_gap: int = 0  # depth-0 rounds before the next probe (0: explore_first)
    _best: int | None = field(default=None, repr=False, compare=False)
    # the best drafting depth's (tokens per second, -depth): depth 0's time does not enter it
    _drafting: tuple[float, int] | None = field(default=None, repr=False, compare=False)
    _probe_at: int | None = field(default=None, repr=False, compare=False)  # this run's priced length
    # draft_more's prices (per k: rate x (T(k+1) - T(k)), and the acceptances), made once per round:
    # its host time between two drafts is time the device waits
    _prices: tuple[list[float], list[float]] | None = field(default=None, repr=False, compare=False)
    probe_extra: float | None = None  # seconds a probe measurably adds to its plain step (None: none timed)
    probes_timed: int = 0
    calibration: Calibration | None = None  # set: confidence stopping (``draft_more``); None: depth by ``choose``

    def __post_init__(self):
        if self.max_depth < 0:
            raise ValueError("max_depth must be >= 0")
        missing = [w for w in range(2, self.max_depth + 2) if w not in self.costs.verify]
        if missing:
            raise ValueError(f"no measured verify cost for window sizes {missing}")
        if self.explore_every < 1 or self.explore_first < 1:
            raise ValueError("explore_every and explore_first must be >= 1")
        if not self.explore_share > 0:
            raise ValueError("explore_share must be > 0")
        if self.fixed is not None and not 0 <= self.fixed <= self.max_depth:
            raise ValueError(f"fixed depth {self.fixed} outside 0..{self.max_depth}")
        if not self.hits:
            self.hits = [0.0] * self.max_depth
            self.trials = [0.0] * self.max_depth
        if self.times is None:
            self.times = RoundTimes(self.costs, self.max_depth)

    @property
    def accept(self) -> list[float]:
        """Depth k's prior is depth k-1's estimate: with no evidence yet at a depth, it is assumed
        to behave like the one before it, so good acceptance pulls the policy deeper to look."""
        out, prior = [], self.prior
        for h, t in zip(self.hits, self.trials):
            prior = (h + prior * self.strength) / (t + self.strength)
            out.append(prior)
        return out

    def expected_tokens(self, depth: int) -> float:
        total, run, accept = 1.0, 1.0, self.accept
        for k in range(depth):
            run *= accept[k]
            total += run
        return total

    def round_times(self) -> list[float]:
        """Seconds per round at each depth, as the policy currently prices them."""
        if self.online:
            return self.times.times()
        return [self.costs.round_time(d) for d in range(self.max_depth + 1)]

    def step_time(self) -> float:
        """Seconds of a plain step as priced now (``round_times()[0]``, without the list)."""
        return self.times.estimate[0] if self.online else self.costs.step

    def best_depth(self) -> int:
        # only update() and observe() change the answer; caching it keeps a round's host work (which
        # the GPU waits for) to a few attribute reads in between. A plain round's observe() moves
        # only depth 0's time, so the drafting depths' best rate stays cached across plain rounds
        if self._best is None:
            if self._drafting is None:
                times, total, run, accept = self.round_times(), 1.0, 1.0, self.accept
                self._drafting = (float("-inf"), 0)
                for d in range(1, self.max_depth + 1):
                    run *= accept[d - 1]
                    total += run  # = expected_tokens(d)
                    self._drafting = max(self._drafting, (total / times[d], -d))
            self._best = -max((1.0 / self.step_time(), 0), self._drafting)[1]
        return self._best

    def rate(self) -> float:
        """Tokens per second of the best choice as priced now (a plain step's, or the best
        drafting depth's)."""
        self.best_depth()
        return max(1.0 / self.step_time(), self._drafting[0])

    def draft_more(self, confidences: list[float]) -> bool:
        """With confidence stopping: after drafts with these confidences, whether one more is
        worth its price (the module docstring's rule); never past ``max_depth``."""
        k = len(confidences)
        if self.calibration is None or k >= self.max_depth:
            return False
        if self._prices is None:
            times, rate = self.round_times(), self.rate()
            self._prices = [rate * (times[d + 1] - times[d]) for d in range(self.max_depth)], self.accept
        price, accept = self._prices
        cum = 1.0
        for c in confidences:
            cum *= self.calibration.accept(c)
        return cum * accept[k] >= price[k]

    def probe_wait(self, rows: int = 1) -> int:
        """Plain rounds before a probe with ``rows`` head rows to catch up may come, by its price:
        L / (explore_share * T(0))."""
        step = self.step_time()
        calls = self.catch_up_calls(rows) if self.catch_up_calls is not None else 1
        loss = min(calls * self.costs.draft, max(0.0, self.round_times()[1] - (1.0 + self.accept[0]) * step))
        if self.probe_extra is not None:  # what probes have really cost here, when it is more
            loss = max(loss, self.probe_extra)
        if not self.drafted:
            loss += self.costs.head_prefill if self.first_draft is None else self.first_draft
        return math.ceil(loss / (self.explore_share * step))

    def choose(self) -> int:
        """The next round's depth; 1 with ``probing`` set for a probe (see the module docstring)."""
        self.probing = False
        if self.fixed is not None:
            return self.fixed
        d = self.best_depth()
        if d == 0 and self.max_depth > 0:
            self.zero_run += 1
            gap = min(self.explore_gap or self.explore_first, self.explore_every)
            if self.zero_run < gap:
                return 0
            if self._probe_at is None:
                # priced once per run, when the doubling run is done (plain rounds stay a few reads),
                # for the rows the catch-up will have by then
                wait = self.probe_wait(self.zero_run + 1)
                self._probe_at = max(wait, self.probe_wait(wait + 1))
            if self.zero_run >= self._probe_at:
                self.explore_gap = min(2 * self.zero_run, self.explore_every)
                self.zero_run = 0
                self._probe_at = None
                self.probing = True
                return 1
            return 0
        self.zero_run = 0
        self.explore_gap = 0
        self._probe_at = None
        return d

    def plain_rounds(self, most: int) -> int:
        """After ``choose`` returned 0 (not a probe): how many plain rounds, this one included and
        at most ``most``, may run before the policy must be asked again, i.e. until a probe could
        be due. They count as chosen; the caller reports their time with one ``observe``. So a
        run of plain steps costs the host what fast-serial's loop does, not a choice per step."""
        if self.fixed is not None or self.max_depth == 0 or most <= 1:
            return max(1, most)
        due = self._probe_at
        if due is None:  # the run is priced when it reaches its doubling length
            due = min(self.explore_gap or self.explore_first, self.explore_every)
        rounds = max(1, min(most, due - self.zero_run))
        self.zero_run += rounds - 1
        return rounds

    def update(self, depth: int, accepted: int, confidences: list[float] | None = None) -> None:
        """A round drafted ``depth`` tokens and ``accepted`` of them matched; ``confidences``
        (one per draft) train the calibration, when there is one."""
        if not 0 <= accepted <= depth <= self.max_depth:
            raise ValueError(f"update({depth}, {accepted}) out of range")
        if confidences is not None and self.calibration is not None:
            if len(confidences) != depth:
                raise ValueError(f"update: {len(confidences)} confidences for depth {depth}")
            self.calibration.update(confidences, accepted)
        self._best = self._drafting = self._probe_at = self._prices = None
        self.drafted = True
        if accepted:  # evidence that the head predicts: the probe runs start short again
            self.explore_gap = 0
        self.hits = [h * self.forget for h in self.hits]
        self.trials = [t * self.forget for t in self.trials]
        for k in range(min(accepted + 1, depth)):  # drafts 1..accepted+1 were observed
            self.trials[k] += 1.0
            self.hits[k] += 1.0 if k < accepted else 0.0

    def observe(self, depth: int, seconds: float, rounds: int = 1) -> None:
        """``rounds`` rounds of ``depth`` took ``seconds`` of wall time in all (sync point to sync
        point), each counted at their mean."""
        if self.online and self.fixed is None:
            self.times.observe(depth, seconds / rounds, rounds)
            self._best = self._prices = None
            if depth > 0:
                self._drafting = None

    def observe_probe(self, seconds: float) -> None:
        """A probe round (the draft and the plain step beside it) took ``seconds`` of wall time: what
        it added to a plain step becomes the probe's measured price, a running mean over up to
        ``times.horizon`` probes. The round's step is not a plain round's time: on a GPU it also
        waits for the draft."""
        if not (self.online and self.fixed is None) or not seconds > 0:
            return
        extra = max(0.0, seconds - self.step_time())
        self.probes_timed += 1
        if self.probe_extra is None:
            self.probe_extra = extra
        else:
            self.probe_extra += (extra - self.probe_extra) / min(self.probes_timed, self.times.horizon)
        self._probe_at = None

    def learnt(self) -> float | None:
        """The depth-1 acceptance this policy ended with, for the next decode's prior; None where it
        learnt nothing (it never drafted, or its depth was fixed)."""
        return self.accept[0] if self.drafted and self.fixed is None else None

    def state(self) -> dict:
        return {"prior": round(self.prior, 4), "accept": [round(a, 4) for a in self.accept],
                "best_depth": self.best_depth(),
                "round_ms": [round(t * 1e3, 4) for t in self.round_times()], "timed_rounds": list(self.times.rounds),
                "probe_extra_ms": None if self.probe_extra is None else round(self.probe_extra * 1e3, 4),
                **({"calibration": self.calibration.state()} if self.calibration is not None else {})}
