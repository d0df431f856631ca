"""Where outputs go (core.paths): links written through, FIFOs and devices never replaced."""
from __future__ import annotations

import os

import pytest

from core.errors import UserError
from core.paths import AtomicFile, check_new_output, check_output_file
from core.schema import write_json_atomic


def test_a_link_to_a_file_is_written_through_and_stays_a_link(tmp_path):
    target = tmp_path / "kept" / "doc.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "doc.json"
    link.symlink_to(target)
    write_json_atomic(check_output_file(link), {"a": 1})
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text().startswith("{")
    assert sorted(p.name for p in target.parent.iterdir()) == ["doc.json"]


def test_a_dangling_link_a_fifo_a_device_and_a_directory_are_refused(tmp_path):
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere" / "x")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, words in ((dangling, "which does not exist"), (fifo, "not a regular file"),
                        (tmp_path, "is a directory"), ("/dev/null", "not a regular file")):
        with pytest.raises(UserError, match=words):
            check_output_file(path)
        with pytest.raises(UserError, match=words):
            check_new_output(path, force=True)
    assert fifo.exists() and not fifo.is_file()


def test_an_atomic_file_through_a_link_leaves_no_temporary_beside_the_link(tmp_path):
    (tmp_path / "real").mkdir()
    link = tmp_path / "out.txt"
    link.symlink_to(tmp_path / "real" / "out.txt")
    with AtomicFile(link) as out:
        out.fh.write("x")
        out.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt", "real"]
    assert (tmp_path / "real" / "out.txt").read_text() == "x" and link.is_symlink()


def test_an_output_another_process_wrote_meanwhile_is_not_replaced(tmp_path):
    """Two runs given one --out: the second to finish says so instead of replacing the first's."""
    out = tmp_path / "run" / "stream.jsonl"
    with pytest.raises(UserError, match="written by another process"):
        with AtomicFile(out) as mine:
            mine.fh.write("mine\n")
            with AtomicFile(out) as theirs:  # the other run, finishing first
                theirs.fh.write("theirs\n")
                theirs.commit()
            mine.commit()
    assert out.read_text() == "theirs\n" and sorted(p.name for p in out.parent.iterdir()) == ["stream.jsonl"]
    with AtomicFile(out) as again:  # a file that was there when the writer began is replaced
        again.fh.write("again\n")
        again.commit()
    assert out.read_text() == "again\n"
