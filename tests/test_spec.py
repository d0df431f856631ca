"""``spec`` and its instrument emit exactly the serial control's tokens (CPU, tiny).

Random MTP heads accept almost nothing, so the instrument (drafts replaced by the control's token
with probability alpha) is what drives long accepted runs, rollbacks at every row and the head's
catch-up; the plain head covers the all-rejected path. Depths fixed 1..6 and adaptive, shortlist
on and off, EOS-terminated and long generations.
"""
import dataclasses
import json
from collections import Counter

import pytest
import torch

from core.sampling import GREEDY, Sampler
from decoders.policy import Costs
from decoders.sampled import settings
from decoders.serial import SerialDecoder
from decoders.spec import InstrumentedSpecDecoder, PhaseTimer, SpecDecoder, accepted_prefix
from fixtures.prompts import DEV_PROMPTS


@pytest.fixture(scope="module")
def serial(tiny):
    dec = SerialDecoder()
    dec.prepare(tiny)
    return dec


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    return [tiny_tokenizer.encode(p["text"]) for p in DEV_PROMPTS[:3]]


@pytest.fixture(scope="module")
def shortlist_file(tmp_path_factory, serial, prompts):
    """A request-independent shortlist: the most frequent ids in generated text."""
    counts = Counter()
    for ids in prompts:
        counts.update(serial.decode(ids, 48).tokens)
    path = tmp_path_factory.mktemp("shortlist") / "shortlist.json"
    path.write_text(json.dumps({"ids": [t for t, _ in counts.most_common(200)], "source": "test"}))
    return str(path)


def assert_exact(dec, serial, prompts, n):
    for ids in prompts:
        got = dec.decode(ids, n)
        assert got.tokens == serial.decode(ids, n).tokens
    return got


@pytest.mark.parametrize("depth", [1, 2, 3, 6])
def test_instrument_exact_at_fixed_depths(tiny, serial, prompts, depth):
    dec = InstrumentedSpecDecoder(alpha=0.8, depth=depth, seed=depth)
    dec.prepare(tiny)
    res = assert_exact(dec, serial, prompts, 40)
    assert res.stats.accepted > 0 and res.stats.drafted > res.stats.accepted  # accepts and rejects happened
    # every round at the fixed depth, except the last few, cut to the tokens still wanted
    trace = res.stats.extra["depth_trace"]
    full = len(trace) - sum(1 for d in trace if d != depth)
    assert trace[:full] == [depth] * full and full >= len(trace) - (depth - 1)
    tail = trace[full:]
    assert all(0 < b < a < depth for a, b in zip(tail, tail[1:])) and all(0 < d < depth for d in tail)
    assert len(res.tokens) == 40  # no EOS in tiny's stream here: the cut rounds end exactly at n


def test_instrument_adaptive_every_accept_length(tiny, serial, prompts):
    dec = InstrumentedSpecDecoder(alpha=0.7, max_depth=6, seed=3, online_costs=False)
    dec.prepare(tiny)
    # CPU windows are slow (eager), so measured costs keep the policy shallow; give it costs shaped
    # like the H200's (bench/NOTES.md), and no online timing, so that it goes deep and every
    # rollback row is exercised
    dec.costs = Costs(step=1.0, draft=0.05, verify={w: 1 + 0.1 * (w - 1) for w in range(1, 8)})
    seen = set()
    for seed in range(4):
        dec.seed = seed
        res = assert_exact(dec, serial, prompts, 64)
        seen |= {int(k) for k in res.stats.to_json()["accept_hist"]}
    assert len(seen) >= 4  # several distinct accept lengths, so rollbacks to several rows


def test_instrument_full_acceptance(tiny, serial, prompts):
    dec = InstrumentedSpecDecoder(alpha=1.0, depth=4)
    dec.prepare(tiny)
    res = assert_exact(dec, serial, prompts, 41)
    assert res.stats.accept_hist.keys() <= {4, 3, 2, 1, 0} and res.stats.accept_hist[4] >= 8
    assert res.stats.to_json()["mean_accepted_length"] > 4


def test_real_head_exact_with_and_without_shortlist(tiny, serial, prompts, shortlist_file):
    for kwargs in ({"depth": 3}, {"depth": 2, "shortlist": shortlist_file}, {}):
        dec = SpecDecoder(**kwargs)
        dec.prepare(tiny)
        assert_exact(dec, serial, prompts, 32)
    assert dec.drafter.shortlist is None
    short = SpecDecoder(depth=2, shortlist=shortlist_file)
    short.prepare(tiny)
    size = len(json.loads(open(shortlist_file).read())["ids"])
    assert short.drafter.head_weight.shape[0] == size and short.config()["shortlist_size"] == size < tiny.vocab_size


def test_instrument_with_shortlist(tiny, serial, prompts, shortlist_file):
    dec = InstrumentedSpecDecoder(alpha=0.85, depth=3, shortlist=shortlist_file)
    dec.prepare(tiny)
    assert_exact(dec, serial, prompts, 40)


def test_eos_terminated(tiny, serial, prompts):
    stream = serial.decode(prompts[0], 40).tokens
    eos_model = dataclasses.replace(tiny, eos_token_ids=(stream[17],))
    ref = SerialDecoder()
    ref.prepare(eos_model)
    want = ref.decode(prompts[0], 40).tokens
    assert want[-1] == stream[17] and len(want) < 40
    after = ref.decode(prompts[1], 40).tokens
    # depth 0: runs of plain steps only, each step queued before the token before it is read
    for dec in (InstrumentedSpecDecoder(alpha=0.9, depth=5), SpecDecoder(depth=2), SpecDecoder(depth=0)):
        dec.prepare(eos_model)
        assert dec.decode(prompts[0], 40).tokens == want
        assert dec.decode(prompts[1], 40).tokens == after


def test_long_generation_grows_capacity(tiny, serial, prompts):
    dec = InstrumentedSpecDecoder(alpha=0.8, max_depth=4, capacity=128)
    dec.prepare(tiny)
    assert dec.decode(prompts[1], 200).tokens == serial.decode(prompts[1], 200).tokens
    assert dec.runtime.capacity >= len(prompts[1]) + 200


@pytest.mark.parametrize("capacity", [1, 20])
def test_a_small_capacity_grows_and_stays_exact(tiny, serial, prompts, capacity):
    """Any capacity the constructor takes works: ``prepare`` builds at least what its cost
    measurement uses, and a request past that grows the runtime and the drafter alike."""
    short = prompts[0][:capacity + 1]  # longer than the capacity, within the start-up size
    for dec in (SpecDecoder(capacity=capacity), SpecDecoder(depth=6, capacity=capacity),
                InstrumentedSpecDecoder(alpha=0.8, depth=6, capacity=capacity)):
        dec.prepare(tiny)
        start = dec.calibration_positions()
        assert dec.runtime.capacity == dec.drafter.capacity == start > capacity
        assert dec.decode(short, 12).tokens == serial.decode(short, 12).tokens
        assert dec.runtime.capacity == start  # it fitted: nothing was rebuilt
        long_ids = prompts[0]
        assert len(long_ids) + 32 + dec.margin > start  # this one grows the state
        assert dec.decode(long_ids, 32).tokens == serial.decode(long_ids, 32).tokens
        assert dec.runtime.capacity == dec.drafter.capacity >= len(long_ids) + 32 + dec.margin


def test_stats_carry_depth_trace_and_time_split(tiny, prompts):
    dec = InstrumentedSpecDecoder(alpha=0.8, depth=3)
    dec.prepare(tiny)
    stats = dec.decode(prompts[0], 30).stats.to_json()
    assert set(stats["time_split"]) <= {"step", "draft", "verify", "rollback", "other"}
    assert len(stats["depth_trace"]) >= 1 and stats["drafted_by_depth"]


def test_bad_arguments():
    with pytest.raises(ValueError):
        SpecDecoder(max_depth=99)
    with pytest.raises(ValueError):
        InstrumentedSpecDecoder(alpha=1.5)
    with pytest.raises(ValueError, match="stop must be one of depth, confidence"):
        SpecDecoder(stop="never")
    with pytest.raises(ValueError, match="depth="):
        SpecDecoder(stop="confidence", depth=3)
    for bad in (0, -5, True):
        with pytest.raises(ValueError, match="capacity must be >= 1"):
            SpecDecoder(capacity=bad)


def test_depth_and_max_depth():
    """``depth`` out of range names ``depth``; a depth above a given ``max_depth`` is refused;
    without ``max_depth``, a depth deeper than the default sets it."""
    for bad in (20, 16, -1):
        with pytest.raises(ValueError, match=rf"^depth must be within 0\.\.15 .*not {bad}$"):
            SpecDecoder(depth=bad)
    with pytest.raises(ValueError, match=r"^max_depth must be within 0\.\.15, not 16$"):
        SpecDecoder(max_depth=16)
    with pytest.raises(ValueError, match=r"^depth 5 exceeds max_depth 2: give a depth within 0\.\.2"):
        SpecDecoder(max_depth=2, depth=5)
    with pytest.raises(ValueError, match="depth 1 exceeds max_depth 0"):
        InstrumentedSpecDecoder(alpha=0.5, max_depth=0, depth=1)
    assert (SpecDecoder().max_depth, SpecDecoder().fixed) == (6, None)
    assert (SpecDecoder(depth=2).max_depth, SpecDecoder(depth=9).max_depth, SpecDecoder(depth=15).max_depth) == (6, 9, 15)
    assert (SpecDecoder(max_depth=2, depth=2).max_depth, SpecDecoder(max_depth=4, depth=0).max_depth) == (2, 4)
    assert SpecDecoder(max_depth=3).max_depth == 3


@pytest.mark.parametrize("sampler", [None, Sampler(temperature=0.6, top_k=8, seed=4)], ids=["greedy", "sampled"])
def test_confidence_stop_sets_each_rounds_depth_and_stays_exact(tiny, serial, prompts, sampler):
    """``stop=confidence``: rounds of many depths, set on the way by the head's calibrated
    confidence, every token the control's (greedy and sampled), the calibration in the stats."""
    dec = InstrumentedSpecDecoder(alpha=0.8, max_depth=6, online_costs=False, stop="confidence")
    dec.prepare(tiny)
    assert dec.drafter.confidence and dec.config()["stop"] == "confidence"
    dec.costs = Costs(step=1.0, draft=0.05, verify={w: 1 + 0.1 * (w - 1) for w in range(1, 8)})
    depths = set()
    for seed in range(3):
        dec.seed = seed
        for ids in prompts:
            res = dec.decode(ids, 48, sampler=sampler)
            assert res.tokens == serial.decode(ids, 48, sampler=sampler).tokens
            depths |= set(res.stats.extra["depth_trace"]) - {0}
            assert res.stats.drafted == sum(res.stats.extra["depth_trace"])
    assert len(depths) >= 3 and max(depths) > 3
    assert len(res.stats.extra["policy"]["calibration"]) == 10


def test_accepted_prefix_counts_leading_agreement():
    assert accepted_prefix([5, 6, 7, 8], [5, 6, 7]) == 3  # all accepted: the 4th row is the bonus token
    assert accepted_prefix([5, 6, 7, 8], [5, 9, 7]) == 1  # a later agreement after a miss does not count
    assert accepted_prefix([5, 6], [4]) == 0
    assert accepted_prefix([5], []) == 0


def test_measured_costs_keep_every_rep(tiny):
    dec = SpecDecoder(max_depth=2)
    dec.prepare(tiny)
    reps, cfg = dec.cost_reps, dec.config()
    assert len(reps["step"]) == len(reps["draft"]) == 7 and sorted(reps["verify"]) == [1, 2, 3]
    assert dec.costs.step == min(reps["step"]) and dec.costs.verify[3] == min(reps["verify"][3])
    assert cfg["cost_reps_s"]["verify"]["2"] == reps["verify"][2] and cfg["costs_s"]["draft"] == min(reps["draft"])
    assert not dec.runtime.prefilled  # measuring left nothing a decode could continue from


def test_rounds_are_timed_online_unless_switched_off(tiny, prompts):
    for online in (True, False):
        dec = SpecDecoder(max_depth=3, online_costs=online)
        dec.prepare(tiny)
        stats = dec.decode(prompts[0], 30).stats.to_json()
        timed, trace = stats["policy"]["timed_rounds"], stats["depth_trace"]
        assert len(stats["policy"]["round_ms"]) == 4 and dec.config()["online_costs"] is online
        # a probe is a depth-0 entry of the trace priced by observe_probe, never a timed round;
        # whether one comes within 30 tokens depends on the measured times
        probes = stats["probes"]
        if online:  # every plain step, and every drafting round that follows another, is timed
            assert sum(timed) == sum(1 for i, d in enumerate(trace) if d == 0 or i == 0 or trace[i - 1] > 0) - probes
            assert timed[0] == trace.count(0) - probes
        else:
            assert sum(timed) == 0
    with pytest.raises(ValueError):
        SpecDecoder(online_costs="yes")


# CPU-shaped costs for tiny: a depth-1 round pays only above ~70% acceptance, so a fresh policy
# starts on plain steps and probes the head after its priced wait
PLAIN_FIRST = Costs(step=1.0, draft=0.3, verify={w: 1 + 0.4 * (w - 1) for w in range(1, 8)})


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_probes_draft_beside_plain_steps(tiny, serial, prompts, alpha):
    """A probe is a plain step (depth 0 in the trace, timed as one) with one draft beside it, no
    window: a head that cannot pay costs only the draft; one that can resumes drafting."""
    dec = InstrumentedSpecDecoder(alpha=alpha, max_depth=3, online_costs=False)
    dec.prepare(tiny)
    dec.costs = PLAIN_FIRST
    wait = dec.new_policy().probe_wait()
    n = wait + 40
    res = assert_exact(dec, serial, prompts[:1], n)
    stats = res.stats.to_json()
    trace = stats["depth_trace"]
    assert trace[:wait] == [0] * wait and stats["probes"] >= 1
    split = stats["time_split"]
    assert split["step"] > 0 and split["draft"] > 0  # plain steps are steps; each probe drafted
    if alpha == 0.0:  # every probe missed: no verify window was ever run
        assert set(trace) == {0} and stats["probe_hits"] == 0 and stats["drafted"] == 0
        assert stats["forwards"] == len(res.tokens) and stats["accept_hist"] == {}
        assert "verify" not in split and "rollback" not in split
    else:  # every probe hits, the runs between them shorten, and drafting takes over
        assert stats["probe_hits"] == stats["probes"] and stats["accepted"] > 0 and trace[-1] > 0
        assert split["verify"] > 0


# costs at which a depth-1 round pays from 20% acceptance: a fresh policy (prior 0.3) opens with windows
DRAFT_FIRST = Costs(step=1.0, draft=0.05, verify={w: 1 + 0.1 * (w - 1) for w in range(1, 8)})


def test_a_decode_starts_from_the_head_acceptance_the_last_one_learnt(tiny, serial, prompts):
    """The policy's prior is the depth-1 acceptance the last drafting decode under the same
    sampler setting ended with: a head that predicts nothing opens the first decode with windows,
    and later ones with plain steps; a sampler setting of its own starts from the built-in prior,
    and so does a decoder prepared again. Tokens are the control's throughout."""
    dec = InstrumentedSpecDecoder(alpha=0.0, max_depth=3, online_costs=False)
    dec.prepare(tiny)
    dec.costs = DRAFT_FIRST
    first = assert_exact(dec, serial, prompts[:1], 24).stats.to_json()
    assert first["policy"]["prior"] == 0.3 and first["depth_trace"][0] > 0  # opened with a window
    learnt = dec.carried_accept[settings(GREEDY)]
    assert learnt < 0.2 and first["policy"]["accept"][0] == round(learnt, 4)
    second = assert_exact(dec, serial, prompts[1:2], 24).stats.to_json()
    assert second["policy"]["prior"] == round(learnt, 4) and second["depth_trace"][0] == 0
    sampled = dec.decode(prompts[0], 8, sampler=Sampler(temperature=0.6, seed=1)).stats.to_json()
    assert sampled["policy"]["prior"] == 0.3
    dec.prepare(tiny)
    assert dec.carried_accept == {}


def test_head_prompt_rows_wait_for_the_first_draft(tiny, serial, prompts):
    """A decode that never drafts never makes the head's prompt rows; one that does makes them
    once, before its first draft; measure_costs times them."""
    dec = SpecDecoder(max_depth=3, online_costs=False)
    dec.prepare(tiny)
    assert len(dec.cost_reps["head_prefill"]) == 7 and dec.costs.head_prefill > 0
    assert dec.config()["costs_s"]["head_prefill"] == dec.costs.head_prefill
    made = []
    real = dec.drafter.prefill
    dec.drafter.prefill = lambda hidden, ids: made.append(len(ids)) or real(hidden, ids)
    dec.costs = PLAIN_FIRST  # plain steps first; the probe comes after its priced wait
    policy = dec.new_policy(len(prompts[0]))
    first = next(i for i in range(200) if policy.choose() and policy.probing)  # the round that probes
    assert_exact(dec, serial, prompts[:1], first)  # rounds 0..first-2: plain steps only
    assert made == []
    res = assert_exact(dec, serial, prompts[:1], first + 8)
    assert made == [len(prompts[0])] and res.stats.extra["probes"] >= 1


@pytest.mark.parametrize("sampler", [None, Sampler(temperature=0.6, top_k=8, seed=4)], ids=["greedy", "sampled"])
def test_the_head_is_handed_every_rows_own_hidden_state_and_next_token(tiny, prompts, monkeypatch, sampler):
    """Every row a decode hands the head (``Pending.take``) is the hidden state that position's
    forward made (a plain step's, through the runtime's ring, or a kept window row's) and the
    stream's token after it: plain runs longer than the ring (shrunk to 5 slots, so it wraps at
    every offset), probes and windows mixed in one decode."""
    from decoders.runtime import state as state_mod
    from decoders.spec import Pending

    monkeypatch.setattr(state_mod, "RING_ROWS", 5)
    dec = InstrumentedSpecDecoder(alpha=1.0, max_depth=3, online_costs=False)
    dec.prepare(tiny)
    dec.costs = PLAIN_FIRST  # plain steps first (longer than the ring), then probes and windows
    rt = dec.runtime
    assert rt.state.ring_hidden.shape[0] == 5
    made, window, taken = {}, {}, []  # position -> hidden row its forward made; the open window; takes
    real_prefill, real_step, real_verify, real_accept = rt.prefill, rt.step, rt.verify, rt.accept

    def prefill(ids):
        logits, hidden = real_prefill(ids)
        made[len(ids) - 1] = hidden[0, -1].clone()
        return logits, hidden

    def step(token):
        prog = real_step(token)
        made[rt.length - 1] = prog.ws["hidden"][0, 0].clone()
        return prog

    def verify(tokens):
        window["start"] = rt.length
        prog = real_verify(tokens)
        window["rows"] = prog.ws["hidden"][0].clone()
        return prog

    def accept(rows):
        made.update({window["start"] + r: window["rows"][r] for r in range(rows)})
        real_accept(rows)

    real_take = Pending.take

    def take(self):
        a = self.first
        hidden, nxt = real_take(self)
        taken.append((a, hidden[0].clone(), nxt[0].tolist()))
        return hidden, nxt

    monkeypatch.setattr(rt, "prefill", prefill)
    monkeypatch.setattr(rt, "step", step)
    monkeypatch.setattr(rt, "verify", verify)
    monkeypatch.setattr(rt, "accept", accept)
    monkeypatch.setattr(Pending, "take", take)
    ids = prompts[2]  # a stream (and seed) that runs long enough to draft, greedy or sampled
    n = dec.new_policy(len(ids)).probe_wait() + 120
    res = dec.decode(ids, n, sampler=sampler)
    stats = res.stats.to_json()
    assert stats["depth_trace"][:6] == [0] * 6 and stats["accepted"] > 0  # plain runs, then windows
    stream = ids + res.tokens
    assert max(len(nxt) for _, _, nxt in taken) > 5  # a take spanning a wrapped ring
    for a, hidden, nxt in taken:
        assert nxt == stream[a + 1:a + 1 + len(nxt)]
        for r in range(len(nxt)):
            assert torch.equal(hidden[r], made[a + r]), (a, r)


class _QueuedEvent:
    """A CUDA event's timing behaviour on one stream: ``elapsed_time`` refuses until the end event
    has run, and ``synchronize`` waits for the event and so for every event recorded before it (a
    busy GPU may not have run them when the decode returns)."""

    def __init__(self, stream: dict, at: float):
        self.stream, self.at = stream, at

    def synchronize(self) -> None:
        self.stream["ran_to"] = max(self.stream["ran_to"], self.at)

    def elapsed_time(self, end: "_QueuedEvent") -> float:
        if end.at > self.stream["ran_to"]:
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return (end.at - self.at) * 1e3


def test_phase_times_wait_for_work_still_queued():
    """``PhaseTimer.result`` reads each phase's events only once its end event has run: the last
    round's rollback is queued after the tokens are read, and on a loaded GPU it can still be
    waiting when the decode asks for its times."""
    timer = PhaseTimer(torch.device("cpu"))
    stream = {"ran_to": -1.0}
    at = [_QueuedEvent(stream, t) for t in (0.0, 0.002, 0.002, 0.0025)]
    timer.marks = [("verify", at[0], at[1]), ("rollback", at[2], at[3])]
    assert timer.result() == pytest.approx({"verify": 0.002, "rollback": 0.0005})
    assert timer.marks == []
