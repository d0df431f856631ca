"""The ``stream.jsonl`` format, shared by the harness (writer) and the audit (reader).

One JSON object per line, each with a ``type``:

  header   once, first: schema, command line, model identity, dtype, device ({type, name}, and
           on CUDA the GPU's uuid), library versions,
           determinism settings, control and candidate decoder (name + config), prompt set
           (source + sha256), max_new_tokens, legs, warmup_tokens, seed; world_size and ranks
           (one {rank, device} per process; under torchrun also each rank's resident_bytes and
           candidate_config, since every rank prepared its own decoders). Files written before
           these two keys existed are one-process runs.
  prompt   per prompt: id, token_ids (what every leg decoded from), text when known, warmup_ids
           (the other prompt of the same length both sides warmed up on); under torchrun
           (world_size > 1) also rank, the process that timed it: prompt i -> i % world_size.
  leg      per timed decode: prompt_id, role ("control" | "candidate"), leg (0..L-1 within the
           role), order (0..2L-1 within the prompt: ABBA), t_start / t_end (monotonic seconds
           since its process began timing: one clock per rank), wall_s, tokens (every emitted
           id), peak_mem_bytes (null where not measured), stats (the decoder's own counters);
           under torchrun also rank.
  summary  per prompt, after its legs: the harness's own medians and ratio.
  violation  where the harness found its own process tampered with (``integrity_checked`` in
           the header says it looked): at (after prepare / after leg K of prompt ID) and problem
           (what changed). The audit fails a run on any.
  end      once, last: number of records before it and the sha256 of their bytes, so a
           truncated or hand-edited file is detectable; and the harness's median ratio.

Reading is strict: every number finite and inside int64 (``1e999``, ``NaN``, a 400-digit integer
are refused), nesting at most ``MAX_DEPTH`` deep, ``true``/``false`` never taken for an integer,
leg times inside a plausible range (so no ratio derived from them can overflow), so that a
hostile file is one clean error. Only regular files are read (a link to a device, a FIFO or a
socket is refused without waiting on it), and a stream no larger than its header's counts
allow (``stream_size_cap``): a huge or sparse file is refused from its size, before it is read.

Files are written atomically (a temporary file renamed into place at the end), so an
interrupted run leaves no ``stream.jsonl`` at all rather than one that looks complete. Under
torchrun, rank 0 writes the merged file in one go once every rank has reported.
"""
from __future__ import annotations

import hashlib
import json
import math
import io
import os
import stat
import statistics
from pathlib import Path
from typing import Callable, Iterator

import jsonlines

from core.errors import UserError
from core.paths import AtomicFile

SCHEMA = "qwen35-exact/stream/1"
KNOWN_SCHEMAS = (SCHEMA,)
ROLES = ("control", "candidate")
RECORD_TYPES = ("header", "prompt", "leg", "summary", "violation", "end")
# deepest nesting of objects and lists a record may have (a header's decoder config is ~5)
MAX_DEPTH = 32
# integers beyond int64 are refused: no field of a stream needs more
MAX_INT_DIGITS = 19


class StreamFormatError(ValueError):
    """The file is not a well-formed stream (malformed line, wrong schema, bad field)."""


def abba_roles(legs: int, opens: str = "control") -> list[str]:
    """Role of each timed decode of one prompt, in order: pairs alternating which side goes first
    (A B B A A B ..., A the side that ``opens``), so drift and warm-up effects fall on both sides."""
    pair = ["control", "candidate"] if opens == "control" else ["candidate", "control"]
    order = []
    for n in range(legs):
        order += pair if n % 2 == 0 else pair[::-1]
    return order


def prompt_ratio(control_walls: list[float], candidate_first_wall: float) -> float | None:
    """A prompt's speed ratio: the control's median leg time over the candidate's first timed leg
    (``leg == 0``), its first encounter with the prompt. Later candidate legs are recorded and
    checked (warm legs, noise) but never make a prompt faster: a decoder that learns from a prompt
    it has already decoded gains nothing here."""
    if not control_walls or not candidate_first_wall or candidate_first_wall <= 0:
        return None
    return statistics.median(control_walls) / candidate_first_wall


def leg_spread(walls: list[float]) -> float | None:
    """How far one role's legs on one prompt are apart: slowest / fastest - 1 (None under 2 legs)."""
    if len(walls) < 2 or min(walls) <= 0:
        return None
    return max(walls) / min(walls) - 1


# A prompt is unstable when one role's legs spread by more than LEG_SPREAD_LIMIT, and a run when
# more than UNSTABLE_RUN_SHARE of its prompts are: its ratio is within the machine's noise.
LEG_SPREAD_LIMIT = 0.25
UNSTABLE_RUN_SHARE = 0.25


def dumps(record: dict) -> str:
    return json.dumps(record, sort_keys=True, allow_nan=False, separators=(",", ":"))


class _DigestingText:
    """A text sink that hashes what passes through it on its way to the file."""

    def __init__(self, fh, digest):
        self.fh, self.digest = fh, digest

    def write(self, text: str) -> int:
        self.digest.update(text.encode())
        return self.fh.write(text)

    def flush(self) -> None:
        self.fh.flush()


class AtomicJsonlWriter(AtomicFile):
    """JSON lines collected in a temporary file beside ``path``; ``commit`` renames it into place
    (see ``AtomicFile``: a failed or stopped run leaves nothing behind)."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.digest = hashlib.sha256()
        self.lines = jsonlines.Writer(_DigestingText(self.fh, self.digest), dumps=dumps, flush=True)
        self.count = 0

    def write(self, record: dict) -> None:
        self.lines.write(record)
        self.count += 1

    def write_end(self, **fields) -> None:
        self.write({"type": "end", "records": self.count, "sha256": self.digest.hexdigest(), **fields})


def write_json_atomic(path: Path, obj, indent: int | None = 2) -> None:
    """``obj`` as JSON at ``path``, whole or not at all (a temporary file, then a rename);
    ``indent=None``: compact, for data files."""
    with AtomicFile(path) as out:
        json.dump(obj, out.fh, indent=indent, sort_keys=True, allow_nan=False,
                  separators=None if indent is not None else (",", ":"))
        out.fh.write("\n")
        out.commit()


# --------------------------------------------------------------------------- reading


# the largest user jsonl (a prompt set, a file of generations) read: far beyond any benchmark's,
# small enough to hold in memory
MAX_JSONL_BYTES = 256 << 20


def open_regular(path: Path, error=UserError):
    """``path`` opened for binary reading, and its size, if it is a regular file; otherwise
    ``error``. Opened non-blocking and checked on the open descriptor, so a FIFO, a device or a
    socket (also behind a symlink, or swapped in after a check by name) is refused at once rather
    than read from forever."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a device, FIFO or socket?)"
            raise error(f"{path} is {kind}; give a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def read_capped(fh, size: int, cap: int, path: Path, why: str, error=UserError) -> bytes:
    """The rest of ``fh``, refused unread when the file's size is beyond ``cap`` bytes, and refused
    once ``cap`` bytes are read when the size was understated (a file that grows, a /proc file)."""
    if size > cap:
        raise error(f"{path} is {size} bytes, beyond the {cap} bytes {why}")
    data = fh.read(cap + 1 - fh.tell())
    if fh.tell() > cap:
        raise error(f"{path} holds more than the {cap} bytes {why}")
    return data


def read_regular(path: Path, cap: int = MAX_JSONL_BYTES, error=UserError) -> bytes:
    """All of a regular file of at most ``cap`` bytes (``open_regular``, ``read_capped``)."""
    fh, size = open_regular(path, error)
    with fh:
        return read_capped(fh, size, cap, path, "a file read here may hold", error)


def jsonl_values(path: Path, at: Callable[[int], str] | None = None, *, raw: bytes | None = None,
                 cap: int = MAX_JSONL_BYTES) -> Iterator[tuple[int, object]]:
    """(line number, value) for every non-blank line of a user's jsonl file (a prompt set, a file
    of generations), read by ``jsonlines``; a line that is not JSON, text that is not UTF-8, a file
    that cannot be read, is not a regular file or is larger than ``cap`` is a UserError naming the
    file and the line (``at(lineno)``, by default "PATH line N", the caller's own style of naming a
    line). ``raw``: the file's bytes, when the caller has read them already (to hash them)."""
    path = Path(path)
    at = at or (lambda n: f"{path} line {n}")
    lineno = 0
    data = read_regular(path, cap) if raw is None else raw

    def numbered(fh):  # the reader takes one line per value: after a read, lineno is its line
        nonlocal lineno
        for lineno, line in enumerate(fh, start=1):
            yield line

    try:
        with io.TextIOWrapper(io.BytesIO(data), encoding="utf-8") as fh, \
                jsonlines.Reader(numbered(fh), loads=loads) as reader:
            while True:
                try:
                    value = reader.read(skip_empty=True)
                except EOFError:
                    return
                yield lineno, value
    except jsonlines.InvalidLineError as exc:
        raise UserError(f"{at(exc.lineno)}: not valid JSON ({_reason(exc)})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text") from None


def _reject_constant(name: str):
    raise ValueError(f"non-finite number {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"non-finite number {text[:40]} (beyond a double's range)")
    return value


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    value = int(text) if digits <= MAX_INT_DIGITS else None
    if value is None or not -(1 << 63) <= value < (1 << 63):
        raise ValueError(f"integer of {digits} digits, beyond int64")
    return value


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float, parse_int=_bounded_int)


def nesting_depth(value, limit: int = MAX_DEPTH) -> int:
    """Depth of nested objects and lists (a scalar is 0), counted without recursion; stops
    counting once past ``limit``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            break
        stack.extend((child, depth + 1) for child in children)
    return deepest


def loads(text: str):
    """One JSON value under the stream's rules: finite numbers inside int64, at most MAX_DEPTH
    levels deep. Anything else is a ValueError (also for nesting too deep for the parser)."""
    try:
        value = _DECODER.decode(text)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels") from None
    if nesting_depth(value) > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    return value


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int(x) -> bool:
    """An integer, and not ``true``/``false`` (which Python counts as ints)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _ints(xs) -> bool:
    return isinstance(xs, list) and all(_int(t) for t in xs)


# A timed leg lasts from a nanosecond to ~four months, on a clock that started less than ~30
# years ago: beyond those, a time is no measurement, and ratios of such times could overflow.
MIN_LEG_S, MAX_LEG_S, MAX_CLOCK_S = 1e-9, 1e7, 1e9


def _require(cond: bool, lineno: int, what: str) -> None:
    if not cond:
        raise StreamFormatError(f"line {lineno}: {what}")


def check_record(rec: dict, lineno: int) -> None:
    """Field-level validation of one record (types, finiteness); cross-record checks are the audit's."""
    kind = rec.get("type")
    _require(kind in RECORD_TYPES, lineno, f"unknown record type {kind!r}")
    if kind == "header":
        _require(rec.get("schema") in KNOWN_SCHEMAS, lineno,
                 f"unknown schema version {rec.get('schema')!r} (this tool reads {', '.join(KNOWN_SCHEMAS)})")
        for key in ("model", "device", "determinism", "control", "candidate", "max_new_tokens", "legs"):
            _require(key in rec, lineno, f"header lacks {key!r}")
        _require(isinstance(rec.get("integrity_checked", False), bool), lineno,
                 "header integrity_checked must be true or false")
    elif kind == "prompt":
        _require(isinstance(rec.get("id"), str) and rec["id"] != "", lineno, "prompt without a string id")
        ids = rec.get("token_ids")
        _require(_ints(ids) and ids, lineno, "prompt token_ids must be a non-empty list of integers")
        warm = rec.get("warmup_ids", [0])
        _require(_ints(warm) and warm, lineno,
                 "prompt warmup_ids must be a non-empty list of integers")
    elif kind == "leg":
        _require(isinstance(rec.get("prompt_id"), str), lineno, "leg without prompt_id")
        _require(rec.get("role") in ROLES, lineno, f"leg role {rec.get('role')!r} is not control/candidate")
        _require(_int(rec.get("leg")) and _int(rec.get("order")), lineno, "leg needs integer 'leg' and 'order'")
        for key in ("wall_s", "t_start", "t_end"):
            _require(_finite(rec.get(key)), lineno, f"leg {key} is missing or not a finite number")
        _require(rec["wall_s"] > 0, lineno, "leg wall_s must be positive")
        _require(MIN_LEG_S <= rec["wall_s"] <= MAX_LEG_S, lineno,
                 f"leg wall_s {rec['wall_s']!r} is outside the plausible {MIN_LEG_S:g}..{MAX_LEG_S:g} seconds")
        for key in ("t_start", "t_end"):
            _require(abs(rec[key]) <= MAX_CLOCK_S, lineno,
                     f"leg {key} {rec[key]!r} is beyond any clock's reading ({MAX_CLOCK_S:g} seconds)")
        _require(_ints(rec.get("tokens")), lineno, "leg tokens must be a list of integers")
        mem = rec.get("peak_mem_bytes")
        _require(mem is None or (_int(mem) and mem >= 0), lineno, "peak_mem_bytes must be null or >= 0")
    elif kind == "summary":
        _require(isinstance(rec.get("prompt_id"), str), lineno, "summary without prompt_id")
        for key in ("control_median_s", "candidate_median_s", "ratio"):
            _require(_finite(rec.get(key)), lineno, f"summary {key} is missing or not finite")
    elif kind == "violation":
        _require(isinstance(rec.get("at"), str) and isinstance(rec.get("problem"), str), lineno,
                 "violation record needs string 'at' and 'problem'")
    elif kind == "end":
        _require(_int(rec.get("records")) and isinstance(rec.get("sha256"), str), lineno,
                 "end record needs 'records' and 'sha256'")


def _reason(exc: jsonlines.InvalidLineError) -> str:
    cause = exc.__cause__
    return str(cause) if cause is not None else exc.args[0]


# What a stream may hold, from its header's counts (``stream_size_cap``): the header itself; per
# prompt its record (id, text, token ids and warm-up ids of a prompt of up to ~1M tokens) and a
# summary; per leg its fields and decoder stats, plus per new token its id and the stats that grow
# with it (a speculative decoder's depth trace). Whatever the counts, never more than
# MAX_STREAM_BYTES.
MAX_STREAM_BYTES = 512 << 20
MAX_HEADER_BYTES = 1 << 20
STREAM_BASE_BYTES = 1 << 20
PROMPT_RECORD_BYTES = 16 << 20
LEG_BASE_BYTES = 64 << 10
LEG_TOKEN_BYTES = 256


def stream_size_cap(header) -> tuple[int, str]:
    """The most bytes a stream with this header can plausibly hold, and why (for the message):
    proportional to its prompt count, legs and max_new_tokens where the header declares them,
    MAX_STREAM_BYTES at most."""
    info = header.get("prompts") if isinstance(header, dict) else None
    count = info.get("count") if isinstance(info, dict) else None
    legs, n = (header.get(k) if isinstance(header, dict) else None for k in ("legs", "max_new_tokens"))
    if not all(_int(x) and x >= 1 for x in (count, legs, n)):
        return MAX_STREAM_BYTES, f"a stream may hold (at most {MAX_STREAM_BYTES >> 20} MiB)"
    per_prompt = PROMPT_RECORD_BYTES + 2 * legs * (LEG_BASE_BYTES + LEG_TOKEN_BYTES * n)
    cap = min(MAX_STREAM_BYTES, STREAM_BASE_BYTES + count * per_prompt)
    why = (f"its header's {count} prompt(s) x {legs} leg(s) per side of up to {n} tokens can fill"
           if cap < MAX_STREAM_BYTES else f"a stream may hold (at most {MAX_STREAM_BYTES >> 20} MiB)")
    return cap, why


def read_stream_bytes(path: Path) -> bytes:
    """A stream's bytes, read only from a regular file and only up to the size its header's counts
    allow (``stream_size_cap``); StreamFormatError otherwise, before the rest is read."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise StreamFormatError(f"{path}: no such file")
    fh, size = open_regular(path, StreamFormatError)
    with fh:
        first = fh.readline(MAX_HEADER_BYTES + 1)
        if len(first) > MAX_HEADER_BYTES:
            raise StreamFormatError(f"not a stream.jsonl: line 1 is longer than {MAX_HEADER_BYTES} bytes")
        try:
            header = loads(first.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            header = None  # parse_stream says what is wrong with line 1
        cap, why = stream_size_cap(header)
        return first + read_capped(fh, size, cap, path, why, StreamFormatError)


def read_stream(path: Path) -> tuple[list[dict], dict]:
    """Parse and field-check every record. Returns (records, integrity) where integrity says
    whether the end record is present and whether its count and sha256 match the file."""
    return parse_stream(read_stream_bytes(path), path)


def parse_stream(raw: bytes, path: Path) -> tuple[list[dict], dict]:
    """``read_stream`` on the bytes of ``path`` already read (``read_stream_bytes``)."""
    if not raw.strip():
        raise StreamFormatError(f"{path}: empty file")
    lines = raw.split(b"\n")
    terminated = lines[-1] == b""
    if terminated:
        lines.pop()
    digest = hashlib.sha256()

    def digested():  # a line enters the digest once the next one is asked for: the end record's
        for line in lines:  # check sees the digest of the lines before it
            yield line
            digest.update(line + b"\n")

    reader = jsonlines.Reader(digested(), loads=loads)
    records, end_check = [], None
    truncated = f"line {len(lines)}: last line is not newline-terminated (truncated file?)"
    for i in range(1, len(lines) + 1):
        if i > 1 and i == len(lines) and not terminated:
            raise StreamFormatError(truncated)
        try:
            rec = reader.read(type=dict)
        except jsonlines.InvalidLineError as exc:
            if i == 1:  # random bytes, another format: say what the file is not
                raise StreamFormatError(f"not a stream.jsonl: line 1 is not a JSON object ({_reason(exc)})") from None
            raise StreamFormatError(f"line {i}: not valid JSON ({_reason(exc)})") from None
        if i == 1:
            if rec.get("type") != "header":
                raise StreamFormatError("not a stream.jsonl: the first record is not a header")
            if len(lines) == 1 and not terminated:
                raise StreamFormatError(truncated)
        check_record(rec, i)
        if rec["type"] == "end":
            _require(i == len(lines), i, "end record is not the last line")
            end_check = {"present": True, "count_ok": rec["records"] == len(records),
                         "sha256_ok": rec["sha256"] == digest.hexdigest()}
        if i > 1:
            _require(rec["type"] != "header", i, "a second header")
        records.append(rec)
    return records, end_check or {"present": False, "count_ok": False, "sha256_ok": False}
