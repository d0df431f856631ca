"""`audit tokens`: any engine's greedy output against the pristine serial path.

The generation files are written here from the pristine path itself (``audit.replay.PristineSerial``),
so an untouched file is greedy by construction; flips are placed where the pristine logits show a
near-tie or a large margin, and stop errors where the pristine path emits an EOS.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from audit_helpers import run_harness
from click.testing import CliRunner

from audit.cli import main as audit_main
from audit.replay import PristineSerial, greedy_and_top
from audit.tokens import TIE_ULPS, ulp
from core.errors import UserError
from core.models import load_model
from reports.cli import main as reports_main
from reports.render import render_run

N = 16
# on `small`, greedy decoding emits an EOS right after this prompt (found from its pristine logits)
EOS_PROMPT = "if __name__ == '__main__':\n    main()\n"
CODE_PROMPTS = ["def add(a, b):\n    return", "import os\n", "class Foo:\n"]


def greedy_walk(model, prompt_ids: list[int], n: int) -> list[dict]:
    """Per position of the pristine greedy path: the token, the runner-up, top-1 logit, margin."""
    stepper = PristineSerial(model)
    logits, out = stepper.start(prompt_ids), []
    for _ in range(n):
        g, top, margin = greedy_and_top(logits)
        out.append({"token": g, "runner_up": top[1][0], "top1": top[0][1], "margin": margin})
        if g in model.eos_token_ids:
            break
        logits = stepper.step(g)
    return out


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def audit_tokens(path: Path, model: str, *args: str, out: Path | None = None):
    """Returns (click Result, the written document or None)."""
    out = out or path.parent / "audit_tokens.json"
    result = CliRunner().invoke(audit_main, ["tokens", str(path), "--model", model, "--device", "cpu",
                                             "--out", str(out), *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result, json.loads(out.read_text()) if out.exists() else None


def flipped(tokens: list[int], walk: list[dict], pos: int) -> list[int]:
    return tokens[:pos] + [walk[pos]["runner_up"]] + tokens[pos + 1:]


@pytest.fixture(scope="module")
def tiny_prompts(tiny):
    """Three token-id prompts and one text prompt with their greedy walks on tiny."""
    tok = tiny.tokenizer.get()
    prompts = {"p0": list(range(40, 70)), "p1": list(range(100, 112)), "p2": [5, 9, 300, 41, 77]}
    text = "The river runs"
    walks = {pid: greedy_walk(tiny, ids, N) for pid, ids in prompts.items()}
    walks["text"] = greedy_walk(tiny, list(tok.encode(text)), N)
    return prompts, text, walks


@pytest.fixture(scope="module")
def small():
    return load_model("small", "cpu")


# --------------------------------------------------------------------------- accepted shapes


def test_exact_file_passes_in_every_shape(tiny_prompts, tmp_path):
    prompts, text, walks = tiny_prompts
    out = {pid: [w["token"] for w in walk] for pid, walk in walks.items()}
    records = [
        {"id": "a-ids", "prompt_token_ids": prompts["p0"], "output_token_ids": out["p0"]},
        {"id": "a-text", "prompt": text, "output_token_ids": out["text"]},
        # a serving engine's request output, with both the text and the ids (ids win), two samples
        {"request_id": "b", "prompt": "ignored", "prompt_token_ids": prompts["p1"],
         "outputs": [{"token_ids": out["p1"], "text": "..."}, {"token_ids": out["p1"][:N]}]},
        {"id": "c-len", "sequences": [prompts["p2"] + out["p2"]], "prompt_length": len(prompts["p2"])},
        {"id": "c-ids", "sequences": prompts["p0"] + out["p0"], "prompt_token_ids": prompts["p0"]},
    ]
    path = write_jsonl(tmp_path / "gens.jsonl", records[:2] + [""] + records[2:])  # a blank line is skipped
    result, doc = audit_tokens(path, "tiny", out=None)
    assert result.exit_code == 0, result.output
    assert doc["kind"] == "tokens-audit" and doc["verdict"] == "exact"
    assert [g["id"] for g in doc["generations"]] == ["a-ids", "a-text", "b/0", "b/1", "c-len", "c-ids"]
    assert [g["line"] for g in doc["generations"]] == [1, 2, 4, 4, 5, 6]
    assert all(g["exact"] and g["first_divergence"] is None for g in doc["generations"])
    assert doc["max_new_tokens"] == N and doc["n_from"] == "longest output"
    assert doc["counts"] == {"generations": 6, "exact": 6, "near-tie": 0, "real": 0, "stop": 0}
    assert (tmp_path / "audit_tokens.json").is_file()  # the default place: beside FILE
    assert "verdict: EXACT" in result.output


def test_limit_keeps_the_first_records(tiny_prompts, tmp_path):
    prompts, _, walks = tiny_prompts
    recs = [{"prompt_token_ids": prompts[p], "output_token_ids": [w["token"] for w in walks[p]]} for p in prompts]
    recs.append("not json at all")  # past the limit: never read
    result, doc = audit_tokens(write_jsonl(tmp_path / "g.jsonl", recs), "tiny", "--limit", "2")
    assert result.exit_code == 0, result.output
    assert [g["id"] for g in doc["generations"]] == ["line-1", "line-2"]


# --------------------------------------------------------------------------- divergences


def test_near_tie_and_real_divergence_by_margin(tiny_prompts, tmp_path):
    """Flip one token at the smallest and at the largest margin of the pristine path; with a tie
    margin between them, the first is a near-tie and the second a real divergence."""
    prompts, _, walks = tiny_prompts
    spots = sorted(((w["margin"], pid, i) for pid in prompts for i, w in enumerate(walks[pid])))
    lo, lo_pid, lo_i = spots[0]
    hi, hi_pid, hi_i = next(s for s in reversed(spots) if s[1] != lo_pid)  # each prompt diverges once
    assert lo < hi
    recs = []
    for pid in prompts:
        tokens = [w["token"] for w in walks[pid]]
        if pid == lo_pid:
            tokens = flipped(tokens, walks[pid], lo_i)
        if pid == hi_pid:
            tokens = flipped(tokens, walks[pid], hi_i)
        recs.append({"id": pid, "prompt_token_ids": prompts[pid], "output_token_ids": tokens})
    path = write_jsonl(tmp_path / "spec.jsonl", recs)
    result, doc = audit_tokens(path, "tiny", "--tie-margin", str((lo + hi) / 2))
    assert result.exit_code == 1, result.output
    gens = {g["id"]: g for g in doc["generations"]}
    tie = gens[lo_pid]["first_divergence"]
    assert tie["position"] == lo_i and tie["class"] == "near-tie" and tie["margin"] == tie["gap"] == lo
    assert tie["emitted"] == walks[lo_pid][lo_i]["runner_up"] and tie["greedy"] == walks[lo_pid][lo_i]["token"]
    assert len(tie["top5"]) == 5 and tie["top5"][0][0] == tie["greedy"]
    real = gens[hi_pid]["first_divergence"]
    assert real["position"] == hi_i and real["class"] == "real" and real["margin"] == hi
    assert doc["verdict"] == "real divergences"
    assert doc["tie_margin"] == {"mode": "fixed", "value": (lo + hi) / 2}
    # the default tolerance: TIE_ULPS ulps of bf16 at the top-1 logit
    _, doc = audit_tokens(path, "tiny")
    tie = {g["id"]: g for g in doc["generations"]}[lo_pid]["first_divergence"]
    assert tie["tolerance"] == TIE_ULPS * ulp(tie["top5"][0][1], torch.bfloat16)
    assert tie["class"] == ("near-tie" if lo <= tie["tolerance"] else "real")


def test_ulp_is_bf16_spacing():
    assert ulp(1.0, torch.bfloat16) == 2 ** -7
    assert ulp(1.99, torch.bfloat16) == 2 ** -7
    assert ulp(-12.0, torch.bfloat16) == 2 ** -4  # [8, 16): 8 * 2^-7
    assert ulp(0.0, torch.bfloat16) > 0


def test_stopping_early_is_caught(tiny_prompts, tmp_path):
    prompts, _, walks = tiny_prompts
    tokens = [w["token"] for w in walks["p0"]]
    path = write_jsonl(tmp_path / "g.jsonl", [{"prompt_token_ids": prompts["p0"], "output_token_ids": tokens[:5]}])
    result, doc = audit_tokens(path, "tiny", "-n", str(N))
    assert result.exit_code == 1
    d = doc["generations"][0]["first_divergence"]
    assert d["class"] == "stop" and d["position"] == 5 and d["stop"].startswith("stopped early")
    assert doc["n_from"] == "-n" and doc["verdict"] == "real divergences"


# --------------------------------------------------------------------------- bad input


BAD = {
    "invalid-json": (['{"prompt_token_ids": [1], "output_token_ids": [2]}', '{"prompt_token_ids": [1'], 2, "not valid JSON"),
    "not-object": (["[1, 2, 3]"], 1, "not a JSON object"),
    "no-output": ([{"id": "x", "prompt_token_ids": [1, 2]}], 1, "'output_token_ids'"),
    "no-prompt": ([{"prompt_token_ids": [1], "output_token_ids": [2]}, {"output_token_ids": [3]}], 2,
                  "'prompt_token_ids'"),
    "output-no-token-ids": ([{"prompt_token_ids": [1], "outputs": [{"text": "hi"}]}], 1, "outputs[0] lacks 'token_ids'"),
    "sequences-unsplit": ([{"sequences": [[1, 2, 3]]}], 1, "'prompt_length'"),
    "prompt-mismatch": ([{"sequences": [[1, 2, 3]], "prompt_token_ids": [2]}], 1, "'prompt_token_ids'"),
    "not-ints": ([{"prompt_token_ids": [1, "a"], "output_token_ids": [2]}], 1, "'prompt_token_ids'"),
    "outside-vocab": ([{"prompt_token_ids": [1], "output_token_ids": [2]}, {"prompt_token_ids": [1],
                       "output_token_ids": [99999]}], 2, "99999 outside the model's vocabulary"),
    "duplicate-id": ([{"id": "q", "prompt_token_ids": [1], "output_token_ids": [2]},
                      {"id": "q", "prompt_token_ids": [1], "output_token_ids": [2]}], 2, "'q' already used on line 1"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_lines_give_one_clean_error(case, tmp_path):
    lines, lineno, field = BAD[case]
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    out = tmp_path / "audit_tokens.json"
    result, doc = audit_tokens(path, "tiny", out=out)
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output
    assert f"line {lineno}" in errors[0] and field in errors[0], errors[0]
    assert doc is None and list(tmp_path.iterdir()) == [path]  # nothing written, no temporary file


def test_unknown_model_and_missing_file_are_bad_input(tmp_path):
    result, _ = audit_tokens(tmp_path / "none.jsonl", "tiny")
    assert result.exit_code == 2 and "no such file" in result.output
    path = write_jsonl(tmp_path / "g.jsonl", [{"prompt_token_ids": [1], "output_token_ids": [2]}])
    result, doc = audit_tokens(path, "no-such-model")
    assert result.exit_code == 2 and doc is None and "cannot load model" in result.output


# --------------------------------------------------------------------------- `small`: real ties, EOS, reference


@pytest.fixture(scope="module")
def small_walks(small):
    tok = small.tokenizer.get()
    prompts = {f"q{i}": list(tok.encode(t)) for i, t in enumerate(CODE_PROMPTS)}
    return prompts, {pid: greedy_walk(small, ids, 24) for pid, ids in prompts.items()}


def test_small_default_tolerance_tells_ties_from_real(small, small_walks, tmp_path):
    """On `small`, with the default (bf16 ulp) tolerance: a flip where the pristine margin is within
    it is a near-tie, a flip at the largest margin is real; the reference (the unflipped outputs)
    shows where speculation changed a greedy output."""

    prompts, walks = small_walks
    tol = {(pid, i): TIE_ULPS * ulp(w["top1"], torch.bfloat16) for pid in walks for i, w in enumerate(walks[pid])}
    ties = [(pid, i) for (pid, i), t in tol.items() if walks[pid][i]["margin"] <= t]
    assert ties, "small's greedy paths on these prompts hold a near-tie"
    tie_pid, tie_i = ties[0]
    real_pid, real_i = max(((p, i) for p in walks if p != tie_pid for i in range(len(walks[p]))),
                           key=lambda pi: walks[pi[0]][pi[1]]["margin"])
    plain = {pid: [w["token"] for w in walks[pid]] for pid in prompts}
    spec = dict(plain)
    spec[tie_pid] = flipped(plain[tie_pid], walks[tie_pid], tie_i)
    spec[real_pid] = flipped(plain[real_pid], walks[real_pid], real_i)
    ref = write_jsonl(tmp_path / "plain.jsonl", [{"id": p, "prompt_token_ids": prompts[p], "output_token_ids": plain[p]}
                                                 for p in prompts])
    path = write_jsonl(tmp_path / "spec.jsonl", [{"id": p, "prompt_token_ids": prompts[p], "output_token_ids": spec[p]}
                                                 for p in reversed(list(prompts))])  # matched by id, not line
    result, doc = audit_tokens(path, "small", "--reference", str(ref))
    assert result.exit_code == 1, result.output
    gens = {g["id"]: g for g in doc["generations"]}
    assert gens[tie_pid]["first_divergence"]["class"] == "near-tie"
    assert gens[real_pid]["first_divergence"]["class"] == "real"
    assert doc["counts"]["near-tie"] == 1 and doc["counts"]["real"] == 1
    assert doc["verdict"] == "real divergences"
    assert doc["reference"]["matched_by"] == "id" and doc["reference"]["parted"] == 2
    for pid, i, cls in ((tie_pid, tie_i, "near-tie"), (real_pid, real_i, "real")):
        part = gens[pid]["reference"]
        assert part["parts"] and part["position"] == i and part["class"] == cls
        assert part["reference"] == part["greedy"] == plain[pid][i] and part["emitted"] == spec[pid][i]
        assert part["cause"].startswith("speculation changed the output")
    other = next(p for p in prompts if p not in (tie_pid, real_pid))
    assert gens[other]["reference"]["parts"] is False
    assert "against the reference:" in result.output

    # without the flip at the near-tie, only near-ties are left when the real one goes too
    spec_ties = write_jsonl(tmp_path / "ties.jsonl", [{"id": tie_pid, "prompt_token_ids": prompts[tie_pid],
                                                       "output_token_ids": spec[tie_pid]}])
    result, doc = audit_tokens(spec_ties, "small", "-n", "24")
    assert result.exit_code == 1 and doc["verdict"] == "near-ties only"


def test_reference_that_was_never_greedy(small, small_walks, tmp_path):
    """Both outputs leave greedy at the same early position, then part later: the engine was not
    greedy-exact before speculation. Matched by line (no ids)."""
    prompts, walks = small_walks
    pid = "q0"
    plain = [w["token"] for w in walks[pid]]
    early, late = 2, 10
    both = flipped(plain, walks[pid], early)
    # after the early flip the context differs from greedy's: part at `late` with some other token
    spec = both[:late] + [(both[late] + 1) % small.vocab_size] + both[late + 1:]
    ref = write_jsonl(tmp_path / "plain.jsonl", [{"prompt_token_ids": prompts[pid], "output_token_ids": both}])
    path = write_jsonl(tmp_path / "spec.jsonl", [{"prompt_token_ids": prompts[pid], "output_token_ids": spec}])
    result, doc = audit_tokens(path, "small", "--reference", str(ref))
    assert result.exit_code == 1
    g = doc["generations"][0]
    assert g["first_divergence"]["position"] == early
    part = g["reference"]
    assert doc["reference"]["matched_by"] == "line" and part["position"] == late
    assert part["prefix"] == f"departs from greedy at position {early}"
    assert part["cause"].startswith("engine not greedy-exact") and part["greedy"] is not None
    assert part["margin"] is not None and len(part["top5"]) == 5


def test_running_past_eos_is_caught(small, tmp_path):
    ids = list(small.tokenizer.get().encode(EOS_PROMPT))
    walk = greedy_walk(small, ids, 4)
    assert walk[0]["token"] in small.eos_token_ids  # greedy stops at once here
    eos = walk[0]["token"]
    recs = [{"id": "stops", "prompt_token_ids": ids, "output_token_ids": [eos]},
            {"id": "runs-on", "prompt_token_ids": ids, "output_token_ids": [eos, 5, 6]},
            # generate pads a finished row with its pad id (an EOS id for Qwen): not a run past EOS
            {"id": "padded", "sequences": [ids + [eos, eos, eos]], "prompt_length": len(ids)}]
    result, doc = audit_tokens(write_jsonl(tmp_path / "g.jsonl", recs), "small")
    assert result.exit_code == 1
    gens = {g["id"]: g for g in doc["generations"]}
    assert gens["stops"]["exact"] and gens["stops"]["ends_with_eos"] and gens["padded"]["exact"]
    d = gens["runs-on"]["first_divergence"]
    assert d["class"] == "stop" and d["position"] == 1 and d["stop"] == "ran past an EOS"
    assert doc["counts"]["stop"] == 1 and doc["verdict"] == "real divergences"


# --------------------------------------------------------------------------- the report


def test_reports_render_shows_a_tokens_audit(tiny_prompts, tmp_path):
    prompts, _, walks = tiny_prompts
    recs = []
    for k, pid in enumerate(prompts):
        tokens = [w["token"] for w in walks[pid]]
        recs.append({"id": pid, "prompt_token_ids": prompts[pid],
                     "output_token_ids": flipped(tokens, walks[pid], 3) if k else tokens})
    path = write_jsonl(tmp_path / "gens.jsonl", recs)
    result, doc = audit_tokens(path, "tiny", out=None)
    assert result.exit_code == 1
    res = CliRunner().invoke(reports_main, ["render", str(tmp_path)])
    assert res.exit_code == 0, res.output
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# Token audit: gens.jsonl · tiny") and "## Token audit" in report
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]]
            for ln in report.splitlines() if ln.startswith("| `")}
    gens = {g["id"]: g for g in doc["generations"]}
    assert set(rows) == {f"`{pid}`" for pid in prompts}
    for pid in prompts:
        row, g = rows[f"`{pid}`"], gens[pid]
        assert row[1] == ("yes" if g["exact"] else "**NO**")
        assert row[6] == (g["first_divergence"]["class"] if g["first_divergence"] else "—")
    assert f"| Verdict | **{doc['verdict'].upper()}** |" in report
    png = tmp_path / "figures" / "token_margins.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "](figures/token_margins.png)" in report


def test_stream_export_audits_exact(tmp_path):
    """bench/stream_to_tokens.py: a harness stream's candidate legs as shape (a), exact under audit."""
    stream = run_harness(tmp_path / "run", "spec", limit=2, n=12, legs=1)
    out = tmp_path / "run" / "candidate.jsonl"
    script = Path(__file__).resolve().parent.parent / "bench" / "stream_to_tokens.py"
    proc = subprocess.run([sys.executable, str(script), str(stream), str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "-n 12" in proc.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    legs = [r for r in map(json.loads, stream.read_text().splitlines()) if r["type"] == "leg"
            and r["role"] == "candidate" and r["leg"] == 0]
    assert [r["output_token_ids"] for r in records] == [leg["tokens"] for leg in legs]
    result, doc = audit_tokens(out, "tiny", "-n", "12")
    assert result.exit_code == 0, result.output
    assert doc["verdict"] == "exact" and [g["id"] for g in doc["generations"]] == [r["id"] for r in records]

    # beside a stream, the token audit is a section of the run's report (after the run's own)
    render_run(stream.parent)
    report = (stream.parent / "report.md").read_text()
    assert report.startswith("# Run report:") and "## Appendix: decoder configurations" in report
    assert report.index("## Appendix") < report.index("## Token audit")
    assert "| Verdict | **EXACT** |" in report and "No generation diverged on a token" in report
    assert not (stream.parent / "figures" / "token_margins.png").exists()


def test_refused_under_torchrun(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    path = write_jsonl(tmp_path / "g.jsonl", [{"prompt_token_ids": [1], "output_token_ids": [2]}])
    result, doc = audit_tokens(path, "tiny")
    assert result.exit_code == 2 and "without torchrun" in result.output and doc is None


def test_a_document_for_a_closed_or_failing_stdout_is_an_error_not_a_silent_loss(monkeypatch):
    """`--out -` with stdout closed (``>&-``) or full: one error, never exit 0 with the document lost."""
    import io

    from audit.report import write_document
    from audit.stream import BadInput
    from audit.tokens import TokensOptions, out_destination

    monkeypatch.setattr(sys, "stdout", None)
    with pytest.raises(UserError, match="stdout is closed"):
        out_destination(TokensOptions(file="x.jsonl", model="tiny", out="-"))
    with pytest.raises(BadInput, match="stdout is closed"):
        write_document(None, {"a": 1}, "table")

    class Full(io.StringIO):
        def write(self, text):
            raise OSError(28, "No space left on device")
    monkeypatch.setattr(sys, "stdout", Full())
    with pytest.raises(BadInput, match="No space left on device"):
        write_document(None, {"a": 1}, "table")
