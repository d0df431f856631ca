"""Reading a run directory for the report: ``stream.jsonl`` (required) and ``audit.json`` (optional).

The stream is parsed and field-checked by ``core.schema.read_stream``; on top of that the
report needs the run to be whole (an end record, every prompt timed on the control and at least one
other role) and the decoder statistics it plots to have the right shapes. Anything wrong is a
``UserError`` with one line saying what and where, so nothing is rendered from a partial run.

``audit.json`` is checked against the shape ``audit replay`` writes (schema ``qwen35-exact/audit/1``),
and ``retime.json`` (optional, ``audit retime``: the verified figures) against its own.
Whether it belongs to this stream is decided by its ``stream_sha256``, the sha256 of the bytes of
``stream.jsonl``; a mismatch is not an error (the report says so prominently instead).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import UserError
from core.schema import StreamFormatError, read_stream

STREAM_NAME = "stream.jsonl"
AUDIT_NAME = "audit.json"
TOKENS_AUDIT_NAME = "audit_tokens.json"  # `audit tokens`; read by reports.tokens
AUDIT_SCHEMA = "qwen35-exact/audit/1"
RETIME_NAME = "retime.json"
RETIME_SCHEMA = "qwen35-exact/retime/2"
CONTROL_ROLE = "control"


@dataclass
class Run:
    """One run directory, split by record type; ``audit`` is None when there is no audit.json."""

    run_dir: Path
    stream_path: Path
    stream_sha256: str
    header: dict
    prompts: list[dict]  # prompt records, in stream order
    legs: list[dict]  # leg records, in stream order
    summaries: dict[str, dict]  # prompt id -> the harness's own summary record
    end: dict
    integrity: dict  # from read_stream: present / count_ok / sha256_ok
    audit: dict | None = None
    audit_path: Path | None = None
    retime: dict | None = None  # retime.json: the verified figures, None when absent
    roles: list[str] = field(default_factory=list)  # control first, then others as they appear

    @property
    def audit_matches(self) -> bool | None:
        """True/False when an audit is present (does it name this stream's bytes?), else None."""
        if self.audit is None:
            return None
        return self.audit["stream_sha256"] == self.stream_sha256


def load_run(run_dir) -> Run:
    """Read and check ``RUN_DIR/stream.jsonl`` and, where present, ``RUN_DIR/audit.json``."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise UserError(f"run directory {str(run_dir)!r} not found")
    if not run_dir.is_dir():
        raise UserError(f"{str(run_dir)!r} is not a directory (give the run directory that holds {STREAM_NAME})")
    stream_path = run_dir / STREAM_NAME
    if not stream_path.is_file():
        raise UserError(f"no {STREAM_NAME} in {run_dir} (write one with `harness time --out {run_dir}`) "
                        f"and no {TOKENS_AUDIT_NAME} (`audit tokens FILE --out {run_dir}/{TOKENS_AUDIT_NAME}`)")
    try:
        raw = stream_path.read_bytes()
        records, integrity = read_stream(stream_path)
    except OSError as exc:
        raise UserError(f"{stream_path}: cannot read ({exc.strerror or exc})") from None
    except StreamFormatError as exc:
        msg = str(exc)  # read_stream names the file itself in some messages, not in others
        raise UserError(msg if msg.startswith(str(stream_path)) else f"{stream_path}: {msg}") from None
    run = run_from_records(records, integrity, hashlib.sha256(raw).hexdigest(), run_dir, stream_path)
    audit_path = run_dir / AUDIT_NAME
    if audit_path.exists():
        run.audit = load_audit(audit_path)
        run.audit_path = audit_path
        if run.audit_matches:
            check_audit_prompts(run)
    retime_path = run_dir / RETIME_NAME
    if retime_path.exists():
        run.retime = load_retime(retime_path)
    return run


def load_retime(path: Path) -> dict:
    """Parse retime.json and check the fields the report reads; raise UserError on any mismatch."""
    doc = read_json(path)
    if not isinstance(doc, dict):
        raise UserError(f"{path}: not a JSON object")
    if doc.get("schema") != RETIME_SCHEMA:
        raise UserError(f"{path}: unknown retime schema {doc.get('schema')!r} (this tool reads {RETIME_SCHEMA})")
    _need(path, doc, "stream_sha256", lambda v: isinstance(v, str) and len(v) == 64, "a sha256 hex string")
    _need(path, doc, "verdict", lambda v: v in ("pass", "fail", "unverified"), "'pass', 'fail' or 'unverified'")
    _need(path, doc, "claimed", lambda v: isinstance(v, dict), "an object")
    _opt(path, doc["claimed"], "ratio", _is_num, "a finite number or null", "claimed.")
    _opt(path, doc, "verified", lambda v: isinstance(v, dict), "an object or null")
    for key in ("ratio", "ci_low", "ci_high", "score"):
        _opt(path, doc.get("verified") or {}, key, _is_num, "a finite number or null", "verified.")
    return doc


def run_from_records(records: list[dict], integrity: dict, stream_sha256: str, run_dir: Path,
                     stream_path: Path) -> Run:
    """Split parsed records into a Run and check that the run is whole enough to report on."""
    where = stream_path
    if not integrity.get("present"):
        # an interrupted harness leaves no file; a file without an end record was cut or assembled by hand
        raise UserError(f"{where}: no end record; the stream is incomplete (truncated or interrupted run)")
    header, prompts, legs, summaries, end = records[0], [], [], {}, records[-1]
    for rec in records[1:-1]:
        kind = rec["type"]
        if kind == "prompt":
            prompts.append(rec)
        elif kind == "leg":
            legs.append(rec)
        elif kind == "summary":
            summaries[rec["prompt_id"]] = rec
    if not prompts:
        raise UserError(f"{where}: no prompt records; nothing to report")
    ids = [p["id"] for p in prompts]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise UserError(f"{where}: prompt id {dupes[0]!r} appears more than once")
    roles = role_order(legs)
    for i, leg in enumerate(legs):
        if leg["prompt_id"] not in ids:
            raise UserError(f"{where}: a leg of prompt {leg['prompt_id']!r}, which has no prompt record")
        check_stats(leg, where, i)
    for pid in ids:
        have = {leg["role"] for leg in legs if leg["prompt_id"] == pid}
        if CONTROL_ROLE not in have or len(have) < 2:
            raise UserError(f"{where}: prompt {pid!r} lacks timed legs for "
                            f"{'the control' if CONTROL_ROLE not in have else 'any decoder but the control'}"
                            " (partial run?)")
    for role in roles:
        if role != CONTROL_ROLE and not isinstance(header.get(role, {}), dict):
            raise UserError(f"{where}: header field {role!r} must be an object naming the decoder")
    header_sampler(header, where)
    return Run(run_dir=Path(run_dir), stream_path=Path(stream_path), stream_sha256=stream_sha256, header=header,
               prompts=prompts, legs=legs, summaries=summaries, end=end, integrity=integrity, roles=roles)


def header_sampler(header: dict, where):
    """The sampler the header records (``core.sampling.Sampler``); absent: greedy. One that
    defines no sampler is bad input."""
    from core.sampling import Sampler, SamplerError  # imports torch: only when a report is rendered

    try:
        return Sampler.from_json(header.get("sampler"))
    except (SamplerError, TypeError) as exc:
        raise UserError(f"{where}: header sampler: {exc}") from None


def role_order(legs: list[dict]) -> list[str]:
    """Control first, then every other role in order of first appearance (more roles = more series)."""
    seen = []
    for leg in legs:
        if leg["role"] not in seen:
            seen.append(leg["role"])
    return sorted(seen, key=lambda r: (r != CONTROL_ROLE, seen.index(r)))


# --------------------------------------------------------------------------- decoder stats


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_stats(leg: dict, where: Path, index: int) -> None:
    """The stats the figures read must have the shapes DecodeStats.to_json writes; absent is fine."""
    stats = leg.get("stats", {})
    label = f"{where}: leg {index} ({leg['prompt_id']} {leg['role']}#{leg['leg']}) stats"
    if not isinstance(stats, dict):
        raise UserError(f"{label} must be an object")
    hist = stats.get("accept_hist", {})
    if not (isinstance(hist, dict) and all(k.isdigit() and _is_int(v) and v >= 0 for k, v in hist.items())):
        raise UserError(f"{label}.accept_hist must map accepted-draft counts to round counts")
    for key in ("drafted_by_depth", "accepted_by_depth"):
        val = stats.get(key, [])
        if not (isinstance(val, list) and all(_is_int(v) and v >= 0 for v in val)):
            raise UserError(f"{label}.{key} must be a list of counts")
    trace = stats.get("depth_trace")
    if trace is not None and not (isinstance(trace, list) and all(_is_int(v) and v >= 0 for v in trace)):
        raise UserError(f"{label}.depth_trace must be a list of draft depths")
    split = stats.get("time_split")
    if split is not None and not (isinstance(split, dict) and split
                                  and all(_is_num(v) and v >= 0 for v in split.values())):
        raise UserError(f"{label}.time_split must map phases to seconds (finite, >= 0)")


# --------------------------------------------------------------------------- audit.json


def read_json(path: Path):
    """A JSON file's value; unreadable, not UTF-8 or not JSON is a UserError naming the file."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None


def load_audit(path: Path) -> dict:
    """Parse audit.json and check the fields the report reads; raise UserError on any mismatch."""
    audit = read_json(path)
    if not isinstance(audit, dict):
        raise UserError(f"{path}: not a JSON object")
    if audit.get("schema") != AUDIT_SCHEMA:
        raise UserError(f"{path}: unknown audit schema {audit.get('schema')!r} (this tool reads {AUDIT_SCHEMA})")
    _need(path, audit, "stream_sha256", lambda v: isinstance(v, str) and len(v) == 64, "a sha256 hex string")
    _need(path, audit, "verdict", lambda v: v in ("pass", "fail"), "'pass' or 'fail'")
    _need(path, audit, "exact", lambda v: isinstance(v, bool), "true or false")
    _need(path, audit, "consistent", lambda v: isinstance(v, bool), "true or false")
    _need(path, audit, "score", _is_num, "a finite number")
    _need(path, audit, "prompts", lambda v: isinstance(v, list), "a list")
    _need(path, audit, "findings", lambda v: isinstance(v, list), "a list")
    _opt(path, audit, "median_ratio", _is_num, "a finite number or null")
    _opt(path, audit, "f_mem", _is_num, "a finite number or null")
    for key in ("memory", "replay", "score_params", "model", "header_model"):
        _opt(path, audit, key, lambda v: isinstance(v, dict), "an object or null")
    for key in ("control_peak_bytes", "candidate_peak_bytes"):
        _opt(path, audit.get("memory") or {}, key, lambda v: _is_int(v) and v >= 0, "bytes or null", "memory.")
    _opt(path, audit.get("memory") or {}, "ratio", _is_num, "a finite number or null", "memory.")
    for i, p in enumerate(audit["prompts"]):
        check_audit_prompt(path, p, i)
    for i, f in enumerate(audit["findings"]):
        if not (isinstance(f, dict) and isinstance(f.get("check"), str) and f.get("severity") in ("fail", "warn")
                and isinstance(f.get("message"), str)):
            raise UserError(f"{path}: findings[{i}] needs a string check, severity 'fail'/'warn' and a message")
    return audit


def check_audit_prompt(path: Path, p, i: int) -> None:
    where = f"prompts[{i}]."
    if not isinstance(p, dict):
        raise UserError(f"{path}: prompts[{i}] is not an object")
    _need(path, p, "id", lambda v: isinstance(v, str) and v != "", "a prompt id", where)
    _need(path, p, "exact", lambda v: isinstance(v, bool), "true or false", where)
    for key in ("ratio", "harness_ratio", "control_median_s", "candidate_median_s"):
        _opt(path, p, key, _is_num, "a finite number or null", where)
    div = p.get("first_divergence")
    if div is not None:
        if not isinstance(div, dict):
            raise UserError(f"{path}: {where}first_divergence must be an object or null")
        _need(path, div, "position", lambda v: _is_int(v) and v >= 0, "a token position", where + "first_divergence.")
        for key in ("emitted", "greedy"):
            _opt(path, div, key, _is_int, "a token id or null", where + "first_divergence.")
        _opt(path, div, "margin", _is_num, "a finite number or null", where + "first_divergence.")
        _opt(path, div, "top5", lambda v: isinstance(v, list) and all(
            isinstance(t, list) and len(t) == 2 and _is_int(t[0]) and _is_num(t[1]) for t in v),
            "a list of [id, logit] pairs", where + "first_divergence.")


def check_audit_prompts(run: Run) -> None:
    """An audit of this very stream must name the stream's prompts, no others."""
    ids = {p["id"] for p in run.prompts}
    for p in run.audit["prompts"]:
        if p["id"] not in ids:
            raise UserError(f"{run.audit_path}: names prompt {p['id']!r}, which {run.stream_path.name} does not have")


def _need(path, obj: dict, key: str, ok, what: str, prefix: str = "") -> None:
    if key not in obj:
        raise UserError(f"{path}: lacks '{prefix}{key}'")
    if not ok(obj[key]):
        raise UserError(f"{path}: {prefix}{key} must be {what}, not {obj[key]!r:.60}")


def _opt(path, obj: dict, key: str, ok, what: str, prefix: str = "") -> None:
    if obj.get(key) is not None and not ok(obj[key]):
        raise UserError(f"{path}: {prefix}{key} must be {what}, not {obj[key]!r:.60}")
