"""``core.records``: whole lines appended, bad paths refused before any work, nothing clobbered."""
from __future__ import annotations

import json
import os
import threading

import pytest

from core.errors import UserError
from core.records import append_record, check_record_path, generation_record
from core.sampling import GREEDY, Sampler


def test_appends_one_line_per_record(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"id": "old"}\n')  # a file the user owned is appended to, never replaced
    append_record(path, generation_record("a", [1, 2], [3], 4, "spec", "tiny"))
    append_record(path, {"id": "b", "text": "é\n"})
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"id": "old"},
                     {"id": "a", "prompt_token_ids": [1, 2], "output_token_ids": [3], "max_new_tokens": 4,
                      "decoder": "spec", "model": "tiny", "sampler": GREEDY.to_json()},
                     {"id": "b", "text": "é\n"}]


def test_concurrent_writers_never_interleave(tmp_path):
    path = tmp_path / "r.jsonl"
    big = list(range(5000))  # a line far longer than any buffer of a text-mode writer

    def write(k):
        for i in range(10):
            append_record(path, {"id": f"{k}-{i}", "output_token_ids": big})
    threads = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = path.read_text().splitlines()
    assert len(lines) == 40 and all(json.loads(line)["output_token_ids"] == big for line in lines)


def test_bad_paths_are_refused(tmp_path):
    with pytest.raises(UserError, match="is a directory"):
        check_record_path(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        check_record_path(tmp_path / "no" / "r.jsonl")
    with pytest.raises(UserError, match="not a regular file"):
        append_record("/dev/null", {"id": "x"})
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match="not a regular file"):
        append_record(fifo, {"id": "x"})
    assert check_record_path(tmp_path / "new.jsonl") == tmp_path / "new.jsonl"
    assert not (tmp_path / "new.jsonl").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_directory_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(UserError, match="not writable"):
            check_record_path(locked / "r.jsonl")
    finally:
        locked.chmod(0o700)


def test_every_record_names_its_sampler_and_a_greedy_one_is_greedy_whatever_its_seed():
    assert generation_record("a", [1], [2], 3, "spec", "tiny", Sampler(seed=7))["sampler"] == GREEDY.to_json()
    sampled = Sampler(temperature=0.6, top_k=20, seed=7)
    assert generation_record("a", [1], [2], 3, "spec", "tiny", sampled)["sampler"] == sampled.to_json()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_a_directory_that_refuses_new_files_is_refused_before_any_work_even_as_root():
    """Tried, not asked of os.access, which says yes to root where no file can be made."""
    with pytest.raises(UserError, match="is not writable"):
        check_record_path("/proc/qwen-exact-record-probe.jsonl")


def test_the_writability_probe_leaves_nothing_behind(tmp_path):
    assert check_record_path(tmp_path / "r.jsonl") == tmp_path / "r.jsonl"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not os.path.exists("/proc/self/mountinfo"), reason="Linux mount table")
def test_a_kernel_interface_is_refused_before_any_work_even_where_it_opens_for_appending():
    """/proc/version opens for appending as root and fails only when the line is written;
    /proc/sysrq-trigger would take the line as an order. Both are refused up front."""
    for path in ("/proc/version", "/proc/sysrq-trigger"):
        if os.path.exists(path):
            with pytest.raises(UserError, match="kernel interface on proc"):
                check_record_path(path)


def test_the_file_system_is_found_by_the_files_device_in_the_mount_table(tmp_path):
    from core.paths import kernel_filesystem

    table = tmp_path / "mountinfo"
    table.write_text("22 27 0:21 / /proc rw,relatime - proc proc rw\n"
                     "30 27 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
                     "31 30 0:44 / /sys/kernel/debug rw master:9 - debugfs debugfs rw\n")

    def status(major, minor):
        return os.stat_result((0o100644, 1, os.makedev(major, minor), 1, 0, 0, 0, 0, 0, 0))

    assert kernel_filesystem(status(0, 21), table) == "proc"
    assert kernel_filesystem(status(0, 44), table) == "debugfs"
    assert kernel_filesystem(status(8, 1), table) is None  # a disk
    assert kernel_filesystem(status(9, 9), table) is None  # not in the table
    assert kernel_filesystem(status(0, 21), tmp_path / "missing") is None


def test_a_file_whose_last_line_is_unfinished_or_not_a_record_is_refused(tmp_path):
    """Appending to either would glue the record to another line, or bury it in a text file."""
    partial = tmp_path / "partial.jsonl"
    partial.write_text('{"prompt_token_ids": [1, 2], "output_token_ids": [3')
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    listed = tmp_path / "list.jsonl"
    listed.write_text("[1, 2]\n")
    for path, words in ((partial, "does not end with a newline"), (notes, "last line is not JSON"),
                        (listed, "not a JSON object")):
        with pytest.raises(UserError, match=words):
            check_record_path(path)
    good = tmp_path / "good.jsonl"
    append_record(good, {"id": "a"})
    append_record(good, {"id": "b"})
    assert check_record_path(good) == good


def test_a_dash_is_not_taken_for_a_file(tmp_path, monkeypatch):
    """``-`` means stdout to other options; as a record path it is refused, and ``./-`` is a file."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="not to stdout"):
        check_record_path("-")
    assert list(tmp_path.iterdir()) == []
    assert check_record_path("./-").name == "-"
