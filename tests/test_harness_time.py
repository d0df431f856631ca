"""``harness time`` end to end on the tiny model: a complete, well-formed stream.jsonl, written
atomically, and the CLI's help, listing, warnings and edges. Every run pins ``--device cpu`` and
``-n``, whose defaults differ on a GPU machine."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from core import determinism
from core.schema import LEG_SPREAD_LIMIT, SCHEMA, abba_roles, prompt_ratio, read_stream
from fixtures.prompts import DEV_FILE, DEV_PROMPTS
from harness.commands.time import time_cmd
from harness.load import busy_warning
from harness.options import TimeOptions
from harness.table import render_table
from harness.cli import main

REPO = Path(__file__).resolve().parent.parent


def invoke(args: list[str]):
    return CliRunner().invoke(main, args, catch_exceptions=True)


def time_args(out: Path, decoder: str, legs: int = 2, limit: int = 2, n: int = 8, *extra: str) -> list[str]:
    return ["time", "--decoder", decoder, "--model", "tiny", "--device", "cpu", "--limit", str(limit), "-n", str(n),
            "--legs", str(legs), "--out", str(out), *extra]


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir()) if out.exists() else []


# --------------------------------------------------------------------------- stream.jsonl


def check_stream(path: Path, *, decoder: str, legs: int, n: int, limit: int, tokenizer) -> list[dict]:
    records, integrity = read_stream(path)
    assert integrity == {"present": True, "count_ok": True, "sha256_ok": True}
    header, end = records[0], records[-1]

    # header
    assert header["type"] == "header" and header["schema"] == SCHEMA
    model = header["model"]
    assert model["name"] == "tiny" and model["kind"] == "builtin" and model["layout"] == "multimodal"
    assert len(model["config_sha256"]) == 64 and len(model["weights_fingerprint"]) == 64
    assert header["dtype"] == "bfloat16"
    assert header["device"]["type"] == "cpu" and header["device"]["name"].startswith("cpu")
    import torch
    import transformers

    assert header["versions"]["torch"] == torch.__version__
    assert header["versions"]["transformers"] == transformers.__version__
    assert header["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert "cuda" in header["versions"]
    det = header["determinism"]
    for key, value in determinism.PINNED.items():
        assert det[key] == value, key
    assert determinism.differences(det) == []
    assert header["control"]["name"] == "serial" and isinstance(header["control"]["config"], dict)
    assert header["candidate"]["name"] == decoder and header["candidate"]["spec"] == decoder
    assert isinstance(header["candidate"]["config"], dict)
    assert header["prompts"] == {"source": "builtin:dev", "count": limit,
                                 "sha256": hashlib.sha256(DEV_FILE.read_bytes()).hexdigest()}
    assert header["max_new_tokens"] == n and header["legs"] == legs
    assert header["seed"] == 0 and header["warmup_tokens"] == 8
    assert header["integrity_checked"] is True
    assert header["command"][0] == "harness" and isinstance(header["command"], list)

    # body: per prompt, a prompt record, 2L legs in ABBA order, a summary; then the end record
    body = records[1:-1]
    per_prompt = 1 + 2 * legs + 1
    assert len(body) == limit * per_prompt
    last_t_end = 0.0
    ratios = []
    for p in range(limit):
        chunk = body[p * per_prompt:(p + 1) * per_prompt]
        prompt, legs_recs, summary = chunk[0], chunk[1:-1], chunk[-1]
        want = DEV_PROMPTS[p]
        assert prompt["type"] == "prompt" and prompt["id"] == want["id"]
        assert prompt["text"] == want["text"]
        assert prompt["token_ids"] == tokenizer.encode(want["text"])
        # the warm-up prompt: as long as the prompt, not the prompt, drawn from the seed and the index
        assert len(prompt["warmup_ids"]) == len(prompt["token_ids"]) and prompt["warmup_ids"] != prompt["token_ids"]
        assert all(isinstance(t, int) and 0 <= t < tokenizer.vocab_size for t in prompt["warmup_ids"])
        assert [r["type"] for r in legs_recs] == ["leg"] * (2 * legs)
        assert [r["role"] for r in legs_recs] == abba_roles(legs)
        assert [r["order"] for r in legs_recs] == list(range(2 * legs))
        for role in ("control", "candidate"):
            assert [r["leg"] for r in legs_recs if r["role"] == role] == list(range(legs))
        control_tokens = legs_recs[0]["tokens"]
        for r in legs_recs:
            assert r["prompt_id"] == want["id"]
            assert r["wall_s"] == r["t_end"] - r["t_start"] and r["wall_s"] > 0
            assert r["t_start"] >= last_t_end  # legs are sequential, on one clock
            last_t_end = r["t_end"]
            assert r["peak_mem_bytes"] is None  # not measured on CPU
            assert isinstance(r["tokens"], list) and 1 <= len(r["tokens"]) <= n
            assert all(isinstance(t, int) for t in r["tokens"])
            assert isinstance(r["stats"], dict) and r["stats"]["forwards"] >= 1
            if r["role"] == "control":
                assert r["tokens"] == control_tokens
        assert summary["type"] == "summary" and summary["prompt_id"] == want["id"]
        ctl = [r["wall_s"] for r in legs_recs if r["role"] == "control"]
        cand = [r["wall_s"] for r in legs_recs if r["role"] == "candidate"]
        assert summary["control_median_s"] == statistics.median(ctl)
        assert summary["candidate_median_s"] == statistics.median(cand)
        first = next(r["wall_s"] for r in legs_recs if r["role"] == "candidate" and r["leg"] == 0)
        assert summary["candidate_first_s"] == first
        assert summary["ratio"] == prompt_ratio(ctl, first) == summary["control_median_s"] / first
        same = all(r["tokens"] == control_tokens for r in legs_recs)
        assert summary["same_tokens_as_control"] is same
        ratios.append(summary["ratio"])

    assert end["type"] == "end" and end["records"] == len(records) - 1
    raw = path.read_bytes().splitlines(keepends=True)
    assert end["sha256"] == hashlib.sha256(b"".join(raw[:-1])).hexdigest()
    assert end["median_ratio"] == statistics.median(ratios)
    return records


@pytest.mark.parametrize("decoder,legs", [("serial", 2), ("spec-naive", 2), ("spec-naive", 3)])
def test_stream_is_complete_and_well_formed(tmp_path, tiny_tokenizer, decoder, legs):
    out = tmp_path / "run"
    result = invoke(time_args(out, decoder, legs=legs))
    assert result.exit_code == 0, result.output
    assert leftovers(out) == ["stream.jsonl"]
    records = check_stream(out / "stream.jsonl", decoder=decoder, legs=legs, n=8, limit=2, tokenizer=tiny_tokenizer)
    if decoder == "serial":
        assert all(r["tokens"] == records[2]["tokens"] for r in records if r["type"] == "leg"
                   and r["prompt_id"] == records[1]["id"])
    assert "median ratio" in result.stdout and "stream.jsonl" in result.stdout
    # stderr is no terminal here: no progress bar (nor its lone label), one complete line per prompt
    lines = result.stderr.splitlines()
    assert "legs" not in lines
    assert [ln.split(":")[0] for ln in lines if " prompts, ratio " in ln] == [p["id"] for p in DEV_PROMPTS[:2]]


def test_abba_order():
    assert abba_roles(1) == ["control", "candidate"]
    assert abba_roles(2) == ["control", "candidate", "candidate", "control"]
    assert abba_roles(3) == ["control", "candidate", "candidate", "control", "control", "candidate"]


def test_command_recorded_from_real_process(tmp_path, tiny_tokenizer):
    """Through a real process (the installed ``harness`` script): the header's command is this
    command line, and a plug-in decoder is recorded by its spec."""
    out = tmp_path / "run"
    args = time_args(out, "plugin_decoders:WrappedSerial", 1, 1, 4)
    pythonpath = os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1")  # tiny model: threads only contend
    # the installed console script when there is one (pip install -e .), else the module
    exe = shutil.which("harness")
    cmd = [exe] if exe else [sys.executable, "-m", "harness.cli"]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    records, integrity = read_stream(out / "stream.jsonl")
    assert all(integrity.values())
    header = records[0]
    assert header["command"] == ["harness", *args]
    assert header["candidate"]["spec"] == "plugin_decoders:WrappedSerial"
    assert header["candidate"]["name"] == "wrapped-serial"
    assert header["candidate"]["config"] == {"tag": "class"}
    assert header["legs"] == 1 and header["max_new_tokens"] == 4
    legs = [r for r in records if r["type"] == "leg"]
    assert [r["role"] for r in legs] == ["control", "candidate"]
    assert legs[0]["tokens"] == legs[1]["tokens"]


def test_default_out_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke(["time", "--decoder", "serial", "--device", "cpu", "--limit", "1", "-n", "2", "--legs", "1"])
    assert result.exit_code == 0, result.output
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("serial-")
    assert leftovers(runs[0]) == ["stream.jsonl"]


# --------------------------------------------------------------------------- atomic writes


@pytest.mark.parametrize("decoder,exit_code", [("plugin_decoders:Failing", 1),
                                               ("plugin_decoders:Interrupted", 130)])
def test_failure_mid_run_leaves_nothing(tmp_path, monkeypatch, decoder, exit_code):
    import plugin_decoders

    cls = getattr(plugin_decoders, decoder.split(":")[1])
    out = tmp_path / "run"
    monkeypatch.setattr(cls, "watch", out)
    monkeypatch.setattr(cls, "seen", None)
    result = invoke(time_args(out, decoder))
    # the failure came mid-run: the temporary stream was there, holding the first prompt's records
    assert cls.seen is not None and len(cls.seen) == 1, cls.seen
    assert cls.seen[0].startswith(".stream.jsonl.") and cls.seen[0].endswith(".tmp")
    assert result.exit_code == exit_code, result.output
    if exit_code == 130:
        assert result.stderr.strip().splitlines()[-1] == "error: interrupted; nothing was written"
    else:
        assert isinstance(result.exception, RuntimeError) and "deliberate failure" in str(result.exception)
    assert leftovers(out) == []  # neither stream.jsonl nor its temporary file


def test_existing_stream_needs_force(tmp_path, tiny_tokenizer):
    out = tmp_path / "run"
    out.mkdir()
    stream = out / "stream.jsonl"
    stream.write_text("precious\n")

    result = invoke(time_args(out, "serial"))
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "--force" in result.stderr and "Traceback" not in result.output
    assert stream.read_text() == "precious\n"

    for decoder in ("plugin_decoders:Failing", "plugin_decoders:Interrupted"):
        result = invoke([*time_args(out, decoder), "--force"])
        assert result.exit_code != 0
        assert stream.read_text() == "precious\n", f"a failed --force run ({decoder}) replaced the stream"
        assert leftovers(out) == ["stream.jsonl"]

    result = invoke([*time_args(out, "serial"), "--force"])
    assert result.exit_code == 0, result.output
    assert leftovers(out) == ["stream.jsonl"]
    check_stream(stream, decoder="serial", legs=2, n=8, limit=2, tokenizer=tiny_tokenizer)


# --------------------------------------------------------------------------- help and listing


def test_help_and_list():
    result = invoke(["--help"])
    assert result.exit_code == 0
    assert "time" in result.stdout and "list" in result.stdout and "audit replay" in result.stdout

    result = invoke(["time", "--help"])
    assert result.exit_code == 0
    for word in ("--decoder", "--model", "--prompts", "--max-new-tokens", "--legs", "--device", "--out",
                 "--force", "tiny", "synthetic-9b", "dev", "random-512", "ABBA"):
        assert word in result.stdout, word

    result = invoke(["list"])
    assert result.exit_code == 0
    for word in ("serial", "spec-naive", "[control]", "[default]", "tiny", "synthetic-9b", "dev", "random-512"):
        assert word in result.stdout, word


# --------------------------------------------------------------------------- options, warnings and edges


def test_time_options_name_every_option_once():
    """``TimeOptions`` is the one list of ``harness time``'s options: every option is a field, and
    each default is the field's."""
    fields = {f.name: f for f in dataclasses.fields(TimeOptions)}
    params = {p.name: p for p in time_cmd.params if p.expose_value}  # --version passes no value
    assert set(params) == set(fields)
    parsed = time_cmd.make_context("time", []).params  # the command line's defaults, as time_cmd gets them
    assert TimeOptions(**parsed) == TimeOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        TimeOptions().legs = 3


def test_out_naming_a_file_is_refused_before_the_model_loads(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("mine\n")
    for out in (target, target / "run"):
        result = invoke(time_args(out, "serial"))
        assert result.exit_code == 2, result.output
        assert result.stderr.strip().splitlines() == [result.stderr.strip()]  # one line: nothing loaded first
        assert result.stderr.startswith("error: ") and "is a file, not a directory" in result.stderr
        assert "Traceback" not in result.output
    assert target.read_text() == "mine\n"


def test_missing_prompt_file_is_refused_before_the_model_loads(tmp_path):
    """The prompts load after both decoders are prepared; a set that cannot exist fails first."""
    out = tmp_path / "run"
    result = invoke([*time_args(out, "serial"), "--prompts", str(tmp_path / "none.jsonl")])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: prompt file ") and "not found" in line
    assert not out.exists()


@pytest.mark.parametrize("decoder,arg,needles", [
    ("spec", "bogus=1", ("decoder 'spec' takes no argument 'bogus'", "its arguments: ", "max_depth=")),
    ("serial", "depth=2", ("decoder 'serial' takes no argument 'depth'", "its arguments: none")),
    ("plugin_decoders:Validates", "width=0", ("decoder 'plugin_decoders:Validates' rejected width=0",
                                              "width must be at least 1", "its arguments: width=4, tag='validates'")),
])
def test_decoder_arg_errors_name_the_decoder_and_its_arguments(tmp_path, decoder, arg, needles):
    out = tmp_path / "run"
    result = invoke([*time_args(out, decoder), "--decoder-arg", arg])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    for needle in needles:
        assert needle in line, (needle, line)
    assert "TypeError" not in line and "__init__()" not in line
    assert not out.exists()


def add_control_code_finding(monkeypatch, severity: str, check: str, message: str) -> None:
    """The control-code check's findings as the harness reads them, with one more."""
    import core.provenance

    real = core.provenance.control_code_header
    extra = {"check": check, "severity": severity, "prompt_id": None, "message": message}

    def with_finding(**kwargs):
        summary, findings, modules = real(**kwargs)
        return summary, [*findings, extra], modules

    monkeypatch.setattr(core.provenance, "control_code_header", with_finding)


@pytest.fixture
def startup_code_note(monkeypatch):
    """The control-code check finds startup code no distribution owns, as on a machine with a
    stray ``.pth`` file: a note, which the run records and prints."""
    message = "startup code no distribution owns runs in every interpreter: /site/stray.pth"
    add_control_code_finding(monkeypatch, "warn", "control-startup-code", message)
    return f"note: control-startup-code: {message}"


def test_control_code_notes_wait_until_every_input_is_accepted(tmp_path, startup_code_note):
    """A mistake in the inputs is still one `error:` line; a run that goes on shows the note
    after the model loads and the decoders are prepared, before the timing starts."""
    result = invoke([*time_args(tmp_path / "bad", "serial"), "--decoder-arg", "depth=2"])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: decoder 'serial' takes no argument 'depth'")

    result = invoke(time_args(tmp_path / "ok", "serial", legs=1, limit=1, n=2))
    assert result.exit_code == 0, result.output
    lines = result.stderr.strip().splitlines()
    loading = next(i for i, ln in enumerate(lines) if ln.startswith("loading model "))
    timing = next(i for i, ln in enumerate(lines) if ln.startswith("timing "))
    assert lines.index(startup_code_note) in range(loading + 1, timing)


def test_changed_control_code_is_named_before_anything_else(tmp_path, monkeypatch):
    """The run will fail its audit: that is said at once, before a mistake in the inputs too."""
    add_control_code_finding(monkeypatch, "fail", "control-code-modified", "1 file of the control differs")
    result = invoke([*time_args(tmp_path / "bad", "serial"), "--decoder-arg", "depth=2"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines()[0] == "WARNING: control-code-modified: 1 file of the control differs"
    assert result.stderr.strip().splitlines()[-1].startswith("error: decoder 'serial' takes no argument")


def test_prepare_runs_before_the_prompts_load_and_report_says_unaudited(tmp_path, monkeypatch):
    """Both decoders are prepared before the prompt set is loaded (prepare() cannot read it from the
    harness); ``--report`` says the report shows NOT AUDITED until the audit runs."""
    import core.prompts
    import plugin_decoders
    import reports.render

    events = []
    real_prepare, real_load = plugin_decoders.WrappedSerial.prepare, core.prompts.load_prompts
    monkeypatch.setattr(plugin_decoders.WrappedSerial, "prepare",
                        lambda self, model: (events.append("prepare"), real_prepare(self, model))[1])
    monkeypatch.setattr(core.prompts, "load_prompts", lambda *a: (events.append("load_prompts"), real_load(*a))[1])
    monkeypatch.setattr(reports.render, "render_run", lambda run_dir: {"report": run_dir / "report.md"})
    out = tmp_path / "run"
    result = invoke([*time_args(out, "plugin_decoders:WrappedSerial", 1, 1, 4), "--report"])
    assert result.exit_code == 0, result.output
    assert events == ["prepare", "load_prompts"]
    assert f"report: {out / 'report.md'}" in result.stdout
    assert f'the report shows "NOT AUDITED" until `audit replay {out / "stream.jsonl"}` runs' in result.stdout


def leg(role: str, k: int, wall: float) -> dict:
    return {"type": "leg", "role": role, "leg": k, "wall_s": wall, "tokens": [1, 2], "stats": {}}


def test_unstable_legs_warning():
    from core.prompts import Prompt

    steady = [leg("control", 0, 1.0), leg("candidate", 0, 0.5), leg("candidate", 1, 0.5), leg("control", 1, 1.1)]
    noisy = [leg("control", 0, 1.0), leg("candidate", 0, 0.5), leg("candidate", 1, 0.5 * (1 + LEG_SPREAD_LIMIT) + 0.01),
             leg("control", 1, 1.0)]
    summary = {"control_tokens_per_s": 2.0, "ratio": 2.0, "same_tokens_as_control": True}
    rows = [(Prompt(f"p{i}", [1, 2, 3]), legs, summary) for i, legs in enumerate([steady, noisy, steady])]
    table = render_table(rows, 2.0, "cand")
    assert table.splitlines()[-1] == (f"WARNING: 1 of 3 prompts have unstable legs (spread > {LEG_SPREAD_LIMIT:.0%}); "
                                      "rerun with more --legs")
    assert "WARNING" not in render_table([rows[0]], 2.0, "cand")
    # one leg per side has no spread to measure
    assert "WARNING" not in render_table([(rows[0][0], [leg("control", 0, 1.0), leg("candidate", 0, 9.0)],
                                               summary)], 2.0, "cand")


def test_busy_machine_warning():
    warning = busy_warning((3.25, 2))
    assert warning.startswith("WARNING: this machine is busy") and "3.25" in warning and "2 CPUs" in warning
    assert busy_warning((0.5, 2)) is None and busy_warning(None) is None


def test_sigterm_mid_run_leaves_nothing(tmp_path):
    """SIGTERM while the temporary stream is open: one error line, exit 1, no file left behind."""
    out = tmp_path / "run"
    pythonpath = os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "harness", *time_args(out, "plugin_decoders:Sleeps", 1, 1, 4)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 240
        while not [p for p in leftovers(out) if p.endswith(".tmp")]:
            assert proc.poll() is None and time.monotonic() < deadline, "the run never opened its stream"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stderr
    assert stderr.strip().splitlines()[-1] == "error: stopped by SIGTERM; nothing was written"
    assert "Traceback" not in stderr
    assert leftovers(out) == []


def test_written_files_get_the_permissions_of_a_plain_open(tmp_path):
    """What the atomic writers publish is readable as any file the user writes."""
    from core.schema import AtomicJsonlWriter, write_json_atomic

    umask = os.umask(0o022)
    try:
        write_json_atomic(tmp_path / "doc.json", {"a": 1})
        with AtomicJsonlWriter(tmp_path / "s.jsonl") as w:
            w.write({"type": "header"})
            w.commit()
    finally:
        os.umask(umask)
    for name in ("doc.json", "s.jsonl"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o644
