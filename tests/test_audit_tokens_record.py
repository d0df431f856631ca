"""`audit tokens` honours a line's own ``max_new_tokens``: an output that stopped at its own N is
exact, one longer than its own N is a stop divergence, and a bad value is one clean error. The
lines are written by ``core.records`` as ``harness generate --record`` writes them."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from audit.cli import main as audit_main
from core.records import append_record, generation_record
from decoders.serial import SerialDecoder


@pytest.fixture(scope="module")
def stream(tiny, tiny_tokenizer):
    ids = tiny_tokenizer.encode("The river ran")
    dec = SerialDecoder()
    dec.prepare(tiny)
    tokens = dec.decode(ids, 16).tokens
    assert len(tokens) == 16 and not set(tokens) & set(tiny.eos_token_ids)
    return ids, tokens


def audit(path, *args):
    out = path.parent / "audit_tokens.json"
    res = CliRunner().invoke(audit_main, ["tokens", str(path), "--model", "tiny", "--device", "cpu",
                                          "--out", str(out), *args])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res, json.loads(out.read_text()) if out.exists() else None


def test_outputs_with_their_own_n_pass(stream, tmp_path):
    ids, tokens = stream
    path = tmp_path / "record.jsonl"
    for i, n in enumerate((4, 16, 9)):
        append_record(path, generation_record(f"g{i}", ids, tokens[:n], n, "spec", "tiny"))
    res, doc = audit(path)
    assert res.exit_code == 0, res.output
    assert doc["verdict"] == "exact" and doc["counts"]["exact"] == 3
    assert doc["n_from"].startswith("unused") and [g["max_new_tokens"] for g in doc["generations"]] == [4, 16, 9]
    assert "N = each line's own" in res.output
    # without the field the short ones stopped early against the longest output's N
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({k: v for k, v in json.loads(line).items() if k != "max_new_tokens"}) + "\n"
                             for line in path.read_text().splitlines()))
    res, doc = audit(plain)
    assert res.exit_code == 1 and doc["counts"]["stop"] == 2


def test_own_n_overrides_dash_n(stream, tmp_path):
    ids, tokens = stream
    path = tmp_path / "record.jsonl"
    append_record(path, generation_record("g", ids, tokens[:5], 5, "spec", "tiny"))
    res, _ = audit(path, "-n", "12")
    assert res.exit_code == 0, res.output


def test_output_longer_than_its_own_n_is_a_stop_divergence(stream, tmp_path):
    ids, tokens = stream
    path = tmp_path / "record.jsonl"
    append_record(path, generation_record("long", ids, tokens[:10], 6, "spec", "tiny"))
    res, doc = audit(path)
    assert res.exit_code == 1
    first = doc["generations"][0]["first_divergence"]
    assert first["class"] == "stop" and first["position"] == 6


@pytest.mark.parametrize("bad", [0, -3, True, "8", 2.5, [4]])
def test_bad_max_new_tokens_is_one_error_line(stream, tmp_path, bad):
    ids, tokens = stream
    path = tmp_path / "record.jsonl"
    path.write_text(json.dumps({"id": "x", "prompt_token_ids": ids, "output_token_ids": tokens[:4],
                                "max_new_tokens": bad}) + "\n")
    res, doc = audit(path)
    assert res.exit_code == 2 and doc is None
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert lines[-1].startswith("error:") and "'max_new_tokens' must be a positive integer" in lines[-1]
