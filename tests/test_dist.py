"""``harness time`` and ``audit replay`` under torchrun: two CPU processes on gloo.

Launched for real with ``python -m torch.distributed.run --nproc-per-node 2`` (torchrun). The
merged stream must be well formed, list the prompts in order, and hold the same token streams as
a one-process run; the sharded audit must write the same document as a one-process audit of the
same file (apart from the replay's timing and world size); a rank that raises, hangs or dies must
fail the whole run with one line naming the rank and prompt, and leave no file behind.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from audit import checks
from audit.stream import BadInput, PromptRun, Run, validate_header
from audit_helpers import read_records, run_audit, write_records
from fixtures.prompts import DEV_PROMPTS
from core import dist
from core.errors import UserError
from core.schema import abba_roles, read_stream

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
# every default that differs on a GPU machine is pinned: the device and N
RUN_ARGS = ["--model", "tiny", "--device", "cpu", "--limit", "3", "-n", "12", "--legs", "2"]
LAUNCH_TIMEOUT_S = 300
TIMING_KEYS = ("seconds", "ms_per_token", "world_size", "ranks")  # the replay fields that may differ
TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")


# --------------------------------------------------------------------------- launching


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), str(REPO), os.environ.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"  # tiny model: threads only contend on 2 cores
    env["CUDA_VISIBLE_DEVICES"] = ""  # every rank on the CPU (gloo only), on a GPU machine too
    return {**env, **extra}


def torchrun(target: list[str], cwd: Path, **extra_env) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --nproc-per-node 2 ... TARGET`` on the CPU (gloo)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), *target]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=launch_env(**extra_env),
                          timeout=LAUNCH_TIMEOUT_S)


def harness_time(out: Path, decoder: str, *extra: str, script: str | None = None,
                 **extra_env) -> subprocess.CompletedProcess:
    target = [script] if script else ["-m", "harness"]
    return torchrun([*target, "time", *RUN_ARGS, "--decoder", decoder, "--out", str(out), *extra],
                    out.parent, **extra_env)


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error: ")]


def leftovers(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


def without_timing(doc: dict) -> dict:
    doc = json.loads(json.dumps(doc))
    for key in TIMING_KEYS:
        doc["replay"].pop(key)
    doc.pop("stream")
    return doc


# --------------------------------------------------------------------------- runs shared by the tests


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sharded") / "run"
    proc = harness_time(out, "fast-serial")
    assert proc.returncode == 0, proc.stderr
    assert leftovers(out) == ["stream.jsonl"]
    return out / "stream.jsonl"


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    from harness.cli import main

    out = tmp_path_factory.mktemp("single") / "run"
    result = CliRunner().invoke(main, ["time", *RUN_ARGS, "--decoder", "fast-serial", "--out", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return out / "stream.jsonl"


def records_by_type(path: Path) -> dict[str, list[dict]]:
    records, _ = read_stream(path)
    out = {}
    for r in records:
        out.setdefault(r["type"], []).append(r)
    return out


# --------------------------------------------------------------------------- harness time


def test_merged_stream_is_well_formed(sharded):
    records, integrity = read_stream(sharded)
    assert integrity == {"present": True, "count_ok": True, "sha256_ok": True}
    header = records[0]
    assert header["world_size"] == 2
    assert [r["rank"] for r in header["ranks"]] == [0, 1]
    for entry in header["ranks"]:
        assert entry["device"] == header["device"] and entry["device"]["type"] == "cpu"
        assert set(entry) == {"rank", "device", "resident_bytes", "candidate_config"}
    assert header["command"][:2] == ["harness", "time"]

    # prompts in their original order, each: prompt, 2L legs in ABBA order, summary; then the end
    body, per_prompt = records[1:-1], 1 + 2 * 2 + 1
    assert [r["id"] for r in body[::per_prompt]] == [p["id"] for p in DEV_PROMPTS[:3]]
    last_end = {0: 0.0, 1: 0.0}
    for i in range(3):
        prompt, legs, summary = body[i * per_prompt], body[i * per_prompt + 1:(i + 1) * per_prompt - 1], \
            body[(i + 1) * per_prompt - 1]
        assert prompt["type"] == "prompt" and prompt["rank"] == i % 2
        assert [r["role"] for r in legs] == abba_roles(2)
        assert all(r["rank"] == i % 2 and r["prompt_id"] == prompt["id"] for r in legs)
        assert summary["type"] == "summary" and summary["prompt_id"] == prompt["id"]
        for r in legs:  # each rank's legs follow one another on that rank's clock
            assert r["t_start"] >= last_end[r["rank"]]
            last_end[r["rank"]] = r["t_end"]
    assert records[-1]["type"] == "end"


def test_merged_stream_holds_the_one_process_token_streams(sharded, single):
    merged, alone = records_by_type(sharded), records_by_type(single)
    assert [p["id"] for p in merged["prompt"]] == [p["id"] for p in alone["prompt"]]
    assert [p["token_ids"] for p in merged["prompt"]] == [p["token_ids"] for p in alone["prompt"]]
    key = lambda r: (r["prompt_id"], r["role"], r["leg"])  # noqa: E731
    assert {key(r): r["tokens"] for r in merged["leg"]} == {key(r): r["tokens"] for r in alone["leg"]}
    # the one-process run is unchanged apart from the header's world_size and ranks
    header = alone["header"][0]
    assert header["world_size"] == 1 and header["ranks"] == [{"rank": 0, "device": header["device"]}]
    assert not any("rank" in r for r in alone["prompt"] + alone["leg"])


def test_failing_rank_fails_the_run(tmp_path):
    out = tmp_path / "run"
    proc = harness_time(out, "dist_decoders:Raises")
    assert proc.returncode != 0
    assert error_lines(proc) == ["error: rank 1 failed on prompt 'prose-letter': RuntimeError: deliberate failure "
                                 "on the target prompt; nothing was written"], proc.stderr
    assert "[rank 1] Traceback" in proc.stderr  # the failing rank shows where
    assert leftovers(out) == []  # neither stream.jsonl nor a temporary file


def test_hung_rank_fails_the_run(tmp_path):
    """Launched through tests/dist_decoders.py, whose results exchange calls a rank hung after
    HANG_LIMIT_S without progress (1 s) while every other wait keeps --dist-timeout."""
    from dist_decoders import HANG_LIMIT_S

    out = tmp_path / "run"
    proc = harness_time(out, "dist_decoders:Hangs", script=str(TESTS / "dist_decoders.py"))
    assert proc.returncode != 0
    assert (f"error: rank 1 made no progress for {HANG_LIMIT_S:g} s (--dist-timeout) while at prompt "
            "'prose-letter' (1/1): it hung or died; nothing was written") in error_lines(proc), proc.stderr
    assert leftovers(out) == []


def test_dead_rank_fails_the_run(tmp_path):
    """A rank gone without a word: torchrun stops rank 0, which names where that rank was."""
    out = tmp_path / "run"
    proc = harness_time(out, "dist_decoders:Dies")
    assert proc.returncode != 0
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("error: stopped by the launcher"), proc.stderr
    assert "unfinished: rank 1 (at prompt 'prose-letter' (1/1))" in lines[0]
    assert re.search(r"exitcode\s*:\s*3\b", proc.stderr)  # torchrun's own summary gives the dead rank's code
    assert leftovers(out) == []


# --------------------------------------------------------------------------- audit replay


def sharded_audit(stream: Path, out: Path, script: str | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    target = [script] if script else ["-m", "audit"]
    proc = torchrun([*target, "replay", str(stream), "--device", "cpu", "--out", str(out)], stream.parent)
    return proc, json.loads(out.read_text()) if out.exists() else None


def test_sharded_audit_equals_the_one_process_audit(sharded):
    result, alone = run_audit(sharded, out=sharded.parent / "audit-1.json")
    assert result.exit_code == 0, result.output
    assert (alone["verdict"], alone["exact"], alone["consistent"]) == ("pass", True, True)
    assert alone["replay"]["world_size"] == 1

    proc, doc = sharded_audit(sharded, sharded.parent / "audit-2.json")
    assert proc.returncode == 0, proc.stderr
    assert doc["replay"]["world_size"] == 2 and [r["rank"] for r in doc["replay"]["ranks"]] == [0, 1]
    assert doc["replay"]["tokens_replayed"] == alone["replay"]["tokens_replayed"]
    assert without_timing(doc) == without_timing(alone)
    assert "verdict: PASS" in proc.stdout


def test_sharded_audit_reports_the_same_findings(sharded, tmp_path):
    """A divergence on rank 1's prompt and a leg moved to the other rank: the same findings."""
    stream = tmp_path / "stream.jsonl"
    records = read_records(sharded)
    leg = next(r for r in records if r["type"] == "leg" and r["prompt_id"] == "prose-letter"
               and r["role"] == "candidate" and r["leg"] == 1)
    leg["tokens"][5] = (leg["tokens"][5] + 1) % 512
    summary = next(r for r in records if r["type"] == "summary" and r["prompt_id"] == "prose-letter")
    summary["same_tokens_as_control"] = False  # as the harness would have written it
    third = next(r for r in records if r["type"] == "leg" and r["prompt_id"] == "code-python")
    third["rank"] = 1
    write_records(stream, records)

    result, alone = run_audit(stream, out=tmp_path / "audit-1.json")
    assert result.exit_code == 1
    found = {(f["check"], f["prompt_id"]) for f in alone["findings"] if f["severity"] == "fail"}
    assert found == {("exactness", "prose-letter"), ("tamper", "code-python")}
    proc, doc = sharded_audit(stream, tmp_path / "audit-2.json")
    assert proc.returncode != 0 and "verdict: FAIL" in proc.stdout, proc.stderr
    assert without_timing(doc) == without_timing(alone)


def test_failing_audit_rank_fails_the_audit(sharded, tmp_path):
    out = tmp_path / "audit.json"
    proc, doc = sharded_audit(sharded, out, str(TESTS / "dist_audit_fault.py"))
    assert proc.returncode != 0 and doc is None
    assert error_lines(proc) == ["error: rank 1 failed on prompt 'prose-letter': RuntimeError: deliberate replay "
                                 "failure; nothing was written"], proc.stderr
    assert leftovers(tmp_path) == []


def test_file_without_world_size_audits_as_one_process(single, tmp_path):
    """Streams written before the header had world_size and ranks are one-process runs."""
    stream = tmp_path / "stream.jsonl"
    records = read_records(single)
    del records[0]["world_size"], records[0]["ranks"]
    write_records(stream, records)
    result, doc = run_audit(stream)
    assert result.exit_code == 0, result.output
    assert doc["verdict"] == "pass"


def test_module_entries():
    for module in ("harness", "audit"):
        proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                              env=launch_env(), timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(f"Usage: python -m {module} ")
    proc = subprocess.run([sys.executable, "-m", "harness", "time", "--help"], capture_output=True, text=True,
                          env=launch_env(), timeout=120)
    assert "--dist-timeout" in proc.stdout and "torchrun" in proc.stdout


# --------------------------------------------------------------------------- pure parts


def test_topology_from_environment():
    assert dist.topology({}) == dist.Topology(0, 1, 0)
    assert not dist.topology({"WORLD_SIZE": "1", "RANK": "0"}).active
    topo = dist.topology({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"})
    assert (topo.rank, topo.world_size, topo.local_rank, topo.active, topo.main) == (3, 4, 1, True, False)


@pytest.mark.parametrize("n,world", [(0, 2), (1, 2), (5, 2), (7, 3), (3, 4)])
def test_round_robin_shards_and_merges_back(n, world):
    items = list(range(n))
    shards = [dist.shard(items, dist.Topology(r, world, r)) for r in range(world)]
    assert all(dist.owner(i, world) == r for r, s in enumerate(shards) for i in s)
    assert dist.unshard(shards) == items


def test_rank_device():
    one, two = dist.Topology(), dist.Topology(1, 2, 1)
    assert dist.rank_device("cuda:1", one) == "cuda:1"  # one process: untouched
    assert dist.rank_device("cpu", two) == "cpu"
    with pytest.raises(UserError, match="cuda:LOCAL_RANK"):
        dist.rank_device("cuda:0", two)


def leg(pid, role, k, order, t, rank):
    return {"type": "leg", "prompt_id": pid, "role": role, "leg": k, "order": order, "t_start": t,
            "t_end": t + 1.0, "wall_s": 1.0, "tokens": [1], "peak_mem_bytes": None, "rank": rank}


def sharded_run(ranks_of_prompts: list[int], world: int = 2, peaks=None, resident=None) -> Run:
    """Prompts whose legs ran on their rank's clock, each rank's clock starting at 0."""
    clocks, prompts = {r: 0.0 for r in range(world)}, []
    for i, rank in enumerate(ranks_of_prompts):
        p = PromptRun(f"p{i}", 2 + i, [5, 6], rank)
        for order, role in enumerate(abba_roles(1)):
            p.legs.append(leg(p.id, role, 0, order, clocks[rank], rank))
            if peaks:
                p.legs[-1]["peak_mem_bytes"] = peaks[role]
            clocks[rank] += 1.5
        prompts.append(p)
    ranks = [{"rank": r, "device": {"type": "cpu", "name": "cpu"}} for r in range(world)]
    if resident:
        for r, res in enumerate(resident):
            ranks[r]["resident_bytes"] = res
    header = {"world_size": world, "ranks": ranks, "legs": 1, "max_new_tokens": 4,
              "memory": {"resident_bytes": resident[0] if resident else None}}
    return Run(Path("x"), header, prompts, None, {})


def test_each_rank_has_its_own_clock():
    run = sharded_run([0, 1, 0, 1])
    assert checks.check_ranks(run) == []
    assert checks.check_prompt_sequence(run.prompts, run.world_size) == []
    assert checks.check_prompt_sequence(run.prompts)  # as one clock the intervals would overlap


def test_prompt_or_leg_on_the_wrong_rank_is_tamper():
    run = sharded_run([0, 0, 1, 1])  # prompt 1 belongs to rank 1, prompt 2 to rank 0
    found = checks.check_ranks(run)
    # each prompt's record and its legs
    assert [f["prompt_id"] for f in found] == ["p1", "p1", "p2", "p2"] and {f["check"] for f in found} == {"tamper"}
    run = sharded_run([0, 1])
    run.prompts[1].legs[0]["rank"] = 0
    found = checks.check_ranks(run)
    assert len(found) == 1 and found[0]["legs"] == ["control#0"]


def test_resident_bytes_per_rank():
    """Each rank's legs are measured against the decoders that rank prepared."""
    resident = [{"control": 100, "candidate": 500}, {"control": 300, "candidate": 900}]
    run = sharded_run([0, 1], peaks={"control": 1000, "candidate": 1200}, resident=resident)
    assert checks.check_resident(run) == []
    own = {r: checks.own_peak_bytes(run.prompts[r].role_legs("control"), "control", run.header) for r in (0, 1)}
    assert own == {0: 500, 1: 100}  # 1000 less rank 0's candidate 500, less rank 1's 900
    run.prompts[1].legs[0]["peak_mem_bytes"] = 800  # below rank 1's resident candidate: impossible
    assert checks.check_resident(run)


def test_recorded_devices_must_all_match_the_replay():
    run = sharded_run([0, 1])
    run.header["device"] = {"type": "cpu", "name": "cpu"}
    assert checks.check_devices(run.header, [{"type": "cpu", "name": "cpu"}] * 2, False) == []
    run.header["ranks"][1]["device"] = {"type": "cuda", "name": "NVIDIA H200"}
    with pytest.raises(BadInput):
        checks.check_devices(run.header, [{"type": "cpu", "name": "cpu"}], False)


@pytest.mark.parametrize("edit", [
    lambda h: h.update(world_size=0),
    lambda h: h.update(world_size="2"),
    lambda h: h["ranks"].pop(),
    lambda h: h["ranks"][1].update(rank=0),
    lambda h: h["ranks"][1].update(rank=True),
    lambda h: h["ranks"][0].pop("device"),
])
def test_malformed_ranks_are_bad_input(edit):
    header = {"max_new_tokens": 4, "legs": 1, "model": {}, "device": {"type": "cpu", "name": "cpu"},
              "control": {"name": "serial"}, "candidate": {"name": "x"}, **sharded_run([0, 1]).header}
    validate_header(header)
    edit(header)
    with pytest.raises(BadInput):
        validate_header(header)
