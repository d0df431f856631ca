"""Property: whatever is done to a real file, the audit answers with an exit code, never a crash.

A stream recorded on `tiny` (one per module) and a file of `tiny`'s greedy generations are
mutated by hypothesis: a JSON value anywhere replaced by a bool, null, a huge, negative or
non-finite number, a subnormal, a string with a lone surrogate, a list or an object; lines
dropped, duplicated or swapped; the file cut short, garbage bytes written in, a byte flipped;
with the stream's seal recomputed or not. Then `audit replay` (or `audit tokens`) runs in-process
and must end in exit 0, 1 or 2, without a traceback; on exit 2 with one ``error:`` line and
nothing written (no document, no temporary file); on 0 or 1 with a document that is strict JSON.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from audit_helpers import run_harness, write_records
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from audit.cli import main as audit_main

# Few examples, each a real replay on tiny, drawn the same way on every run (derandomized, no
# example database) so that a failure in CI reproduces; AUDIT_FUZZ_EXAMPLES=500 draws that many at
# random instead, to explore. The fixtures are module-scoped and only read; each example writes
# into a temporary folder of its own, so no state passes from one example to the next (a
# function-scoped fixture such as tmp_path would be shared by every example: its health check
# stays on, and none is used).
EXPLORE = os.environ.get("AUDIT_FUZZ_EXAMPLES")
FUZZ = settings(max_examples=int(EXPLORE or 25), deadline=None, database=None, derandomize=not EXPLORE,
                suppress_health_check=[HealthCheck.too_slow])

SURROGATES = st.text(alphabet=st.sampled_from(["a", "\ud800", "\udfff", "\u00e9", "\x00"]), min_size=1, max_size=4)
HOSTILE_VALUES = st.one_of(
    st.booleans(), st.none(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.sampled_from([0, -1, 1 << 63, -(1 << 63) - 1, 10 ** 30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e-320, 5e-324, 1e308, -1e308, 1e-9, 1e7]),
    SURROGATES,
    st.lists(st.booleans(), max_size=3),
    st.just({}), st.just([]),
)


def paths_into(value, prefix=()):
    """Every (path, value) inside a JSON value, the value itself first."""
    yield prefix, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths_into(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths_into(v, prefix + (i,))


def set_at(record, path, value):
    target = record
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value


# the fields the audit computes with: ids, token lists, leg numbers and times, counts, the seal
FIELDS = ("id", "prompt_id", "token_ids", "warmup_ids", "tokens", "output_token_ids", "prompt_token_ids", "leg",
          "order", "role", "wall_s", "t_start", "t_end", "peak_mem_bytes", "legs", "max_new_tokens", "prompts",
          "model", "device", "records", "sha256", "median_ratio", "ratio", "control_median_s", "world_size",
          "prompt", "outputs", "sequences", "prompt_length")


def field_paths(record: dict) -> list[tuple]:
    """Paths to the named fields and to the first element of each list among them."""
    out = []
    for key in FIELDS:
        if key in record:
            out.append((key,))
            if isinstance(record[key], list) and record[key]:
                out.append((key, 0))
    return out


def rename_prompt(records: list, new_id) -> None:
    """A prompt's id changed everywhere it is named, as a careful forger would."""
    old = next((r.get("id") for r in records if r.get("type") == "prompt"), None)
    for r in records:
        for key in ("id", "prompt_id"):
            if key in r and r[key] == old:
                r[key] = new_id


def mutate_records(data, records: list) -> list:
    """One structural or value mutation of parsed records."""
    records = json.loads(json.dumps(records))
    kind = data.draw(st.sampled_from(["field", "field", "field", "value", "rename", "drop", "duplicate", "swap"]),
                     label="mutation")
    i = data.draw(st.integers(0, len(records) - 1), label="record")
    if kind == "field" and field_paths(records[i]):
        path = data.draw(st.sampled_from(field_paths(records[i])), label="field")
        set_at(records[i], path, data.draw(HOSTILE_VALUES, label="value"))
    elif kind in ("field", "value"):
        path = data.draw(st.sampled_from([p for p, _ in paths_into(records[i]) if p]), label="path")
        set_at(records[i], path, data.draw(HOSTILE_VALUES, label="value"))
    elif kind == "rename":
        rename_prompt(records, data.draw(st.one_of(SURROGATES, HOSTILE_VALUES), label="new id"))
    elif kind == "drop":
        del records[i]
    elif kind == "duplicate":
        records.insert(i, json.loads(json.dumps(records[i])))
    else:
        j = data.draw(st.integers(0, len(records) - 1), label="other")
        records[i], records[j] = records[j], records[i]
    return records


def mutate_bytes(data, raw: bytes) -> bytes:
    kind = data.draw(st.sampled_from(["truncate", "garbage", "flip"]), label="bytes")
    at = data.draw(st.integers(0, max(len(raw) - 1, 0)), label="at")
    if kind == "truncate":
        return raw[:at]
    if kind == "garbage":
        return raw[:at] + data.draw(st.binary(min_size=1, max_size=64), label="garbage") + raw[at:]
    return raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255), label="bits")]) + raw[at + 1:]


def write_mutated(data, path: Path, records: list, raw: bytes, reseal_allowed: bool) -> None:
    if data.draw(st.booleans(), label="edit bytes instead of values"):
        path.write_bytes(mutate_bytes(data, raw))
        return
    mutated = mutate_records(data, records)
    reseal = reseal_allowed and data.draw(st.booleans(), label="reseal")
    try:
        write_records(path, mutated, reseal=reseal and bool(mutated) and mutated[-1].get("type") == "end")
    except (ValueError, TypeError, UnicodeEncodeError):
        # a value the writer will not seal: write the lines plainly (NaN and all), unsealed
        path.write_text("".join(json.dumps(r) + "\n" for r in mutated), encoding="utf-8", errors="surrogatepass")


def assert_clean_answer(result, folder: Path, inputs: set[str], document: str) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code in (0, 1, 2), result.output
    assert "Traceback" not in result.output and "Traceback" not in result.stderr
    left = {p.name for p in folder.iterdir()}
    if result.exit_code == 2:
        errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and result.stderr.strip().splitlines()[-1] == errors[0], result.stderr
        assert left == inputs, left - inputs  # nothing written, no temporary file
    else:
        json.loads((folder / document).read_text(), parse_constant=pytest.fail)  # strict JSON
        assert left == inputs | {document}, left


# --------------------------------------------------------------------------- audit replay


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = run_harness(tmp_path_factory.mktemp("fuzz") / "run", "serial", limit=2, n=6, legs=2)
    return [json.loads(line) for line in path.read_text().splitlines()], path.read_bytes()


@FUZZ
@given(data=st.data())
def test_a_mutated_stream_gets_exit_0_1_or_2_never_a_traceback_and_nothing_written_on_2(recorded, data):
    records, raw = recorded
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        stream = folder / "stream.jsonl"
        write_mutated(data, stream, records, raw, reseal_allowed=True)
        result = CliRunner().invoke(audit_main, ["replay", str(stream)])
        assert_clean_answer(result, folder, {"stream.jsonl"}, "audit.json")


# --------------------------------------------------------------------------- audit tokens


@pytest.fixture(scope="module")
def generations(tiny):
    from audit.replay import PristineSerial, greedy_and_top

    lines = []
    for k, prompt in enumerate([[5, 6, 7, 8], [40, 41, 42]]):
        stepper, out = PristineSerial(tiny), []
        logits = stepper.start(prompt)
        for _ in range(6):
            out.append(greedy_and_top(logits)[0])
            if out[-1] in tiny.eos_token_ids:
                break
            logits = stepper.step(out[-1])
        lines.append({"id": f"q{k}", "prompt_token_ids": prompt, "output_token_ids": out})
    lines.append({"id": "q2", "prompt": "The river", "outputs": [{"token_ids": lines[0]["output_token_ids"]}]})
    return lines


@FUZZ
@given(data=st.data())
def test_a_mutated_tokens_file_gets_exit_0_1_or_2_never_a_traceback_and_nothing_written_on_2(generations, data):
    raw = "".join(json.dumps(r) + "\n" for r in generations).encode()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        gens, ref = folder / "gens.jsonl", folder / "ref.jsonl"
        write_mutated(data, gens, generations, raw, reseal_allowed=False)
        args = ["tokens", str(gens), "--model", "tiny", "--device", "cpu"]
        inputs = {"gens.jsonl"}
        if data.draw(st.booleans(), label="with a reference"):
            if data.draw(st.booleans(), label="mutate the reference too"):
                write_mutated(data, ref, generations, raw, reseal_allowed=False)
            else:
                ref.write_bytes(raw)
            args += ["--reference", str(ref)]
            inputs.add("ref.jsonl")
        result = CliRunner().invoke(audit_main, args)
        assert_clean_answer(result, folder, inputs, "audit_tokens.json")
