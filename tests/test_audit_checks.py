"""Pure audit logic without a model: score, memory factor, ratio recomputation, leg timing and
order, warm legs, and the replay's stop rules on a scripted stepper."""
import math
import statistics

import pytest
import torch

from audit import checks
from audit.replay import AFTER_EOS, ENDS_EARLY, NOT_ARGMAX, TOO_LONG, replay_prompt
from audit.stream import BadInput, PromptRun
from core.schema import abba_roles

# --------------------------------------------------------------------------- builders


def make_prompt(walls: dict[str, list[float]] | None = None, legs: int = 2, tokens=(1, 2, 3), pid="p",
                mem: dict[str, list] | None = None, start: float = 1.0, gap: float = 0.01) -> PromptRun:
    """A prompt whose legs ran in ABBA order back to back, with the given wall times per role."""
    walls = walls or {"control": [1.0] * legs, "candidate": [0.5] * legs}
    mem = mem or {"control": [None] * legs, "candidate": [None] * legs}
    p = PromptRun(pid, 2, [5, 6, 7])
    seen = {"control": 0, "candidate": 0}
    t = start
    for order, role in enumerate(abba_roles(legs)):
        k = seen[role]
        seen[role] += 1
        w = walls[role][k]
        p.legs.append({"type": "leg", "prompt_id": pid, "role": role, "leg": k, "order": order, "t_start": t,
                       "t_end": t + w, "wall_s": (t + w) - t, "tokens": list(tokens),
                       "peak_mem_bytes": mem[role][k]})
        t = t + w + gap
    return p


def checks_named(found, check):
    return [f for f in found if f["check"] == check]


# --------------------------------------------------------------------------- score


def test_score_formula_without_memory():
    f_mem, ratio = checks.memory_factor(None, None, 1.2)
    assert (f_mem, ratio) == (1.0, None)
    m = 2.5
    assert checks.score(m, f_mem, 0.95, 2.0, False) == pytest.approx(0.95 * (1 - math.exp(-(m - 1) / 2.0)))


def test_score_formula_with_memory():
    f_mem, ratio = checks.memory_factor(1000, 1800, 1.2)  # candidate uses 1.8x the control's peak
    assert ratio == pytest.approx(1.8)
    assert f_mem == pytest.approx(1.2 / 1.8)
    assert checks.score(3.0, f_mem, 0.95, 2.0, False) == pytest.approx(0.95 * (1 - math.exp(-1.0)) * 1.2 / 1.8)
    assert checks.memory_factor(1000, 1100, 1.2)[0] == 1.0  # within the allowance: no cut
    assert checks.score(3.0, 1.0, 0.5, 4.0, False) == pytest.approx(0.5 * (1 - math.exp(-0.5)))


def test_score_zero_when_disqualified_or_not_faster():
    assert checks.score(3.0, 1.0, 0.95, 2.0, True) == 0.0
    assert checks.score(1.0, 1.0, 0.95, 2.0, False) == 0.0
    assert checks.score(0.7, 1.0, 0.95, 2.0, False) == 0.0
    assert checks.score(None, 1.0, 0.95, 2.0, False) == 0.0


def test_peak_is_max_over_legs_and_mixed_nulls_are_tamper():
    p = make_prompt(mem={"control": [100, 300], "candidate": [200, 150]})
    assert checks.peak_bytes(p.role_legs("control")) == 300
    assert checks.peak_bytes(p.role_legs("candidate")) == 200
    assert checks.check_memory_recorded([p]) == []
    q = make_prompt(mem={"control": [100, 300], "candidate": [None, 150]})
    assert checks_named(checks.check_memory_recorded([q]), "tamper")


# --------------------------------------------------------------------------- ratios


def test_ratios_recomputed_from_raw_legs():
    a = make_prompt({"control": [1.0, 1.2, 1.1], "candidate": [0.5, 0.4, 0.6]}, legs=3, pid="a")
    b = make_prompt({"control": [2.0, 2.0, 2.0], "candidate": [1.0, 0.5, 1.0]}, legs=3, pid="b", start=100)
    per, median = checks.recompute_ratios([a, b])
    ra = statistics.median([1.0, 1.2, 1.1]) / statistics.median([0.5, 0.4, 0.6])
    assert per["a"]["ratio"] == pytest.approx(ra)
    assert per["b"]["ratio"] == pytest.approx(2.0)
    assert median == pytest.approx((ra + 2.0) / 2)


def test_summary_mismatch_beyond_rounding_is_tamper():
    p = make_prompt()
    med = checks.prompt_medians(p)
    p.summaries.append({"type": "summary", "prompt_id": "p", **med})
    assert checks.check_summary(p, med) == []
    p.summaries[0]["ratio"] = med["ratio"] * (1 + 1e-12)  # rounding: fine
    assert checks.check_summary(p, med) == []
    p.summaries[0]["ratio"] = med["ratio"] * (1 + 1e-6)
    assert [f["field"] for f in checks.check_summary(p, med)] == ["ratio"]
    assert checks_named(checks.check_summary(make_prompt(), med), "tamper")  # no summary at all


def test_end_median_mismatch_is_tamper():
    assert checks.check_end_median({"median_ratio": 2.0}, 2.0) == []
    assert checks.check_end_median({"median_ratio": 2.0}, 2.1)[0]["field"] == "median_ratio"
    assert checks.check_end_median({}, 2.0)[0]["check"] == "tamper"


# --------------------------------------------------------------------------- leg timing and order


def test_clean_legs_pass_timing_and_order():
    p = make_prompt(legs=3)
    assert checks.check_leg_timing(p) == []
    assert checks.check_leg_order(p, 3) == []
    assert checks.check_leg_set(p, 3) == []


def test_edited_wall_time_is_caught():
    p = make_prompt()
    p.legs[1]["wall_s"] *= 0.5
    found = checks.check_leg_timing(p)
    assert found and found[0]["leg"] == "candidate#0"


def test_swapped_leg_times_are_caught():
    p = make_prompt()
    a, b = p.legs[0], p.legs[1]  # control#0 (order 0), candidate#0 (order 1)
    for key in ("wall_s", "t_start", "t_end"):
        a[key], b[key] = b[key], a[key]
    found = checks.check_leg_timing(p)
    assert any(f.get("legs") == ["control#0", "candidate#0"] for f in found)


def test_overlapping_prompts_are_caught():
    a = make_prompt(pid="a", start=1.0)
    b = make_prompt(pid="b", start=2.0)  # a's legs run until ~4
    assert checks_named(checks.check_prompt_sequence([a, b]), "tamper")
    assert checks.check_prompt_sequence([a, make_prompt(pid="b", start=10.0)]) == []


def test_order_must_follow_abba():
    p = make_prompt(legs=2)
    p.legs[0]["order"], p.legs[1]["order"] = 1, 0  # roles no longer follow A B B A
    found = checks.check_leg_order(p, 2)
    assert len(checks_named(found, "tamper")) >= 2


def test_abba_slot_is_abba_roles_without_the_list():
    for legs in (1, 2, 3, 7):
        roles = abba_roles(legs)
        assert [checks.abba_slot(k) for k in range(2 * legs)] == \
            [(role, roles[:k].count(role)) for k, role in enumerate(roles)]


def test_warmup_prompt_rules():
    p = make_prompt()
    assert checks.check_warmup_prompt(p) == []  # not recorded: nothing to check
    p.warmup_ids = [9, 9, 9]
    assert checks.check_warmup_prompt(p) == []
    p.warmup_ids = list(p.token_ids)
    assert checks_named(checks.check_warmup_prompt(p), "warmup-prompt")
    p.warmup_ids = [9]
    assert checks_named(checks.check_warmup_prompt(p), "warmup-prompt")


def test_leg_spread_warns_and_marks_the_run_unstable():
    steady = make_prompt({"control": [1.0, 1.1], "candidate": [0.5, 0.55]}, pid="s")
    noisy = make_prompt({"control": [1.0, 1.5], "candidate": [0.5, 0.5]}, pid="n", start=100)
    assert checks.check_leg_spread(steady) == []
    (f,) = checks.check_leg_spread(noisy)
    assert (f["check"], f["severity"], f["role"], f["spread"]) == ("unstable", "warn", "control", pytest.approx(0.5))
    assert checks.run_unstable([steady, noisy])  # 1 of 2 > UNSTABLE_RUN_SHARE
    assert not checks.run_unstable([steady, steady, steady, steady, noisy])


def test_prompt_set_against_its_rebuilt_reference():
    a, b = make_prompt(pid="a"), make_prompt(pid="b", start=100)
    ref = ([("a", a.token_ids), ("b", b.token_ids)], {"source": "builtin:x", "sha256": "s", "count": 2})
    header = {"prompts": {"source": "builtin:x", "sha256": "s", "count": 2}}
    assert checks.check_prompt_set(header, [a, b], ref) == []
    bad = checks.check_prompt_set({"prompts": {"source": "builtin:x", "sha256": "t", "count": 3}}, [a, b], ref)
    assert [f["check"] for f in bad] == ["prompts", "prompts"] and all(f["severity"] == "fail" for f in bad)
    b.token_ids = [1]
    assert "not the prompts of" in checks.check_prompt_set(header, [a, b], ref)[0]["message"]
    (w,) = checks.check_prompt_set(header, [a, b], "prompt file 'x' is not on this machine")
    assert w["severity"] == "warn"
    assert checks.check_prompt_set({}, [a], ref)[0]["severity"] == "fail"


def test_missing_duplicate_and_extra_legs():
    p = make_prompt(legs=2)
    del p.legs[2]  # candidate#1
    found = checks.check_leg_set(p, 2)
    assert [(f["check"], f["role"], f["legs"]) for f in found] == [("missing-leg", "candidate", [1])]
    q = make_prompt(legs=2)
    q.legs.append(dict(q.legs[0]))
    assert checks_named(checks.check_leg_set(q, 2), "tamper")[0]["legs"] == [0]
    r = make_prompt(legs=2)
    r.legs[3]["leg"] = 5
    found = checks.check_leg_set(r, 2)
    assert {f["check"] for f in found} == {"tamper", "missing-leg"}


def test_control_consistency():
    p = make_prompt(legs=3)
    assert checks.check_control_consistency(p) == []
    p.role_legs("control")[2]["tokens"] = [1, 9, 3]
    (f,) = checks.check_control_consistency(p)
    assert f["check"] == "control-consistency" and f["position"] == 1


def test_integrity_findings():
    assert checks.check_integrity({"present": True, "count_ok": True, "sha256_ok": True}) == []
    assert "truncated" in checks.check_integrity({"present": False})[0]["message"]
    assert len(checks.check_integrity({"present": True, "count_ok": False, "sha256_ok": False})) == 2


def test_device_mismatch_refused_unless_allowed():
    rec = {"type": "cuda", "name": "NVIDIA H200"}
    assert checks.check_device(rec, "cuda", "NVIDIA H200", False) == []
    with pytest.raises(BadInput, match="allow-device-mismatch"):
        checks.check_device(rec, "cuda", "NVIDIA A100", False)
    assert checks.check_device(rec, "cpu", "cpu (x86_64)", True)[0]["severity"] == "warn"


def test_model_identity():
    tiny = {"name": "tiny", "kind": "builtin", "config_sha256": "a", "weights_fingerprint": "b"}
    assert checks.check_model_identity(tiny, dict(tiny)) == []
    assert checks.check_model_identity(tiny, dict(tiny, weights_fingerprint="c"))[0]["mismatched"] == [
        "weights_fingerprint"]
    syn = {"name": "synthetic-9b", "kind": "builtin", "seed": 0}
    assert checks.check_model_identity(syn, dict(syn, seed=1))[0]["check"] == "model"
    ckpt = {"name": "/a", "kind": "checkpoint", "config_sha256": "a", "weights_fingerprint": "b"}
    assert checks.check_model_identity(ckpt, dict(ckpt, name="/elsewhere")) == []  # moved, same weights


# --------------------------------------------------------------------------- warm legs


def test_warm_leg_flags_request_cache():
    cached = make_prompt({"control": [1.0, 1.0, 1.05], "candidate": [1.0, 0.01, 0.01]}, legs=3)
    flagged, stats = checks.warm_leg_flag(cached, 3)
    assert flagged and stats["candidate_later_over_first"] < 0.6
    assert checks.check_warm_leg(cached, 3)[0]["check"] == "warm-leg"


def test_a_warm_leg_fails_only_as_a_lookup():
    """A slow honest first leg (a loaded machine) is a warning; later legs ten times faster than the
    first, the control's steady, are a lookup and fail."""
    slow_first = make_prompt({"control": [1.0, 1.0, 1.0], "candidate": [1.0, 0.5, 0.5]}, legs=3)
    (f,) = checks.check_warm_leg(slow_first, 3)
    assert f["severity"] == "warn"
    cached = make_prompt({"control": [1.0, 1.0, 1.05], "candidate": [1.0, 0.01, 0.01]}, legs=3)
    assert [f["severity"] for f in checks.check_warm_leg(cached, 3)] == ["fail"]
    noisy_control = make_prompt({"control": [3.0, 1.0, 1.0], "candidate": [1.0, 0.001, 0.001]}, legs=3)
    assert [f["severity"] for f in checks.check_warm_leg(noisy_control, 3)] == ["warn"]


def test_warm_leg_flags_tenfold_relative_speedup_despite_noisy_control():
    # the control's first leg hit a slow spell (later/first 0.5), the candidate's later legs are ~free
    cached = make_prompt({"control": [2.0, 1.0, 1.0], "candidate": [1.0, 0.001, 0.001]}, legs=3)
    assert checks.warm_leg_flag(cached, 3)[0]


def test_warm_leg_not_flagged_when_control_also_warms_or_single_leg():
    both = make_prompt({"control": [1.0, 0.3, 0.3], "candidate": [1.0, 0.1, 0.1]}, legs=3)
    assert not checks.warm_leg_flag(both, 3)[0]
    steady = make_prompt({"control": [1.0, 1.0, 1.0], "candidate": [0.5, 0.5, 0.45]}, legs=3)
    assert not checks.warm_leg_flag(steady, 3)[0]
    single = make_prompt({"control": [1.0], "candidate": [1.0]}, legs=1)
    assert not checks.warm_leg_flag(single, 1)[0]


# --------------------------------------------------------------------------- replay rules


class ScriptedStepper:
    """Logits whose argmax follows ``greedy`` as long as it is fed the greedy tokens."""

    def __init__(self, greedy: list[int], vocab: int = 10, tie_at: int | None = None):
        self.greedy, self.vocab, self.tie_at = greedy, vocab, tie_at
        self.i = 0
        self.steps = 0

    def logits(self) -> torch.Tensor:
        x = torch.zeros(self.vocab)
        x[self.greedy[self.i]] = 2.0
        x[(self.greedy[self.i] + 1) % self.vocab] = 2.0 if self.i == self.tie_at else 1.5
        return x

    def start(self, prompt_ids):
        self.i = 0
        return self.logits()

    def step(self, token):
        assert token == self.greedy[self.i], "the replay must only ever feed greedy tokens"
        self.i += 1
        self.steps += 1
        return self.logits()


EOS = {0}


def replay(streams, greedy, n, **kw):
    stepper = ScriptedStepper(greedy, **kw)
    result, path = replay_prompt(stepper, [9], [tuple(s) for s in streams], n, EOS)
    return result, path, stepper


def test_exact_streams_ending_at_eos_or_n():
    result, _, _ = replay([[3, 4, 0]], [3, 4, 0, 5], 8)
    assert result[(3, 4, 0)] is None  # ends right after EOS
    result, _, _ = replay([[3, 4, 5]], [3, 4, 5, 6], 3)
    assert result[(3, 4, 5)] is None  # ends at N


def test_wrong_token_reports_position_top5_and_margin():
    result, _, _ = replay([[3, 7, 5]], [3, 4, 5, 6], 3)
    d = result[(3, 7, 5)]
    assert (d.position, d.emitted, d.greedy, d.reason) == (1, 7, 4, NOT_ARGMAX)
    assert d.top5[0] == [4, 2.0] and len(d.top5) == 5
    assert d.margin == pytest.approx(0.5)


def test_tie_takes_first_index():
    result, _, _ = replay([[3, 5]], [3, 4, 5], 2, tie_at=1)  # tokens 4 and 5 tie at position 1
    d = result[(3, 5)]
    assert (d.greedy, d.margin) == (4, 0.0)


def test_stop_rules():
    greedy = [3, 4, 0, 5, 6]
    result, _, _ = replay([[3, 4, 0, 5]], greedy, 8)
    d = result[(3, 4, 0, 5)]
    assert (d.position, d.emitted, d.greedy, d.reason) == (3, 5, None, AFTER_EOS)
    result, _, _ = replay([[3, 4]], greedy, 8)
    d = result[(3, 4)]
    assert (d.position, d.emitted, d.greedy, d.reason) == (2, None, 0, ENDS_EARLY)
    result, _, _ = replay([[3, 4, 5, 6]], [3, 4, 5, 6, 7], 3)
    d = result[(3, 4, 5, 6)]
    assert (d.position, d.emitted, d.reason) == (3, 6, TOO_LONG)
    result, _, _ = replay([[]], greedy, 8)
    assert result[()].reason == ENDS_EARLY and result[()].position == 0


def test_one_walk_serves_every_stream():
    streams = [[3, 4, 5, 6], [3, 4, 5, 6], [3, 9], [3, 4, 5, 6]]
    result, path, stepper = replay(streams, [3, 4, 5, 6, 7], 4)
    assert result[(3, 4, 5, 6)] is None and result[(3, 9)].position == 1
    assert path == [3, 4, 5, 6] and stepper.steps == 3  # prefill + 3 steps for 4 positions
    _, path, stepper = replay([[3, 9], [8]], [3, 4, 5], 10)
    assert stepper.steps == 1  # stops as soon as no stream needs more
