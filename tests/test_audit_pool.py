"""``audit replay --workers N`` (``audit.pool``): N processes on one device, each with its own
pristine serial path, replay a stream's prompts at once. Each walk's arithmetic is a lone
replay's, so audit.json is the same document field by field (apart from the replay's timing and
its worker count), every replayed logit the same value; a worker that fails, hangs or dies fails
the audit (exit 2) with one line naming the worker and prompt, and nothing is written.

On tiny, on the CPU: 2 workers against 1 (and on a GPU, marked ``cuda``). The workers are spawned processes; a fault is patched
into them by running the audit through tests/pool_audit_fault.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from audit_helpers import find_leg, read_records, run_audit, run_harness, write_records

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
# the replay fields a pool may change: its timing and its worker count
POOL_KEYS = ("seconds", "ms_per_token", "workers")
FAULT_TIMEOUT_S = 300


def differences(a, b, path: str = "") -> list[str]:
    """Every path at which two JSON documents differ, field by field."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in one" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            out += differences(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if (a == b and type(a) is type(b)) else [f"{path}: {a!r} vs {b!r}"]


def without_pool(doc: dict) -> dict:
    doc = json.loads(json.dumps(doc))
    for key in POOL_KEYS:
        doc["replay"].pop(key)
    return doc


@pytest.fixture(scope="module")
def exact_stream(tmp_path_factory) -> Path:
    return run_harness(tmp_path_factory.mktemp("pool") / "exact", "fast-serial", limit=3, n=12, legs=2)


@pytest.fixture(scope="module")
def diverging_stream(exact_stream, tmp_path_factory) -> Path:
    """A wrong token in prose-letter (the second worker's first prompt) and a candidate leg of
    code-python cut short: an exactness and a stop divergence, each with its logits."""
    stream = tmp_path_factory.mktemp("pool") / "diverging" / "stream.jsonl"
    stream.parent.mkdir()
    records = read_records(exact_stream)
    leg = find_leg(records, "prose-letter", "candidate", 1)
    leg["tokens"][5] = (leg["tokens"][5] + 1) % 512
    cut = find_leg(records, "code-python", "candidate", 0)
    cut["tokens"] = cut["tokens"][:7]
    for r in records:
        if r["type"] == "summary" and r["prompt_id"] in ("prose-letter", "code-python"):
            r["same_tokens_as_control"] = False  # as the harness would have written it
    write_records(stream, records)
    return stream


def audit_both(stream: Path, tmp_path: Path) -> tuple[dict, dict]:
    """audit.json of a lone replay and of one on 2 workers."""
    docs = []
    for workers in (1, 2):
        result, doc = run_audit(stream, "--workers", str(workers), out=tmp_path / f"audit-{workers}.json")
        assert result.exit_code in (0, 1) and doc is not None, result.output
        assert doc["replay"]["workers"] == workers
        docs.append(doc)
    return docs[0], docs[1]


def test_two_workers_write_the_lone_replays_audit(exact_stream, tmp_path):
    alone, pooled = audit_both(exact_stream, tmp_path)
    assert (alone["verdict"], alone["exact"]) == ("pass", True)
    assert differences(without_pool(alone), without_pool(pooled)) == []
    assert pooled["replay"]["tokens_replayed"] == alone["replay"]["tokens_replayed"] > 0


def test_two_workers_find_the_same_divergences_and_logits(diverging_stream, tmp_path):
    alone, pooled = audit_both(diverging_stream, tmp_path)
    assert alone["verdict"] == "fail"
    assert differences(without_pool(alone), without_pool(pooled)) == []
    by_id = {e["id"]: e for e in pooled["prompts"]}
    found = {e["id"]: e["first_divergence"] for e in alone["prompts"] if e["first_divergence"]}
    assert set(found) == {"prose-letter", "code-python"}
    for pid, div in found.items():  # the replayed logits at each divergence, value for value
        assert div["top5"] and by_id[pid]["first_divergence"]["top5"] == div["top5"]
        assert by_id[pid]["first_divergence"]["margin"] == div["margin"]


def test_pool_walks_equal_this_process_walks_to_the_last_logit(diverging_stream):
    """Below audit.json: every PromptReplay, each divergence's own emitted-token logit included
    (audit.json reports only the margin and the top-5), and the greedy path walked."""
    from audit.pool import PoolOptions, WorkerPool
    from audit.replay import replay_run, walk_here
    from audit.stream import load_run
    from core.models import load_model

    run = load_run(diverging_stream)
    model = load_model("tiny", "cpu")
    alone, tokens, _ = replay_run(walk_here(model), run)
    with WorkerPool(model, PoolOptions(workers=2)) as pool:
        pooled, pooled_tokens, _ = replay_run(pool.walk, run)
    assert list(pooled) == list(alone) == [p.id for p in run.prompts]  # file order, however they finished
    assert pooled == alone and pooled_tokens == tokens
    logits = [d.emitted_logit for rep in pooled.values() for d in rep.divergences.values()]
    assert any(v is not None for v in logits)


def test_workers_read_the_audits_own_weights_not_copies(exact_stream):
    """On the CPU the weights the workers were sent live in shared memory afterwards: the parent's own
    tensors, moved there once, not a copy per worker; the model still serves the audit after the pool."""
    from audit.pool import PoolOptions, WorkerPool
    from audit.replay import replay_run, walk_here
    from audit.stream import load_run
    from core.models import load_model, weights_fingerprint

    run = load_run(exact_stream)
    model = load_model("tiny", "cpu")
    before = {name: t.data_ptr() for name, t in model.backbone.state_dict().items()}
    assert not any(t.is_shared() for t in model.backbone.state_dict().values())
    with WorkerPool(model, PoolOptions(workers=2)) as pool:
        tensors = [*model.backbone.state_dict().values(), *model.mtp.state_dict().values()]
        assert all(t.is_shared() for t in tensors)
        pooled, _, _ = replay_run(pool.walk, run)
    assert weights_fingerprint(model.backbone, model.mtp) == model.identity["weights_fingerprint"]
    assert replay_run(walk_here(model), run)[0] == pooled
    assert {name: t.data_ptr() for name, t in model.backbone.state_dict().items()}.keys() == before.keys()


def test_several_streams_on_workers_write_their_lone_audits(exact_stream, diverging_stream, tmp_path):
    from audit.cli import main as audit_main

    streams = []
    for name, src in (("a", exact_stream), ("b", diverging_stream)):
        (tmp_path / name).mkdir()
        streams.append(tmp_path / name / "stream.jsonl")
        streams[-1].write_bytes(src.read_bytes())
    alone = [run_audit(s, out=s.parent / "alone.json")[1] for s in streams]
    result = CliRunner().invoke(audit_main, ["replay", *map(str, streams), "--workers", "2"])
    assert result.exit_code == 1, result.output
    for s, doc in zip(streams, alone):
        pooled = json.loads((s.parent / "audit.json").read_text())
        assert pooled["replay"]["workers"] == 2
        assert differences(without_pool(doc), without_pool(pooled)) == []


def test_workers_are_refused_under_torchrun(exact_stream, tmp_path, monkeypatch):
    for key, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(key, value)
    result, doc = run_audit(exact_stream, "--workers", "2", out=tmp_path / "audit.json")
    assert result.exit_code == 2 and doc is None
    assert "under torchrun every rank has a device of its own" in result.output


# --------------------------------------------------------------------------- a worker that fails


def faulty_audit(stream: Path, out: Path, fault: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "POOL_FAULT": fault, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, str(TESTS / "pool_audit_fault.py"), "replay", str(stream), "--device", "cpu",
           "--workers", "2", "--out", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out.parent, timeout=FAULT_TIMEOUT_S)


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize("fault, line", [
    ("raise", "error: replay worker 1 failed on prompt 'prose-letter': RuntimeError: deliberate replay failure; "
              "nothing was written"),
    ("hang", "error: replay worker 1 made no progress for 2 s on prompt 'prose-letter': it hung; nothing was written"),
    ("die", "error: replay worker 1 exited (exit code 3) on prompt 'prose-letter'; nothing was written"),
    ("hang-start", "error: replay worker 1 was not ready after 2 s while taking the model: it starts too slowly "
                   "or hung; nothing was written"),
    ("oom", "error: replay worker 1 failed while taking the model: CUDA out of memory. Tried to allocate 96.00 MiB: "
            "each of the 2 workers holds its own activations and cache on cpu; use fewer --workers; nothing was written"),
    ("weights", "error: replay worker 1 failed while taking the model: computes with other weights than the audit's "
                "(identity weights_fingerprint: "),
], ids=["raise", "hang", "die", "hang-start", "oom", "weights"])
def test_a_failing_worker_fails_the_audit_and_writes_nothing(exact_stream, tmp_path, fault, line):
    proc = faulty_audit(exact_stream, tmp_path / "audit.json", fault)
    assert proc.returncode == 2, proc.stderr
    if fault == "weights":  # the fingerprints themselves follow
        assert len(error_lines(proc)) == 1 and error_lines(proc)[0].startswith(line), proc.stderr
        assert error_lines(proc)[0].endswith("; nothing was written") and "config_sha256" not in proc.stderr
    else:
        assert error_lines(proc) == [line], proc.stderr
    assert "Traceback" not in proc.stderr.replace("[worker 1] Traceback", "")  # only the worker's own
    if fault == "oom":  # not a bug: no traceback at all
        assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_workers_on_one_gpu_equal_the_lone_replay_bit_for_bit(diverging_stream, tmp_path):
    """Two workers sharing one GPU: every PromptReplay (each emitted-token logit, top-5 and margin)
    and audit.json equal a lone replay's on that GPU. The CPU-recorded stream is replayed with
    --allow-device-mismatch: where the GPU's greedy path parts from the CPU's, there are more
    divergences, and so more logits, to compare."""
    from audit.pool import PoolOptions, WorkerPool
    from audit.replay import replay_run, walk_here
    from audit.stream import load_run
    from core.models import load_model

    run = load_run(diverging_stream)
    model = load_model("tiny", "cuda")
    alone, _, _ = replay_run(walk_here(model), run)
    with WorkerPool(model, PoolOptions(workers=2)) as pool:
        pooled, _, _ = replay_run(pool.walk, run)
    assert pooled == alone

    docs = []
    for workers in (1, 2):
        result, doc = run_audit(diverging_stream, "--device", "cuda", "--allow-device-mismatch", "--workers",
                                str(workers), out=tmp_path / f"audit-{workers}.json")
        assert result.exit_code in (0, 1) and doc is not None, result.output
        docs.append(doc)
    assert differences(without_pool(docs[0]), without_pool(docs[1])) == []


def test_no_more_workers_start_than_there_are_walks(exact_stream, tmp_path):
    """Each worker is a whole model: --workers 9 on a stream of 3 prompts starts 3."""
    result, doc = run_audit(exact_stream, "--workers", "9", out=tmp_path / "audit-9.json")
    assert result.exit_code == 0 and doc["replay"]["workers"] == 3, result.output
    assert "--workers 9: 3 walk(s) to hand out, so 3 worker(s)" in result.output
    assert "starting 3 replay workers" in result.output


def test_shared_replays_share_out_the_wall_time_not_the_walks_summed():
    """Workers walk at once, so walks' own seconds add up to more than the replay took: each run's
    seconds are its share of the wall, split by its walks' seconds."""
    from types import SimpleNamespace as NS

    from audit.replay import Walked, replay_shared

    def leg(role, tokens):
        return {"role": role, "leg": 0, "tokens": tokens}

    runs = [NS(prompts=[NS(id="a", token_ids=[1, 2], legs=[leg("control", [5, 6])]),
                        NS(id="b", token_ids=[3], legs=[leg("control", [7, 8])])], max_new_tokens=2, sampler=None),
            NS(prompts=[NS(id="c", token_ids=[4], legs=[leg("control", [9, 9])])], max_new_tokens=2, sampler=None)]

    def walker(walks, bar=None, log=None):  # three walks of 30 s each, said to have run at once
        for k, walk in enumerate(walks):
            yield k, Walked({s: None for s in walk.streams}, list(walk.streams[0]), 30.0, worker=k)

    out = replay_shared(walker, runs)
    assert [tokens for _, tokens, _ in out] == [4, 2]
    first, second = out[0][2], out[1][2]
    assert 0 <= first < 1.0 and 0 <= second < 1.0  # not 60 and 30: the walks took no wall time here
    assert first == 2 * second or first == second == 0.0


def test_planned_walks_count_prompts_or_shared_walks():
    from types import SimpleNamespace as NS

    from audit.replay import planned_walks

    a = NS(prompts=[NS(token_ids=[1, 2]), NS(token_ids=[3])], max_new_tokens=8, sampler=None)
    b = NS(prompts=[NS(token_ids=[1, 2])], max_new_tokens=8, sampler=None)
    assert planned_walks([a]) == 2 and planned_walks([a, b]) == 3 and planned_walks([a, b], shared=True) == 2


def test_progress_lines_in_a_log_say_the_time_left():
    """Off a terminal the bar is off and counts nothing: the log lines count for themselves."""
    from audit.progress import Progress

    now, lines = [0.0], []
    with Progress(100, "replay", lines.append, enabled=False, clock=lambda: now[0]) as bar:
        now[0] = 10.0
        bar.settle(estimated=50, walked=25, ticked=0)  # a walk that stopped early: 25 off the total
        bar.log("replay [1/2] a")
        now[0] = 20.0
        bar.tick(50)
        bar.settle(estimated=50, walked=50, ticked=50)
        bar.log("replay [2/2] b")
    assert lines == ["replay [1/2] a; about 20 s left", "replay [2/2] b; 20 s in all"]
