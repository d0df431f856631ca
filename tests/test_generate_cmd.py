"""``harness generate``: the streamed text is HF greedy ``generate``'s, --json and --record give
the ids, the record passes ``audit tokens``, and every user mistake is one line before the load."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import core.models
from audit.cli import main as audit_main
from core.models import load_model
from decoders.serial import SerialDecoder
from harness.cli import main as harness_main

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "def fib(n):"


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.backbone.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                                      eos_token_id=list(model.eos_token_ids), pad_token_id=0)
    return out[0, len(ids):].tolist()  # one row: no padding


def invoke(*args, input=None):
    res = CliRunner().invoke(harness_main, ["generate", *args], input=input)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res


@pytest.fixture(scope="module")
def small():
    return load_model("small", "cpu")


def test_streamed_text_is_hf_greedy_on_small(small):
    tok = small.tokenizer.get()
    res = invoke(PROMPT, "-n", "24", "--model", "small")
    assert res.exit_code == 0, res.output
    want = hf_greedy(small, tok.encode(PROMPT), 24)
    assert res.stdout == tok.decode(want, skip_special_tokens=True)
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{len(want)} tokens (") and "tok/s" in last and "TTFT" in last
    assert "mean accepted length" in last and "drafted" in last


def test_json_stdin_and_prompt_file(tiny, tmp_path):
    tok = tiny.tokenizer.get()
    ids = tok.encode(PROMPT)
    control = SerialDecoder()
    control.prepare(tiny)
    want = control.decode(ids, 12).tokens
    res = invoke("--json", "-n", "12", "--model", "tiny", "--decoder", "fast-serial", input=PROMPT)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["prompt_ids"] == ids and doc["token_ids"] == want
    assert doc["text"] == tok.decode(want, skip_special_tokens=True)
    assert doc["finish_reason"] == "length" and doc["stats"]["new_tokens"] == 12
    assert set(doc["stats"]) >= {"prompt_tokens", "seconds", "time_to_first_token_s", "tokens_per_s",
                                 "drafted", "accepted", "mean_accepted_length", "forwards"}
    f = tmp_path / "p.txt"
    f.write_text(PROMPT)
    for args in (["--prompt-file", str(f)], ["-"]):
        res = invoke(*args, "--json", "-n", "12", "--model", "tiny", "--decoder", "fast-serial",
                     input=PROMPT if args == ["-"] else None)
        assert res.exit_code == 0 and json.loads(res.stdout)["token_ids"] == want


def test_record_then_audit_tokens_passes(tiny, tmp_path):
    record = tmp_path / "record.jsonl"
    for args in (["-n", "6"], ["-n", "14", "--chat"], ["-n", "10", "--decoder", "fast-serial"]):
        res = invoke("The river ran", "--model", "tiny", "--record", str(record), *args)
        assert res.exit_code == 0, res.output
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [line["max_new_tokens"] for line in lines] == [6, 14, 10]
    assert [line["decoder"] for line in lines] == ["spec", "spec", "fast-serial"]
    assert all(line["model"] == "tiny" for line in lines) and len({line["id"] for line in lines}) == 3
    chat = tiny.tokenizer.get().encode("<|im_start|>user\nThe river ran<|im_end|>\n<|im_start|>assistant\n")
    assert lines[1]["prompt_token_ids"] == chat
    res = CliRunner().invoke(audit_main, ["tokens", str(record), "--model", "tiny", "--device", "cpu",
                                          "--out", str(tmp_path / "audit.json")])
    assert res.exit_code == 0, res.output


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the mistake was caught")
    monkeypatch.setattr(core.models, "load_model", refuse)


@pytest.mark.parametrize("args,input,message", [
    (["", "--model", "tiny"], None, "the prompt is empty"),
    (["-", "--model", "tiny"], "", "the prompt is empty"),
    (["x", "--model", "no-such-model"], None, "neither a built-in"),
    (["--prompt-file", "/no/such/file", "--model", "tiny"], None, "cannot read prompt file"),
    (["x", "--model", "tiny", "--record", "/"], None, "is a directory"),
    (["x", "--model", "tiny", "--record", "/no/such/dir/r.jsonl"], None, "does not exist"),
    (["x", "--model", "tiny", "--device", "gpu"], None, "not supported"),
    (["x", "--model", "tiny", "--decoder-arg", "oops"], None, "expected KEY=VALUE"),
    (["x", "--prompt-file", "f", "--model", "tiny"], None, "not both"),
    (["def f\udcff():", "--model", "tiny"], None, "not UTF-8 text"),  # a non-UTF-8 byte in argv
    (["x", "--model", "tiny", "--record", "/proc/qwen-exact-record.jsonl"], None, "is not writable"),
])
def test_mistakes_are_one_line_before_the_load(no_model_load, args, input, message):
    res = invoke(*args, input=input)
    assert res.exit_code == 2
    assert res.stdout == ""
    assert res.stderr.strip().splitlines() == [res.stderr.strip()] and res.stderr.startswith("error: ")
    assert message in res.stderr


def test_mistakes_after_the_load_are_one_line(tiny):
    res = invoke("x", "--model", "tiny", "--decoder-arg", "max_depth=99")
    assert res.exit_code == 2 and res.stderr.startswith("error: ") and len(res.stderr.strip().splitlines()) == 1


def test_prompt_file_not_utf8(tmp_path, no_model_load):
    f = tmp_path / "p.bin"
    f.write_bytes(b"\xff\xfe\x00bad")
    res = invoke("--prompt-file", str(f), "--model", "tiny")
    assert res.exit_code == 2 and "not UTF-8" in res.stderr


def test_ctrl_c_is_one_line_exit_130(monkeypatch, tmp_path):
    import harness.commands.generate as cmd

    def interrupted(opts):
        raise KeyboardInterrupt
    monkeypatch.setattr(cmd, "run_generate", interrupted)
    res = invoke("x", "--model", "tiny")
    assert res.exit_code == 130 and res.stderr.strip() == "error: interrupted; no record was written"


def test_subprocess_streams_hf_greedy_text(small):
    tok = small.tokenizer.get()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "harness", "generate", PROMPT, "-n", "16", "--model", "small"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    want = hf_greedy(small, tok.encode(PROMPT), 16)
    assert proc.stdout == tok.decode(want, skip_special_tokens=True)
    assert proc.stderr.strip().splitlines()[-1].startswith(f"{len(want)} tokens (")


def test_prompt_ids_from_a_file_decode_those_ids(tmp_path):
    """A model without a tokenizer (synthetic-9b) takes its prompt as token ids."""
    from click.testing import CliRunner

    from decoders.api import open_decoder
    from harness.cli import main

    ids = [5, 17, 42, 99, 3, 250]
    path = tmp_path / "ids.json"
    path.write_text(json.dumps(ids))
    result = CliRunner().invoke(main, ["generate", "--prompt-ids", str(path), "--model", "tiny", "--device", "cpu",
                                       "--decoder", "fast-serial", "-n", "8", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    serial = open_decoder("tiny", "serial", device="cpu").generate(ids, 8)
    assert doc["prompt_ids"] == ids and doc["token_ids"] == serial.token_ids


@pytest.mark.parametrize("content, extra, words", [
    ("[1, true]", (), "non-negative integers"),
    ("[]", (), "non-negative integers"),
    ("not json", (), "cannot read a JSON list"),
    ("[1, 2]", ("--chat",), "--chat applies a template"),
    ("[1, 2]", ("some text",), "not both a PROMPT argument and --prompt-ids"),
])
def test_bad_prompt_ids_are_one_line(tmp_path, content, extra, words):
    from click.testing import CliRunner

    from harness.cli import main

    path = tmp_path / "ids.json"
    path.write_text(content)
    result = CliRunner().invoke(main, ["generate", "--prompt-ids", str(path), "--model", "tiny", "--device", "cpu",
                                       *extra])
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output, result.output


SAMPLED = ("--temperature", "0.6", "--top-k", "20", "--top-p", "0.95", "--seed", "5")


def test_sampled_generation_is_serial_sampling_and_its_record_passes_audit_tokens(tiny, tmp_path):
    """--temperature/--top-k/--top-p/--seed (or --sampling) decode with that seeded sampler: the
    tokens are serial's under it, --json and --record carry it, and `audit tokens --sampling`
    passes the record, as it does with no --sampling (each line under its own); --sampling greedy is
    refused."""
    from core.sampling import Sampler

    sampler = Sampler(temperature=0.6, top_k=20, top_p=0.95, seed=5)
    ids = tiny.tokenizer.get().encode(PROMPT)
    control = SerialDecoder()
    control.prepare(tiny)
    want = control.decode(ids, 12, sampler=sampler).tokens
    assert want != control.decode(ids, 12).tokens
    record = tmp_path / "record.jsonl"
    for how in (SAMPLED, ("--sampling", "temperature=0.6,top_k=20,top_p=0.95,seed=5")):
        res = invoke(PROMPT, "--json", "-n", "12", "--model", "tiny", "--decoder", "spec", "--record", str(record),
                     *how)
        assert res.exit_code == 0, res.output
        doc = json.loads(res.stdout)
        assert doc["token_ids"] == want and doc["sampler"] == sampler.to_json()
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [line["sampler"] for line in lines] == [sampler.to_json()] * 2
    out = tmp_path / "audit.json"
    base = ["tokens", str(record), "--model", "tiny", "--device", "cpu", "--out", str(out)]
    res = CliRunner().invoke(audit_main, [*base, "--sampling", sampler.describe()])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(audit_main, base)  # each line is judged under the sampler it records
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(audit_main, [*base, "--sampling", "greedy"])  # a claim the lines do not make
    assert res.exit_code == 2 and "records the sampler" in res.output


def test_preset_with_overrides(tiny):
    res = invoke(PROMPT, "--json", "-n", "6", "--model", "tiny", "--decoder", "fast-serial",
                 "--sampling", "qwen-thinking", "--seed", "9", "--top-k", "5")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["sampler"] == {"name": "gumbel-max/v2", "temperature": 0.6, "top_k": 5,
                                                  "top_p": 0.95, "min_p": 0.0, "seed": 9}


@pytest.mark.parametrize("args,message", [
    (("--temperature", "-1"), "temperature must be"),
    (("--top-p", "0", "--temperature", "1"), "top_p must be"),
    (("--sampling", "qwen-nonsense"), "unknown sampler preset"),
    (("--seed", "-4", "--temperature", "1"), "seed must be"),
    (("--top-k", "5"), "top_k=5 has no effect at temperature 0"),
    (("--sampling", "top_p=0.5"), "top_p=0.5 has no effect at temperature 0"),
    (("--sampling", "qwen-thinking", "--temperature", "0"), "has no effect at temperature 0"),
    (("--seed", "5"), "--seed 5 without a temperature samples nothing"),
    (("--sampling", "seed=7,seed=8"), "sampler key 'seed' given twice"),
])
def test_bad_sampling_is_one_line_before_the_load(no_model_load, args, message):
    res = invoke("x", "--model", "tiny", *args)
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [res.stderr.strip()] and res.stderr.startswith("error: ")
    assert message in res.stderr


def test_a_decoder_that_does_not_sample_is_refused(tiny):
    res = invoke("x", "--model", "tiny", "--decoder", "spec-naive", "--temperature", "0.7")
    assert res.exit_code == 2 and res.stderr.startswith("error: ") and len(res.stderr.strip().splitlines()) == 1
    assert "cannot sample" in res.stderr


def test_with_stderr_on_stdout_the_stats_line_is_a_line_of_its_own(tiny, tmp_path):
    """``2>&1`` into one file: the text, then a newline, then the stats line (with stdout alone
    in a file the text stays exactly the decoded text, as above)."""
    out = tmp_path / "both.txt"
    with out.open("w") as f:
        proc = subprocess.run([sys.executable, "-m", "harness", "generate", PROMPT, "-n", "8", "--model", "tiny",
                               "--device", "cpu", "--decoder", "fast-serial"], cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=f, stderr=subprocess.STDOUT,
                              timeout=600)
    assert proc.returncode == 0
    tok = tiny.tokenizer.get()
    want = tok.decode(hf_greedy(tiny, tok.encode(PROMPT), 8), skip_special_tokens=True)
    text = out.read_text()
    assert text.startswith(want + "\n") and text.splitlines()[-1].startswith("8 tokens (")


def test_a_stdout_that_fails_stops_the_decode_with_one_line_and_no_record(tmp_path):
    """A full disk, or no stdout or stdin at all (``>&-``, ``<&-``): one error line, nothing
    recorded, never a traceback."""
    import shlex

    record = tmp_path / "r.jsonl"
    command = shlex.join([sys.executable, "-m", "harness", "generate", "--model", "tiny", "-n", "8",
                          "--record", str(record)])
    for shell, words in ((f"{command} hi >/dev/full", "No space left on device"),
                         (f"{command} hi >&-", "stdout is closed"),
                         (f"{command} <&-", "stdin is closed")):
        proc = subprocess.run(["sh", "-c", shell], stderr=subprocess.PIPE, text=True, timeout=120,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode in (1, 2) and len(lines) == 1 and words in lines[0], proc.stderr
    assert not record.exists()
