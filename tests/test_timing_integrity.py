"""Timing a decoder cannot game from inside the harness's process (tiny model, CPU).

Each attack in tests/bad_decoders.py either gains nothing (the warm-up decodes another prompt;
``prepare_prompt`` is for instruments only) or leaves a ``violation`` record in the stream, which
``audit replay`` fails as ``in-process-integrity``. The attacks patch this very process, so every
test restores what they touch before the audit replays (and before the next test).
"""
from __future__ import annotations

import statistics
import time

import pytest
import torch

import bad_decoders
from audit_helpers import findings, read_records, run_audit, run_harness
from core import determinism
from core.schema import AtomicJsonlWriter
from decoders.serial import SerialDecoder
from harness import timing


@pytest.fixture
def restore(monkeypatch):
    """Undo whatever a tampering decoder changes in this process; call it before the audit runs."""
    import harness.timing

    monkeypatch.setattr(SerialDecoder, "decode", SerialDecoder.decode)
    monkeypatch.setattr(harness.timing, "timed_decode", harness.timing.timed_decode)
    monkeypatch.setattr(time, "perf_counter", time.perf_counter)
    monkeypatch.setattr(AtomicJsonlWriter, "write", AtomicJsonlWriter.write)
    dtype = torch.get_default_dtype()

    def undo():
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


def test_watch_sees_each_watched_object(monkeypatch):
    """The pure part: every watched object, the clock and the control's bound decode."""
    settings = determinism.current()
    clock = timing.Clock.start()
    watch = timing.Watch(settings, clock)
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
