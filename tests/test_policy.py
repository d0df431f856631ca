"""Adaptive depth, driven through its states with synthetic acceptance and costs."""
import math
import random

import pytest

from decoders.policy import Calibration, Costs, DepthPolicy, RoundTimes, confidence_bin

# Shaped like the H200 measurements in bench/NOTES.md: step 9.8 ms, window w costs ~1 + 0.1*(w-1)
# steps, a head step ~0.5 ms.
GPU = Costs(step=9.8e-3, draft=0.5e-3, verify={w: 9.8e-3 * (1 + 0.105 * (w - 1)) for w in range(1, 10)})


def drive(policy, alpha, rounds, seed=0, real_time=None):
    """Feed the policy rounds where each draft is accepted with probability alpha; with
    ``real_time``, each round also reports its wall time ``real_time(depth)``."""
    rng = random.Random(seed)
    depths = []
    for _ in range(rounds):
        d = policy.choose()
        depths.append(d)
        j = 0
        while j < d and rng.random() < alpha:
            j += 1
        if d:
            policy.update(d, j)
        if real_time is not None:
            policy.observe(d, real_time(d))
    return depths


def test_zero_acceptance_settles_on_plain_steps_with_rare_probes():
    p = DepthPolicy(GPU, max_depth=6, explore_every=32)
    depths = drive(p, 0.0, 2000)
    tail = depths[200:]
    probes = sum(1 for d in tail if d > 0)
    assert probes <= len(tail) / 32 + 1 and all(d in (0, 1) for d in tail)
    # cost of probing at zero acceptance, in steps: must stay well under the 3% budget
    extra = probes * (GPU.round_time(1) - GPU.step) / (len(tail) * GPU.step)
    assert extra < 0.01


def test_high_acceptance_goes_deep():
    p = DepthPolicy(GPU, max_depth=6)
    depths = drive(p, 0.95, 400)
    assert sum(depths[100:]) / len(depths[100:]) > 5


def test_medium_acceptance_picks_intermediate_depth():
    p = DepthPolicy(GPU, max_depth=8)
    depths = drive(p, 0.6, 600)
    mean = sum(depths[200:]) / len(depths[200:])
    assert 1.5 < mean < 6


def test_tracks_a_change_in_acceptance():
    p = DepthPolicy(GPU, max_depth=6)
    drive(p, 0.95, 300)
    assert p.best_depth() >= 5
    drive(p, 0.0, 300)
    assert p.best_depth() == 0
    drive(p, 0.95, 600, seed=1)
    assert p.best_depth() >= 4


def test_expensive_verification_means_no_speculation():
    costly = Costs(step=1.0, draft=0.5, verify={w: 1.0 * w for w in range(1, 10)})
    p = DepthPolicy(costly, max_depth=4)
    drive(p, 0.9, 300)
    assert p.best_depth() <= 1


def test_choice_maximises_tokens_per_second():
    p = DepthPolicy(GPU, max_depth=6)
    drive(p, 0.7, 300)
    best = p.best_depth()
    rates = [p.expected_tokens(d) / GPU.round_time(d) for d in range(7)]
    assert rates[best] == max(rates)


def test_fixed_depth_and_validation():
    p = DepthPolicy(GPU, max_depth=4, fixed=3)
    assert {p.choose() for _ in range(10)} == {3}
    with pytest.raises(ValueError):
        DepthPolicy(GPU, max_depth=4, fixed=5)
    with pytest.raises(ValueError):
        DepthPolicy(Costs(step=1, draft=1, verify={1: 1}), max_depth=2)
    with pytest.raises(ValueError):
        p.update(2, 3)
    with pytest.raises(ValueError):
        p.update(5, 0)


@pytest.mark.parametrize("prior", [0.3, 0.5])
def test_only_observed_drafts_update(prior):
    p = DepthPolicy(GPU, max_depth=4, prior=prior)
    before = list(p.accept)
    p.update(4, 1)  # draft 1 accepted, draft 2 rejected, drafts 3-4 never seen
    after = p.accept
    assert after[0] > before[0] and after[1] < after[0]
    # the rejection lowers depth 2 below what the depth-1 success alone would make it
    alone = DepthPolicy(GPU, max_depth=4, prior=prior)
    alone.update(1, 1)
    assert after[1] < alone.accept[1]
    if prior == 0.5:  # with an even prior the rejection also takes depth 2 below its prior
        assert after[1] < before[1]
    assert p.trials[2:] == [0.0, 0.0] and p.hits[2:] == [0.0, 0.0]
    # unseen depths follow the deepest evidence: after a rejection at depth 2 they are lowered too
    assert after[2] == pytest.approx(after[1]) and after[3] == pytest.approx(after[1])


# Shaped like the CPU costs `spec` measures for `small` (bench/NOTES.md 2026-12-01): a 2-row window
# pays off only above ~30% acceptance, right at the prior, so one miss can turn drafting off.
CPU = Costs(step=24.7e-3, draft=1.8e-3, verify={1: 25.9e-3, 2: 30.4e-3, 3: 29.8e-3, 4: 35.0e-3, 5: 36.0e-3,
                                                6: 35.9e-3, 7: 40.4e-3})


def test_one_early_miss_costs_a_few_plain_steps_not_explore_every():
    p = DepthPolicy(CPU, max_depth=6, explore_every=64)
    first = p.choose()
    assert first > 0
    p.update(first, 0)  # the very first draft is wrong
    depths = [p.choose() for _ in range(p.explore_first)]
    assert depths[:-1] == [0] * (p.explore_first - 1) and depths[-1] == 1
    p.update(1, 1)  # the probe is accepted, and so is everything after it
    later = drive(p, 0.9, 40)
    assert sum(1 for d in later if d > 0) > 30


def test_probe_gaps_double_up_to_explore_every():
    p = DepthPolicy(GPU, max_depth=6, explore_every=64)
    depths = drive(p, 0.0, 1000)
    probes = [i for i, d in enumerate(depths) if d > 0]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    gaps = [g for g in gaps if g > 1]  # past the first rounds, drafted on the prior alone
    assert gaps[:4] == [8, 16, 32, 64] and set(gaps[4:]) == {64}


def test_explore_settings_must_be_positive():
    with pytest.raises(ValueError):
        DepthPolicy(GPU, max_depth=6, explore_every=0)
    with pytest.raises(ValueError):
        DepthPolicy(GPU, max_depth=6, explore_first=0)


# --------------------------------------------------------------------------- measured round times

def test_round_time_estimate_moves_toward_measured_times():
    times = RoundTimes(GPU, max_depth=6)
    prior = [GPU.round_time(d) for d in range(7)]
    assert times.times() == prior
    seen = []
    for _ in range(40):
        times.observe(2, 2.0 * prior[2])
        seen.append(times.times()[2])
    assert all(a < b for a, b in zip(seen, seen[1:])) and prior[2] < seen[0] < 2 * prior[2]
    assert seen[0] < 1.3 * prior[2]  # one round moves it only part of the way: the prior is worth rounds
    assert seen[-1] == pytest.approx(2 * prior[2], rel=0.02)
    now = times.times()
    assert now[0] == prior[0]  # the plain step keeps its own prior until it is timed
    assert now[5] == pytest.approx(prior[5] * now[2] / prior[2])  # untimed depths follow the timed one
    for _ in range(200):  # past the prior: an exponential moving average that follows a change
        times.observe(2, 0.5 * prior[2])
    assert times.times()[2] == pytest.approx(0.5 * prior[2], rel=0.01)
    with pytest.raises(ValueError):
        times.observe(7, 1.0)
    with pytest.raises(ValueError):
        times.observe(1, 0.0)


# Start-up costs that promise cheap drafting (GPU above), against real rounds shaped like `small`
# on the H200 (bench/NOTES.md): a round's drafting costs ~0.8 ms where 2 head steps measured 0.56,
# plus ~0.25 ms of host work outside draft/verify/rollback; here on a 1 ms step.
STARTUP = Costs(step=1.0e-3, draft=0.28e-3, verify={w: 1.0e-3 * (1 + 0.1 * (w - 1)) for w in range(1, 10)})


def small_h200_round(d: int) -> float:
    return STARTUP.step + 0.05e-3 if d == 0 else STARTUP.verify[d + 1] + d * 0.4e-3 + 0.25e-3


def test_drafting_that_costs_more_than_it_yields_converges_to_plain_steps():
    alpha = 0.55
    # on the start-up costs alone drafting looks worth it, so the offline policy keeps drafting
    offline = DepthPolicy(STARTUP, max_depth=6, prior=0.5, online=False)
    assert sum(d > 0 for d in drive(offline, alpha, 600, real_time=small_h200_round)[300:]) > 250
    # yet at the real round times every depth yields fewer tokens per second than a plain step
    truth = DepthPolicy(STARTUP, max_depth=6, prior=alpha, strength=1e9)
    real_rate = [truth.expected_tokens(d) / small_h200_round(d) for d in range(7)]
    assert max(range(7), key=real_rate.__getitem__) == 0
    p = DepthPolicy(STARTUP, max_depth=6, prior=0.5)
    depths = drive(p, alpha, 600, real_time=small_h200_round)
    tail = depths[300:]
    assert p.best_depth() == 0 and sum(d > 0 for d in tail) <= len(tail) / 32 + 2
    assert p.times.rounds[0] > 250 and p.times.times()[1] > STARTUP.round_time(1) * 1.2


def test_cheap_accurate_drafting_keeps_drafting():
    def real(d):  # every round 30% dearer than measured at start-up, the plain step as well
        return 1.3 * STARTUP.round_time(d)

    p = DepthPolicy(STARTUP, max_depth=6)
    depths = drive(p, 0.9, 400, real_time=real)
    tail = depths[100:]
    assert sum(d > 0 for d in tail) > 0.95 * len(tail) and sum(tail) / len(tail) > 3 and p.best_depth() > 0


def test_fixed_depth_ignores_round_times():
    p = DepthPolicy(STARTUP, max_depth=6, fixed=2)
    drive(p, 0.0, 50, real_time=lambda d: 1.0)
    assert p.times.rounds == [0] * 7 and {p.choose() for _ in range(5)} == {2}


def test_costs_from_reps_take_each_ops_fastest_rep():
    reps = {"step": [3.0, 2.0, 2.5], "draft": [0.4, 0.5], "verify": {"1": [3.1, 2.9], 2: [3.5, 3.3]}}
    costs = Costs.from_reps(reps)
    assert costs == Costs(step=2.0, draft=0.4, verify={1: 2.9, 2: 3.3})
    assert costs.round_time(1) == 0.4 + 3.3


# --------------------------------------------------------------------------- probe price, plain rounds

# Shaped like `spec`'s start-up costs for `tiny` on one CPU thread: a 2-row window 1.4 steps, a head
# step 0.3 steps, so a depth-1 round pays only above ~70% acceptance.
TINY_CPU = Costs(step=1.3e-3, draft=0.4e-3, verify={w: 1.3e-3 * (1 + 0.4 * (w - 1)) for w in range(1, 8)})


def test_probe_waits_by_its_expected_loss():
    p = DepthPolicy(TINY_CPU, max_depth=6)
    step, t1, a1 = TINY_CPU.step, TINY_CPU.round_time(1), p.accept[0]
    assert p.probe_wait() == math.ceil(min(TINY_CPU.draft, t1 - (1 + a1) * step) / (p.explore_share * step))
    assert p.probe_wait() > p.explore_first
    depths = [p.choose() for _ in range(p.probe_wait())]
    assert depths == [0] * (len(depths) - 1) + [1]  # the priced wait, not explore_first
    assert p.probing and p.choose() == 0 and not p.probing
    # a head near paying (a_1 close to T(1) / T(0) - 1) is probed as soon as the doubling run allows
    near = DepthPolicy(TINY_CPU, max_depth=6, prior=0.65)
    assert near.probe_wait() < p.explore_first
    # a probe expected to pay (its window costs less than the tokens it yields) waits for nothing
    assert DepthPolicy(GPU, max_depth=6, prior=0.5).probe_wait() == 0


def test_probes_that_cannot_pay_stay_under_their_share():
    p = DepthPolicy(TINY_CPU, max_depth=6, explore_every=64)
    depths = drive(p, 0.0, 2000)
    probes = sum(1 for d in depths if d > 0)
    loss = probes * TINY_CPU.draft  # a probe drafts beside a plain step
    assert loss < 2 * p.explore_share * len(depths) * TINY_CPU.step
    assert sum(1 for d in depths[:64] if d > 0) <= 1  # one probe at most in a 64-token decode
    with pytest.raises(ValueError):
        DepthPolicy(GPU, max_depth=6, explore_share=0.0)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 0.95])
def test_cached_choice_equals_a_fresh_one_after_plain_rounds(alpha):
    """A plain round re-prices depth 0 only; the choice must equal the one computed from scratch."""
    rng = random.Random(7)
    p = DepthPolicy(STARTUP, max_depth=6)
    for i in range(300):
        d = p.choose()
        j = 0
        while j < d and rng.random() < alpha:
            j += 1
        if d:
            p.update(d, j)
        p.observe(d, STARTUP.round_time(d) * (0.8 + 0.6 * rng.random()))
        fresh = DepthPolicy(STARTUP, max_depth=6, times=p.times, hits=list(p.hits), trials=list(p.trials))
        assert p.best_depth() == fresh.best_depth(), i


def test_one_interrupted_plain_step_does_not_turn_drafting_on():
    """On tiny's CPU costs depth 1 pays only once a plain step costs > 1.3x its price; one step
    slowed 20x by another process must not reprice depth 0 that far, a lasting change must."""
    for rounds_before in (0, 1, 5, 40):
        p = DepthPolicy(TINY_CPU, max_depth=6)
        for _ in range(rounds_before):
            p.observe(0, TINY_CPU.step)
        assert p.best_depth() == 0
        p.observe(0, 20 * TINY_CPU.step)
        assert p.best_depth() == 0 and p.times.times()[0] <= 1.25 * TINY_CPU.step, rounds_before
    p = DepthPolicy(TINY_CPU, max_depth=6)
    for _ in range(40):
        p.observe(0, 3 * TINY_CPU.step)  # a lasting slowdown of the plain step is followed
    assert p.times.times()[0] == pytest.approx(3 * TINY_CPU.step, rel=0.05)
    with pytest.raises(ValueError):
        RoundTimes(TINY_CPU, max_depth=6, outlier=1.0)


def test_first_probe_also_prices_the_heads_prompt_rows():
    costs = Costs(step=TINY_CPU.step, draft=TINY_CPU.draft, verify=TINY_CPU.verify, head_prefill=0.5e-3)
    p = DepthPolicy(costs, max_depth=6)
    before = p.probe_wait()
    assert before == math.ceil((costs.draft + costs.head_prefill) / (p.explore_share * costs.step))
    p.update(1, 0)  # a draft was made: the head has its prompt rows, and the miss lowers a_1
    assert p.drafted and p.probe_wait() == math.ceil(costs.draft / (p.explore_share * costs.step)) < before
    assert Costs.from_reps({"step": [1.0], "draft": [0.1], "verify": {2: [1.2]}, "head_prefill": [0.3, 0.2]}).head_prefill == 0.2


def test_probe_price_counts_catch_up_calls_and_the_prompts_rows():
    costs = Costs(step=TINY_CPU.step, draft=TINY_CPU.draft, verify=TINY_CPU.verify, head_prefill=0.5e-3)
    p = DepthPolicy(costs, max_depth=6, prior=0.0, first_draft=1.5e-3, catch_up_calls=lambda rows: 1 + rows // 16)
    unit = p.explore_share * costs.step
    assert p.probe_wait(1) == math.ceil((min(costs.draft, costs.round_time(1) - costs.step) + 1.5e-3) / unit)
    assert p.probe_wait(40) > p.probe_wait(1)  # three head forwards to catch up 40 rows
    p.update(1, 0)
    assert p.probe_wait(1) == math.ceil(min(costs.draft, costs.round_time(1) - costs.step) / unit)


def test_a_run_of_plain_steps_is_priced_once():
    """Plain rounds stay a few attribute reads: the probe is priced once per run, not per round."""
    calls = []
    p = DepthPolicy(TINY_CPU, max_depth=6, catch_up_calls=lambda rows: calls.append(rows) or 1 + rows // 16)
    depths = drive(p, 0.0, 500)
    probes = sum(1 for d in depths if d > 0)
    assert probes >= 5 and len(calls) <= 2 * (probes + 1)


def test_measured_probes_set_their_price_even_past_explore_every():
    """Probes priced cheap at start-up (GPU costs) but measured dear (a launch-bound small model,
    ~2 steps each) come only as often as explore_share allows, past explore_every."""
    p = DepthPolicy(GPU, max_depth=6, explore_every=64)
    drive(p, 0.0, 300)  # settles at depth 0 with probes every explore_every rounds
    assert p.probe_wait() < 64
    for _ in range(3):
        p.observe_probe(GPU.step + 2 * GPU.step)
    assert p.probe_extra == pytest.approx(2 * GPU.step)
    assert p.probe_wait() == math.ceil(2 * GPU.step / (p.explore_share * GPU.step)) == 200
    depths = drive(p, 0.0, 2000)
    probes = [i for i, d in enumerate(depths) if d > 0]
    assert len(probes) <= 2000 // 200 + 1
    assert all(b - a >= 200 for a, b in zip(probes, probes[1:]))
    # a probe that turns out cheaper than its start-up price does not lower it below that
    q = DepthPolicy(TINY_CPU, max_depth=6)
    before = q.probe_wait()
    q.observe_probe(TINY_CPU.step)
    assert q.probe_extra == 0.0 and q.probe_wait() == before


def test_probe_times_are_ignored_at_a_fixed_depth_or_offline():
    for p in (DepthPolicy(GPU, max_depth=6, fixed=2), DepthPolicy(GPU, max_depth=6, online=False)):
        p.observe_probe(1.0)
        assert p.probe_extra is None and p.probes_timed == 0


def test_many_equal_rounds_observed_at_once_equal_one_by_one():
    one, many = RoundTimes(TINY_CPU, max_depth=6), RoundTimes(TINY_CPU, max_depth=6)
    for count, seconds in ((1, 1.5e-3), (5, 1.2e-3), (40, 1.4e-3)):
        for _ in range(count):
            one.observe(0, seconds)
        many.observe(0, seconds, count)
        assert many.rounds == one.rounds
        assert many.estimate[0] == pytest.approx(one.estimate[0], rel=1e-12)
    with pytest.raises(ValueError):
        many.observe(0, 1e-3, 0)


def test_plain_rounds_run_until_a_probe_could_be_due():
    """Plain rounds batched between choices leave the probe schedule where single rounds would."""
    one, batched = DepthPolicy(TINY_CPU, max_depth=6), DepthPolicy(TINY_CPU, max_depth=6)
    singles = [one.choose() for _ in range(400)]
    runs, seen = [], 0
    while seen < 400:
        d = batched.choose()
        n = batched.plain_rounds(min(16, 400 - seen)) if d == 0 and not batched.probing else 1
        runs.append(n)
        seen += n
        batched_depths = singles[seen - n:seen]
        assert batched_depths == [d] * n  # the batch spans only what single choices would have done
    assert max(runs) == 16 and seen == 400
    assert DepthPolicy(GPU, max_depth=6, fixed=0).plain_rounds(16) == 16
    assert DepthPolicy(GPU, max_depth=6).plain_rounds(1) == 1


def test_calibration_learns_each_tenth_of_confidence_from_the_drafts_observed():
    cal = Calibration(strength=2.0, forget=1.0)
    assert cal.accept(0.97) == pytest.approx(0.95) and cal.accept(0.0) == pytest.approx(0.05)
    assert confidence_bin(1.0) == 9 and confidence_bin(0.1) == 1 and confidence_bin(-0.1) == 0
    # drafts at 0.95, 0.95, 0.15, 0.95 with one accepted: the first two observed, the rest never seen
    cal.update([0.95, 0.95, 0.15, 0.95], accepted=1)
    assert cal.trials[9] == 2 and cal.hits[9] == 1 and cal.trials[1] == 0
    assert cal.accept(0.9) == pytest.approx((1 + 0.95 * 2) / (2 + 2))
    cal.update([0.15], accepted=0)
    assert cal.trials[1] == 1 and cal.hits[1] == 0 and cal.accept(0.15) == pytest.approx(0.15 * 2 / 3)
    decaying = Calibration(forget=0.5)
    decaying.update([0.5], accepted=1)
    decaying.update([0.7], accepted=0)
    assert decaying.trials[5] == 0.5 and decaying.trials[7] == 1.0


def test_draft_more_weighs_the_next_drafts_tokens_against_its_price():
    costs = Costs(step=1.0, draft=0.05, verify={w: 1 + 0.1 * (w - 1) for w in range(1, 8)})
    p = DepthPolicy(costs, max_depth=4, online=False, calibration=Calibration())
    price = p.round_times()[2] - p.round_times()[1]
    assert price == pytest.approx(0.15)
    for confidences in ([0.95], [0.95, 0.95], [0.95, 0.05], [0.45], [0.05]):
        cum = math.prod(p.calibration.accept(c) for c in confidences)
        k = len(confidences)
        want = cum * p.accept[k] >= p.rate() * (p.round_times()[k + 1] - p.round_times()[k])
        assert p.draft_more(confidences) == want
    assert p.draft_more([0.95]) and not p.draft_more([0.05])
    assert not p.draft_more([0.99] * 4)  # never past max_depth
    assert not DepthPolicy(costs, max_depth=4).draft_more([0.99])  # no calibration: the depth is chosen
    with pytest.raises(ValueError, match="confidences"):
        p.update(2, 1, [0.9])
    p.update(2, 1, [0.95, 0.95])
    assert p.calibration.trials[9] > 0 and "calibration" in p.state()


def test_draft_more_prices_once_per_round_and_again_after_each_round():
    """The prices are made at a round's first draft_more and kept through it; a round's update or
    observe makes them again (online times move T(k))."""
    costs = Costs(step=1.0, draft=0.05, verify={w: 1 + 0.1 * (w - 1) for w in range(1, 8)})
    p = DepthPolicy(costs, max_depth=4, calibration=Calibration())
    assert p.draft_more([0.95])
    for _ in range(6):  # depth-2 rounds measured at ten times their price: a second draft now costs far more
        p.observe(2, 10 * p.round_times()[2])
    assert not p.draft_more([0.95])
    p.update(1, 1, [0.95])  # a kept draft: acceptance and the calibration rise
    times = p.round_times()
    want = p.calibration.accept(0.95) * p.accept[1] >= p.rate() * (times[2] - times[1])
    assert p.draft_more([0.95]) == want
