"""Hostile files and options handed to `audit replay` and `audit tokens`, each built here on `tiny`:
a link to a device, a FIFO, a huge sparse file, JSON ``true`` where an integer belongs, leg times
whose ratios overflow, lone surrogates in ids and prompts, devices that do not exist, an output
path that cannot be written. Each ends in one ``error:`` line and exit 2 with nothing written, or
in a finding; never in a traceback or a hang. Also: the same weights given by path are the same
model, and where nothing was replayed the audit says so."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from audit_helpers import copy_stream, edit, findings, read_records, run_harness
from click.testing import CliRunner

from audit.cli import main as audit_main
from core import schema
from core.errors import UserError
from core.models import TINY_DIR
from core.prompts import load_prompts

# a hang guard, not a timing assertion: a refused file answers at once, a blocking read never
HANG_GUARD_S = 120


@pytest.fixture(scope="module")
def clean_stream(tmp_path_factory):
    return run_harness(tmp_path_factory.mktemp("inputs") / "run", "serial", limit=2, n=8, legs=2)


@pytest.fixture
def stream(clean_stream, tmp_path):
    return copy_stream(clean_stream, tmp_path / "run")


def replay(*args: str):
    result = CliRunner().invoke(audit_main, ["replay", *map(str, args)])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result


def error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


def within_guard(fn):
    """``fn()``'s result (or its exception), failing rather than hanging the suite if it blocks."""
    box = {}

    def call():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            box["error"] = exc

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(HANG_GUARD_S)
    assert not worker.is_alive(), "the reader blocked on a file that is not a regular file"
    if "error" in box:
        raise box["error"]
    return box["value"]


# --------------------------------------------------------------------------- files that are not files


def test_a_stream_linking_to_dev_zero_is_refused_not_read(tmp_path):
    (tmp_path / "run").mkdir()
    link = tmp_path / "run" / "stream.jsonl"
    link.symlink_to("/dev/zero")
    for arg in (link, link.parent):  # the file, and the run directory standing for it
        result = within_guard(lambda a=arg: replay(a))
        assert "not a regular file" in error_line(result)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["stream.jsonl"]


def test_a_stream_that_is_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "stream.jsonl"
    os.mkfifo(fifo)
    result = within_guard(lambda: replay(fifo))
    assert "not a regular file" in error_line(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stream.jsonl"]


def test_a_huge_sparse_stream_is_refused_from_its_size_unread(stream):
    header = stream.read_text().splitlines(keepends=True)[0]
    with open(stream, "w") as fh:
        fh.write(header)
        fh.truncate(64 << 30)  # 64 GiB of holes: reading it would exhaust memory
    line = error_line(replay(stream))
    assert f"is {64 << 30} bytes, beyond the" in line and "header's 2 prompt(s)" in line


def test_the_size_cap_follows_the_headers_counts():
    small = {"prompts": {"count": 2}, "legs": 2, "max_new_tokens": 8}
    cap, why = schema.stream_size_cap(small)
    assert cap == schema.STREAM_BASE_BYTES + 2 * (schema.PROMPT_RECORD_BYTES + 4 * (
        schema.LEG_BASE_BYTES + 8 * schema.LEG_TOKEN_BYTES)) and "2 prompt(s)" in why
    assert schema.stream_size_cap({**small, "prompts": {"count": 4}})[0] > cap
    assert schema.stream_size_cap({**small, "prompts": {"count": 10 ** 6}})[0] == schema.MAX_STREAM_BYTES
    assert schema.stream_size_cap({**small, "legs": True})[0] == schema.MAX_STREAM_BYTES  # not a count


def test_a_stream_grown_past_its_cap_while_read_is_refused(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    fh, size = schema.open_regular(path)
    with fh, pytest.raises(UserError, match="holds more than the 10 bytes"):
        schema.read_capped(fh, 0, 10, path, "test")  # a size that understates the file (a /proc file)


def test_prompt_and_tokens_files_that_are_fifos_are_refused(tmp_path, tiny):
    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match="not a regular file"):
        within_guard(lambda: load_prompts(str(fifo), tiny))
    result = within_guard(lambda: CliRunner().invoke(audit_main, ["tokens", str(fifo), "--model", "tiny",
                                                                  "--device", "cpu"]))
    assert "not a regular file" in error_line(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]


def test_a_tokens_file_beyond_the_cap_is_refused_unread(tmp_path):
    path = tmp_path / "gens.jsonl"
    with open(path, "w") as fh:
        fh.truncate(schema.MAX_JSONL_BYTES + 1)
    result = CliRunner().invoke(audit_main, ["tokens", str(path), "--model", "tiny", "--device", "cpu"])
    assert f"beyond the {schema.MAX_JSONL_BYTES} bytes" in error_line(result)


# --------------------------------------------------------------------------- values that are not what they claim


def first_of(records, kind):
    return next(r for r in records if r["type"] == kind)


@pytest.mark.parametrize("where, needle", [
    (lambda recs: first_of(recs, "leg")["tokens"].__setitem__(0, True), "leg tokens must be a list of integers"),
    (lambda recs: first_of(recs, "prompt")["token_ids"].__setitem__(0, True), "prompt token_ids"),
    (lambda recs: first_of(recs, "leg").update(leg=False), "integer 'leg' and 'order'"),
    (lambda recs: first_of(recs, "leg").update(peak_mem_bytes=True), "peak_mem_bytes"),
    (lambda recs: recs[0].update(legs=True), "header legs must be a positive integer"),
    (lambda recs: recs[0].update(max_new_tokens=True), "header max_new_tokens must be a positive integer"),
], ids=["leg-token", "prompt-token", "leg-number", "peak-memory", "header-legs", "header-n"])
def test_json_true_is_never_taken_for_an_integer(stream, where, needle):
    edit(stream, where)
    assert needle in error_line(replay(stream))
    assert not (stream.parent / "audit.json").exists()


def set_leg_time(recs, role, leg, t_start, wall):
    rec = next(r for r in recs if r["type"] == "leg" and r["role"] == role and r["leg"] == leg)
    rec.update(t_start=t_start, t_end=t_start + wall, wall_s=wall)


@pytest.mark.parametrize("edit_times, needle", [
    (lambda recs: set_leg_time(recs, "candidate", 0, 1.0, 1e-320), "wall_s 1e-320 is outside the plausible"),
    (lambda recs: set_leg_time(recs, "control", 0, 0.0, 1e308), "wall_s 1e+308 is outside the plausible"),
    (lambda recs: set_leg_time(recs, "control", 1, -1e308, 1.0), "beyond any clock's reading"),
], ids=["subnormal-candidate-leg", "huge-control-leg", "huge-clock"])
def test_leg_times_whose_ratio_would_overflow_are_refused(stream, edit_times, needle):
    edit(stream, edit_times)
    assert needle in error_line(replay(stream))
    assert not (stream.parent / "audit.json").exists()


def test_a_document_with_a_non_finite_number_is_refused_before_it_is_written(tmp_path):
    from audit.report import write_document
    from audit.stream import BadInput

    with pytest.raises(BadInput, match="JSON cannot hold"):
        write_document(tmp_path / "audit.json", {"ratio": float("inf")}, "table")
    assert list(tmp_path.iterdir()) == []


def rename_first_prompt(recs, new_id):
    old = first_of(recs, "prompt")["id"]
    for r in recs:
        if r.get("id") == old:
            r["id"] = new_id
        if r.get("prompt_id") == old:
            r["prompt_id"] = new_id


def test_a_lone_surrogate_in_a_prompt_id_is_escaped_in_the_table_and_audit_json(stream):
    edit(stream, lambda recs: rename_first_prompt(recs, "x\ud800y"))
    result = replay(stream)
    assert result.exit_code == 1  # well-formed, but its prompts are not the named set's
    assert "x\\ud800y" in result.stdout
    doc = json.loads((stream.parent / "audit.json").read_text())
    assert doc["prompts"][0]["id"] == "x\ud800y" and findings(doc, "prompts", severity="fail")


def test_a_lone_surrogate_in_a_prompt_text_is_bad_input(tmp_path, tiny):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "text": "x\ud800"}) + "\n")
    with pytest.raises(UserError, match="lone surrogate"):
        load_prompts(str(prompts), tiny)
    gens = tmp_path / "g.jsonl"
    gens.write_text(json.dumps({"prompt": "x\ud800", "output_token_ids": [1]}) + "\n")
    result = CliRunner().invoke(audit_main, ["tokens", str(gens), "--model", "tiny", "--device", "cpu"])
    assert "lone surrogate" in error_line(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.jsonl", "p.jsonl"]


def test_json_true_is_no_token_id_in_a_tokens_file(tmp_path):
    gens = tmp_path / "g.jsonl"
    gens.write_text(json.dumps({"prompt_token_ids": [1, True], "output_token_ids": [2]}) + "\n")
    result = CliRunner().invoke(audit_main, ["tokens", str(gens), "--model", "tiny", "--device", "cpu"])
    assert "non-negative integer token ids" in error_line(result)


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize("device", ["gpu", "mps", "cuda", "cuda:1", "cuda:x"])
def test_an_unusable_device_is_one_error_line_before_anything_is_read(stream, device):
    import torch

    if device in ("cuda", "cuda:1") and torch.cuda.device_count() > int(device.partition(":")[2] or 0):
        pytest.skip("a device this machine has")
    line = error_line(replay(stream, "--device", device))
    assert repr(device) in line and "choose cpu" in line
    result = CliRunner().invoke(audit_main, ["tokens", str(stream), "--model", "tiny", "--device", device])
    assert repr(device) in error_line(result)
    assert sorted(p.name for p in stream.parent.iterdir()) == ["stream.jsonl"]


def test_the_same_weights_by_path_are_replayed(stream):
    result = replay(stream, "--model", TINY_DIR)
    assert result.exit_code == 0, result.output
    doc = json.loads((stream.parent / "audit.json").read_text())
    assert doc["exact"] and doc["replayed"] and doc["replay"]["tokens_replayed"] > 0
    (warn,) = findings(doc, "model")
    assert warn["severity"] == "warn" and "the same config and weights" in warn["message"]


def test_another_model_says_not_replayed_rather_than_not_exact(stream):
    edit(stream, lambda recs: recs[0]["model"].update(weights_fingerprint="0" * 64))
    result = replay(stream)
    assert result.exit_code == 1
    doc = json.loads((stream.parent / "audit.json").read_text())
    assert (doc["exact"], doc["replayed"], doc["replay"]["tokens_replayed"], doc["replay"]["workers"]) == (
        False, False, 0, 0)  # nothing replayed, so no worker ran
    assert "exact: not replayed" in result.stdout and "exact: NO" not in result.stdout
    # another tokenizer would cut other prompts: the model's finding is not repeated as a prompts one
    assert not findings(doc, "prompts", severity="fail")
    assert any("not rebuilt" in f["message"] for f in findings(doc, "prompts", severity="warn"))


def test_a_named_model_that_did_not_record_the_stream_is_refused_and_writes_nothing(stream):
    assert replay(stream).exit_code == 0
    audit_json = stream.parent / "audit.json"
    before = audit_json.read_bytes()
    result = replay(stream, "--model", "small")
    line = error_line(result)
    assert result.exit_code == 2 and "--model 'small' is not the model that recorded the stream ('tiny'" in line
    assert "leave --model out" in line and "replaying" not in result.stderr
    assert audit_json.read_bytes() == before  # the passing audit the user had is still there


def test_an_unwritable_out_is_refused_before_the_replay(stream, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who may write anywhere (root)")
        result = replay(stream, "--out", locked / "audit.json")
        line = error_line(result)
        assert "cannot write" in line and "replaying" not in result.stderr
    finally:
        locked.chmod(0o700)


def test_an_out_under_a_regular_file_is_refused_before_the_replay(stream):
    result = replay(stream, "--out", stream.parent / "stream.jsonl" / "audit.json")
    assert "cannot write" in error_line(result) and "replaying" not in result.stderr
    assert sorted(p.name for p in stream.parent.iterdir()) == ["stream.jsonl"]


def test_check_writable_leaves_nothing_behind(tmp_path):
    from audit.pipeline import check_writable

    check_writable(tmp_path / "audit.json")
    check_writable(tmp_path / "to" / "be" / "made" / "audit.json")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- tokens: --out - and --reference


def greedy_file(path: Path, tiny, ids: dict[str, list[int]], n: int = 6) -> Path:
    from audit.replay import PristineSerial, greedy_and_top

    lines = []
    for gid, prompt in ids.items():
        stepper, out = PristineSerial(tiny), []
        logits = stepper.start(prompt)
        for _ in range(n):
            out.append(greedy_and_top(logits)[0])
            if out[-1] in tiny.eos_token_ids:
                break
            logits = stepper.step(out[-1])
        lines.append(json.dumps({"id": gid, "prompt_token_ids": prompt, "output_token_ids": out}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_tokens_out_dash_writes_the_document_to_stdout(tiny, tmp_path):
    gens = greedy_file(tmp_path / "g.jsonl", tiny, {"a": [5, 6, 7]})
    result = CliRunner().invoke(audit_main, ["tokens", str(gens), "--model", "tiny", "--device", "cpu",
                                             "--out", "-"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["kind"] == "tokens-audit" and doc["verdict"] == "exact"
    assert "verdict: EXACT" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.jsonl"]  # no file named '-'


def test_tokens_out_naming_the_input_is_refused(tiny, tmp_path):
    gens = greedy_file(tmp_path / "g.jsonl", tiny, {"a": [5, 6, 7]})
    before = gens.read_bytes()
    result = CliRunner().invoke(audit_main, ["tokens", str(gens), "--model", "tiny", "--out", str(gens)])
    assert "is an input file" in error_line(result) and gens.read_bytes() == before


@pytest.mark.parametrize("ref_ids, needle", [
    ({"b": [5, 6, 7]}, "1 of 1 generations"),           # no id in common
    ({"a": [5, 6, 7]}, "1 of 2 generations"),           # one of two lacks its counterpart
], ids=["no-match", "one-unmatched"])
def test_tokens_reference_without_every_counterpart_is_bad_input(tiny, tmp_path, ref_ids, needle):
    ids = {"a": [5, 6, 7]} if needle.startswith("1 of 1") else {"a": [5, 6, 7], "c": [8, 9]}
    gens = greedy_file(tmp_path / "g.jsonl", tiny, ids)
    ref = greedy_file(tmp_path / "ref.jsonl", tiny, ref_ids)
    result = CliRunner().invoke(audit_main, ["tokens", str(gens), "--model", "tiny", "--device", "cpu",
                                             "--reference", str(ref)])
    line = error_line(result)
    assert needle in line and "no counterpart" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.jsonl", "ref.jsonl"]


def test_tokens_reference_with_every_counterpart_passes(tiny, tmp_path):
    gens = greedy_file(tmp_path / "g.jsonl", tiny, {"a": [5, 6, 7], "c": [8, 9]})
    ref = greedy_file(tmp_path / "ref.jsonl", tiny, {"c": [8, 9], "a": [5, 6, 7], "extra": [3]})
    result = CliRunner().invoke(audit_main, ["tokens", str(gens), "--model", "tiny", "--device", "cpu",
                                             "--reference", str(ref)])
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "audit_tokens.json").read_text())
    assert doc["reference"]["unmatched"] == 0 and doc["reference"]["matched_by"] == "id"


# --------------------------------------------------------------------------- progress


def test_progress_bar_counts_every_walked_position_and_shrinks_its_total(stream):
    """Forced on (a terminal would turn it on): its total is the planned positions less those
    no walk needed, its count the positions the replay computed."""
    import io

    from audit.progress import Progress
    from audit.replay import planned_positions, replay_run, walk_here
    from audit.stream import load_run
    from core.models import load_model

    def diverge_at_once(recs):  # every leg of the first prompt: its walk ends after one position
        pid = first_of(recs, "prompt")["id"]
        for r in recs:
            if r["type"] == "leg" and r["prompt_id"] == pid:
                r["tokens"][0] = (r["tokens"][0] + 1) % 256

    edit(stream, diverge_at_once)
    run = load_run(stream)
    sink = io.StringIO()
    with Progress(planned_positions([run]), "replay", enabled=True, file=sink) as bar:
        _, positions, _ = replay_run(walk_here(load_model("tiny", "cpu")), run, bar.log, bar=bar)
        assert bar.bar.n == positions and bar.bar.total == positions < planned_positions([run])
    assert "replay" in sink.getvalue() and "tok" in sink.getvalue()
    assert planned_positions([run]) == sum(min(run.max_new_tokens, max(len(r["tokens"]) for r in p.legs) + 1)
                                           for p in run.prompts)


def test_read_records_of_the_clean_stream_are_unchanged_by_the_reader(clean_stream):
    records, integrity = schema.read_stream(clean_stream)
    assert records == read_records(clean_stream)
    assert integrity == {"present": True, "count_ok": True, "sha256_ok": True}


def test_an_out_that_is_a_fifo_or_a_device_is_never_replaced(tmp_path):
    """`--out /dev/null` ("only the exit status") must not replace the device, as root least of all."""
    import os

    from audit.pipeline import check_replaceable
    from audit.stream import BadInput

    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/null")):
        with pytest.raises(BadInput, match="not a regular file"):
            check_replaceable(path)
    assert not fifo.is_file()
