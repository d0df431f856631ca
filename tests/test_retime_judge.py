"""The retime's judgement on its own figures: the like-for-like ratio, a distribution-free interval
whose coverage holds at any number of prompts, a score only for a speed-up the interval tells from
none, and a claim judged "too noisy to verify" when the interval is too wide to hold it to account."""
from __future__ import annotations

import random
import statistics
from math import comb

import pytest

from audit.interval import MIN_PROMPTS, order_rank
from audit.retime import judge
from audit.stream import PromptRun


def figures(monkeypatch, ratios, disqualified=False):
    monkeypatch.setattr(judge, "prompt_ratios", lambda timed: list(ratios))
    return judge.verified_figures([], disqualified=disqualified, s_max=0.95, kappa=2.0)


def test_a_median_above_one_whose_interval_reaches_below_one_scores_nothing(monkeypatch):
    v = figures(monkeypatch, [0.9, 1.1, 1.2, 0.95, 1.15, 1.3, 1.05])
    assert v["ratio"] > 1 and v["ci_low"] <= 1 and not v["significant"] and v["score"] == 0


def test_a_clear_speed_up_scores_by_its_median(monkeypatch):
    v = figures(monkeypatch, [2.0, 2.1, 1.9, 2.05, 1.95, 2.2])
    assert v["significant"] and v["ci_low"] > 1
    assert v["score"] == pytest.approx(judge.checks.score(v["ratio"], 1.0, 0.95, 2.0, False))
    assert figures(monkeypatch, [2.0, 2.1, 1.9, 2.05, 1.95, 2.2], disqualified=True)["score"] == 0


@pytest.mark.parametrize("n", range(1, 31))
def test_the_order_statistics_cover_the_median_at_95_percent(n):
    """k is the largest rank whose exact binomial coverage reaches 95%; none exists under 6."""
    rank = order_rank(n)
    if n < MIN_PROMPTS:
        assert rank is None
        return
    k, coverage = rank

    def cover(j):
        return 1 - 2 * sum(comb(n, i) for i in range(j)) / 2 ** n
    assert coverage == pytest.approx(cover(k)) and cover(k) >= 0.95 > (cover(k + 1) if k < n // 2 else 0)


def test_under_six_prompts_there_is_no_interval_and_no_score(monkeypatch):
    v = figures(monkeypatch, [3.0] * 5)
    assert v["ci_low"] is None and v["ci_high"] is None and v["confidence"] is None
    assert "needs 6" in v["interval"] and not v["significant"] and v["score"] == 0
    assert judge.claim_findings(9.0, None, None) == []


def test_the_interval_is_the_named_order_statistics():
    low, high, coverage, how = judge.interval([1.9, 1.1, 1.5, 1.3, 1.7, 1.2, 1.6, 1.4, 1.8])
    assert (low, high) == (1.2, 1.8) and coverage == pytest.approx(0.9609, abs=1e-4)
    assert how.startswith("order statistics 2 and 8 of the 9 prompts' ratios")


def synthetic_prompt(control: list[float], candidate: list[float], opens: str = "control") -> PromptRun:
    from core.schema import abba_roles

    p = PromptRun("fresh-0", 0, [1, 2, 3])
    walls = {"control": list(control), "candidate": list(candidate)}
    seen = {"control": 0, "candidate": 0}
    for order, role in enumerate(abba_roles(len(control), opens)):
        p.legs.append({"type": "leg", "prompt_id": p.id, "role": role, "leg": seen[role], "order": order,
                       "wall_s": walls[role][seen[role]]})
        seen[role] += 1
    return p


def test_the_verified_ratio_is_first_leg_over_first_leg():
    assert judge.verified_ratio(synthetic_prompt([0.2, 0.1], [0.1, 0.05])) == pytest.approx(2.0)
    assert judge.verified_ratio(synthetic_prompt([0.2, 0.1], [0.1, 0.05], opens="candidate")) == pytest.approx(2.0)
    assert judge.verified_ratio(PromptRun("x", 0, [1])) is None


def loaded_leg(rng: random.Random) -> float:
    """One leg on a loaded machine: a fixed time plus right-skewed noise (bursts of other work)."""
    return 0.1 + rng.expovariate(1 / 0.05)


def test_an_equally_fast_candidate_is_above_one_half_the_time_like_for_like():
    """Under load's right-skewed noise the median of two control legs (their mean) lies above one
    candidate leg more often than not; first leg against first leg, exactly half the time."""
    rng = random.Random(5)
    trials = [([loaded_leg(rng), loaded_leg(rng)], [loaded_leg(rng), loaded_leg(rng)]) for _ in range(20000)]
    median_rule = sum(statistics.median(c) > k[0] for c, k in trials) / len(trials)
    like_for_like = sum(judge.verified_ratio(synthetic_prompt(c, k)) > 1 for c, k in trials) / len(trials)
    assert median_rule > 0.53 and abs(like_for_like - 0.5) < 0.015


@pytest.mark.parametrize("n", [6, 9, 12])
def test_a_serial_speed_candidate_scores_at_most_one_time_in_forty(monkeypatch, n):
    """Thousands of retimes of a candidate exactly as fast as the control, on a loaded machine: the
    interval's bottom lies above 1 (a positive score) at most 2.5% of the time, plus sampling error."""
    rng = random.Random(n)
    scored = 0
    for _ in range(4000):
        ratios = [judge.verified_ratio(synthetic_prompt([loaded_leg(rng), loaded_leg(rng)],
                                                        [loaded_leg(rng), loaded_leg(rng)])) for _ in range(n)]
        scored += figures(monkeypatch, ratios)["score"] > 0
    assert scored / 4000 <= 0.025 + 0.008


@pytest.mark.parametrize("low, high, noisy", [(1.0, 1.49, False), (1.0, 1.51, True), (0.6, 1.2, True),
                                               (None, None, False), (1.2, 1.2, False)])
def test_too_noisy_is_an_interval_wider_than_the_span(low, high, noisy):
    assert judge.too_noisy(low, high) is noisy


def test_a_claim_above_the_margin_fails_and_one_within_it_does_not():
    assert judge.claim_findings(2.0, 1.0, 1.2)[0]["check"] == "claim-not-reproduced"
    assert judge.claim_findings(1.6, 1.0, 1.2) == []
