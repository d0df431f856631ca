"""``audit retime`` on tiny (CPU pinned): honest streams are verified (their own ratio, interval
and score); a stream whose candidate legs were shortened and resealed, and a decoder that
precomputes the built-in prompt set in ``prepare()``, both pass ``audit replay`` and are caught by
the retime (``claim-not-reproduced``). The scripted-worker tests run on a fake clock.

Every retime starts two worker processes (``python -m harness.worker``); tests/ goes on their
PYTHONPATH so that they can import the plug-in decoder.
"""
import json
import math
import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from audit_helpers import claim_refused, copy_stream, findings, forge_stream, run_audit, run_harness

TESTS = Path(__file__).resolve().parent
# six prompts: the fewest whose median ratio has an interval, which audit replay's claimed score
# needs (the forgeries below must look scored to the replay)
N, PROMPTS, LEGS = 24, 6, 2
# fresh prompts a retime times: the fewest whose median has a 95% interval (audit.retime.judge)
FRESH = 6
# spec's first leg of a prompt may hold a probe or two (the head's prompt rows and a catch-up, tens
# of ms on tiny's CPU), as its adaptive policy decides from times it measures: over 24 tokens that
# alone moves an honest ratio by up to a third between runs (bench/NOTES.md, the retime test on the
# H200's host); over 64 tokens by less than half of that. Five prompts a side, so that the medians
# on both sides stand unless three prompts of five are off
SPEC_N, SPEC_PROMPTS = 64, 5


@pytest.fixture(autouse=True)
def workers_import_tests(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))


def run_retime(stream: Path, *args: str):
    """Returns (click Result, retime.json document or None)."""
    from audit.cli import main as audit_main

    out = stream.parent / "retime.json"
    result = CliRunner().invoke(audit_main, ["retime", str(stream), "--device", "cpu", *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result, json.loads(out.read_text()) if out.exists() else None


@pytest.fixture(scope="session")
def fast_serial_stream(tmp_path_factory):
    return run_harness(tmp_path_factory.mktemp("retime") / "fast", "fast-serial", limit=PROMPTS, n=N, legs=LEGS)


@pytest.mark.parametrize("decoder", ["fast-serial", "spec"])
def test_honest_stream_reproduces(decoder, fast_serial_stream, tmp_path):
    prompts = PROMPTS if decoder == "fast-serial" else SPEC_PROMPTS
    stream = fast_serial_stream if decoder == "fast-serial" else \
        run_harness(tmp_path / decoder, decoder, limit=prompts, n=SPEC_N, legs=LEGS)
    result, doc = run_retime(stream, "--prompts", str(FRESH))
    assert result.exit_code == 0, result.output
    assert doc["verdict"] == "pass" and not findings(doc, "claim-not-reproduced")
    v = doc["verified"]
    assert v["ci_low"] <= v["ratio"] <= v["ci_high"] and v["prompts"] == len(doc["prompts"])
    # scored by the median, and only where the interval tells the speed-up from none
    assert v["significant"] == (v["ci_low"] > 1)
    assert v["score"] == pytest.approx(0.95 * (1 - math.exp(-(v["ratio"] - 1) / 2)) if v["significant"] else 0.0)
    assert "order statistics 1 and 6 of the 6 prompts' ratios" in v["interval"] and v["confidence"] >= 0.95
    assert doc["claimed"]["ratio"] > 0 and not findings(doc, "header-disagrees")
    assert doc["candidate"]["name"] == decoder and doc["kind"] == "retime"
    looks = 2 if doc["second_look"] else 1
    assert len(doc["prompts"]) == looks * FRESH and all(e["exact"] for e in doc["prompts"])
    assert all(set(e["waited"]) == set(e["others_load"]) == {"control", "candidate"} for e in doc["prompts"])
    # the control's code checked unchanged; the candidate sandboxed where this machine allows
    assert doc["control_code"]["checked"] > 0 and doc["control_code"]["modified"] == []
    from audit.sandbox import plan
    assert doc["sandbox"]["tool"] == plan("/tmp").tool
    assert bool(findings(doc, "candidate-not-sandboxed")) == (doc["sandbox"]["tool"] is None)
    assert "candidate sandbox: " in result.stdout
    held = {tuple(r["token_ids"]) for r in map(json.loads, stream.read_text().splitlines())
            if r["type"] == "prompt"}
    by_id = {json.loads(line)["id"]: json.loads(line) for line in stream.read_text().splitlines()
             if json.loads(line)["type"] == "prompt"}
    for e in doc["prompts"]:  # fresh prompts: none of the stream's, each as long as the one it mirrors
        assert tuple(e["token_ids"]) not in held
        assert e["tokens"] == len(by_id[e["mirrors"]]["token_ids"])
    # tiny's set, dev, is text: fresh prompts are runs of stdlib lines, never the stream's own tokens
    from audit.retime.fresh import LineStarts
    assert doc["fresh_source"]["kind"] == "line-runs" and "dev split" in doc["fresh_prompts"]
    assert doc["fresh_source"]["line_starts"] == len(LineStarts.of("dev"))
    assert "verified median ratio" in result.stdout and "claimed median ratio" in result.stdout
    assert "retime took" in result.stdout


def test_the_draw_comes_from_a_secret_seed_shown_at_the_end(fast_serial_stream, tmp_path):
    """Each retime draws its own seed, which no worker is sent and which is printed only with the
    result: a decoder cannot derive the fresh prompts from the stream file. ``--seed`` repeats a
    retime's draw; every draw (a prompt, its spare, its warm-up) has a generator of its own."""
    from audit.retime.fresh import fresh_prompts
    from audit.stream import load_run
    from core.models import load_model

    run, model = load_run(fast_serial_stream), load_model("tiny", "cpu")

    def ids(draw):
        return [(p.token_ids, p.spare.token_ids, p.warmup_ids) for look in (draw.first, draw.second) for p in look]
    assert ids(fresh_prompts(run, model, 2, 7)) == ids(fresh_prompts(run, model, 2, 7)) != \
        ids(fresh_prompts(run, model, 2, 8))
    first = fresh_prompts(run, model, 2, 7).first
    assert all(p.warmup_ids != p.token_ids and len(p.warmup_ids) == len(p.token_ids) for p in first)

    docs, outputs = [], []
    for args in ([], [], None):
        copy = tmp_path / f"run{len(docs)}" / "stream.jsonl"
        copy.parent.mkdir()
        copy.write_bytes(fast_serial_stream.read_bytes())
        result, doc = run_retime(copy, "--prompts", str(FRESH),
                                 *(["--seed", str(docs[0]["seed"])] if args is None else args))
        assert result.exit_code in (0, 1), result.output  # the verdict is not what this test is about
        docs.append(doc)
        outputs.append(result.stdout)
    seeds = [d["seed"] for d in docs]
    assert seeds[0] != seeds[1] and seeds[2] == seeds[0]

    def drawn(seed):  # every prompt a retime with this seed may time: both looks and their spares
        return {tuple(t) for t, spare, _ in ids(fresh_prompts(run, model, FRESH, seed)) for t in (t, spare)}
    timed = [{tuple(e["token_ids"]) for e in d["prompts"]} for d in docs]
    assert timed[0] <= drawn(seeds[0]) and timed[2] <= drawn(seeds[0]) and not timed[1] & drawn(seeds[0])
    assert f"--seed {seeds[0]} draws them again" in outputs[0]
    assert str(seeds[0]) not in outputs[0].split("fresh prompts:")[0]  # not before the legs ran


def test_shortened_candidate_legs_pass_replay_but_not_retime(fast_serial_stream, tmp_path):
    forged = forge_stream(fast_serial_stream, tmp_path / "forged", 0.25)
    result, doc = run_audit(forged)
    timing = [f for f in doc["findings"] if f["severity"] == "fail"]
    assert timing == [] and doc["verdict"] == "pass" and doc["score"] > 0, result.output

    result, doc = run_retime(forged, "--prompts", str(FRESH))
    assert result.exit_code == 1, result.output
    assert doc["second_look"] is not None and len(doc["prompts"]) == 2 * FRESH
    assert claim_refused(doc) and doc["verified"]["score"] == 0, result.output
    for f in findings(doc, "claim-not-reproduced"):
        assert f["claimed"] > f["ci_high"] * (1 + f["margin"])
        assert "claim-not-reproduced" in result.stdout


def test_precomputed_builtin_prompts_pass_replay_but_not_retime(tmp_path):
    stream = run_harness(tmp_path / "pre", "retime_decoders:Precomputed", limit=PROMPTS, n=N, legs=LEGS)
    result, doc = run_audit(stream)
    assert result.exit_code == 0, result.output
    assert doc["exact"] and doc["median_ratio"] > 5 and doc["score"] > 0.5  # looks like a great decoder

    result, _ = run_retime(stream)  # the stream names code: it runs only when trusted
    assert result.exit_code == 2 and "--trust-plugin" in result.stderr
    assert not (stream.parent / "retime.json").exists()

    result, doc = run_retime(stream, "--trust-plugin", "--prompts", str(FRESH))
    assert result.exit_code == 1, result.output
    assert claim_refused(doc) and all(e["exact"] for e in doc["prompts"])
    assert doc["verified"]["ratio"] < 2 < doc["claimed"]["ratio"] and doc["verified"]["score"] == 0


def test_spoiling_its_own_later_legs_wins_a_precomputing_decoder_nothing(tmp_path):
    """Its own unstable legs buy it no measurement on a spare: each prompt's first measurement
    stands (warned unstable), the first look falls short, so a second look (spoiled alike) follows,
    and the claim still fails."""
    stream = run_harness(tmp_path / "uneven", "retime_decoders:PrecomputedUneven", limit=PROMPTS, n=N, legs=LEGS)
    result, doc = run_retime(stream, "--trust-plugin", "--prompts", str(FRESH))
    assert result.exit_code == 1, result.output
    assert claim_refused(doc) and all(e["exact"] for e in doc["prompts"])
    assert doc["second_look"]["first_prompts"] == doc["second_look"]["prompts"] == FRESH
    # measured again only for the control's spread or load, never for the candidate's spread alone
    assert all(e["leg_spread"]["control"] > 0.25 or e["reason"].startswith("other work") for e in doc["remeasured"])
    assert any(f["role"] == "candidate" for f in findings(doc, "unstable"))
    assert doc["verified"]["ratio"] < 2 < doc["claimed"]["ratio"]


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="process trees are found in /proc (Linux)")
@pytest.mark.parametrize("orphan,cgroup", [(False, True), (True, True), (False, False), (True, False)])
def test_processes_a_worker_starts_never_run_while_the_control_is_timed(tmp_path, orphan, cgroup, monkeypatch):
    """The plug-in starts spinners that burn the machine whenever its worker is stopped (i.e. while
    the control is timed), each in a session of its own that a signal to the worker's group misses,
    and with ``orphan`` abandoned out of the worker's tree. The audit stops them with the worker
    (frozen in its cgroup where this machine offers one, else by signals through /proc), so none
    ever runs while it is stopped; it warns about them and kills them at the end."""
    from retime_decoders import written_pids
    import audit.cgroups

    if cgroup and audit.cgroups.where()[0] is None:
        pytest.skip(f"no writable cgroup v2 here: {audit.cgroups.where()[2]}")
    if not cgroup:
        monkeypatch.setattr(audit.cgroups, "where", lambda: (None, "", "switched off by the test"))

    log = tmp_path / "spun.log"
    stream = run_harness(tmp_path / "load", "retime_decoders:LoadsTheControl", limit=2, n=N, legs=LEGS,
                         extra=("--decoder-arg", f"log={log}", "--decoder-arg", f"orphan={orphan}"))
    # outside the sandbox: inside, its spinners could not write their pids, and would die with it
    result, doc = run_retime(stream, "--trust-plugin", "--prompts", str(FRESH), "--no-sandbox")
    assert result.exit_code in (0, 1), result.output  # its speed is serial's: the verdict is noise's
    pids = written_pids(str(log))
    assert len(pids) == (os.cpu_count() or 1)
    assert not log.exists(), log.read_text()[:200]  # no spinner burst while its worker was stopped
    (f,) = findings(doc, "worker-processes")
    assert f["severity"] == "warn" and f["role"] == "candidate"
    assert sorted(f["outside_group"]) == sorted(pids) and f["killed_at_close"] == len(pids)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)  # killed and reaped
    assert "outside its process group" in result.stdout
    how = doc["isolation"]["candidate"]
    assert (how["freeze"] == "cgroup.freeze" and how["outside_box"] == []) if cgroup else how["freeze"] == "signals"


def retime_leaving_outsiders(tmp_path, plugin: str):
    """``harness time`` with the plug-in ``plugin``, which leaves processes behind (their pids in a
    file), then the retime of its stream; the processes are killed whatever happens."""
    import signal

    pids = tmp_path / "outsiders"
    try:
        stream = run_harness(tmp_path / "outside", f"retime_decoders:{plugin}", limit=2, n=N, legs=LEGS,
                             extra=("--decoder-arg", f"pids={pids}"))
        return run_retime(stream, "--trust-plugin", "--prompts", str(FRESH))
    finally:
        for pid in [int(x) for x in pids.read_text().split()] if pids.exists() else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.skipif(not Path("/proc/self/schedstat").is_file(), reason="waiting for a CPU is read from /proc (Linux)")
def test_load_on_the_control_from_a_process_out_of_reach_is_measured_and_judged(tmp_path):
    """The plug-in's run in ``harness time`` leaves spinners behind, out of the retime's process
    tree, that burn the machine whenever the retime's candidate worker is stopped. The audit cannot
    stop them, but it measures around every leg how long each side waited for a CPU and how many
    cores other work took: a prompt whose control waited WAIT_GAP more than its candidate, or ran
    beside OTHERS_GAP more cores of other work, is measured again on its spare, and the retime
    fails (``load-against-control``) exactly when most judged prompts are still so loaded. (The
    spinners miss some legs, so how many prompts they load varies from run to run.)"""
    from audit.retime.load import OTHERS_GAP, WAIT_GAP
    from core.schema import LEG_SPREAD_LIMIT

    def loaded(e):
        return (e["waited"]["control"] - e["waited"]["candidate"] > WAIT_GAP
                or e["others_load"]["control"] - e["others_load"]["candidate"] > OTHERS_GAP)

    result, doc = retime_leaving_outsiders(tmp_path, "LoadsTheControlFromOutside")
    assert result.exit_code in (0, 1), result.output
    measured = doc["prompts"] + doc["remeasured"]
    assert any(loaded(e) for e in measured), result.output  # the spinners' work was seen
    for e in doc["remeasured"]:  # measured again for its load when its control's legs were steady
        steady = e["leg_spread"]["control"] is None or e["leg_spread"]["control"] <= LEG_SPREAD_LIMIT
        assert e["reason"].startswith("other work took") == (loaded(e) and steady)
    judged = [e["id"] for e in doc["prompts"] if loaded(e)]
    caught = findings(doc, "load-against-control")
    assert bool(caught) == (2 * len(judged) > len(doc["prompts"])), result.output
    if caught:
        assert caught[0]["prompts"] == judged and result.exit_code == 1


def test_pauses_of_the_control_by_a_process_out_of_reach_fail_the_retime(tmp_path):
    """The plug-in's run in ``harness time`` leaves a process behind, out of the retime's reach, that
    pauses the control's worker (SIGSTOP, a few ms, SIGCONT) while the control is timed: no load on
    the machine, no wait for a CPU, yet a slower control and an inflated ratio. A stopped process
    runs again only on a SIGCONT, and each worker counts those it receives: more than the audit sent
    fail the retime (``stopped-by-others``)."""
    result, doc = retime_leaving_outsiders(tmp_path, "StopsTheControlFromOutside")
    (f,) = [f for f in findings(doc, "stopped-by-others") if f["side"] == "control"]
    assert f["severity"] == "fail" and f["legs"] and result.exit_code == 1, result.output
    assert "stopped the control's worker" in result.stdout


def test_the_audit_stopped_during_its_legs_fails_the_retime(fast_serial_stream, tmp_path):
    """The audit's clock runs in its own process: stopping it during a leg puts the pause into
    that leg's time. The audit counts the SIGCONTs it receives, and any during a leg fails the
    retime (``stopped-by-others``, side ``audit``): a job stopped from a shell, or an attack."""
    import signal
    import subprocess
    import time

    out = tmp_path / "retime.json"
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    audit = subprocess.Popen([sys.executable, "-m", "audit", "retime", str(fast_serial_stream), "--device", "cpu",
                              "--prompts", str(FRESH), "--out", str(out)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        while audit.poll() is None:  # pauses of 5 ms, every 50 ms, all through the retime
            time.sleep(0.045)
            try:
                os.kill(audit.pid, signal.SIGSTOP)
                time.sleep(0.005)
                os.kill(audit.pid, signal.SIGCONT)
            except ProcessLookupError:
                break
    finally:
        if audit.poll() is None:
            os.kill(audit.pid, signal.SIGCONT)
        output = audit.communicate(timeout=300)[0]
    doc = json.loads(out.read_text())
    (f,) = [f for f in findings(doc, "stopped-by-others") if f["side"] == "audit"]
    assert f["severity"] == "fail" and f["legs"] and audit.returncode == 1, output
    assert not [f for f in findings(doc, "stopped-by-others") if f["side"] == "control"]


def test_a_gpu_shared_with_a_process_out_of_reach_fails_the_retime(fast_serial_stream, monkeypatch):
    """On a GPU the audit asks the driver, all through the legs, which processes hold a context. One
    that is neither the audit nor its descendant could slow the control with GPU work, which takes
    too little CPU to be seen, so the retime fails (``gpu-shared``). This runs on the CPU with a
    stand-in for nvidia-smi that names the audit itself and, the second time, pid 1 as well."""
    import audit.processes
    import audit.retime.command

    monkeypatch.setattr(audit.retime.command, "watches_gpu", lambda device: True)
    listing = [sys.executable, "-c", "import sys; print('\\n'.join(sys.argv[1:]))", f"{os.getpid()}, GPU-a, 100, audit"]
    monkeypatch.setattr(audit.processes, "GPU_QUERY", listing)
    _, doc = run_retime(fast_serial_stream, "--prompts", str(FRESH))
    assert doc["gpu_processes"]["samples"] >= 1 and doc["gpu_processes"]["unmeasured"] is None
    assert doc["gpu_processes"]["foreign"] == [] and not findings(doc, "gpu-shared")
    assert not findings(doc, "worker-processes")  # the audit's poller is no worker's orphan

    monkeypatch.setattr(audit.processes, "GPU_QUERY", [*listing, "1, GPU-a, 100, miner"])
    result, doc = run_retime(fast_serial_stream, "--prompts", str(FRESH))
    (f,) = findings(doc, "gpu-shared")
    assert f["severity"] == "fail" and f["pids"] == [1] and result.exit_code == 1
    assert doc["gpu_processes"]["foreign"] == [{"pid": 1, "name": "miner"}]
    assert "1 (miner)" in result.stdout


def test_retimed_legs_are_replayed_on_workers(fast_serial_stream, tmp_path, monkeypatch):
    """--workers: the retimed legs replayed by worker processes on the one device (audit.pool),
    each taken as hung after --dist-timeout."""
    import audit.retime.command

    pools = []
    walker = audit.retime.command.replay_walker
    monkeypatch.setattr(audit.retime.command, "replay_walker",
                        lambda model, pool, log: pools.append(pool) or walker(model, pool, log))
    stream = copy_stream(fast_serial_stream, tmp_path / "run")
    result, doc = run_retime(stream, "--prompts", str(FRESH), "--workers", "2", "--dist-timeout", "900")
    assert [(p.workers, p.timeout_s) for p in pools] == [(2, 900)]
    assert result.exit_code in (0, 1) and doc is not None, result.output
    assert not findings(doc, "retime-error") and not findings(doc, "exactness")
    assert doc["prompts"] and all(e["exact"] for e in doc["prompts"])
    assert "starting 2 replay workers" in result.output and "[worker " in result.output


def test_bad_input_exits_2_and_writes_nothing(fast_serial_stream, tmp_path):
    outdir = tmp_path / "outdir"
    outdir.mkdir()
    result, _ = run_retime(fast_serial_stream, "--out", str(outdir))
    assert result.exit_code == 2 and "is a directory" in result.stderr and list(outdir.iterdir()) == []
    result, doc = run_retime(tmp_path / "missing.jsonl")
    assert result.exit_code == 2 and doc is None and result.stderr.startswith("error:")
    blocker = tmp_path / "afile"
    blocker.write_text("")
    for unwritable in (blocker / "retime.json", "/proc/qwen-exact-retime.json"):
        result, _ = run_retime(fast_serial_stream, "--out", str(unwritable))  # refused before any worker starts
        assert result.exit_code == 2 and "cannot write" in result.stderr, result.output
        assert "worker" not in result.output and "retim" not in result.stderr.split("error:")[0]


def test_recorded_sides_and_their_arguments():
    from audit.retime.workers import recorded_sides, worker_command
    from audit.stream import BadInput

    header = {"control": {"name": "serial"}, "candidate": {"name": "spec", "spec": "spec", "args": {"depth": 3}},
              "command": ["harness", "time", "--decoder-arg", "depth=2"]}
    control, candidate = recorded_sides(header, trust_plugins=False)
    assert (control.spec, control.args, candidate.spec, candidate.args, candidate.raw_args) == \
        ("serial", {}, "spec", {"depth": 3}, ())
    # no recorded args: the command line's --decoder-arg values go to the worker as they were given
    del header["candidate"]["args"]
    header["command"] += ["--decoder-arg=max_depth=4"]
    candidate = recorded_sides(header, trust_plugins=False)[1]
    assert candidate.raw_args == ("depth=2", "max_depth=4")
    assert worker_command(candidate, "tiny", "cpu")[-2:] == ["--decoder-arg=depth=2", "--decoder-arg=max_depth=4"]
    with pytest.raises(BadInput, match="--trust-plugin"):
        recorded_sides({**header, "candidate": {"name": "x", "spec": "os:system"}}, trust_plugins=False)


def test_the_candidate_loads_while_the_control_code_is_checked_and_the_control_starts_after(monkeypatch):
    """The check of the control's code runs after the candidate's worker started and before the
    control's, which alone gets the pycache the check compiled; the workers come back in the sides'
    order with the check's result."""
    import audit.retime.workers as W

    events = []

    class Started:
        def __init__(self, role):
            self.proc = type("P", (), {"pid": 10 + len(events)})()
            self.tree = type("T", (), {})()
            self.role = role

        def wait_ready(self):
            events.append(f"ready {self.role}")

        def close(self, graceful=True):
            events.append(f"closed {self.role}" + ("" if graceful else ", killed"))

    def start_worker(side, model_spec, device, continues, sandboxed, positions, control_pycache=None, hide=()):
        events.append(f"start {side.role} pycache={control_pycache} hide={hide}")
        return Started(side.role)

    def check():
        events.append("check")
        return "report"

    monkeypatch.setattr(W, "start_worker", start_worker)
    sides = W.recorded_sides({"control": {"name": "serial"}, "candidate": {"name": "spec", "spec": "spec"}},
                             trust_plugins=False)
    workers, checked = W.start_workers(sides, "tiny", "cpu", None, control_pycache="/p", hide=("/f",),
                                       check_control=check)
    assert checked == "report" and list(workers) == [s.role for s in sides] == ["control", "candidate"]
    assert events == ["start candidate pycache=None hide=('/f',)", "check", "start control pycache=/p hide=('/f',)",
                      "ready control", "ready candidate"]

    def failing():
        raise OSError("no git")
    events.clear()
    with pytest.raises(OSError):
        W.start_workers(sides, "tiny", "cpu", None, check_control=failing)
    assert events[-1] == "closed candidate, killed"  # a worker that failed to start is not waited for


def test_a_worker_closed_on_a_stop_is_killed_at_once_and_a_graceful_one_is_given_time():
    """A retime stopped (SIGTERM, Ctrl-C) while a worker loads does not wait for the load."""
    import subprocess

    import audit.retime.workers as W
    from core.continues import ContinueCounter

    for graceful, timeouts in ((False, [0]), (True, [W.WORKER_EXIT_S])):
        worker = W.Worker("candidate", [sys.executable, "-c", "import time; time.sleep(600)"], ContinueCounter(),
                          sandboxed=False, boxed=False)
        waits = []
        wait = worker.proc.wait

        def spy(timeout=None):
            waits.append(timeout)
            if timeout == W.WORKER_EXIT_S:  # as if the graceful wait had run out
                raise subprocess.TimeoutExpired(worker.proc.args, timeout)
            return wait(timeout)

        worker.proc.wait = spy
        worker.close(graceful)
        assert waits[:1] == timeouts and worker.proc.returncode == -9


def test_an_instrument_is_retimed_with_its_untimed_preparation(tmp_path):
    """An instrument makes no scored claim, but its ratio is reproducible: the candidate's worker
    gets the same untimed per-prompt preparation ``harness time`` gives it, and only it."""
    stream = run_harness(tmp_path / "inst", "spec-instrument", limit=2, n=N, legs=LEGS)
    result, doc = run_retime(stream, "--prompts", str(FRESH))
    assert result.exit_code == 0, result.output
    assert doc["candidate"]["instrument"] is True and "instrument: never scored" in result.stdout
    assert all(e["exact"] for e in doc["prompts"]) and not findings(doc, "claim-not-reproduced")
    assert doc["verified"]["ratio"] is not None and doc["verified"]["score"] == 0  # never scored


def test_the_worker_refuses_to_prepare_a_decoder_that_is_not_an_instrument():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "harness.worker", "--model", "tiny", "--device", "cpu",
                           "--decoder", "fast-serial"],
                          input=json.dumps({"prepare_prompt": [1, 2, 3], "max_new_tokens": 4}) + "\n",
                          capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines[0]["ready"] is True and lines[0]["instrument"] is False  # the decoder's own word
    assert lines[0]["decoder"] == "fast-serial" and isinstance(lines[0]["config"], dict)
    assert "not an instrument" in lines[1]["error"]


@pytest.mark.parametrize("source, how", [("builtin:random-512", "random token ids over the whole vocabulary"),
                                         ("builtin:stdlib-heldout", "runs of lines of the stdlib corpus's heldout split")])
def test_fresh_prompts_come_from_the_stream_source(fast_serial_stream, tmp_path, source, how):
    from audit.retime.fresh import fresh_prompts
    from audit.stream import load_run
    from core.corpus import collect
    from core.models import load_model
    from core.prompts import corpus_prompts

    copy = tmp_path / "stream.jsonl"
    records = [json.loads(line) for line in fast_serial_stream.read_text().splitlines()]
    records[0]["prompts"]["source"] = source
    copy.write_text("".join(json.dumps(r) + "\n" for r in records))
    run, model = load_run(copy), load_model("tiny", "cpu")
    draw = fresh_prompts(run, model, 3, 12345)
    first, second, said = draw.first, draw.second, draw.source["how"]
    assert how in said
    lengths = {p.id: len(p.token_ids) for p in run.prompts}
    assert [p.id for p in first] == ["fresh-0", "fresh-1", "fresh-2"]
    assert [p.id for p in second] == ["fresh-3", "fresh-4", "fresh-5"]
    assert [p.mirrors for p in second] == [p.mirrors for p in first]  # a second look like the first
    fresh = first + second
    spares = [p.spare for p in fresh]
    assert [len(p.token_ids) for p in fresh + spares] == [lengths[p.mirrors] for p in fresh + spares]
    assert [p.mirrors for p in spares] == [p.mirrors for p in fresh]
    assert [p.id for p in spares] == [f"{p.id}-again" for p in fresh]
    assert len({tuple(p.token_ids) for p in fresh + spares}) == 12  # each spare is another prompt
    if source.endswith("heldout"):  # none is the start of one of the set's own snippets
        tok = model.tokenizer.get()
        own = [tok.encode(e["text"]) for e in corpus_prompts("heldout", 10)]
        assert not any(ids[:len(p.token_ids)] == p.token_ids for p in fresh + spares for ids in own)
        # each is lines of the split: every line the start of one of the split's (a long one is cut
        # for a short prompt); and most are lines from more than one place, no stretch of one file
        # (a prompt of a line or two may be one piece: tests/test_retime_fresh.py checks the pieces)
        texts = [f.text for f in collect().split("heldout")]
        lines = "\n" + "\n".join(texts)
        stretches = 0
        for p in fresh + spares:
            text = tok.decode(p.token_ids)
            assert all(f"\n{line}" in lines for line in text.split("\n")[:-1]), text
            stretches += any(text in t for t in texts)
        assert stretches <= len(fresh + spares) // 4, stretches


class FakeClock:
    """The audit's clock for scripted workers: it moves only when a worker answers."""

    def __init__(self):
        self.t = 100.0

    def now(self) -> float:
        return self.t


class ScriptedWorker:
    """A worker whose answer to each timed request takes the next of ``seconds`` on the fake clock
    (warm-ups take none of them): what a burst of the machine's noise does to one leg."""

    tree = None  # no processes to stop or to measure

    def __init__(self, seconds: list[float], clock: FakeClock):
        from core.continues import ContinueCounter

        self.seconds, self.timed, self.clock = list(seconds), [], clock
        self.audit_continues = ContinueCounter()  # not installed: nothing stops this test's process

    def pause(self): pass
    def resume(self): pass
    def continues_by_others(self): return 0

    def send(self, prompt_ids, max_new_tokens, key="prompt_ids"):
        self.prompt = list(prompt_ids)

    def tokens(self):
        if len(self.prompt) > 4:  # the warm-up prompts below are 4 ids long
            self.clock.t += self.seconds.pop(0)
            self.timed.append(self.prompt)
        return [1, 2]


def scripted(control: list[float], candidate: list[float]):
    """A Measurement of two scripted workers on one fake clock (N=2, 2 legs, warm-ups of 2 tokens)."""
    from audit.retime.measure import Measurement

    clock = FakeClock()
    workers = {"control": ScriptedWorker(control, clock), "candidate": ScriptedWorker(candidate, clock)}
    return Measurement(workers, max_new_tokens=2, legs=2, warmup_tokens=2, clock=clock), workers


def scripted_outcome(ran, timed, findings, remeasured, second_look=None):
    from audit.retime.document import Outcome
    from audit.retime.judge import verified_figures
    from audit.stream import Run

    run = Run(Path("stream.jsonl"), {"candidate": {"name": "c"}, "control": {"name": "s"}, "model": {"name": "m"}},
              [], None, {})
    return Outcome(run=run, sha256="0" * 64, seed=0, source={"kind": "scripted", "how": "scripted"},
                   verdict="fail" if findings else "pass", findings=findings,
                   verified=verified_figures(timed, bool(findings), 0.95, 2.0),
                   claimed={"ratio": 2.0, "per_prompt": {"p0": 2.0, "p1": 2.0}}, max_new_tokens=2, legs=2,
                   seconds=0.1, instrument=False, fresh=ran, timed=timed, exact={p.id: True for p in timed},
                   remeasured=remeasured, second_look=second_look)


def spared(i, again=False):
    from audit.retime.fresh import FreshPrompt

    return FreshPrompt(f"fresh-{i}" + "-again" * again, [100 * again + 10 * i + 5 + j for j in range(6)],
                       [1, 2, 3, 4], f"p{i}")


def test_a_prompt_whose_control_legs_are_unstable_is_measured_again_on_its_spare():
    """The first prompt's control legs differ by 4x: its spare is timed in its place and the first
    measurement is reported, not counted; the steady second prompt is timed once."""
    from audit.retime.document import build_document, render_table
    from audit.retime.measure import Measured, time_fresh

    fresh = [spared(0), spared(1)]
    for i, fp in enumerate(fresh):
        fp.spare = spared(i, again=True)
    m, workers = scripted([0.08, 0.32, 0.08, 0.08, 0.08, 0.08], [0.04] * 6)
    out = Measured()
    time_fresh(m, fresh, out)
    ran, remeasured = out.ran, out.remeasured
    assert [fp.id for fp, _ in ran] == ["fresh-0-again", "fresh-1"]
    assert [p.id for _, p in ran] == ["fresh-0-again", "fresh-1"]
    assert workers["candidate"].timed == [fresh[0].token_ids] * 2 + [fresh[0].spare.token_ids] * 2 + [fresh[1].token_ids] * 2
    assert len(remeasured) == 1 and remeasured[0]["id"] == "fresh-0" and remeasured[0]["replaced_by"] == "fresh-0-again"
    assert remeasured[0]["leg_spread"]["control"] == pytest.approx(3.0)
    # the clock's, exactly; the second prompt's legs opened by the candidate (B A A B)
    assert [r["wall_s"] for r in ran[1][1].legs] == pytest.approx([0.04, 0.08, 0.08, 0.04])
    assert [r["role"] for r in ran[0][1].legs] == ["control", "candidate", "candidate", "control"]
    assert [r["role"] for r in ran[1][1].legs] == ["candidate", "control", "control", "candidate"]
    # the document lists the replaced measurement apart from the prompts whose ratios count
    doc = build_document(scripted_outcome([fp for fp, _ in ran], [p for _, p in ran], [], remeasured))
    assert [e["id"] for e in doc["prompts"]] == ["fresh-0-again", "fresh-1"]
    assert [e["id"] for e in doc["remeasured"]] == ["fresh-0"]
    assert doc["verified"]["ratio"] == pytest.approx(2.0) and doc["claimed"]["ratio"] == 2.0
    assert "measured again: fresh-0 (control legs unstable (300%)" in render_table(doc)


def test_a_candidate_that_spoils_its_second_leg_after_a_slow_first_gets_no_new_draw():
    """A candidate knows how its first leg went: spoiling its second leg whenever the first was slow
    (here 4x) would, were its own instability a reason to measure again, trade each unlucky first
    leg for a new draw and keep only its lucky ones. Its first measurement stands."""
    from audit.retime.measure import Measured, time_fresh

    fresh = [spared(0), spared(1)]
    for i, fp in enumerate(fresh):
        fp.spare = spared(i, again=True)
    # prompt 0 (control opens): the candidate's first leg slow (0.12), its second spoiled (0.48)
    m, workers = scripted([0.08] * 4, [0.12, 0.48, 0.04, 0.04])
    out = Measured()
    time_fresh(m, fresh, out)
    assert [fp.id for fp, _ in out.ran] == ["fresh-0", "fresh-1"] and out.remeasured == []
    assert judge_ratio(out.ran[0][1]) == pytest.approx(0.08 / 0.12)
    assert workers["candidate"].timed == [fresh[0].token_ids] * 2 + [fresh[1].token_ids] * 2


def judge_ratio(p):
    from audit.retime.judge import verified_ratio

    return verified_ratio(p)


def test_a_spare_is_timed_at_most_once():
    """A spare whose legs are unstable too stands, warned about by the spread check: a prompt is
    measured at most twice, so a retime always ends."""
    from audit.retime.fresh import FreshPrompt
    from audit.retime.measure import Measured, time_fresh

    fp = FreshPrompt("fresh-0", list(range(5, 11)), [1, 2, 3, 4], "p0",
                     spare=FreshPrompt("fresh-0-again", list(range(20, 26)), [1, 2, 3, 4], "p0"))
    m, _ = scripted([0.01, 0.04] * 2, [0.01] * 4)
    out = Measured()
    time_fresh(m, [fp], out)
    assert [f.id for f, _ in out.ran] == ["fresh-0-again"] and len(out.remeasured) == 1


@pytest.mark.parametrize("first, second, looks_again, passes", [
    (0.02, None, False, True),  # the first look holds the claim: judged on it alone
    (0.06, 0.02, True, True),  # noise sank the first look: the second lifts the interval of all twelve
    (0.06, 0.06, True, False),  # a decoder slower than its claim is as slow on the second look
])
def test_a_first_look_that_falls_short_gets_a_second(first, second, looks_again, passes):
    """Claimed ratio 2.0; the control takes 60 ms a leg; the candidate ``first`` seconds a leg on
    the first look's six prompts and ``second`` on the second look's (ratios 1 and 3)."""
    from audit.retime.document import build_document, render_table
    from audit.retime.fresh import FreshPrompt
    from audit.retime.judge import claim_findings, falls_short, interval, prompt_ratios
    from audit.retime.measure import Measured, time_looks

    looks = tuple([FreshPrompt(f"fresh-{FRESH * look + i}", [10 * (FRESH * look + i) + 5 + j for j in range(6)],
                               [1, 2, 3, 4], f"p{i}") for i in range(FRESH)] for look in range(2))
    candidate = [first] * 2 * FRESH + ([second] * 2 * FRESH if second else [])
    m, workers = scripted([0.06] * 4 * FRESH, candidate)
    out = Measured()
    time_looks(m, looks, out, falls_short(2.0))
    timed = [fp.id for fp, _ in out.ran]
    assert timed == [f"fresh-{i}" for i in range(2 * FRESH if looks_again else FRESH)]
    assert len(workers["candidate"].timed) == 2 * len(timed)  # the second look only when taken
    if looks_again:
        assert out.second_look["first_prompts"] == FRESH and out.second_look["prompts"] == FRESH
        assert out.second_look["first_median_ratio"] == pytest.approx(1.0)
    else:
        assert out.second_look is None
    low, high, _, _ = interval(prompt_ratios(out.timed))
    found = claim_findings(2.0, low, high)
    assert (found == []) == passes
    doc = build_document(scripted_outcome([fp for fp, _ in out.ran], out.timed, found, out.remeasured,
                                          out.second_look))
    assert doc["second_look"] == out.second_look and len(doc["prompts"]) == len(timed)
    # a score only for a claim that holds and a speed-up the interval tells from none (six ratios of
    # 1 and six of 3: the interval reaches 1, so the second case passes the claim with a score of 0)
    assert (doc["verified"]["score"] > 0) == (passes and doc["verified"]["significant"])
    assert doc["verified"]["significant"] == (doc["verified"]["ci_low"] > 1)
    assert ("second look: the first 6 fresh prompts' median" in render_table(doc)) == looks_again


def test_fewer_fresh_prompts_than_an_interval_needs_is_bad_input(fast_serial_stream, tmp_path):
    stream = copy_stream(fast_serial_stream, tmp_path / "few")
    result, doc = run_retime(stream, "--prompts", str(FRESH - 1))
    assert result.exit_code == 2 and doc is None
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: --prompts {FRESH - 1}: a 95% interval for the median ratio needs at least {FRESH} fresh prompts")


def test_an_n_beyond_the_models_context_is_bad_input_before_any_worker_starts(fast_serial_stream, tmp_path):
    """A worker sized for it would hold memory for every position; tiny's context is 4096."""
    stream = copy_stream(fast_serial_stream, tmp_path / "huge")
    for n, words in (("100000000", "-n 100000000: beyond the model's context of 4096"),
                     ("4090", "the longest fresh prompt + N = ")):
        result, doc = run_retime(stream, "-n", n)
        assert result.exit_code == 2 and doc is None, result.output
        assert words in result.stderr.strip().splitlines()[-1] and "worker" not in result.output


def test_worker_that_cannot_start_is_bad_input(fast_serial_stream, tmp_path):
    from audit_helpers import copy_stream, read_records, write_records

    stream = copy_stream(fast_serial_stream, tmp_path / "unknown")
    records = read_records(stream)
    records[0]["candidate"]["spec"] = "no-such-decoder"
    write_records(stream, records)
    result, doc = run_retime(stream)
    assert result.exit_code == 2 and doc is None
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: retime could not start") and "no-such-decoder" in lines[-1]
