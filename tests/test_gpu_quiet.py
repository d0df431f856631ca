"""The GPU quiet of a retime, and what each side took of the machine besides its time: the wait
for an idle GPU (``audit.retime.quiet``), GPU work left behind an answer charged to its side,
memory and GPUs per side, the control's allocator, and a score withheld while what it rests on
is missing. Probes, clocks and the driver's answers are scripted: nothing here needs a GPU."""
from __future__ import annotations

import pytest

from audit.processes import GpuProcess, GpuWatch
from audit.retime import judge, quiet, resources
from audit.stream import PromptRun


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def now(self) -> float:
        return self.t


class ScriptedProbe:
    """Each probe takes the next of ``times`` on the fake clock (then the solo time for ever)."""

    def __init__(self, clock: FakeClock, times: list[float], solo: float = 0.002):
        self.clock, self.times, self.solo = clock, list(times), solo

    def run(self) -> float:
        took = self.times.pop(0) if self.times else self.solo
        self.clock.t += took
        return took


def waited(times: list[float], **kwargs) -> float:
    clock = FakeClock()

    def pause(seconds):
        clock.t += seconds
    return quiet.Quiet(ScriptedProbe(clock, times), clock, solo_s=0.002, pause=pause, **kwargs).wait()


def test_an_idle_gpu_is_quiet_at_once():
    assert waited([]) == 0.0


def test_busy_probes_count_until_the_run_of_quiet_ones_begins():
    # two slow probes (0.5 s and 0.3 s of another context's work), each followed by the probe's
    # pause off the GPU, then quiet from there on
    assert waited([0.5, 0.3]) == pytest.approx(0.8 + 2 * quiet.BUSY_PAUSE_S)


def test_a_quiet_probe_between_busy_ones_does_not_end_the_wait():
    # quiet, busy, quiet twice, busy again, then quiet for good: the wait ends where the last run
    # of quiet probes began
    assert waited([0.002, 0.01, 0.002, 0.002, 0.5]) == pytest.approx(0.516 + 2 * quiet.BUSY_PAUSE_S)


def test_a_gpu_that_never_goes_quiet_is_busy():
    with pytest.raises(quiet.GpuBusy, match="stayed busy"):
        waited([1.0] * 100, timeout_s=10.0)


def test_the_solo_time_is_the_median_of_the_calibration():
    clock = FakeClock()
    q = quiet.Quiet(ScriptedProbe(clock, [0.003, 0.001, 0.002, 0.009, 0.002, 0.002, 0.004, 0.002, 0.002]), clock)
    assert q.calibrate() == 0.002 and q.describe()["solo_ms"] == pytest.approx(2.0)


class Side:
    """A scripted worker: each timed request takes the next of ``seconds`` on the clock; it records
    whether it was resumed when asked, and how it was paused and resumed."""

    tree = None
    alloc_retries = None

    def __init__(self, role, seconds, clock, log):
        from core.continues import ContinueCounter

        self.role, self.seconds, self.clock, self.log = role, list(seconds), clock, log
        self.audit_continues = ContinueCounter()
        self.running = True

    def pause(self):
        self.running = False
        self.log.append(f"pause {self.role}")

    def resume(self):
        self.running = True
        self.log.append(f"resume {self.role}")

    def continues_by_others(self):
        return 0

    def send(self, prompt_ids, max_new_tokens, key="prompt_ids"):
        assert self.running, f"{self.role} asked while stopped"
        self.prompt = list(prompt_ids)

    def tokens(self):
        if len(self.prompt) > 4:  # warm-ups (4 ids) take no time
            self.clock.t += self.seconds.pop(0)
        self.left = self.role == "candidate" and len(self.prompt) > 4
        return [1, 2]


class LeftBehind:
    """A GPU on which the candidate leaves ``left_s`` of work behind each timed answer: the first
    wait after that answer finds it, any other wait finds the GPU idle."""

    def __init__(self, sides, left_s, clock):
        self.sides, self.left_s, self.clock, self.probes = sides, left_s, clock, 0

    def wait(self) -> float:
        cand = self.sides["candidate"]
        if getattr(cand, "left", False):
            cand.left = False
            assert not cand.running  # the answering side is stopped before the wait
            self.clock.t += self.left_s
            return self.left_s
        return 0.0


def test_work_left_behind_an_answer_is_the_candidates_time_not_the_controls():
    """The candidate answers in 40 ms and leaves 100 ms of GPU work: each of its legs takes 140 ms on
    the audit's clock, the control's 80 ms are untouched, and both sides run only while timed."""
    from audit.retime.fresh import FreshPrompt
    from audit.retime.measure import Measured, Measurement, time_fresh

    clock, log = FakeClock(), []
    sides = {"control": Side("control", [0.08] * 2, clock, log), "candidate": Side("candidate", [0.04] * 2, clock, log)}
    m = Measurement(sides, max_new_tokens=2, legs=2, warmup_tokens=2, clock=clock,
                    quiet=LeftBehind(sides, 0.1, clock))
    for side in sides.values():
        side.pause()
    out = Measured()
    time_fresh(m, [FreshPrompt("fresh-0", list(range(5, 11)), [1, 2, 3, 4], "p0")], out)
    (p,) = out.timed
    walls = {role: [r["wall_s"] for r in p.role_legs(role)] for role in ("control", "candidate")}
    assert walls["control"] == pytest.approx([0.08, 0.08])
    assert walls["candidate"] == pytest.approx([0.14, 0.14])
    assert [r["gpu_after_s"] for r in p.role_legs("candidate")] == pytest.approx([0.1, 0.1])
    assert judge.verified_ratio(p) == pytest.approx(0.08 / 0.14)
    # every request: its side resumed, then stopped again; the other side never resumed meanwhile
    requests = [entry for entry in log[2:]]
    assert requests == [f"{verb} {role}" for role in ("control", "candidate", "control", "candidate",
                                                      "candidate", "control") for verb in ("resume", "pause")]
    (f,) = resources.lingering_findings([p])
    assert f["check"] == "gpu-work-after-answer" and f["severity"] == "warn" and f["side"] == "candidate"
    assert f["seconds"] == pytest.approx(0.2)


def leg(role, k, **measures):
    return {"type": "leg", "prompt_id": "fresh-0", "role": role, "leg": k, "order": 0, "t_start": 0.0, "t_end": 1.0,
            "wall_s": 1.0, "tokens": [1], **measures}


def prompt(*legs) -> PromptRun:
    p = PromptRun("fresh-0", 0, [5, 6, 7])
    p.legs.extend(legs)
    return p


def test_a_control_short_of_device_memory_fails_the_retime():
    calm = prompt(leg("control", 0, alloc_retries=0), leg("candidate", 0, alloc_retries=7))
    assert resources.squeeze_findings([calm]) == []  # the candidate's own retries slow only itself
    (f,) = resources.squeeze_findings([prompt(leg("control", 0, alloc_retries=2))])
    assert f["check"] == "control-memory-squeezed" and f["severity"] == "fail" and f["legs"] == ["fresh-0 leg 0"]


def watch_with(gpus: dict, peaks: dict, unknown=()) -> GpuWatch:
    w = GpuWatch()
    w.gpus, w.peak_bytes, w.memory_unknown = gpus, peaks, set(unknown)
    return w


def test_the_candidate_may_use_the_controls_one_gpu_only():
    assert resources.gpu_device_findings(watch_with({"control": {"GPU-a"}, "candidate": {"GPU-a"}}, {})) == []
    for candidate in ({"GPU-a", "GPU-b"}, {"GPU-b"}):
        (f,) = resources.gpu_device_findings(watch_with({"control": {"GPU-a"}, "candidate": candidate}, {}))
        assert f["check"] == "gpus-beyond-the-control" and f["severity"] == "fail"


def test_memory_from_the_driver_sets_the_verified_memory_factor():
    gib = 1 << 30
    mem = resources.memory_figures([], watch_with({}, {"control": 18 * gib, "candidate": 36 * gib}), 1.2)
    assert mem["ratio"] == pytest.approx(2.0) and mem["f_mem"] == pytest.approx(0.6) and mem["measured"]
    unknown = resources.memory_figures([], watch_with({}, {"control": gib}, unknown=["candidate"]), 1.2)
    assert unknown["measured"] is None and unknown["f_mem"] == 1.0


def test_memory_on_a_cpu_is_each_trees_peak_resident_memory():
    p = prompt(leg("control", 0, peak_rss_bytes=100), leg("control", 1, peak_rss_bytes=120),
               leg("candidate", 0, peak_rss_bytes=300))
    mem = resources.memory_figures([p], None, 1.2)
    assert (mem["control_peak_bytes"], mem["candidate_peak_bytes"]) == (120, 300)
    assert mem["f_mem"] == pytest.approx(1.2 / 2.5)


def test_the_driver_answer_is_read_per_process():
    from audit.processes import read_gpu_answer

    found = read_gpu_answer({"rc": 0, "out": "502, GPU-a, 18000, python\n546, GPU-a, [N/A], /usr/bin/py, thon\n"})
    assert found == {502: GpuProcess("python", "GPU-a", 18000 << 20), 546: GpuProcess("/usr/bin/py, thon", "GPU-a", None)}


class Tree:
    def __init__(self, pid, members=()):
        self.pid, self._members = pid, list(members)

    def members(self, table):
        return self._members


def test_each_answer_is_summed_per_side():
    w = GpuWatch()
    w.assign({"control": Tree(10), "candidate": Tree(20, [21])})
    w.per_side({10: GpuProcess("c", "GPU-a", 5), 20: GpuProcess("k", "GPU-a", 3), 21: GpuProcess("k2", "GPU-b", 4),
                99: GpuProcess("audit", "GPU-a", 50)})
    w.per_side({10: GpuProcess("c", "GPU-a", 6), 20: GpuProcess("k", "GPU-a", 1)})
    assert w.peak_bytes == {"control": 6, "candidate": 7}
    assert w.gpus == {"control": {"GPU-a"}, "candidate": {"GPU-a", "GPU-b"}}


@pytest.mark.parametrize("check", sorted(judge.SCORE_RESTS_ON))
def test_a_score_is_withheld_while_what_it_rests_on_is_missing(monkeypatch, check):
    monkeypatch.setattr(judge, "prompt_ratios", lambda timed: [2.0, 2.1, 1.9, 2.05, 1.95, 2.2])
    measured = {"measured": "x"}
    whole = judge.verified_figures([], False, 0.95, 2.0, 1.0, judge.withheld_reasons([], measured))
    assert whole["score"] > 0 and whole["withheld"] == []
    found = [{"check": check, "severity": "warn"}]
    v = judge.verified_figures([], False, 0.95, 2.0, 1.0, judge.withheld_reasons(found, measured))
    assert v["score"] == 0 and v["withheld"] == [judge.SCORE_RESTS_ON[check]] and v["significant"]


def test_a_score_is_withheld_without_memory_and_cut_by_it():
    withheld = judge.withheld_reasons([], {"measured": None})
    assert withheld == ("neither side's memory was measured",)
    assert judge.withheld_reasons([{"check": "gpu-unmeasured"}], {"measured": None}) == (
        judge.SCORE_RESTS_ON["gpu-unmeasured"],)


def test_the_memory_factor_cuts_the_verified_score(monkeypatch):
    monkeypatch.setattr(judge, "prompt_ratios", lambda timed: [2.0] * 6)
    full = judge.verified_figures([], False, 0.95, 2.0)
    cut = judge.verified_figures([], False, 0.95, 2.0, 0.6)
    assert cut["score"] == pytest.approx(0.6 * full["score"]) and cut["f_mem"] == 0.6
