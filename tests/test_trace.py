"""Acceptance traces (decoders/trace/) and the instrument that replays them (CPU, tiny).

A recorded trace round-trips through its file and carries the serial stream; replayed by
``spec-instrument trace=FILE`` every round accepts exactly the drafts the trace marks (checked
round by round from the decoder's own depth trace), and the emitted stream stays the control's.
tiny's random head accepts almost nothing, so the replay tests use a trace with a dense, known
pattern of accepted drafts written in the same format.
"""
import json
import random

import pytest

from core.errors import UserError
from core.models import load_model
from core.prompts import load_prompts
from core.sampling import Sampler
from core.schema import write_json_atomic
from decoders import get_decoder
from decoders import trace as T
from decoders.trace.cli import main as trace_main
from decoders.trace.record import record
from decoders.policy import Costs
from decoders.serial import SerialDecoder
from decoders.spec import SpecDecoder

N = 48


@pytest.fixture(scope="module")
def prompts(tiny):
    return load_prompts("dev", tiny, limit=3)[0]


@pytest.fixture(scope="module")
def streams(tiny, prompts):
    serial = SerialDecoder()
    serial.prepare(tiny)
    return [serial.decode(p.token_ids, N).tokens for p in prompts]


def test_recorded_trace_round_trips_and_follows_the_serial_stream(tiny, prompts, streams, tmp_path):
    data = record(tiny, prompts, N, max_depth=4)
    path = tmp_path / "trace.json"
    write_json_atomic(path, data)
    back = T.load(path)
    assert back.max_depth == 4 and back.max_new_tokens == N and back.meta["model"]["name"] == "tiny"
    assert [r.tokens for r in back.rows] == streams  # teacher-forced along the exact greedy stream
    for row, p in zip(back.rows, prompts):
        assert row.prompt_id == p.id and row.prompt_sha256 == T.prompt_sha256(p.token_ids)
        assert [len(b) for b in row.bits] == [min(4, len(row.tokens) - 1 - t) for t in range(len(row.tokens))]
        assert back.row_for(p.token_ids) is row
    per_depth = data["acceptance"]["per_depth"]
    ones = sum(b.count("1") for r in back.rows for b in r.bits)
    assert len(per_depth) == 4 and per_depth[0]["opportunities"] == sum(len(r.bits) - 1 for r in back.rows)
    assert per_depth[0]["accepted"] == sum(b[0] == "1" for r in back.rows for b in r.bits if b)
    assert sum(d["accepted"] for d in per_depth) <= ones
    assert json.loads(path.read_text())["rows"][0]["bits"] == back.rows[0].bits


def test_cli_writes_a_trace_and_reports_bad_input_in_one_line(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert trace_main(["--model", "tiny", "--prompts", "dev", "--limit", "2", "-n", "12", "--max-depth", "3",
                   "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "traced 1/2" in err and "traced 2/2" in err
    loaded = T.load(out)
    assert len(loaded.rows) == 2 and loaded.meta["prompts"]["source"] == "builtin:dev"
    for argv, needle in ((["--model", "no-such-model"], "no-such-model"), (["--model", "tiny", "--max-depth", "0"], "max-depth"),
                         (["--model", "tiny", "--limit", "0"], "--limit"),
                         (["--model", "tiny", "--prompts", str(tmp_path / "none.jsonl")], "not found")):
        target = tmp_path / "bad.json"
        assert trace_main([*argv, "--out", str(target)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and needle in err[0] and not target.exists()
    assert trace_main(["--model", "tiny", "--out", str(tmp_path)]) == 2
    assert "directory" in capsys.readouterr().err


def dense_trace(prompts, streams, depth: int, seed: int, p: float = 0.7) -> dict:
    """A trace in the recorded format whose bits are drawn with P(1) = p, independently."""
    rng = random.Random(seed)
    rows = []
    for prompt, tokens in zip(prompts, streams):
        bits = ["".join("1" if rng.random() < p else "0" for _ in range(min(depth, len(tokens) - 1 - t)))
                for t in range(len(tokens))]
        rows.append({"id": prompt.id, "prompt_sha256": T.prompt_sha256(prompt.token_ids), "tokens": tokens,
                     "bits": bits})
    return {"format": T.FORMAT, "model": {"name": "synthetic", "identity": {}}, "drafter": {},
            "max_new_tokens": len(streams[0]), "max_depth": depth, "rows": rows,
            "acceptance": T.summarize([r["bits"] for r in rows], depth)}


def replay_rounds(trace: T.Trace, row: T.TraceRow, depth_trace: list[int]) -> tuple[dict, int]:
    """What each round must accept, from the decoder's own depths: (accept_hist, tokens emitted)."""
    emitted, hist = 1, {}
    for d in depth_trace:
        if d == 0:
            emitted += 1
            continue
        j = 0
        while j < d and trace.accepts(row, emitted - 1, j + 1):
            j += 1
        hist[j] = hist.get(j, 0) + 1
        emitted += j + 1
    return hist, emitted


@pytest.mark.parametrize("args", [{"depth": 1}, {"depth": 3}, {"depth": 6}, {"max_depth": 6, "online_costs": False}])
def test_instrument_accepts_exactly_the_traced_drafts(tiny, prompts, streams, tmp_path, args):
    path = tmp_path / "dense.json"
    write_json_atomic(path, dense_trace(prompts, streams, 6, seed=len(args) + args.get("depth", 0)))
    trace = T.load(path)
    dec = get_decoder("spec-instrument", trace=str(path), **args)
    dec.prepare(tiny)
    if "depth" not in args:  # adaptive: costs shaped like the H200's, so that depths vary (test_spec.py)
        dec.costs = Costs(step=1.0, draft=0.05, verify={w: 1 + 0.1 * (w - 1) for w in range(1, 8)})
    assert dec.config()["trace"] == str(path) and dec.config()["alpha"] is None and dec.instrument
    accepted = 0
    for p, want in zip(prompts, streams):
        res = dec.decode(p.token_ids, N)
        assert res.tokens == want
        hist, emitted = replay_rounds(trace, trace.row_for(p.token_ids), res.stats.extra["depth_trace"])
        assert {int(k): v for k, v in res.stats.to_json()["accept_hist"].items()} == hist
        assert emitted >= len(want)  # the last round may overshoot n; its extra tokens are cut
        accepted += res.stats.accepted
    assert accepted > N  # the dense trace drives long accepted runs
    if "depth" not in args:
        assert len(set(res.stats.extra["depth_trace"])) > 2


def test_sampled_trace_follows_the_sampled_stream_and_its_replay_is_exact(tiny, prompts, tmp_path, capsys):
    """``--sampling``: the stream is the sampled control's; coupled drafts accept more than plain
    argmax ones on tiny at T = 1 (both near uniform, so the shared noise decides); replaying a
    trace under that sampler, the instrument accepts the traced drafts and emits the sampled
    control's stream."""
    sampler = Sampler(temperature=1.0, seed=4)
    serial = SerialDecoder()
    serial.prepare(tiny)
    sampled = [serial.decode(p.token_ids, 24, sampler=sampler).tokens for p in prompts]
    coupled = record(tiny, prompts, 24, max_depth=3, sampler=sampler)
    plain = record(tiny, prompts, 24, max_depth=3, sampler=sampler, coupled=False)
    assert [r["tokens"] for r in coupled["rows"]] == [r["tokens"] for r in plain["rows"]] == sampled
    assert coupled["drafter"]["sampler"] == sampler.to_json() and coupled["drafter"]["coupled"] is True
    assert plain["drafter"]["coupled"] is False
    first = [data["acceptance"]["per_depth"][0]["accepted"] for data in (coupled, plain)]
    assert first[0] > 2 * first[1] + 2
    path = tmp_path / "dense.json"
    write_json_atomic(path, dense_trace(prompts, sampled, 3, seed=9))
    trace = T.load(path)
    dec = get_decoder("spec-instrument", trace=str(path), depth=3)
    dec.prepare(tiny)
    for p, want in zip(prompts, sampled):
        res = dec.decode(p.token_ids, 24, sampler=sampler)
        assert res.tokens == want
        hist, _ = replay_rounds(trace, trace.row_for(p.token_ids), res.stats.extra["depth_trace"])
        assert {int(k): v for k, v in res.stats.to_json()["accept_hist"].items()} == hist
    out = tmp_path / "t.json"
    assert trace_main(["--model", "tiny", "--prompts", "dev", "--limit", "1", "-n", "8", "--max-depth", "2",
                   "--sampling", "qwen-thinking,seed=3", "--out", str(out)]) == 0
    assert T.load(out).meta["drafter"]["sampler"]["top_k"] == 20
    capsys.readouterr()
    for argv, needle in ((["--sampling", "temperature=-1"], "--sampling"), (["--uncoupled"], "--uncoupled")):
        assert trace_main(["--model", "tiny", *argv, "--out", str(tmp_path / "bad.json")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and needle in err[0]


def test_other_prompts_and_longer_runs_cycle_through_the_trace(tiny, prompts, streams, tmp_path):
    path = tmp_path / "dense.json"
    write_json_atomic(path, dense_trace(prompts[:2], [s[:20] for s in streams[:2]], 4, seed=5))
    trace = T.load(path)
    other = prompts[2]
    assert trace.row_for(other.token_ids) in trace.rows  # untraced prompt: a row by its hash
    assert trace.row_for(other.token_ids) is trace.row_for(list(other.token_ids))
    dec = get_decoder("spec-instrument", trace=str(path), depth=4)
    dec.prepare(tiny)
    for p, want in zip(prompts, streams):  # N = 48 tokens against 20-token rows
        res = dec.decode(p.token_ids, N)
        assert res.tokens == want
        hist, _ = replay_rounds(trace, trace.row_for(p.token_ids), res.stats.extra["depth_trace"])
        assert {int(k): v for k, v in res.stats.to_json()["accept_hist"].items()} == hist
    row = T.TraceRow("x", "0" * 64, [1, 2, 3, 4, 5], ["11", "01", "10", "1", ""])
    assert T.Trace.accepts(row, 1, 2) and not T.Trace.accepts(row, 1, 1)
    assert T.Trace.accepts(row, 3, 2) == T.Trace.accepts(row, 0, 2)  # past the row's end: cycles (full rows 0..2)
    assert T.Trace.accepts(row, 7, 1) == T.Trace.accepts(row, 7 % 4, 1)


def test_bad_trace_files_and_arguments_are_user_errors(tmp_path, prompts, streams):
    good = dense_trace(prompts[:1], streams[:1], 3, seed=1)
    cases = {"missing": None, "not json": "{", "format": {**good, "format": "other"},
             "bits": {**good, "rows": [{**good["rows"][0], "bits": good["rows"][0]["bits"][:-1]}]},
             "chars": {**good, "rows": [{**good["rows"][0], "bits": ["1x1"] + good["rows"][0]["bits"][1:]}]}}
    for name, content in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.json"
        if content is not None:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(UserError, match=str(path.name)):
            get_decoder("spec-instrument", trace=str(path))
    path = tmp_path / "good.json"
    path.write_text(json.dumps(good))
    with pytest.raises(UserError, match="not both"):
        get_decoder("spec-instrument", trace=str(path), alpha=0.5)
    with pytest.raises(UserError, match="depth 3"):
        get_decoder("spec-instrument", trace=str(path), max_depth=6)
    with pytest.raises(UserError, match="depth 3"):
        get_decoder("spec-instrument", trace=str(path), depth=4)
    assert get_decoder("spec-instrument", trace=str(path), max_depth=3).trace.max_depth == 3


def test_trace_of_small_predicts_the_real_spec_rounds(tmp_path):
    """On `small`, whose head accepts often: replaying the recorded trace through spec's own depth
    choices gives exactly the accept counts the real head had in those rounds."""
    small = load_model("small", "cpu")
    prompts = load_prompts("stdlib-heldout", small, limit=1)[0]
    path = tmp_path / "small.json"
    write_json_atomic(path, record(small, prompts, 40, max_depth=4))
    trace = T.load(path)
    for depth in (2, 4):
        dec = SpecDecoder(depth=depth)
        dec.prepare(small)
        res = dec.decode(prompts[0].token_ids, 40)
        assert res.tokens == trace.rows[0].tokens
        hist, _ = replay_rounds(trace, trace.rows[0], res.stats.extra["depth_trace"])
        assert {int(k): v for k, v in res.stats.to_json()["accept_hist"].items()} == hist
        assert res.stats.accepted > 10


def test_head_ranks_leave_the_drafts_as_they_are_and_price_a_second_branch(tmp_path):
    """``head_top_k``: the same bits as a trace without ranks; a rank 0 wherever the first draft
    was accepted (greedy: the draft is the head's best); and a file that loads back."""
    small = load_model("small", "cpu")
    prompts = load_prompts("stdlib-heldout", small, limit=2)[0]
    plain = record(small, prompts, 40, max_depth=3)
    ranked = record(small, prompts, 40, max_depth=3, head_top_k=4)
    assert [r["bits"] for r in ranked["rows"]] == [r["bits"] for r in plain["rows"]]
    assert ranked["head_top_k"] == 4 and "ranks" not in plain["rows"][0]
    misses = 0
    for row in ranked["rows"]:
        assert len(row["ranks"]) == len(row["tokens"]) - 1
        for bits, rank in zip(row["bits"], row["ranks"]):
            assert (bits[0] == "1") == (rank == 0)
            misses += bits[0] == "0"
    branch = ranked["acceptance"]["second_branch"]
    assert branch["opportunities"] == sum(len(r["ranks"]) for r in ranked["rows"]) and misses > 0
    assert branch["in_top"]["1"] == ranked["acceptance"]["per_depth"][0]["accepted"] / branch["opportunities"]
    assert branch["misses_in_top"]["1"] == 0 and branch["misses_in_top"]["4"] >= branch["misses_in_top"]["2"]
    for d in ("1", "3"):  # a second branch never emits less
        assert (branch["tokens_per_round_at_fixed_depth"][d]
                >= ranked["acceptance"]["tokens_per_round_at_fixed_depth"][d])
    path = tmp_path / "ranked.json"
    write_json_atomic(path, ranked)
    assert T.load(path).rows[0].ranks == ranked["rows"][0]["ranks"]
    bad = {**ranked, "rows": [{**ranked["rows"][0], "ranks": ranked["rows"][0]["ranks"][:-1]}]}
    path.write_text(json.dumps(bad))
    with pytest.raises(UserError, match="ranks"):
        T.load(path)


def test_second_branch_counts_on_a_known_trace():
    # positions 0..4; first drafts: miss (token is branch 1), miss (no branch), hit, miss (branch 2)
    bits = [["0", "0", "1", "0", ""]]
    ranks = [[1, -1, 0, 2]]
    out = T.second_branch(bits, ranks, 1, 4)
    assert out["opportunities"] == 4
    assert out["in_top"] == {"1": 0.25, "2": 0.5, "3": 0.75, "4": 0.75}
    assert out["misses_in_top"] == {"1": 0.0, "2": 1 / 3, "3": 2 / 3, "4": 2 / 3}
    # with the branch: t=0 emits 2 (to t=2), t=2 accepts its draft: 2 (to t=4, the end)
    assert out["tokens_per_round_at_fixed_depth"] == {"1": 2.0}
    # without: t=0 1, t=1 1, t=2 2
    assert T.summarize(bits, 1)["tokens_per_round_at_fixed_depth"]["1"] == 4 / 3


def test_confidences_are_recorded_per_draft_and_steer_the_instruments_confidence_stop(tiny, prompts, streams, tmp_path):
    """Every draft's confidence is recorded as its tenth, one digit per bit; it loads back, bad
    digits are user errors, and past a row it cycles as the bits do. Replayed under
    ``stop=confidence`` from a trace whose confidences say exactly which drafts are right, no
    round drafts past the first draft the head doubts, the tokens stay the control's and each
    round accepts exactly what the trace marks."""
    data = record(tiny, prompts[:1], 16, max_depth=3)
    row = data["rows"][0]
    assert data["confidence"] is True and [len(c) for c in row["conf"]] == [len(b) for b in row["bits"]]
    assert all(set(c) <= set("0123456789") for c in row["conf"]) and len(data["acceptance"]["by_confidence"]) == 10
    seen = sum(b["drafts"] for b in data["acceptance"]["by_confidence"])
    assert seen == sum(min(len(b), b.find("0") + 1 if "0" in b else len(b)) for b in row["bits"])
    path = tmp_path / "recorded.json"
    write_json_atomic(path, data)
    assert T.load(path).rows[0].conf == row["conf"]
    for bad in ([c.replace("0", "x") for c in row["conf"]], row["conf"][:-1], None):
        broken = {**data, "rows": [{**row, "conf": bad} if bad is not None else
                                   {k: v for k, v in row.items() if k != "conf"}]}
        path.write_text(json.dumps(broken))
        with pytest.raises(UserError, match="conf"):
            T.load(path)
    short = T.TraceRow("x", "0" * 64, [1, 2, 3, 4], ["11", "01", "1", ""], conf=["93", "09", "5", ""])
    assert T.Trace.confidence(short, 0, 1) == 0.95 and T.Trace.confidence(short, 1, 2) == 0.95
    assert T.Trace.confidence(short, 5, 2) == T.Trace.confidence(short, 1, 2)  # cycles (full rows 0..1)
    assert T.Trace.confidence(T.TraceRow("x", "0" * 64, [1], [""]), 0, 1) == 0.5

    dense = dense_trace(prompts, streams, 6, seed=11)
    for r in dense["rows"]:
        r["conf"] = [b.replace("1", "9") for b in r["bits"]]  # sure of the right drafts, doubting the rest
    dense["confidence"] = True
    path = tmp_path / "informed.json"
    write_json_atomic(path, dense)
    trace = T.load(path)
    dec = get_decoder("spec-instrument", trace=str(path), max_depth=6, online_costs=False, stop="confidence")
    dec.prepare(tiny)
    dec.costs = Costs(step=1.0, draft=0.05, verify={w: 1 + 0.1 * (w - 1) for w in range(1, 8)})
    deep = 0
    for p, want in zip(prompts, streams):
        res = dec.decode(p.token_ids, N)
        assert res.tokens == want
        t_row = trace.row_for(p.token_ids)
        hist, _ = replay_rounds(trace, t_row, res.stats.extra["depth_trace"])
        assert {int(k): v for k, v in res.stats.to_json()["accept_hist"].items()} == hist
        emitted = 1
        for d in res.stats.extra["depth_trace"]:
            if d:
                assert all(trace.accepts(t_row, emitted - 1, k) for k in range(1, d))  # none past a doubt
                deep += d >= 3
                j = 0
                while j < d and trace.accepts(t_row, emitted - 1, j + 1):
                    j += 1
                emitted += j + 1
            else:
                emitted += 1
    assert deep > 3


def test_cli_refuses_an_existing_or_unwritable_out_and_a_bad_device_before_the_model_loads(tmp_path, capsys,
                                                                                       monkeypatch):
    monkeypatch.setattr("core.models.load_model", lambda *a, **k: pytest.fail("the model loaded"))
    mine = tmp_path / "mine.json"
    mine.write_text("my notes")
    for argv, words in ((["--out", str(mine)], "exists; pass --force"),
                        (["--out", "/proc/x.json"], "cannot write under"),
                        (["--out", str(tmp_path / "t.json"), "--device", "gpu"], "is not available"),
                        (["--out", str(tmp_path / "t.json"), "--max-depth", "16"], "--max-depth must be within"),
                        (["--out", str(tmp_path / "t.json"), "--head-top-k", "17"], "--head-top-k must be within"),
                        (["--out", str(tmp_path / "t.json"), "-n", "0"], "-n must be >= 1")):
        assert trace_main(["--model", "tiny", *argv]) == 2
        assert words in capsys.readouterr().err
    assert mine.read_text() == "my notes"


def test_a_usage_mistake_is_one_error_line(capsys):
    """argparse's own errors too: not its usage block then a line."""
    from decoders.shortlist import main as shortlist_main

    for main, argv in ((trace_main, ["--model", "tiny", "-n", "nan", "--out", "t.json"]), (trace_main, []),
                       (shortlist_main, ["--model", "tiny"])):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and len(err) == 1 and err[0].startswith("error:") and "--help" in err[0]
