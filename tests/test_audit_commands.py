"""What every ``audit`` command shares (audit/commands/common.py): a SIGTERM ends a command through
its own cleanup, with one line; score options refuse numbers that are not finite."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner

from audit.cli import main as audit_main
from audit.commands.common import run_command


def test_a_sigterm_runs_the_commands_cleanup_and_is_one_line(capsys):
    cleaned = []

    def command() -> int:
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises at the next bytecode
            return 0
        finally:
            cleaned.append(True)  # a retime's workers and cgroups are closed in such a block

    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as stop:
            run_command(command)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stop.value.code == 2 and cleaned == [True]
    assert capsys.readouterr().err.strip() == "error: stopped (SIGTERM); nothing was written"


@pytest.mark.parametrize("args", [("replay", "s.jsonl", "--s-max", "nan"), ("replay", "s.jsonl", "--mem-allowance", "inf"),
                                  ("retime", "s.jsonl", "--kappa", "nan"),
                                  ("tokens", "g.jsonl", "--model", "tiny", "--tie-margin", "nan")])
def test_score_options_refuse_numbers_that_are_not_finite_before_any_work(args, tmp_path):
    res = CliRunner().invoke(audit_main, [a if not a.endswith(".jsonl") else str(tmp_path / a) for a in args])
    assert res.exit_code == 2 and "is not a finite number" in res.output


@pytest.mark.parametrize("args, words", [(("replay", "--workers", "abc"), "'abc' is not a valid integer."),
                                         (("retime", "--kappa", "x"), "'x' is not a valid number."),
                                         (("retime", "--legs", "1.5"), "'1.5' is not a valid integer.")])
def test_a_number_that_cannot_be_read_is_named_as_the_number_it_should_be(args, words, tmp_path):
    """Not click's "not a valid integer range": the type, not its bounds, is what the value missed."""
    command, *options = args
    res = CliRunner().invoke(audit_main, [command, str(tmp_path / "s.jsonl"), *options])
    assert res.exit_code == 2 and words in res.output and "range" not in res.output


def test_an_out_path_of_dash_or_a_directory_is_refused_with_the_documents_own_name(tmp_path):
    from audit.pipeline import check_out_path
    from audit.stream import BadInput

    stream = tmp_path / "stream.jsonl"
    with pytest.raises(BadInput, match="written to a file"):
        check_out_path(Path("-"), stream)
    with pytest.raises(BadInput, match="retime.json"):
        check_out_path(tmp_path, stream, "retime.json")


def test_an_existing_out_is_replaced_only_when_it_is_an_audits_own_document(tmp_path):
    """Another run's stream, or any file of the user's, given as --out is refused; an earlier
    audit.json is replaced."""
    import shutil

    from audit_helpers import run_audit, run_harness

    stream = run_harness(tmp_path / "run", "fast-serial", limit=1, n=6, legs=1)
    other = tmp_path / "other" / "stream.jsonl"
    other.parent.mkdir()
    shutil.copy(stream, other)
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for out in (other, notes):
        before = out.read_bytes()
        result = CliRunner().invoke(audit_main, ["replay", str(stream), "--out", str(out)])
        assert result.exit_code == 2 and "exists and is not an audit document" in result.output, result.output
        assert out.read_bytes() == before
    result, doc = run_audit(stream, out=tmp_path / "a.json")
    assert result.exit_code == 0 and doc["verdict"] == "pass"
    result, again = run_audit(stream, out=tmp_path / "a.json")
    assert result.exit_code == 0 and again["verdict"] == "pass"


def test_a_moved_checkpoint_is_named_with_the_option_that_finds_it(tmp_path):
    from types import SimpleNamespace

    from audit.pipeline import load_replay_model
    from core.errors import UserError

    run = SimpleNamespace(header={"model": {"name": str(tmp_path / "gone" / "tiny")}})
    with pytest.raises(UserError, match="has moved, give its directory now with --model DIR"):
        load_replay_model(run, None, "cpu")
    with pytest.raises(UserError) as given:  # a --model the user gave is not second-guessed
        load_replay_model(run, str(tmp_path / "typo"), "cpu")
    assert "--model DIR" not in str(given.value)
