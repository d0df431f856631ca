"""The ``stream.jsonl`` format, shared by the harness (writer) and the audit (reader).

One JSON object per line, each with a ``type``:

  header   once, first: schema, command line, model identity, dtype, device ({type, name}, and
           on CUDA the GPU's uuid), library versions,
           determinism settings, control and candidate decoder (name + config), prompt set
           (source + sha256), max_new_tokens, legs, warmup_tokens, seed; world_size and ranks
           (one {rank, device} per process; under torchrun also each rank's resident_bytes and
           candidate_config, since every rank prepared its own decoders). Files written before
           these two keys existed are one-process runs.
  prompt   per prompt: id, token_ids (what every leg decoded from), text when known; under
           torchrun (world_size > 1) also rank, the process that timed it: prompt i -> i % world_size.
  leg      per timed decode: prompt_id, role ("control" | "candidate"), leg (0..L-1 within the
           role), order (0..2L-1 within the prompt: ABBA), t_start / t_end (monotonic seconds
           since its process began timing: one clock per rank), wall_s, tokens (every emitted
           id), peak_mem_bytes (null where not measured), stats (the decoder's own counters);
           under torchrun also rank.
  summary  per prompt, after its legs: the harness's own medians and ratio.
  end      once, last: number of records before it and the sha256 of their bytes, so a
           truncated or hand-edited file is detectable; and the harness's median ratio.

Files are written atomically (a temporary file renamed into place at the end), so an
interrupted run leaves no ``stream.jsonl`` at all rather than one that looks complete. Under
torchrun, rank 0 writes the merged file in one go once every rank has reported.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import tempfile
from pathlib import Path

SCHEMA = "qwen35-exact/stream/1"
KNOWN_SCHEMAS = (SCHEMA,)
ROLES = ("control", "candidate")
RECORD_TYPES = ("header", "prompt", "leg", "summary", "end")


class StreamFormatError(ValueError):
    """The file is not a well-formed stream (malformed line, wrong schema, bad field)."""


def abba_roles(legs: int) -> list[str]:
    """Role of each timed decode of one prompt, in order: control/candidate pairs alternating
    which goes first (A B B A A B ...), so drift and warm-up effects fall on both sides."""
    order = []
    for pair in range(legs):
        order += ["control", "candidate"] if pair % 2 == 0 else ["candidate", "control"]
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


class AtomicJsonlWriter:
    """Collects lines in a temporary file beside ``path``; ``commit`` renames it into place.
    Leaving the ``with`` block by an exception deletes the temporary file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        self.tmp = Path(tmp)
        self.fh = os.fdopen(fd, "w", encoding="utf-8")
        self.digest = hashlib.sha256()
        self.count = 0
        self.committed = False

    def write(self, record: dict) -> None:
        line = dumps(record) + "\n"
        self.fh.write(line)
        self.fh.flush()
        self.digest.update(line.encode())
        self.count += 1

    def write_end(self, **fields) -> None:
        self.write({"type": "end", "records": self.count, "sha256": self.digest.hexdigest(), **fields})

    def commit(self) -> None:
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        os.replace(self.tmp, self.path)
        self.committed = True

    def abort(self) -> None:
        if not self.fh.closed:
            self.fh.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.committed:
            self.abort()
        return False


def write_json_atomic(path: Path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, indent=2, sort_keys=True, allow_nan=False)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- reading


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


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
    elif kind == "prompt":
        _require(isinstance(rec.get("id"), str) and rec["id"] != "", lineno, "prompt without a string id")
        ids = rec.get("token_ids")
        _require(isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids), lineno,
                 "prompt token_ids must be a non-empty list of integers")
    elif kind == "leg":
        _require(isinstance(rec.get("prompt_id"), str), lineno, "leg without prompt_id")
        _require(rec.get("role") in ROLES, lineno, f"leg role {rec.get('role')!r} is not control/candidate")
        _require(isinstance(rec.get("leg"), int) and isinstance(rec.get("order"), int), lineno,
                 "leg needs integer 'leg' and 'order'")
        for key in ("wall_s", "t_start", "t_end"):
            _require(_finite(rec.get(key)), lineno, f"leg {key} is missing or not a finite number")
        _require(rec["wall_s"] > 0, lineno, "leg wall_s must be positive")
        toks = rec.get("tokens")
        _require(isinstance(toks, list) and all(isinstance(t, int) for t in toks), lineno,
                 "leg tokens must be a list of integers")
        mem = rec.get("peak_mem_bytes")
        _require(mem is None or (isinstance(mem, int) and mem >= 0), lineno, "peak_mem_bytes must be null or >= 0")
    elif kind == "summary":
        _require(isinstance(rec.get("prompt_id"), str), lineno, "summary without prompt_id")
        for key in ("control_median_s", "candidate_median_s", "ratio"):
            _require(_finite(rec.get(key)), lineno, f"summary {key} is missing or not finite")
    elif kind == "end":
        _require(isinstance(rec.get("records"), int) and isinstance(rec.get("sha256"), str), lineno,
                 "end record needs 'records' and 'sha256'")


def read_stream(path: Path) -> tuple[list[dict], dict]:
    """Parse and field-check every record. Returns (records, integrity) where integrity says
    whether the end record is present and whether its count and sha256 match the file."""
    path = Path(path)
    if not path.is_file():
        raise StreamFormatError(f"{path}: no such file")
    raw = path.read_bytes()
    if not raw.strip():
        raise StreamFormatError(f"{path}: empty file")
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    else:
        raise StreamFormatError(f"line {len(lines)}: last line is not newline-terminated (truncated file?)")
    records, digest, end_check = [], hashlib.sha256(), None
    for i, line in enumerate(lines, start=1):
        try:
            rec = json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"non-finite {c}")))
        except ValueError as exc:
            raise StreamFormatError(f"line {i}: not valid JSON ({exc})") from None
        _require(isinstance(rec, dict), i, "not a JSON object")
        check_record(rec, i)
        if rec["type"] == "end":
            _require(i == len(lines), i, "end record is not the last line")
            end_check = {"present": True, "count_ok": rec["records"] == len(records),
                         "sha256_ok": rec["sha256"] == digest.hexdigest()}
        if i == 1:
            _require(rec["type"] == "header", i, "first record must be the header")
        else:
            _require(rec["type"] != "header", i, "a second header")
        records.append(rec)
        digest.update(line + b"\n")
    return records, end_check or {"present": False, "count_ok": False, "sha256_ok": False}
