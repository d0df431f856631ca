"""A distribution-free interval for a median ratio, and whether it tells a speed-up from none:
the one rule by which the claimed score (``audit replay``, the stream's own ratios) and the
verified score (``audit retime``, the retime's own) decide whether to score at all.

The interval is the k-th smallest and k-th largest of n prompt ratios for the largest k whose
coverage ``1 - 2 P(Binomial(n, 1/2) < k)`` is at least CONFIDENCE: the interval a sign test
inverts, which holds for any distribution of independent prompt ratios. It needs MIN_PROMPTS.
A decoder no faster than the control has a ratio above 1 on a prompt at most half the time, so
the interval's bottom lies above 1 for it with probability at most (1 - CONFIDENCE) / 2; a score
is given only then (``significant``).
"""
from __future__ import annotations

from scipy import stats

# the interval's least coverage, and the fewest prompts that reach it (1 - 2 * 0.5**6 = 96.9%)
CONFIDENCE = 0.95
MIN_PROMPTS = 6


def order_rank(n: int) -> tuple[int, float] | None:
    """(k, coverage): the largest k for which the k-th smallest and k-th largest of n independent
    draws enclose their distribution's median with probability ``coverage`` >= CONFIDENCE
    (1 - 2 P(Binomial(n, 1/2) < k)); None under MIN_PROMPTS, where no such pair exists."""
    best = None
    for k in range(1, n // 2 + 1):
        coverage = 1 - 2 * float(stats.binom.cdf(k - 1, n, 0.5))
        if coverage >= CONFIDENCE:
            best = (k, coverage)
    return best


def interval(ratios: list[float]) -> tuple[float | None, float | None, float | None, str]:
    """(low, high, coverage, how) for the median of ``ratios``: distribution-free, from order
    statistics; (None, None, None, why) for fewer than MIN_PROMPTS ratios."""
    n = len(ratios)
    rank = order_rank(n)
    if rank is None:
        return None, None, None, (f"nothing: {n} prompt(s); a {CONFIDENCE:.0%} interval for a median needs "
                                  f"{MIN_PROMPTS}")
    k, coverage = rank
    xs = sorted(ratios)
    return xs[k - 1], xs[n - k], coverage, (f"order statistics {k} and {n + 1 - k} of the {n} prompts' ratios "
                                            f"(distribution-free, {coverage:.1%} coverage)")


def significant(low: float | None) -> bool:
    """Whether an interval whose bottom is ``low`` tells a speed-up from none."""
    return low is not None and low > 1
