"""bench/run.py and bench/spec_bench.py: configuration names, and what a set asks of the GPU."""
import importlib.util
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load(name: str):
    """bench/NAME.py as the module ``bench_NAME`` (``run`` alone is too common a name to register)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def spec_bench():
    return load("spec_bench")


@pytest.fixture(scope="module")
def run():
    return load("run")


@pytest.mark.parametrize("name", ["inst-trace:bench/traces/small-dev.json@fs",
                                  "inst-trace:bench/traces/small-dev.json+conf@fs"])
def test_a_trace_configuration_names_its_trace_with_or_without_conf(spec_bench, name):
    r = spec_bench.resolve(name)
    assert r["trace"] == "bench/traces/small-dev.json" and r["shortlisted"]
    assert "trace=bench/traces/small-dev.json" in r["args"] and r["args"][-2:] == ["--control", "fast-serial"]
    assert ("stop=confidence" in r["args"]) == ("+conf" in name)


def test_configurations_without_a_trace_and_unknown_ones(spec_bench):
    assert spec_bench.resolve("inst-0.6+conf@fs")["trace"] is None
    assert spec_bench.resolve("fast-serial+conf") is None and spec_bench.resolve("nope") is None


def test_a_missing_trace_is_one_error_line(spec_bench, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["spec_bench.py", "--out", str(tmp_path),
                                      "--configs", f"inst-trace:{tmp_path / 'none.json'}+conf@fs"])
    assert spec_bench.main() == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no trace file for") and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("most,memory,fit", [(4, 79.6, 4), (8, 79.6, 8), (8, 140.4, 8), (8, 33.0, 3),
                                              (4, None, 4), (4, 12.0, 1)])
def test_replay_workers_fit_the_gpu_memory(run, most, memory, fit):
    assert run.replay_workers(most, memory) == fit


@pytest.mark.parametrize("mps", [False, True])
def test_replay_throughput_stops_at_the_workers_the_gpu_holds(run, tmp_path, monkeypatch, mps):
    """The most workers that fit, and again under an MPS daemon where the machine has one."""
    which = shutil.which
    monkeypatch.setattr(run.shutil, "which",
                        lambda name: ("/usr/bin/" + name if mps else None) if name == "nvidia-cuda-mps-control"
                        else which(name))
    keys = lambda memory: [s.key for s in run.replay_throughput_steps(tmp_path, memory)]  # noqa: E731
    under_mps = lambda most: [f"audit-mps-w{most}"] if mps else []  # noqa: E731
    assert keys(33.0) == ["time", "audit-w1", "audit-w2", "audit-w3", *under_mps(3), "table"]
    assert keys(79.6) == ["time", "audit-w1", "audit-w2", "audit-w4", "audit-w8", *under_mps(8), "table"]
    assert keys(None) == keys(140.4) == keys(79.6)


@pytest.mark.parametrize("cpus, xdist, spread", [(16, True, ["-n", "8", "--dist", "worksteal"]), (16, False, []),
                                                (2, True, []), (1, True, [])])
def test_the_suite_spreads_over_half_the_cpus_only_where_xdist_is_installed(run, cpus, xdist, spread):
    step = run.suite_step(cpus, xdist)
    argv = list(step.argv)
    assert argv[1:3] == ["-m", "pytest"] and "--durations=15" in argv and "--tb=short" in argv
    assert "-q" not in argv  # a cut run's log still says how many tests there were and how far it got
    assert "-v" in argv  # and names the tests it finished
    assert dict(step.env) == {"OMP_NUM_THREADS": "1"}  # as CI runs it
    assert argv[argv.index("--durations=15") + 1:] == spread


@pytest.mark.parametrize("n", [2, 3])
def test_the_suites_parts_hold_every_test_file_once(run, tmp_path, n):
    every = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py"))
    names = [f"{k}of{n}" for k in range(1, n + 1)]
    assert set(names) <= set(run.SUITE_PARTS)
    parts = [run.suite_files(part) for part in names]
    assert sorted(f for files in parts for f in files) == every and all(parts)
    steps = run.set_steps("suite", tmp_path, names)
    assert [s.key for s in steps] == [f"pytest-{name}" for name in names]
    assert [list(s.argv[-len(files):]) for s, files in zip(steps, parts)] == parts
    (whole,) = run.set_steps("suite", tmp_path, None)
    assert not any(a.startswith("tests/") for a in whole.argv)


def test_a_log_names_each_test_it_reached_with_its_outcome():
    suite_logs = load("suite_logs")
    log = "\n".join([
        "8 workers [5 items]",
        "tests/test_a.py::test_one ",  # begun, not ended: not reached
        "[gw1] [ 20%] PASSED tests/test_a.py::test_one ",
        "[gw0] [ 40%] SKIPPED tests/test_a.py::test_two[x-'1.5' is not a valid integer.] ",
        "[gw2] [ 60%] PASSED tests/test_b.py::test_three ",
        "[gw2] [ 60%] ERROR tests/test_b.py::test_three ",  # its teardown failed after the call passed
        "tests/test_b.py::test_four[a b] FAILED                                   [ 80%]",
        "tests/test_b.py::test_five ",
        "!!!! KeyboardInterrupt !!!!",
    ])
    assert suite_logs.reached(log) == {"tests/test_a.py::test_one": "PASSED",
                                       "tests/test_a.py::test_two[x-'1.5' is not a valid integer.]": "SKIPPED",
                                       "tests/test_b.py::test_three": "ERROR",
                                       "tests/test_b.py::test_four[a b]": "FAILED"}


def test_a_parts_rest_logs_come_in_their_order_and_a_new_one_never_takes_a_used_name(tmp_path):
    suite_logs = load("suite_logs")
    for name in ("pytest-1of3-rest2.log", "pytest-1of3-rest10.log", "pytest-1of3-restx.log", "pytest-2of3.log"):
        (tmp_path / name).write_text("")
    logs = suite_logs.part_logs(tmp_path, "pytest-1of3")  # its first log is gone
    assert [p.name for p in logs] == ["pytest-1of3-rest2.log", "pytest-1of3-rest10.log"]
    assert suite_logs.next_rest(logs, "pytest-1of3") == "pytest-1of3-rest11"
    (tmp_path / "pytest-1of3.log").write_text("")
    assert suite_logs.part_logs(tmp_path, "pytest-1of3")[0].name == "pytest-1of3.log"
    assert suite_logs.next_rest([tmp_path / "pytest.log"], "pytest") == "pytest-rest1"


def test_resume_runs_only_the_tests_a_parts_logs_never_reached_and_keeps_their_failures(run, tmp_path, monkeypatch,
                                                                                        capsys):
    part = ["tests/test_paths.py"]
    monkeypatch.setattr(run, "suite_files", lambda name: part)
    monkeypatch.setattr(run, "xdist_installed", lambda: False)
    ids = run.collected(run.PYTEST, part)
    assert len(ids) >= 3
    logs = tmp_path / "logs"
    logs.mkdir()
    first = logs / "pytest-1of3.log"
    first.write_text(f"[gw0] [ 10%] PASSED {ids[0]} \n[gw1] [ 20%] FAILED {ids[1]} \n{ids[2]} \n")
    assert run.main(["suite", "--configs", "1of3", "--out", str(tmp_path), "--resume"]) == 1  # the failure stands
    shown = capsys.readouterr().out
    assert "pytest-1of3-rest1" in shown and "(1 failed before)" in shown
    assert f"pytest-1of3: 2 of {len(ids)} tests ended in pytest-1of3.log, 1 failed; {len(ids) - 2} left to run" in shown
    assert f"failed in an earlier log: {ids[1]}" in shown
    again = load("suite_logs").reached((logs / "pytest-1of3-rest1.log").read_text())
    assert sorted(again) == sorted(ids[2:]) and set(again.values()) == {"PASSED"}  # ran the rest, no more
    assert first.read_text().endswith(f"{ids[2]} \n")  # the first log is kept as it was
    assert run.main(["suite", "--configs", "1of3", "--out", str(tmp_path), "--resume"]) == 1
    assert "kept (--resume) (1 failed before)" in capsys.readouterr().out
    assert sorted(p.name for p in logs.iterdir()) == ["pytest-1of3-rest1.log", "pytest-1of3.log"]
    first.write_text(first.read_text().replace("FAILED", "PASSED"))
    assert run.main(["suite", "--configs", "1of3", "--out", str(tmp_path), "--resume"]) == 0
    assert "kept (--resume)" in capsys.readouterr().out


def test_a_part_whose_tests_cannot_be_collected_is_one_error_line(run, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run, "suite_files", lambda name: ["tests/test_no_such_file.py"])
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "pytest-2of3.log").write_text("8 workers [3 items]\n")
    assert run.main(["suite", "--configs", "2of3", "--out", str(tmp_path), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: pytest could not collect the tests") and "Traceback" not in err
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["pytest-2of3.log"]


def spawn_sleeper(ignore_interrupt: bool) -> subprocess.Popen:
    """A step stand-in in a session of its own, as run_step starts one; it says when it is ready."""
    code = ("import signal, sys, time\n"
            f"{'signal.signal(signal.SIGINT, signal.SIG_IGN)' if ignore_interrupt else ''}\n"
            "print('ready', flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.stdout.close()  # it prints nothing more
    return proc


def test_a_step_past_its_time_is_interrupted_first(run):
    """SIGINT, as Ctrl-C: a step that ends on it (pytest, after printing its failures) is not killed."""
    proc = spawn_sleeper(ignore_interrupt=False)
    graces = []
    run.stop_group(proc.pid, lambda grace: graces.append(grace) or run.wait_for(proc, 60))
    assert proc.wait(timeout=60) == -signal.SIGINT or proc.returncode == 1  # KeyboardInterrupt's exit
    assert graces == [run.STOP_GRACE_S]


def test_a_step_that_outlives_its_interrupt_is_killed(run):
    proc = spawn_sleeper(ignore_interrupt=True)
    run.stop_group(proc.pid, lambda grace: False)  # the grace has passed and it is still there
    assert proc.wait(timeout=60) == -signal.SIGKILL
    run.stop_group(proc.pid, lambda grace: pytest.fail("a step that is gone was waited for"))


def test_profile_idle_gaps_are_the_time_between_busy_intervals_by_length():
    prof = load("profile_runtime")
    # two lanes overlapping (0-10, 5-12), a 0.5 us gap, a 40 us gap, a 2 us gap; two calls
    spans = [(0.0, 10.0), (5.0, 12.0), (12.5, 20.0), (60.0, 70.0), (72.0, 80.0)]
    assert prof.busy_time(spans) == 12.0 + 7.5 + 10.0 + 8.0
    gaps = prof.idle_gaps(spans, calls=2)
    assert gaps["<1us"] == {"count": 0.5, "ms": 0.5 / 1e3 / 2}
    assert gaps["1-3us"] == {"count": 0.5, "ms": 2.0 / 1e3 / 2}
    assert gaps[">=30us"] == {"count": 0.5, "ms": 40.0 / 1e3 / 2}
    assert gaps["3-10us"]["count"] == gaps["10-30us"]["count"] == 0


def test_replay_table_names_each_document_and_compares_all_but_the_pool_fields(tmp_path, capsys, run):
    table = load("replay_table")
    base = {"stream": "s.jsonl", "verdict": "pass", "findings": [],
            "replay": {"device": "cuda", "tokens_replayed": 96, "seconds": 8.0, "ms_per_token": 80.0, "workers": 1}}
    paths = []
    for name, workers, seconds in (("audit-w1", 1, 8.0), ("audit-w7", 7, 2.0), ("audit-mps-w7", 7, 1.5)):
        doc = json.loads(json.dumps(base))
        doc["replay"].update(workers=workers, seconds=seconds)
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(doc))
    assert table.main([str(p) for p in paths]) == 0
    out = capsys.readouterr().out
    assert "| audit-w1 | 1 | 96 | 8.0 | 12.0 | 1.00x" in out and "| audit-mps-w7 | 7 | 96 | 1.5 | 64.0 | 5.33x" in out
    doc["verdict"] = "fail"
    paths[2].write_text(json.dumps(doc))
    assert table.main([str(p) for p in paths]) == 1


def test_replay_throughput_runs_the_most_workers_again_under_mps_only_where_the_daemon_exists(tmp_path, run,
                                                                                              monkeypatch):
    monkeypatch.setattr(run.shutil, "which", lambda name: None)
    keys = [s.key for s in run.replay_throughput_steps(tmp_path, 140.0)]
    assert keys == ["time", "audit-w1", "audit-w2", "audit-w4", "audit-w8", "table"]
    monkeypatch.setattr(run.shutil, "which", lambda name: "/usr/bin/" + name)
    steps = run.replay_throughput_steps(tmp_path, 33.0)  # room for three workers beside the weights
    assert [s.key for s in steps] == ["time", "audit-w1", "audit-w2", "audit-w3", "audit-mps-w3", "table"]
    script = steps[-2].argv[-1]
    assert "nvidia-cuda-mps-control -d" in script and "echo quit | nvidia-cuda-mps-control" in script
    assert "--workers 3" in script and str(tmp_path / "mps" / "pipe") in script


def test_gemm_stack_probe_tries_every_run_of_neighbouring_projections():
    probe = load("gemm_stack_probe")
    assert probe.stacks(probe.MLP) == [("gate_proj", "up_proj")]
    assert probe.stacks(probe.ATTENTION) == [("q_proj", "k_proj"), ("q_proj", "k_proj", "v_proj"), ("k_proj", "v_proj")]
    assert len(probe.stacks(probe.GDN)) == 6 and ("in_proj_b", "in_proj_a") in probe.stacks(probe.GDN)


def test_the_decode_trace_charges_each_late_launch_to_the_frames_around_it():
    prof = load("profile_runtime")
    frames = [(0, 100, "spec.py: decode"), (10, 40, "spec.py: _spec_round"), (12, 20, "runtime.py: verify"),
              (50, 90, "spec.py: _draft")]
    assert prof.enclosing(frames, [15, 45, 60, 200]) == [
        ("spec.py: decode", "spec.py: _spec_round", "runtime.py: verify"), ("spec.py: decode",),
        ("spec.py: decode", "spec.py: _draft"), ()]
    # gaps: (idle from, us, correlation); launches: correlation -> host launch time
    gaps = [(14, 30.0, 1), (55, 12.0, 2), (70, 50.0, 3)]
    launches = {1: 16, 2: 60, 3: 5}  # the third was queued long before the GPU went idle
    rows = prof.waits_by_place(gaps, launches, frames, depth=2)
    assert rows == [("queued before the GPU went idle", 1, 50.0),
                    ("spec.py: _spec_round > runtime.py: verify", 1, 30.0),
                    ("spec.py: decode > spec.py: _draft", 1, 12.0)]


def test_the_decode_trace_finds_the_projects_frames_in_a_real_profile():
    """The frames come from the profiler itself (not every torch flags python events on its
    kineto events): a project function profiled on the CPU is found, with its span."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from decoders.stepping import TokenReader

    prof_mod = load("profile_runtime")
    reader = TokenReader(torch.device("cpu"))
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        reader.read(reader.post(torch.tensor([7])))
    frames = prof_mod.project_frames(prof)
    names = [n for _, _, n in frames]
    assert any(n.startswith("decoders/stepping.py(") and n.endswith(": post") for n in names)
    assert any(n.endswith(": read") for n in names)
    assert all(a <= b for a, b, _ in frames)
    assert not any(n.startswith("torch/") for n in names)  # only the project's own


@pytest.mark.parametrize("script", ["replay_table", "retime_table", "sampling_exact_table"])
def test_a_table_script_refuses_what_it_cannot_read_in_one_line(tmp_path, capsys, script):
    table = load(script)
    with pytest.raises(SystemExit) as stop:
        table.main(["--help"])
    assert stop.value.code == 0 and "usage:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        table.main([str(tmp_path / "*" / "x.json")])
    assert stop.value.code == 2 and "a pattern that matched nothing" in capsys.readouterr().err
    for content in ("not json", "[1, 2]", '{"replay": {}}'):
        bad = tmp_path / "bad.json"
        bad.write_text(content)
        assert table.main([str(bad)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {bad}: not ") and "Traceback" not in err[0]


def run_main_error(run, capsys, *argv) -> str:
    with pytest.raises(SystemExit) as stop:
        run.main(list(argv))
    assert stop.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_run_refuses_before_any_step_what_cannot_work(run, tmp_path, capsys, monkeypatch):
    """A GPU set on a machine without one, an --out or --archive that cannot be written, an
    existing archive (never overwritten), an empty --configs, a timeout of 0, a set that spreads
    pytest over processes without pytest-xdist: one argparse error each, and nothing made."""
    monkeypatch.setattr(run, "cuda_available", lambda: False)
    monkeypatch.setattr(run, "run_step", lambda *a: pytest.fail("a step ran"))
    out = tmp_path / "out"
    assert "set runtime needs a CUDA GPU" in run_main_error(run, capsys, "runtime", "--out", str(out))
    (tmp_path / "file").write_text("mine")
    assert "exists and is not a directory" in run_main_error(run, capsys, "policy", "--out", str(tmp_path / "file"))
    assert "is never overwritten" in run_main_error(run, capsys, "policy", "--out", str(out),
                                                    "--archive", str(tmp_path / "file"))
    assert (tmp_path / "file").read_text() == "mine"
    assert "cannot write under /proc" in run_main_error(run, capsys, "policy", "--out", str(out),
                                                        "--archive", "/proc/x.tgz")
    assert "names no configuration" in run_main_error(run, capsys, "retime-9b", "--out", str(out), "--configs", ",")
    assert "above 0" in run_main_error(run, capsys, "policy", "--out", str(out), "--timeout", "0")
    monkeypatch.setattr(run, "cuda_available", lambda: True)
    monkeypatch.setattr(run, "xdist_installed", lambda: False)
    assert "needs pytest-xdist" in run_main_error(run, capsys, "tests-cuda-shared", "--out", str(out))
    assert not out.exists()


def test_script_args_refuse_out_of_range_values_and_turn_a_users_mistake_into_one_line(tmp_path, capsys):
    import argparse

    from core.errors import UserError

    args = load("script_args")
    assert args.positive_int("3") == 3 and args.fraction("0.6") == 0.6
    assert args.listed(args.positive_int)("512, 2048,") == [512, 2048]
    for kind, text in ((args.positive_int, "0"), (args.positive_int, "abc"), (args.fraction, "1.5"),
                       (args.fraction, "nan"), (args.listed(args.fraction), ",")):
        with pytest.raises(argparse.ArgumentTypeError):
            kind(text)
    (tmp_path / "file").write_text("mine")
    for bad in (tmp_path / "file" / "x.json", tmp_path, "/proc/x.json"):
        with pytest.raises(argparse.ArgumentTypeError):
            args.new_output(str(bad))
    assert args.new_output(str(tmp_path / "x.json")) == tmp_path / "x.json" and not (tmp_path / "x.json").exists()

    def mistaken():
        raise UserError("model 'bogus' is neither a built-in nor a directory")

    assert args.run_main(mistaken) == 2
    assert capsys.readouterr().err == "error: model 'bogus' is neither a built-in nor a directory\n"
    with pytest.raises(ZeroDivisionError):  # a bug stays a traceback
        args.run_main(lambda: 1 // 0)
