"""``harness time`` on the inputs a new user tries: each is one ``error:`` line, exit 2, before the
model loads where it can be, and a failed run leaves no directory behind."""
from __future__ import annotations

import tempfile

import pytest
from click.testing import CliRunner

from core.schema import AtomicJsonlWriter
from harness.cli import main


def time_cmd(tmp_path, *args):
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["time", "--model", "tiny", "--device", "cpu", "--limit", "1", "-n", "4",
                                       "--legs", "1", "--out", str(out), *args])
    return result, out


def one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    return errors[0]


@pytest.mark.parametrize("args, words", [
    (("--decoder-arg", "depth=-1"), "depth must be within 0..15 (0: plain steps only), not -1"),
    (("--decoder", "json:loads"), "could not be built with no arguments"),
    (("--device", "gpu"), "--device 'gpu' is not available"),
    (("--device", "mps"), "--device 'mps' is not available"),
])
def test_bad_arguments_are_one_line_and_leave_no_directory(tmp_path, args, words):
    result, out = time_cmd(tmp_path, *args)
    assert words in one_error_line(result)
    assert not out.exists()


def test_an_out_under_proc_is_refused(tmp_path):
    result = CliRunner().invoke(main, ["time", "--model", "tiny", "--device", "cpu", "--out", "/proc/x"])
    assert "cannot write under /proc" in one_error_line(result)


def test_an_out_nobody_may_write_under_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    def unwritable(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryFile", unwritable)
    monkeypatch.setattr("core.models.load_model", lambda *a, **k: pytest.fail("the model loaded"))
    result, out = time_cmd(tmp_path)
    assert "cannot write under" in one_error_line(result) and "Permission denied" in result.output


def test_a_writer_that_fails_removes_the_directories_it_made_and_keeps_the_users(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("x")
    with pytest.raises(RuntimeError):
        with AtomicJsonlWriter(tmp_path / "mine" / "a" / "b" / "stream.jsonl") as writer:
            writer.write({"type": "header"})
            raise RuntimeError("failed mid-run")
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["keep.txt"]


class Interrupted(BaseException):
    """What a signal handler raises (harness's SIGTERM handler raises ``Stopped``)."""


def test_an_exception_at_any_line_of_a_writers_making_leaves_nothing_once_the_process_exits(tmp_path):
    """A signal handler raises wherever the interpreter is. Interrupted inside its constructor, a
    writer has no ``with`` block to clean up after it: the exit handler removes what it made."""
    import sys

    from core import paths

    inits = {paths.AtomicFile.__init__.__code__, AtomicJsonlWriter.__init__.__code__}
    for k in range(1000):
        lines = 0

        def raise_at_line_k(frame, event, arg):
            nonlocal lines
            if frame.f_code not in inits:
                return None
            if event == "line":
                lines += 1
                if lines > k:
                    raise Interrupted
            return raise_at_line_k

        sys.settrace(raise_at_line_k)
        try:
            writer = AtomicJsonlWriter(tmp_path / "a" / "b" / "stream.jsonl")
        except Interrupted:
            writer = None
        finally:
            sys.settrace(None)
        if writer is not None:  # k is past the constructor's last line
            writer.abort()
            break
        paths._abort_unfinished()
        assert list(tmp_path.iterdir()) == [], f"left behind when interrupted at line {k}"
    assert k > 5 and not list(tmp_path.iterdir())


def test_a_decode_beyond_the_models_context_is_refused_before_timing(tmp_path):
    """The audit refuses to judge positions past the model's context; the harness does not time them."""
    result, out = time_cmd(tmp_path, "-n", "4096")
    line = one_error_line(result)
    assert "beyond model tiny's context of 4096" in line and "+ N 4096" in line
    assert not out.exists()


def test_replacing_a_stream_notes_the_audit_of_the_one_before(tmp_path):
    result, out = time_cmd(tmp_path)
    assert result.exit_code == 0, result.output
    (out / "audit.json").write_text("{}")
    import os
    os.utime(out / "audit.json", (1, 1))  # older than any stream written now
    result, _ = time_cmd(tmp_path, "--force")
    assert result.exit_code == 0 and "note: audit.json in" in result.output and "audit the new one again" in result.output
    (out / "report.md").write_text("# an old report\n")
    for name in ("audit.json", "report.md"):
        os.utime(out / name, (1, 1))
    result, _ = time_cmd(tmp_path, "--force")
    assert result.exit_code == 0 and "note: audit.json and report.md in" in result.output


def test_a_dangling_link_or_a_fifo_as_the_stream_is_refused_before_the_model_loads(tmp_path):
    import os

    from core.errors import UserError
    from harness.run import choose_stream_path

    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere" / "x")
    with pytest.raises(UserError, match="which does not exist"):
        choose_stream_path("spec", dangling, force=False)
    (tmp_path / "run").mkdir()
    os.mkfifo(tmp_path / "run" / "stream.jsonl")
    with pytest.raises(UserError, match="not a regular file"):
        choose_stream_path("spec", tmp_path / "run", force=True)


def test_progress_lines_in_a_log_say_the_time_left(capsys):
    """Off a terminal one line per prompt, with the time left at the pace so far (an injected clock)."""
    from harness.progress import Progress

    now = [100.0]
    with Progress(3, 2, clock=lambda: now[0]) as progress:
        for i, spent in enumerate((10.0, 10.0, 10.0)):
            now[0] += spent
            progress.prompt_done(f"p{i}", 1.5)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["p0: 1/3 prompts, ratio 1.500, about 20 s left", "p1: 2/3 prompts, ratio 1.500, about 10 s left",
                     "p2: 3/3 prompts, ratio 1.500, 30 s in all"]
