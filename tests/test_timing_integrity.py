"""Timing a decoder cannot game from inside the harness's process (tiny model, CPU).

Each attack in tests/bad_decoders.py either gains nothing (the warm-up decodes another prompt;
``prepare_prompt`` is for instruments only) or leaves a ``violation`` record in the stream, which
``audit replay`` fails as ``in-process-integrity``. The attacks patch this very process, so every
test restores what they touch before the audit replays (and before the next test).
"""
from __future__ import annotations

import gc
import signal
import statistics
import sys
import threading
import time

import pytest
import torch

import bad_decoders
from audit_helpers import findings, read_records, run_audit, run_harness
from core import determinism
from core.schema import AtomicJsonlWriter
from decoders.serial import SerialDecoder
from harness import timing
from harness import watch as watch_module


@pytest.fixture
def restore(monkeypatch):
    """Undo whatever a tampering decoder changes in this process; call it before the audit runs."""
    import harness.timing

    monkeypatch.setattr(SerialDecoder, "decode", SerialDecoder.decode)
    monkeypatch.setattr(harness.timing, "timed_decode", harness.timing.timed_decode)
    monkeypatch.setattr(time, "perf_counter", time.perf_counter)
    monkeypatch.setattr(AtomicJsonlWriter, "write", AtomicJsonlWriter.write)
    dtype = torch.get_default_dtype()
    hooks = sys.gettrace(), sys.getprofile(), threading.gettrace(), threading.getprofile()
    collector = gc.isenabled(), gc.get_threshold(), list(gc.callbacks)
    torch_threads = torch.get_num_threads()
    alarm = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)

    def undo():
        signal.setitimer(signal.ITIMER_REAL, *alarm[1])
        signal.signal(signal.SIGALRM, alarm[0])
        sys.settrace(hooks[0])
        sys.setprofile(hooks[1])
        threading.settrace(hooks[2])
        threading.setprofile(hooks[3])
        (gc.enable if collector[0] else gc.disable)()
        gc.set_threshold(*collector[1])
        gc.callbacks[:] = collector[2]
        torch.set_num_threads(torch_threads)
        if bad_decoders.SpinningThread.stop is not None:
            bad_decoders.SpinningThread.stop.set()
        monkeypatch.undo()
        torch.set_default_dtype(dtype)
        determinism.pin()

    yield undo
    undo()


def prompts_of(records: list[dict]) -> list[dict]:
    return [r for r in records if r["type"] == "prompt"]


def violations_of(records: list[dict]) -> list[dict]:
    return [r for r in records if r["type"] == "violation"]


# --------------------------------------------------------------------------- first encounter


def test_warmup_ids_come_from_seed_and_index_only():
    prompt = [5, 6, 7, 8]
    ids = timing.warmup_ids(3, 1, 4, 512, prompt)
    assert len(ids) == 4 and ids != prompt and all(0 <= t < 512 for t in ids)
    assert timing.warmup_ids(3, 1, 4, 512, [9, 9, 9, 9]) == ids  # another prompt, the same draw
    assert timing.warmup_ids(3, 2, 4, 512, prompt) != ids and timing.warmup_ids(4, 1, 4, 512, prompt) != ids
    # a draw equal to the prompt is refused, and only then does the prompt matter
    assert timing.warmup_ids(3, 1, 4, 512, ids) != ids


def test_warmup_cache_never_hits_the_timed_prompt(tmp_path, monkeypatch):
    """The warm-up decodes the recorded warm-up prompt, never the timed one: the cache the warm-up
    fills is useless, leg 0 computes, and the later legs' lookups are a warm-leg failure."""
    monkeypatch.setattr(bad_decoders.WarmupCache, "calls", [])
    stream = run_harness(tmp_path / "run", "bad_decoders:WarmupCache", limit=2, n=16, legs=3)
    records = read_records(stream)
    calls = bad_decoders.WarmupCache.calls
    assert len(calls) == 2 * (1 + 3)
    for i, prompt in enumerate(prompts_of(records)):
        warm, *legs = calls[4 * i:4 * (i + 1)]
        assert warm == (prompt["warmup_ids"], 8, False)  # the warm-up prompt, before leg 0
        assert len(prompt["warmup_ids"]) == len(prompt["token_ids"]) and prompt["warmup_ids"] != prompt["token_ids"]
        assert [(ids, n, hit) for ids, n, hit in legs] == [(prompt["token_ids"], 16, False),
                                                            (prompt["token_ids"], 16, True),
                                                            (prompt["token_ids"], 16, True)]
    first_legs = [r for r in records if r["type"] == "leg" and r["role"] == "candidate" and r["leg"] == 0]
    assert [r["stats"]["cache_hit"] for r in first_legs] == [False, False]
    assert violations_of(records) == [] and records[0]["integrity_checked"] is True
    result, doc = run_audit(stream)
    assert result.exit_code == 1, result.output
    assert doc["exact"] and len(findings(doc, "warm-leg", severity="fail")) == 2


@pytest.mark.parametrize("decoder, legs", [("bad_decoders:WarmupCache", 1), ("bad_decoders:HashPrefixCache", 3)])
def test_cached_later_legs_never_enter_the_ratio(tmp_path, monkeypatch, decoder, legs):
    """A cache keyed on the prompt (or a hash of its first tokens) answers only legs after the
    first; each prompt's ratio is the control's median over the candidate's leg 0, which had to
    compute. With one leg the cache never answers a timed leg at all."""
    monkeypatch.setattr(bad_decoders.WarmupCache, "calls", [])
    stream = run_harness(tmp_path / "run", decoder, limit=2, n=16, legs=legs)
    records = read_records(stream)
    cand = [r for r in records if r["type"] == "leg" and r["role"] == "candidate"]
    assert [r["stats"]["cache_hit"] for r in cand if r["leg"] == 0] == [False, False]
    assert all(r["stats"]["cache_hit"] for r in cand if r["leg"] > 0)
    result, doc = run_audit(stream)
    assert doc["exact"], result.output
    for p in doc["prompts"]:
        walls = [r["wall_s"] for r in records if r["type"] == "leg" and r["prompt_id"] == p["id"]
                 and r["role"] == "control"]
        first = next(r["wall_s"] for r in cand if r["prompt_id"] == p["id"] and r["leg"] == 0)
        assert p["ratio"] == pytest.approx(statistics.median(walls) / first, rel=1e-12)


def test_prepare_prompt_is_for_instruments_only(tmp_path, monkeypatch):
    monkeypatch.setattr(bad_decoders.PreparePromptCache, "calls", [])
    stream = run_harness(tmp_path / "run", "bad_decoders:PreparePromptCache", limit=1, n=8, legs=2)
    calls = bad_decoders.PreparePromptCache.calls
    assert [c[0] for c in calls] == ["decode"] * 3  # the warm-up and two legs; never prepare_prompt
    assert not any(hit for _, _, hit in calls)
    header = read_records(stream)[0]
    assert header["candidate"]["instrument"] is False


def test_unmarked_oracle_instrument_gets_no_untimed_oracle(tmp_path, monkeypatch):
    """spec-instrument's oracle without the mark: its control tokens are computed inside a timed
    leg (leg 0 of each prompt), never untimed."""
    monkeypatch.setattr(bad_decoders.UnmarkedInstrument, "calls", [])
    stream = run_harness(tmp_path / "run", "bad_decoders:UnmarkedInstrument", limit=1, n=8, legs=2)
    records = read_records(stream)
    (prompt,) = prompts_of(records)
    calls = bad_decoders.UnmarkedInstrument.calls
    assert calls and all(inside for _, inside in calls)  # only ever from inside a decode
    assert [ids for ids, _ in calls] == [prompt["warmup_ids"], prompt["token_ids"]]  # warm-up, then leg 0
    assert records[0]["candidate"]["instrument"] is False
    # leg 0 pays for the oracle (a whole decode) on top of its own: no speedup left to score
    _, doc = run_audit(stream)
    assert doc["exact"] and doc["score"] == 0.0


def test_spec_instrument_still_gets_its_oracle(tmp_path):
    """The marked instrument keeps its untimed prepare_prompt (and is never scored)."""
    stream = run_harness(tmp_path / "run", "spec-instrument", limit=1, n=8, legs=1)
    records = read_records(stream)
    assert records[0]["candidate"]["instrument"] is True
    assert violations_of(records) == []


# --------------------------------------------------------------------------- in-process integrity


@pytest.mark.parametrize("decoder,problem", [
    ("SlowsControl", "the control decoder's class attributes changed: SerialDecoder.decode"),
    ("ShortensOwnLegs", "harness.timing.timed_decode was replaced"),
    ("Unpinned", "determinism setting deterministic_algorithms: recorded True, now False"),
    ("Float64Default", "default dtype is torch.float64, the run began with torch.float32"),
    ("PatchesClock", "time.perf_counter was replaced"),
    ("RewritesLegs", "core.schema.AtomicJsonlWriter.write was replaced"),
])
def test_tampering_in_prepare_is_a_violation(tmp_path, restore, decoder, problem):
    stream = run_harness(tmp_path / "run", f"bad_decoders:{decoder}", limit=1, n=6, legs=1)
    restore()
    records = read_records(stream)
    header, violations = records[0], violations_of(records)
    assert header["integrity_checked"] is True
    for key, value in determinism.PINNED.items():  # the header records the pinned settings ...
        assert header["determinism"][key] == value, key
    # ... and the violations what changed after them
    assert violations and all(v["at"] == "after prepare" for v in violations), violations
    assert problem in [v["problem"] for v in violations], violations
    assert records.index(violations[0]) == 1  # right after the header, before the first prompt
    if decoder == "Unpinned":
        assert "determinism setting matmul_allow_tf32: recorded False, now True" in [v["problem"] for v in violations]
    result, doc = run_audit(stream)
    assert result.exit_code == 1, result.output
    found = findings(doc, "in-process-integrity", severity="fail")
    assert found and any(problem in f["message"] for f in found), found


def test_tampering_during_a_leg_is_a_violation_after_that_leg(tmp_path, restore, monkeypatch):
    """A decoder that patches the control's decode from inside its own first timed leg."""
    state = {"done": False}
    real = bad_decoders.SlowsControl.decode

    def decode(self, prompt_ids, max_new_tokens):
        out = real(self, prompt_ids, max_new_tokens)
        if max_new_tokens == 6 and not state["done"]:  # the first timed leg (the warm-up asks for fewer)
            state["done"] = True
            self.tamper()
        return out

    monkeypatch.setattr(bad_decoders.SlowsControl, "prepare", lambda self, model: self.inner.prepare(model))
    monkeypatch.setattr(bad_decoders.SlowsControl, "decode", decode)
    stream = run_harness(tmp_path / "run", "bad_decoders:SlowsControl", limit=1, n=6, legs=2, extra=("--warmup-tokens", "2"))
    restore()
    records = read_records(stream)
    violations = violations_of(records)
    assert {v["at"] for v in violations} == {"after leg candidate#0 of prompt prose-river"}, violations
    leg0 = next(r for r in records if r["type"] == "leg" and r["role"] == "candidate" and r["leg"] == 0)
    assert records.index(violations[0]) == records.index(leg0) + 1


@pytest.mark.parametrize("decoder, args, problem", [
    ("TracesControl", (), "sys.settrace hook changed: the run began with None, now _call_hook"),
    ("ProfilesControl", (), "sys.setprofile hook changed: the run began with None, now _call_hook"),
    ("TracesNewThreads", (), "threading.settrace hook changed: the run began with None, now _call_hook"),
    ("SpinningThread", (), "thread 'prefetch' (daemon) is alive, started since the run began"),
    ("SpinningThread", ("raw=true",), "(not a threading.Thread) is alive, started since the run began"),
    ("TunesGc", (), "gc thresholds changed: the run began with"),
    ("TunesGc", ("how=callback",), "gc callbacks changed: the run began with"),
    ("TunesGc", ("how=off",), "gc enabled changed: the run began with True, now False"),
    ("TorchThreads", (), "torch intra-op threads changed: the run began with"),
    ("AlarmsControl", (), "interval timers changed: the run began with"),
    ("EditsLegRecords", (), "the harness's records were edited after it made them: record 0 (leg control#0 of "
                            "prompt prose-river) changed: t_end, wall_s"),
    ("EditsLegRecords", ("how=swap",), "the harness's records were edited after it made them: record 0 (leg "
                                       "control#0 of prompt prose-river) changed: t_end, wall_s"),
])
def test_tampering_left_behind_by_a_leg_is_a_violation(tmp_path, restore, decoder, args, problem):
    """A change the candidate makes in its first timed leg and leaves for the control's legs after
    it is a violation right after that leg, before the control decodes under it."""
    extra = tuple(x for a in args for x in ("--decoder-arg", a))
    stream = run_harness(tmp_path / "run", f"bad_decoders:{decoder}", limit=1, n=6, legs=2, extra=extra)
    restore()
    records = read_records(stream)
    violations = violations_of(records)
    assert violations and violations[0]["at"] == "after leg candidate#0 of prompt prose-river", violations
    first_leg = next(r for r in records if r["type"] == "leg" and r["role"] == "candidate")
    assert records.index(violations[0]) == records.index(first_leg) + 1
    assert any(problem in v["problem"] for v in violations), violations
    result, doc = run_audit(stream)
    assert result.exit_code == 1, result.output
    found = findings(doc, "in-process-integrity", severity="fail")
    assert any(problem in f["message"] for f in found), found
    if decoder == "AlarmsControl":
        assert any("signal handlers changed" in v["problem"] for v in violations), violations


@pytest.mark.parametrize("how", ["edit", "swap"])
def test_edited_records_reach_the_stream_as_made(tmp_path, restore, monkeypatch, how):
    """The stream holds what the harness measured, not the doubled control legs a frame walk left
    in its list: the harness's copy is written, and the edit is a violation."""
    monkeypatch.setattr(bad_decoders.EditsLegRecords, "forged", [])
    stream = run_harness(tmp_path / "run", "bad_decoders:EditsLegRecords", limit=2, n=6, legs=2,
                         extra=("--decoder-arg", f"how={how}"))
    forged = bad_decoders.EditsLegRecords.forged
    restore()
    records = read_records(stream)
    # control#0 of each prompt, and the first prompt's control#1 (found in the caller's list by
    # the second prompt's warm-up, after it was written)
    assert [(p, leg) for p, leg, _ in forged] == [("prose-river", 0), ("prose-river", 1), ("prose-letter", 0)]
    for prompt_id, leg, wall_s in forged:
        rec = next(r for r in records if r["type"] == "leg" and r["prompt_id"] == prompt_id and r["role"] == "control"
                   and r["leg"] == leg)
        assert rec["wall_s"] * 2 == wall_s  # doubling is exact in binary floating point
    assert {v["at"] for v in violations_of(records)} == {f"after leg candidate#0 of prompt {p['id']}"
                                                         for p in prompts_of(records)}


@pytest.mark.parametrize("decoder", ["fast-serial", "spec"])
def test_honest_runs_have_no_violation(tmp_path, decoder):
    stream = run_harness(tmp_path / "run", decoder, limit=2, n=8, legs=2)
    records = read_records(stream)
    assert violations_of(records) == []
    _, doc = run_audit(stream)
    assert doc["exact"] and findings(doc, "in-process-integrity") == []


def test_watch_reads_the_runtime(monkeypatch):
    """The pure part of the new readings: each change once, restored state silent again."""
    clock = timing.Clock.start()
    watch = watch_module.Watch(determinism.current(), clock)
    assert watch.check("start", clock) == []
    threshold = gc.get_threshold()
    hook = lambda *a: None  # noqa: E731
    monkeypatch.setattr(sys, "gettrace", lambda: None)  # a blinded reader changes nothing: the Watch holds its own
    sys.setprofile(hook)
    gc.set_threshold(threshold[0] + 1, *threshold[1:])
    try:
        problems = [v["problem"] for v in watch.check("then", clock)]
    finally:
        sys.setprofile(None)
        gc.set_threshold(*threshold)
    assert problems == [
        "sys.setprofile hook changed: the run began with None, now test_watch_reads_the_runtime.<locals>.<lambda>",
        f"gc thresholds changed: the run began with {threshold}, now {(threshold[0] + 1, *threshold[1:])}"]
    assert watch.check("restored", clock) == []


def test_watch_reads_monitoring_tools(monkeypatch):
    """sys.monitoring (3.12+): a tool id taken since the run began is a violation. On 3.11 the
    reading runs against a stand-in with the same two calls."""
    if not hasattr(sys, "monitoring"):
        tools = {}
        monkeypatch.setattr(sys, "monitoring", type("Monitoring", (), {
            "get_tool": staticmethod(lambda i: tools.get(i)), "get_events": staticmethod(lambda i: 0)}), raising=False)
        take, free = (lambda i, name: tools.__setitem__(i, name)), tools.pop
    else:
        take, free = sys.monitoring.use_tool_id, sys.monitoring.free_tool_id
    clock = timing.Clock.start()
    watch = watch_module.Watch(determinism.current(), clock)
    free_id = next(i for i in range(6) if sys.monitoring.get_tool(i) is None)
    take(free_id, "sneaky")
    try:
        problems = [v["problem"] for v in watch.check("then", clock)]
    finally:
        free(free_id)
    assert len(problems) == 1 and problems[0].startswith("sys.monitoring tools changed") and "sneaky" in problems[0]


def test_watch_compares_records_with_its_copies():
    clock = timing.Clock.start()
    watch = watch_module.Watch(determinism.current(), clock)
    watch.begin_records()
    records = []
    for i in range(2):
        rec = {"type": "leg", "prompt_id": "p", "role": "control", "leg": i, "wall_s": 0.5, "tokens": [1, 2],
               "stats": {"x": float("nan")}}
        records.append(rec)
        watch.note_record(rec)
        records += watch.check(f"after {i}", clock, records)
    assert [r["type"] for r in records] == ["leg", "leg"]  # an unchanged NaN is no change
    records[1]["tokens"].append(3)
    (v,) = watch.check("edited", clock, records)
    assert v["problem"] == ("the harness's records were edited after it made them: record 1 (leg control#1 of prompt p) "
                            "changed: tokens")
    records.append(v)
    records[1]["tokens"].pop()
    assert watch.check("undone", clock, records) == []
    del records[-1]  # the violation record itself
    (v,) = watch.check("dropped", clock, records)
    assert v["problem"] == ("the harness's records were edited after it made them: 2 records where the harness made 3, "
                            "the last a violation record")


def test_a_check_over_noted_records_finds_nothing_when_nothing_changed():
    """One leg's check at tiny's scale (a prompt's records so far, every reading), repeated: an
    honest run reads as unchanged every time. (Its cost is a benchmark's question, not a test's.)"""
    import harness.cli  # noqa: F401  (the harness's modules loaded, as in a run)

    clock = timing.Clock.start()
    watch = watch_module.Watch(determinism.current(), clock)
    watch.watch_control(SerialDecoder())
    watch.begin_records()
    records = []
    for i in range(8):
        rec = {"type": "leg", "role": "control", "leg": i, "wall_s": 0.1, "tokens": list(range(64)),
               "stats": {"forwards": 64}}
        records.append(rec)
        watch.note_record(rec)
    assert all(watch.check("leg", clock, records) == [] for _ in range(20))


def test_watch_sees_each_watched_object(monkeypatch):
    """The pure part: every watched object, the clock and the control's bound decode."""
    settings = determinism.current()
    clock = timing.Clock.start()
    watch = watch_module.Watch(settings, clock)
    control = SerialDecoder()
    watch.watch_control(control)
    assert watch.check("start", clock) == []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(control, "decode", lambda *a: None)
    object.__setattr__(clock, "origin", clock.origin - 1)
    problems = [v["problem"] for v in watch.check("then", timing.Clock.start())]
    assert problems == ["torch.cuda.synchronize was replaced", "the run's clock was altered",
                        "the legs were timed by another clock than the run's",
                        "the control decoder's decode is no longer its class's method"]
    assert watch.check("again") == []  # each problem once
