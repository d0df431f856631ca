"""Record files: one JSON object per line, appended whole, that `audit tokens` can check.

Shape (a) of docs/audit-tokens.md, with the N the output was decoded under:
``{"id", "prompt_token_ids", "output_token_ids", "max_new_tokens", "decoder", "model", "sampler"}``.
Several writers (``harness generate`` runs, a server's requests) may append to one file: each
line goes out in one ``write`` on a file opened for appending, then is flushed to disk, so lines
never interleave and a crash leaves at most a missing line, never half of one.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from core.errors import UserError
from core.paths import kernel_filesystem, try_new_file


def check_record_path(path, last_line: bool = True) -> Path:
    """Refuse, before any work, a record path that cannot be appended to: a directory, a
    device or other non-regular file, a missing or unwritable parent directory. Writability is
    tried, not asked of ``os.access`` (which says yes to root on a read-only mount or a kernel
    file system): an existing file is opened for appending, a missing one's directory takes a
    probe file, and nothing is left behind. ``last_line``: also refuse an existing file whose last
    line is unfinished or not a record (``last_line_problem``)."""
    if str(path) == "-":  # elsewhere "-" is stdout; here it would quietly make a file named "-"
        raise UserError("record file '-': records are appended to a file, not to stdout (for a file named -, "
                        "give ./-)")
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        parent = path.parent
        if not parent.is_dir():
            raise UserError(f"record file {str(path)!r}: directory {str(parent)!r} does not exist") from None
        try:
            try_new_file(parent, path.name)
        except OSError as exc:
            raise UserError(f"record file {str(path)!r}: directory {str(parent)!r} is not writable "
                            f"({exc.strerror})") from None
        return path
    except OSError as exc:
        raise UserError(f"record file {str(path)!r}: {exc.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise UserError(f"record file {str(path)!r} is a directory")
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"record file {str(path)!r} is not a regular file")
    fstype = kernel_filesystem(st)
    if fstype is not None:
        raise UserError(f"record file {str(path)!r} is a kernel interface on {fstype}, not a file to keep records in")
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)))
    except OSError as exc:
        raise UserError(f"record file {str(path)!r} is not writable ({exc.strerror})") from None
    problem = last_line_problem(path, st.st_size) if last_line else None
    if problem:
        raise UserError(f"record file {str(path)!r} {problem}: a record appended to it would be lost; "
                        "give a new file or a file of records")
    return path


TAIL_BYTES = 1 << 20  # of an existing record file, read to check its last line (a record is ~7 bytes a token)


def last_line_problem(path: Path, size: int) -> str | None:
    """Why appending to a file of ``size`` bytes would not make a record of its own line (None:
    it would): its last line is not finished, or is not a JSON object, so it is not a file of
    records. A last line longer than ``TAIL_BYTES`` is taken on trust once it ends."""
    if size == 0:
        return None
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, size - TAIL_BYTES))
            tail = fh.read(TAIL_BYTES)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if not tail.endswith(b"\n"):
        return "does not end with a newline (its last line is unfinished)"
    lines = tail[:-1].split(b"\n")
    if len(lines) == 1 and size > len(tail):
        return None
    try:
        record = json.loads(lines[-1])
    except ValueError:
        return "is not a file of records (its last line is not JSON)"
    return None if isinstance(record, dict) else "is not a file of records (its last line is not a JSON object)"


def record_line(record: dict) -> bytes:
    return (json.dumps(record, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


def append_record(path, record: dict) -> None:
    """Append ``record`` as one line of ``path`` (created if missing) in a single write, then
    flush it to disk."""
    path = check_record_path(path, last_line=False)  # others may be appending now: their lines are whole
    data = record_line(record)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        raise UserError(f"record file {str(path)!r}: cannot open for appending ({exc.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between the check and the open
            raise UserError(f"record file {str(path)!r} is not a regular file")
        written = os.write(fd, data)
        if written != len(data):  # a full disk: say so rather than leave a silent half line
            raise UserError(f"record file {str(path)!r}: wrote {written} of {len(data)} bytes (disk full?)")
        os.fsync(fd)
    except OSError as exc:
        raise UserError(f"record file {str(path)!r}: cannot append ({exc.strerror})") from None
    finally:
        os.close(fd)


def generation_record(record_id: str, prompt_ids: list[int], output_ids: list[int], max_new_tokens: int,
                      decoder: str, model: str, sampler=None) -> dict:
    """One generation in `audit tokens` shape (a), with its own N and its ``sampler``
    (``core.sampling.Sampler``'s ``to_json()``; greedy too, so `audit tokens` judges every line
    under the sampler that decided it)."""
    record = {"id": record_id, "prompt_token_ids": list(prompt_ids), "output_token_ids": list(output_ids),
              "max_new_tokens": int(max_new_tokens), "decoder": decoder, "model": model}
    from core.sampling import GREEDY  # imports torch: only when a record is made

    record["sampler"] = (GREEDY if sampler is None or sampler.greedy else sampler).to_json()
    return record
