"""Run one named benchmark set and print its table last: ``python bench/run.py SET --out DIR``.

    python bench/run.py SET --out DIR [--configs A,B,...] [--timeout SECONDS] [--resume] [--archive FILE.tgz]

Sets (``python bench/run.py --list`` prints them with their commands):

  runtime     bench/runtime_bench.py on synthetic-9b: control, fast-serial step, verify windows
              w = 1..8 and rollback, every runtime logit compared bit for bit with the control's,
              for a runtime on one stream and one with its lanes, each with the MLP's gate and up
              projections as one GEMM (where calibrated) and as two; last, the step's ms and kernel
              count of all four side by side
  probe       bench/exactness_probe.py: verify windows replayed against serial steps, op class by op class
  profile     bench/profile_runtime.py: busy and kernel time, kernel count per step and window (one
              stream and lanes), the step with its token read, idle gaps by length, draft step and prefill
  gemm-stack  bench/gemm_stack_probe.py: each projection's GEMM time and kernel on 1-4 rows, and each
              stack of projections that read one input (Gated-DeltaNet in_proj_*, attention q/k/v,
              MLP gate/up) as one GEMM: its time and whether every slice is bit-equal
  table       bench/spec_bench.py: the standard synthetic-9b configurations, each against the control
              (NAME@fs: side by side against fast-serial), then one `audit replay` of every stream
  targets     bench/spec_bench.py on synthetic-9b, the speed targets' rows, each side by side against
              fast-serial: the instrument at alpha 0.6, 0.7 (256 new tokens) and 0.85 (512), spec's
              random head (3 legs), and small's real acceptance traces (bench/traces: held-out, dev)
              replayed at the 9B shape, each with stop=depth and stop=confidence (+conf), and alpha
              0.6 with stop=confidence; 4 prompts; then one audit of every stream with 4 workers
              (fewer where the GPU's memory holds fewer 9B replays: 3 on an 80 GB H100)
  small-real  bench/spec_bench.py on the built-in `small` (trained weights, its own MTP head) on the
              GPU: fast-serial and spec against the control, and spec side by side against fast-serial
  context     bench/context_bench.py on synthetic-9b: decode ms/token and peak memory against context
              (512 to 32k: prompt + 256 new tokens), the control, fast-serial and the instrument at alpha
              0.6 and 0.85 side by side in one process, each sized for 32k before timing
  long        bench/context_bench.py for one long generation: a 2000-token prompt + 16384 new tokens,
              fast-serial and the instrument at alpha 0.85 side by side, both sized for it before
              timing (~5 minutes on the H200)
  serve       bench/serve_bench.py on synthetic-9b: time to first token and tokens/s of `spec` through
              `harness serve` (the openai client), `harness generate` and `harness time`, side by side,
              every answer compared with the recorded serial tokens
  sampling    bench/sampling_bench.py: under Qwen's two presets and greedy, side by side in one process,
              `small`'s fast-serial and spec with and without the coupled draft (acceptance and
              speed), and synthetic-9b's fast-serial, spec and instrument at alpha 0.6 and 0.85 (with
              the GPU's default one-call windows and with lazy rows); every token checked against the
              serial control under the same sampler
  sampling-exact
              on the CPU: for tiny and small, T in 0.3, 0.6, 1.0, with and without top-k/top-p, and
              fast-serial and spec (fixed depth 3, so every round verifies drafts): `harness time
              --sampling` (3 prompts x 32 tokens, 1 leg), then one `audit replay` of every stream of a
              model (each replayed with its header's sampler); a table of exactness, acceptance, ratio
  sampling-exact-9b
              the same sweep on the H200 for synthetic-9b, with the instrument at alpha 0.7 (its
              drafts make every round verify; the random head's would be rejected): 2 prompts x 64
              tokens, 1 leg per stream, one `audit replay` of the six
  retime-9b   `audit retime` on synthetic-9b streams inside the sandbox: CUDA checked inside it first,
              then a `fast-serial` stream and an instrument (alpha 0.85) stream, each made by
              `harness time` and retimed on 6 fresh prompts; the table of claimed and verified ratios.
              One GPU call holds one of the two (~300 s each): --configs fs, then --configs inst-0.85
  quiet       the retime's GPU idle probe (bench/gpu_quiet.py: alone, beside another process's
              products, copies and tiny kernels, and after a stopped process's queued work), then
              `audit retime` of a decoder at serial speed that leaves a second of GPU work behind
              every answer (tests/retime_decoders.py LeavesGpuWork) on `tiny`, 6 fresh prompts
  replay-throughput
              `audit replay` of one synthetic-9b stream (fast-serial, made by `harness time` first:
              8 prompts x 96 tokens) at --workers 1, 2, 4 and 8 on the one GPU (8: one prompt each;
              the workers share the audit's one copy of the weights, and a GPU too small for 8
              stops at its own most), and, where nvidia-cuda-mps-control exists, the most again
              under an MPS daemon of the set's own: tokens/s per setting, and whether the
              audit.json documents agree (bench/replay_table.py)
  cpu-verify  bench/cpu_verify.py on the CPU (device cpu): 5 honest retimes each of spec and
              fast-serial on tiny and small (4 at once), then 10 README quick starts (harness time,
              audit replay, audit retime) beside a steady CPU hog (4 at once); two tables
  retime-null bench/retime_null.py (CPU, simulation): how often a retime would score a candidate
              exactly as fast as the control, under the retime's rule and the median/bootstrap rule
  policy      bench/policy_sim.py (CPU, simulation): spec's depth policy, round by round, on the
              instrument's alpha 0.6 / 0.7 / 0.85 and small's two traces, with stop=depth,
              stop=confidence and the oracle's bound (each round knowing its acceptance), priced by
              the costs a 9B run recorded on the H200
  tests-cuda  pytest -q -m cuda
  tests-cuda-shared
              pytest -v -m cuda across 4 processes on the one GPU (pytest-xdist), so that each
              CUDA test runs while others load the card; -v names each test's process
  suite       pytest, the whole suite (its log shows how far a run cut by --timeout got): in
              half the CPUs' worth of processes where pytest-xdist is installed (the `test`
              extra), else in one, with OMP_NUM_THREADS=1 as in CI; its 15 slowest tests named,
              and each test as it ends (-v). In parts, for calls too short for all of it:
              --configs 1of2, then 2of2 (every other test file each), or 1of3, 2of3 and 3of3
              (every third). With --resume, a part whose logs are in DIR runs only the tests they
              never reached (a run cut by --timeout), as STEP-restN, and counts as failed if a log
              names a failure

Every step's output goes to the terminal and to DIR/logs/STEP.log; DIR/host.txt names the machine
and its GPUs. A step that fails or runs past --timeout is reported and the set goes on, so one slow
configuration does not cost the others. A step past --timeout is interrupted as by Ctrl-C (pytest
then prints the failures it has met) and killed 20 s later if it is still there. The last thing
printed is the set's table: the last markdown table of its final step (for pytest, its summary
line).

A GPU call is limited in time, so `table` can be run in parts (``--configs``) into one DIR;
``--resume`` skips configurations whose stream is already there, and the audit and the table
always cover everything in DIR/table. The suite's parts resume test by test: the logs already in
DIR/logs say which tests ended, and only the others run. Directory names such as ``spec@fs`` may
not survive a transfer tool: ``--archive FILE.tgz`` packs DIR into one file at the end.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # its scripts' shared modules, also when this file is imported

from core.paths import nearest_existing, try_new_file  # noqa: E402
from suite_logs import SUITE_PARTS, collected, next_rest, part_logs, rest, suite_files  # noqa: E402
PY = sys.executable
SHORTLIST_9B = "bench/synthetic9b-shortlist-32k.json"  # built from random-512-offline, never the benchmark prompts

# the standard table: every decoder against the control, the three acceptance levels of the
# instrument, and the two side-by-side runs against fast-serial that the headline figures use
TABLE_CONFIGS = ("fast-serial", "spec-naive", "spec", "inst-0.6", "inst-0.85", "inst-0.95", "spec@fs", "inst-0.85@fs")
SMALL_CONFIGS = ("fast-serial", "spec", "spec@fs")
# spec with a head that predicts nothing is within a few percent of fast-serial: one leg is noise
LEGS = {"spec@fs": 3, "fs-read-first@fs": 3}
# the speed targets' rows, each side by side against fast-serial: the instrument at three acceptance levels,
# spec's random head, fast-serial reading each token before its next step (the step's row), and small's real acceptance (held-out and dev traces, with the head's
# confidences) replayed at the 9B shape, with each round's depth chosen before drafting and with
# stop=confidence
TRACES_9B = ("bench/traces/small-heldout.json", "bench/traces/small-dev.json")
TARGET_CONFIGS = ("inst-0.6@fs", "inst-0.7@fs", "inst-0.85@fs", "spec@fs", "fs-read-first@fs",
                  *(f"inst-trace:{t}{stop}@fs" for t in TRACES_9B for stop in ("", "+conf")), "inst-0.6+conf@fs")
# what the policy earns on those rows, simulated from the costs a 9B run recorded (session 20's
# context run, bench/NOTES.md): no GPU needed
POLICY_COSTS = "bench/runs/2026-12-04-h200-s20/context-512-32k.json:inst-0.6"
TARGET_NEW = {"inst-0.85@fs": 512}  # the alpha-0.85 row is 512 new tokens; the others 256


@dataclass(frozen=True)
class Step:
    """One command of a set. ``key`` names its log; ``done`` (a path relative to DIR) skips the step
    under --resume; ``ok`` are the exit codes that count as success; ``failed_before``: tests an
    earlier run of the step failed, which make it count as failed whatever its exit; ``env``:
    variables set for it over the environment's."""
    key: str
    argv: tuple[str, ...]
    done: str | None = None
    ok: tuple[int, ...] = (0,)
    failed_before: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


def spec_bench_steps(out: str, configs: list[str], common: list[str], new_tokens: dict | None = None,
                     workers: int = 1) -> list[Step]:
    """One spec_bench call per configuration (so each has its own log and timeout; ``new_tokens``:
    a configuration's own -n), then one audit of every stream in the directory (each distinct
    prompt replayed once, by ``workers`` processes), then the table."""
    new_tokens = new_tokens or {}
    steps = [Step(f"bench-{c.replace('@', '_at_').replace('/', '_')}",
                  (PY, "bench/spec_bench.py", "--out", out, *common, "--no-audit", "--configs", c,
                   "--legs", str(LEGS.get(c, 1)), *(("-n", str(new_tokens[c])) if c in new_tokens else ())),
                  done=f"{Path(out).name}/{c.replace('/', '_').replace(':', '_')}/stream.jsonl")
             for c in configs]
    # exit 1 = findings (spec-naive is not exact, by design): the table shows them
    steps.append(Step("audit", ("sh", "-c", f'{PY} -m audit replay --workers {workers} "{out}"/*/stream.jsonl'),
                      ok=(0, 1)))
    steps.append(Step("table", (PY, "bench/spec_bench.py", "--out", out, "--table-only")))
    return steps


# CUDA inside the candidate's sandbox: the plan's tool, then a kernel run through it
SANDBOX_CUDA = ("import subprocess, sys; from audit import sandbox; "
                "launch = sandbox.launch([sys.executable, '-I', '-c', 'import torch; x = torch.ones(4, device=\"cuda\"); "
                "print(torch.cuda.get_device_name(), (x * 2).sum().item())'], sandbox=True); "
                "print('sandbox:', launch.sandbox.tool, launch.sandbox.warning); "
                "subprocess.run(launch.argv, env=launch.env, check=True); launch.cleanup()")
RETIME_9B = {"fs": ("--decoder", "fast-serial"),
             "inst-0.85": ("--decoder", "spec-instrument", "--decoder-arg", "alpha=0.85",
                           "--decoder-arg", f"shortlist={SHORTLIST_9B}")}


def quiet_steps(out: Path) -> list[Step]:
    stream = out / "leaves-gpu-work" / "stream.jsonl"
    plugin = "PYTHONPATH=tests"  # the plug-in lives with the tests
    return [Step("probe", (PY, "bench/gpu_quiet.py", "--json", str(out / "gpu-quiet.json"))),
            Step("time", ("sh", "-c", f"{plugin} {PY} -m harness time --decoder retime_decoders:LeavesGpuWork "
                                      f"--model tiny --device cuda --limit 3 -n 64 --legs 2 --force "
                                      f"--out {stream.parent}")),
            # exit 1 = findings: the table shows them
            Step("retime", ("sh", "-c", f"{plugin} {PY} -m audit retime {stream} --trust-plugin --prompts 6"),
                 ok=(0, 1)),
            Step("table", (PY, "bench/retime_table.py", str(stream.parent / "retime.json")))]


def retime_steps(out: Path, configs: list[str]) -> list[Step]:
    steps = [Step("sandbox-cuda", (PY, "-c", SANDBOX_CUDA))]
    for key in configs:
        args = RETIME_9B[key]
        steps.append(Step(f"time-{key}", (PY, "-m", "harness", "time", *args, "--model", "synthetic-9b",
                                          "--prompts", "random-512", "--limit", "3", "-n", "128", "--legs", "2",
                                          "--force", "--out", str(out / key)), done=f"retime/{key}/stream.jsonl"))
        # exit 1 = findings: the table shows them
        # 6 fresh prompts, the fewest with a 95% interval: both retimes fit one 10-minute GPU call
        steps.append(Step(f"retime-{key}", (PY, "-m", "audit", "retime", str(out / key / "stream.jsonl"),
                                            "--prompts", "6"), ok=(0, 1)))
    steps.append(Step("table", ("sh", "-c", f'{PY} bench/retime_table.py "{out}"/*/retime.json')))
    return steps


# replay throughput: one stream, audited at each worker count, the most with one prompt each
REPLAY_WORKERS = (1, 2, 4, 8)
REPLAY_PROMPTS = 8  # all of random-512
# GPU memory of the audit's own process with the one copy of the 9B weights (21.3 GiB), and what
# each worker adds beside it (3.2 GiB: its CUDA context, activations and cache), both rounded up
# (nvidia-smi on an H100, bench/NOTES.md session 30)
REPLAY_WEIGHTS_GIB = 22.0
REPLAY_WORKER_GIB = 3.5


def gpu_memory_gib() -> float | None:
    """The first GPU's memory as nvidia-smi reports it; None without one."""
    if not shutil.which("nvidia-smi"):
        return None
    smi = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True)
    try:
        return float(smi.stdout.split()[0]) / 1024
    except (IndexError, ValueError):
        return None


def replay_workers(most: int, memory_gib: float | None) -> int:
    """At most ``most`` 9B replay workers, and no more than the GPU's memory holds (at least one)."""
    if memory_gib is None:
        return most
    return max(1, min(most, int((memory_gib - REPLAY_WEIGHTS_GIB) // REPLAY_WORKER_GIB)))


def replay_throughput_steps(out: Path, memory_gib: float | None) -> list[Step]:
    fit = replay_workers(max(REPLAY_WORKERS), memory_gib)
    stream = out / "stream" / "stream.jsonl"
    steps = [Step("time", (PY, "-m", "harness", "time", "--decoder", "fast-serial", "--model", "synthetic-9b",
                           "--prompts", "random-512", "--limit", str(REPLAY_PROMPTS), "-n", "96", "--legs", "1",
                           "--force", "--out", str(stream.parent)), done="replay/stream/stream.jsonl")]
    # exit 1 = findings (a timing warning turned failure on a noisy host): the table still compares
    steps += [Step(f"audit-w{n}", (PY, "-m", "audit", "replay", str(stream), "--workers", str(n),
                                   "--out", str(out / f"audit-w{n}.json")), ok=(0, 1))
              for n in sorted({n for n in REPLAY_WORKERS if n <= fit} | {fit})]
    documents = f'"{out}"/audit-w*.json'
    if shutil.which("nvidia-cuda-mps-control"):
        steps.append(mps_replay_step(stream, out, fit))
        documents += f' "{out}"/audit-mps-w{fit}.json'
    steps.append(Step("table", ("sh", "-c", f'{PY} bench/replay_table.py {documents}')))
    return steps


def mps_replay_step(stream: Path, out: Path, workers: int) -> Step:
    """The most workers again with an MPS control daemon of this step's own (its pipe and log
    directories under DIR), so the workers' kernels share the GPU at once instead of taking turns
    by time slice; the daemon is told to quit when the audit ends."""
    pipe, logs = out / "mps" / "pipe", out / "mps" / "log"
    env = f'CUDA_MPS_PIPE_DIRECTORY="{pipe}" CUDA_MPS_LOG_DIRECTORY="{logs}"'
    script = (f'mkdir -p "{pipe}" "{logs}" && export {env} && nvidia-cuda-mps-control -d && '
              f'{PY} -m audit replay "{stream}" --workers {workers} --out "{out}/audit-mps-w{workers}.json"; '
              f'rc=$?; echo quit | nvidia-cuda-mps-control; exit $rc')
    return Step(f"audit-mps-w{workers}", ("sh", "-c", script), ok=(0, 1))


# the sampling sweeps: every (model, sampler, decoder) streamed under its sampler, then replayed
SAMPLING_TEMPERATURES = (0.3, 0.6, 1.0)
SAMPLING_FILTERS = {"plain": "", "filtered": ",top_k=20,top_p=0.95"}


@dataclass(frozen=True)
class SamplingSweep:
    models: tuple[str, ...]
    device: str
    decoders: dict  # tag -> harness time's decoder arguments
    run_args: tuple[str, ...]  # prompts, tokens, legs


SAMPLING_CPU = SamplingSweep(("tiny", "small"), "cpu",
                             {"fast-serial": ("--decoder", "fast-serial"),
                              "spec": ("--decoder", "spec", "--decoder-arg", "depth=3")},
                             ("--limit", "3", "-n", "32", "--legs", "1"))
# the 9B shape's random head drafts nothing worth keeping: the instrument's drafts make every round verify
SAMPLING_9B = SamplingSweep(("synthetic-9b",), "cuda",
                            {"inst-0.7": ("--decoder", "spec-instrument", "--decoder-arg", "alpha=0.7",
                                          "--decoder-arg", f"shortlist={SHORTLIST_9B}")},
                            ("--prompts", "random-512", "--limit", "2", "-n", "64", "--legs", "1"))


def sampling_exact_steps(out: Path, sweep: SamplingSweep) -> list[Step]:
    steps = []
    for model in sweep.models:
        for k, t in enumerate(SAMPLING_TEMPERATURES):
            for tag, filters in SAMPLING_FILTERS.items():
                spec = f"temperature={t:g}{filters},seed={11 + k}"
                for dec, args in sweep.decoders.items():
                    name = f"{model}-T{t:g}-{tag}-{dec}"
                    steps.append(Step(f"time-{name}", (PY, "-m", "harness", "time", *args, "--model", model,
                                                       "--device", sweep.device, *sweep.run_args,
                                                       "--sampling", spec, "--force", "--out", str(out / name)),
                                      done=f"{out.name}/{name}/stream.jsonl"))
        # exit 1 = findings (a timing warning on a loaded CPU, or an inexact stream): the table says which
        steps.append(Step(f"audit-{model}", ("sh", "-c", f'{PY} -m audit replay --device {sweep.device} '
                                                         f'"{out}"/{model}-*/stream.jsonl'), ok=(0, 1)))
    steps.append(Step("table", ("sh", "-c", f'{PY} bench/sampling_exact_table.py "{out}"/*/stream.jsonl')))
    return steps


def xdist_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("xdist") is not None


# pytest as the suite's sets run it: no cache written into the checkout, failures in short form,
# and not -q, so that a log shows how many tests there are and how far a run cut by --timeout got
# (the "[N items]" line and each line's percentage)
PYTEST = (PY, "-m", "pytest", "-p", "no:cacheprovider", "--tb=short")
SHARED_CUDA_PROCESSES = 4  # tests-cuda-shared: test processes on the one GPU at once


def suite_jobs(cpus: int) -> int:
    """pytest processes for the whole suite: half the CPUs, so that the tests that measure a
    machine's load (the retime's) still find cores free beside the others."""
    return max(1, cpus // 2)


def suite_step(cpus: int, xdist: bool, part: str | None = None) -> Step:
    """The whole suite (or one ``part`` of it), its slowest tests named; spread over processes test
    by test (pytest-xdist's worksteal: a file's tests may land on several processes, each building
    the fixtures it needs) where pytest-xdist is installed and more than one process is worth
    starting. -v names each test as it ends, so the log of a run cut by --timeout says which tests
    it never reached."""
    key = f"pytest-{part}" if part else "pytest"
    return pytest_step(key, cpus, xdist, suite_files(part))


# the suite's environment as CI's: the tests' tiny-model ops gain nothing from threads, and on a
# 16-core machine each process a test starts would otherwise run 16, contending with the others'
SUITE_ENV = (("OMP_NUM_THREADS", "1"),)


def pytest_step(key: str, cpus: int, xdist: bool, tests: list[str], failed_before: tuple[str, ...] = ()) -> Step:
    argv = [*PYTEST, "-v", "--durations=15"]
    jobs = suite_jobs(cpus)
    if xdist and jobs > 1:
        argv += ["-n", str(jobs), "--dist", "worksteal"]
    return Step(key, (*argv, *tests), failed_before=failed_before, env=SUITE_ENV)


def suite_rest_step(cpus: int, xdist: bool, part: str | None, logs: Path) -> Step:
    """Under --resume: the step that runs the tests of ``part`` (the whole suite where None) that
    none of its logs in ``logs`` reached, as ``KEY-restN``; kept (its ``done`` the last log) where
    they reached every one; the step as first planned where there is no log yet. Tests a log names
    as failed are not run again: the step carries them and counts as failed."""
    first = suite_step(cpus, xdist, part)
    earlier = part_logs(logs, first.key)
    if not earlier:
        return first
    ids = collected(PYTEST, suite_files(part))
    left, failed = rest(ids, earlier)
    print(f"{first.key}: {len(ids) - len(left)} of {len(ids)} tests ended in {', '.join(p.name for p in earlier)}"
          f"{f', {len(failed)} failed' if failed else ''}; {len(left)} left to run", flush=True)
    if not left:
        return Step(first.key, first.argv, done=f"logs/{earlier[-1].name}", failed_before=tuple(failed))
    return pytest_step(next_rest(earlier, first.key), cpus, xdist, left, tuple(failed))


def set_steps(name: str, out: Path, configs: list[str] | None, resume: bool = False) -> list[Step]:
    if name == "runtime":
        return [Step("runtime", (PY, "bench/runtime_bench.py", "--model", "synthetic-9b", "--positions", "256",
                                 "--lanes", "1,1:unstacked,auto,auto:unstacked", "--json", str(out / "runtime.json")))]
    if name == "probe":
        return [Step("probe", (PY, "bench/exactness_probe.py", "--model", "synthetic-9b",
                               "--prompt", "random-1,random-2,random-3", "-n", "256",
                               "--scenarios", "partial,w2,partial+drafter", "--json", str(out / "probe.json")))]
    if name == "profile":
        return [Step("profile", (PY, "bench/profile_runtime.py", "--json", str(out / "profile.json")))]
    if name == "gemm-stack":
        return [Step("gemm-stack", (PY, "bench/gemm_stack_probe.py", "--json", str(out / "gemm-stack.json")))]
    if name == "table":
        return spec_bench_steps(str(out / "table"), configs or list(TABLE_CONFIGS),
                                ["--model", "synthetic-9b", "--prompts", "random-512", "--limit", "4", "-n", "256",
                                 "--shortlist", SHORTLIST_9B])
    if name == "targets":
        return spec_bench_steps(str(out / "targets"), configs or list(TARGET_CONFIGS),
                                ["--model", "synthetic-9b", "--prompts", "random-512", "--limit", "4", "-n", "256",
                                 "--shortlist", SHORTLIST_9B], new_tokens=TARGET_NEW,
                                workers=replay_workers(4, gpu_memory_gib()))
    if name == "small-real":
        return spec_bench_steps(str(out / "small-real"), configs or list(SMALL_CONFIGS),
                                ["--model", "small", "--prompts", "stdlib-heldout", "--limit", "10", "-n", "256"])
    if name == "context":
        return [Step("context", (PY, "bench/context_bench.py", "--model", "synthetic-9b", "--out", str(out / "context")))]
    if name == "long":
        return [Step("long", (PY, "bench/context_bench.py", "--model", "synthetic-9b", "--contexts", "18384",
                              "-n", "16384", "--control-n", "0", "--alphas", "0.85", "--out", str(out / "long")))]
    if name == "serve":
        return [Step("serve", (PY, "bench/serve_bench.py", "--model", "synthetic-9b", "--decoder", "spec",
                               "--limit", "3", "-n", "256", "--out", str(out / "serve")))]
    if name == "sampling":
        return [Step("sampling", (PY, "bench/sampling_bench.py", "--models", "small,synthetic-9b", "--limit", "3",
                                  "-n", "128", "--reps", "2", "--json", str(out / "sampling.json")))]
    if name == "sampling-exact":
        return sampling_exact_steps(out / "sampling-exact", SAMPLING_CPU)
    if name == "sampling-exact-9b":
        return sampling_exact_steps(out / "sampling-exact-9b", SAMPLING_9B)
    if name == "retime-9b":
        return retime_steps(out / "retime", configs or list(RETIME_9B))
    if name == "replay-throughput":
        return replay_throughput_steps(out / "replay", gpu_memory_gib())
    if name == "quiet":
        return quiet_steps(out / "quiet")
    if name == "cpu-verify":
        return [Step("retimes", (PY, "bench/cpu_verify.py", "retimes", "--out", str(out / "retimes"), "--jobs", "4"),
                     ok=(0, 1)),
                Step("quickstarts", (PY, "bench/cpu_verify.py", "quickstarts", "--out", str(out / "quickstarts"),
                                     "--jobs", "4", "--hogs", "1"), ok=(0, 1))]
    if name == "policy":
        return [Step("policy", (PY, "bench/policy_sim.py", "--costs", POLICY_COSTS, "--alpha", "0.6", "--alpha", "0.7",
                                "--alpha", "0.85", *(a for t in TRACES_9B for a in ("--trace", t)),
                                "--stop", "depth,confidence,oracle", "--prompts", "10", "--json", str(out / "policy.json")))]
    if name == "retime-null":
        return [Step("retime-null", (PY, "bench/retime_null.py", "--trials", "1000"))]
    if name == "tests-cuda":
        return [Step("pytest", (PY, "-m", "pytest", "-q", "-m", "cuda"))]
    if name == "tests-cuda-shared":
        # -v names the process each test ran in, and in what order: a failure that depends on what
        # its process ran before can then be replayed in that order
        return [Step("pytest", (*PYTEST, "-v", "-m", "cuda", "-n", str(SHARED_CUDA_PROCESSES), "--dist", "worksteal"))]
    if name == "suite":
        cpus, xdist = os.cpu_count() or 1, xdist_installed()
        if resume:  # each part's rest: the tests its logs in DIR never reached
            return [suite_rest_step(cpus, xdist, part, out / "logs") for part in configs or [None]]
        return [suite_step(cpus, xdist, part) for part in configs] if configs else [suite_step(cpus, xdist)]
    raise KeyError(name)


# sets whose steps need a CUDA GPU (refused up front on a machine without one)
CUDA_SETS = ("runtime", "probe", "profile", "gemm-stack", "table", "targets", "context", "long", "serve", "sampling",
             "sampling-exact-9b", "retime-9b", "quiet", "replay-throughput", "tests-cuda", "tests-cuda-shared")
SETS = ("runtime", "probe", "profile", "gemm-stack", "table", "targets", "small-real", "context", "long", "serve", "sampling", "sampling-exact",
        "sampling-exact-9b", "retime-9b", "quiet",
        "replay-throughput",
        "cpu-verify", "retime-null", "policy", "tests-cuda", "tests-cuda-shared", "suite")
XDIST_SETS = ("tests-cuda-shared",)  # sets that need pytest-xdist (`suite` runs in one process without it)
CONFIGURABLE = {"table": TABLE_CONFIGS, "targets": TARGET_CONFIGS, "small-real": SMALL_CONFIGS, "retime-9b": tuple(RETIME_9B),
                "suite": SUITE_PARTS}


def run_step(step: Step, log_path: Path, timeout: float | None) -> tuple[int | None, float]:
    """Runs one step, copying its output line by line to the terminal and its log. Returns its
    exit code (None when killed for running past ``timeout``) and its wall time."""
    print(f"\n$ {' '.join(step.argv)}", flush=True)
    t0 = time.monotonic()
    killed = threading.Event()
    with open(log_path, "w", encoding="utf-8") as log:
        # own session: on a timeout the whole process group goes (a harness run spawns children)
        proc = subprocess.Popen(step.argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **dict(step.env)})

        def kill():
            killed.set()
            stop_group(proc.pid, lambda grace: wait_for(proc, grace))

        timer = threading.Timer(timeout, kill) if timeout else None
        if timer:
            timer.start()
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        rc = proc.wait()
        if timer:
            timer.cancel()
    return (None if killed.is_set() else rc), time.monotonic() - t0


STOP_GRACE_S = 20.0  # an interrupted step's time to say what it has (pytest: its failures so far)


def stop_group(pgid: int, gone_within, grace: float = STOP_GRACE_S) -> None:
    """Stop a step past its time: SIGINT to its process group first, as Ctrl-C would, so that
    pytest prints the failures it has met and a harness or audit run removes what it had begun;
    SIGKILL to the group if the step has not ended ``grace`` seconds later (``gone_within(grace)``
    waits that long and says whether it ended)."""
    try:
        os.killpg(pgid, signal.SIGINT)
        if gone_within(grace):
            return
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass


def wait_for(proc: subprocess.Popen, seconds: float) -> bool:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


def last_table(text: str) -> str:
    """The last block of consecutive markdown table lines in ``text``, else its last line."""
    blocks, current = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            blocks.append(current)
            current = []
    if current:
        blocks.append(current)
    if blocks:
        return "\n".join(blocks[-1])
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def host_description() -> str:
    lines = [f"host {platform.node()}", f"python {platform.python_version()}"]
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        lines += smi.stdout.strip().splitlines()
    lines.append(time.strftime("started %Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    return "\n".join(lines) + "\n"


def positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, not {text}")
    return value


def cuda_available() -> bool:
    import torch  # only for the sets that need a GPU: a CPU set starts without it

    return torch.cuda.is_available()


def check_out(out: Path) -> str | None:
    """Why ``--out`` cannot hold a set's results, or None: it must be a directory that takes files."""
    if out.exists() and not out.is_dir():
        return f"--out {out} exists and is not a directory"
    try:
        out.mkdir(parents=True, exist_ok=True)
        try_new_file(out)
    except OSError as exc:
        return f"--out {out}: cannot write there ({exc.strerror or exc})"
    return None


def check_archive(archive: Path) -> str | None:
    """Why ``--archive`` cannot be written at the end, or None; checked before any step runs."""
    if archive.exists():
        return f"--archive {archive} exists: give a new file name (an existing file is never overwritten)"
    parent = nearest_existing(archive.parent)
    if not parent.is_dir():
        return f"--archive {archive}: {parent} is not a directory"
    try:
        try_new_file(parent)
    except OSError as exc:
        return f"--archive {archive}: cannot write under {parent} ({exc.strerror or exc})"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("set", nargs="?", choices=SETS, metavar="SET",
                    help=f"one of: {', '.join(SETS)} (these need a CUDA GPU: {', '.join(CUDA_SETS)})")
    ap.add_argument("--out", type=Path, help="output directory (bench/out/NAME is ignored by git)")
    ap.add_argument("--configs", default=None,
                    help="table / targets / small-real / retime-9b: a comma-separated subset of the configurations; "
                         "suite: 1of2 or 2of2 (every other test file), or 1of3, 2of3 or 3of3 (every third)")
    ap.add_argument("--timeout", type=positive_seconds, default=None, metavar="SECONDS",
                    help="limit per step: then interrupted (SIGINT), and killed 20 s later if still running")
    ap.add_argument("--resume", action="store_true",
                    help="skip configurations whose stream is already in --out; suite: run only the tests that "
                         "the part's logs in --out never reached (as STEP-restN), none that a log names as failed")
    ap.add_argument("--archive", type=Path, default=None, metavar="FILE.tgz",
                    help="pack --out into this new file at the end (an existing file is never overwritten)")
    ap.add_argument("--list", action="store_true", help="print every set's commands and exit")
    args = ap.parse_args(argv)

    if args.list:
        for name in SETS:
            print(f"{name}:")
            for step in set_steps(name, Path("DIR"), None):
                print("   ", " ".join(step.argv))
        return 0
    if args.set is None or args.out is None:
        ap.error("SET and --out are required (or --list)")
    configs = None
    if args.configs is not None:
        if args.set not in CONFIGURABLE:
            ap.error(f"--configs applies to {', '.join(CONFIGURABLE)} only")
        configs = [c for c in args.configs.split(",") if c]
        if not configs:
            ap.error("--configs names no configuration")
        unknown = [c for c in configs if c not in CONFIGURABLE[args.set]]
        if unknown:
            ap.error(f"unknown configs for {args.set}: {', '.join(unknown)}; "
                     f"known: {', '.join(CONFIGURABLE[args.set])}")

    if args.set in CUDA_SETS and not cuda_available():
        ap.error(f"set {args.set} needs a CUDA GPU, and this machine has none "
                 f"(sets for the CPU: {', '.join(n for n in SETS if n not in CUDA_SETS)})")
    if args.set in XDIST_SETS and not xdist_installed():
        ap.error(f"set {args.set} runs pytest across processes, which needs pytest-xdist: "
                 "pip install -e '.[test]'")
    out = args.out.resolve()
    problem = (check_archive(args.archive.resolve()) if args.archive else None) or check_out(out)
    if problem:
        ap.error(problem)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "host.txt").write_text(host_description(), encoding="utf-8")
    print((out / "host.txt").read_text(), end="", flush=True)

    try:
        steps = set_steps(args.set, out, configs, args.resume)
    except RuntimeError as exc:  # the suite's tests could not be collected to find a part's rest
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results = []  # (key, status, seconds, succeeded)
    for step in steps:
        before = f" ({len(step.failed_before)} failed before)" if step.failed_before else ""
        if args.resume and step.done and (out / step.done).is_file():
            results.append((step.key, f"kept (--resume){before}", 0.0, not step.failed_before))
            continue
        rc, seconds = run_step(step, out / "logs" / f"{step.key}.log", args.timeout)
        status = "timed out" if rc is None else f"exit {rc}"
        results.append((step.key, status + before, seconds, rc in step.ok and not step.failed_before))

    if args.archive:
        args.archive.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(args.archive, "w:gz") as tar:
            tar.add(out, arcname=out.name)

    print(f"\n== {args.set}: steps")
    width = max(28, *(len(r[0]) for r in results))
    for key, status, seconds, succeeded in results:
        print(f"  {key:{width}s} {status:16s} {seconds:7.1f} s{'' if succeeded else '  FAILED'}")
    for step in steps:
        for test in step.failed_before:
            print(f"  {step.key}: failed in an earlier log: {test}")
    final = out / "logs" / f"{steps[-1].key}.log"
    print(f"\n== {args.set}: table ({final.relative_to(out)})")
    print(last_table(final.read_text(encoding="utf-8")) if final.is_file() else "(final step did not run)")
    return 0 if all(r[3] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
