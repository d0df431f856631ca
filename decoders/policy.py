"""Adaptive draft depth: pick each round's depth d to maximise expected tokens per unit time.

Pure policy, no tensors: it sees measured costs and acceptance outcomes, nothing else, so it can
change without touching the runtime (and is tested on its own, tests/test_policy.py).

  E(d) = 1 + sum_{i=1..d} prod_{k=1..i} a_k      expected tokens from a round of depth d
  T(0) = c_step                                    a plain exact step
  T(d) = d * c_draft + c_verify[d + 1]             d chained head steps + a window of d + 1 rows

a_k estimates P(draft k accepted | drafts 1..k-1 accepted) from observed drafts only (those after
the first rejection are never seen): hits and trials per depth, decayed by ``forget`` per round so
that it follows the text, with ``strength`` pseudo-observations of a prior (``prior`` for depth 1,
depth k-1's estimate for depth k) so that one round moves it quickly but not all the way. When depth 0 wins it keeps
winning without new evidence, so after a run of depth-0 rounds it probes depth 1. The run starts
at ``explore_first`` rounds and doubles after each probe up to ``explore_every``, and starts again
short whenever drafting resumes: one unlucky miss early in a decode then costs a few plain steps,
not ``explore_every`` of them, while at zero acceptance the probes soon come only every
``explore_every`` steps, each one draft and one 2-row window (~0.2% at 64 on the 9B shape: a 2-row
window costs ~1.13 steps).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Costs:
    step: float  # seconds of a plain (fast-serial) step
    draft: float  # seconds of one chained head step
    verify: dict[int, float]  # window rows -> seconds

    def round_time(self, depth: int) -> float:
        return self.step if depth == 0 else depth * self.draft + self.verify[depth + 1]

    @classmethod
    def from_reps(cls, reps: dict) -> "Costs":
        """The fastest of each op's timed reps, from ``{"step": [..], "draft": [..],
        "verify": {w: [..]}}`` (window keys may be JSON strings)."""
        return cls(step=min(reps["step"]), draft=min(reps["draft"]),
                   verify={int(w): min(v) for w, v in reps["verify"].items()})


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
    explore_every: int = 64  # the longest run of depth-0 rounds between probes
    explore_first: int = 8  # the first such run (it doubles after each probe)
    fixed: int | None = None  # a fixed depth (no adaptation), e.g. for benchmarks
    hits: list[float] = field(default_factory=list)
    trials: list[float] = field(default_factory=list)
    zero_run: int = 0
    explore_gap: int = 0  # depth-0 rounds before the next probe (0: explore_first)
    _best: int | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.max_depth < 0:
            raise ValueError("max_depth must be >= 0")
        missing = [w for w in range(2, self.max_depth + 2) if w not in self.costs.verify]
        if missing:
            raise ValueError(f"no measured verify cost for window sizes {missing}")
        if self.explore_every < 1 or self.explore_first < 1:
            raise ValueError("explore_every and explore_first must be >= 1")
        if self.fixed is not None and not 0 <= self.fixed <= self.max_depth:
            raise ValueError(f"fixed depth {self.fixed} outside 0..{self.max_depth}")
        if not self.hits:
            self.hits = [0.0] * self.max_depth
            self.trials = [0.0] * self.max_depth

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

    def best_depth(self) -> int:
        # only update() changes the answer; caching it keeps a depth-0 round's host work (which the
        # GPU waits for) to a few attribute reads
        if self._best is None:
            rates = [(self.expected_tokens(d) / self.costs.round_time(d), -d) for d in range(self.max_depth + 1)]
            self._best = -max(rates)[1]
        return self._best

    def choose(self) -> int:
        if self.fixed is not None:
            return self.fixed
        d = self.best_depth()
        if d == 0 and self.max_depth > 0:
            self.zero_run += 1
            gap = min(self.explore_gap or self.explore_first, self.explore_every)
            if self.zero_run >= gap:
                self.zero_run = 0
                self.explore_gap = min(2 * gap, self.explore_every)
                return 1
            return 0
        self.zero_run = 0
        self.explore_gap = 0
        return d

    def update(self, depth: int, accepted: int) -> None:
        """A round drafted ``depth`` tokens and ``accepted`` of them matched."""
        if not 0 <= accepted <= depth <= self.max_depth:
            raise ValueError(f"update({depth}, {accepted}) out of range")
        self._best = None
        self.hits = [h * self.forget for h in self.hits]
        self.trials = [t * self.forget for t in self.trials]
        for k in range(min(accepted + 1, depth)):  # drafts 1..accepted+1 were observed
            self.trials[k] += 1.0
            self.hits[k] += 1.0 if k < accepted else 0.0

    def state(self) -> dict:
        return {"accept": [round(a, 4) for a in self.accept], "best_depth": self.best_depth()}
