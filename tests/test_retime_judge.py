"""The retime's judgement on its own figures: a score only for a speed-up the interval tells from
none, and a claim judged "too noisy to verify" when the interval is too wide to hold it to account."""
from __future__ import annotations

import pytest

from audit.retime import judge


def figures(monkeypatch, ratios, disqualified=False):
    monkeypatch.setattr(judge, "prompt_ratios", lambda timed: list(ratios))
    return judge.verified_figures([], seed=7, disqualified=disqualified, s_max=0.95, kappa=2.0)


def test_a_median_above_one_whose_interval_reaches_below_one_scores_nothing(monkeypatch):
    v = figures(monkeypatch, [0.9, 1.1, 1.2, 0.95, 1.15])
    assert v["ratio"] > 1 and v["ci_low"] <= 1 and not v["significant"] and v["score"] == 0


def test_a_clear_speed_up_scores_by_its_median(monkeypatch):
    v = figures(monkeypatch, [2.0, 2.1, 1.9, 2.05])
    assert v["significant"] and v["ci_low"] > 1
    assert v["score"] == pytest.approx(judge.checks.score(v["ratio"], 1.0, 0.95, 2.0, False))
    assert figures(monkeypatch, [2.0, 2.1, 1.9, 2.05], disqualified=True)["score"] == 0


def test_the_interval_is_repeatable_from_the_seed(monkeypatch):
    a, b = figures(monkeypatch, [1.0, 1.4, 1.9, 1.2]), figures(monkeypatch, [1.0, 1.4, 1.9, 1.2])
    assert (a["ci_low"], a["ci_high"]) == (b["ci_low"], b["ci_high"])


@pytest.mark.parametrize("low, high, noisy", [(1.0, 1.49, False), (1.0, 1.51, True), (0.6, 1.2, True),
                                               (None, None, False), (1.2, 1.2, False)])
def test_too_noisy_is_an_interval_wider_than_the_span(low, high, noisy):
    assert judge.too_noisy(low, high) is noisy


def test_a_claim_above_the_margin_fails_and_one_within_it_does_not():
    assert judge.claim_findings(2.0, 1.0, 1.2)[0]["check"] == "claim-not-reproduced"
    assert judge.claim_findings(1.6, 1.0, 1.2) == []
