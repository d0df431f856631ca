"""Read a ``stream.jsonl`` into a per-prompt structure for the checks.

``core.schema.read_stream`` validates each record's fields; here the records are grouped by
prompt and the header's fields the audit relies on are type-checked. Anything that makes the
file impossible to audit meaningfully (unparseable, unknown schema, duplicate prompt ids, a leg
for a prompt never declared) raises ``BadInput``: the CLI prints one line and exits 2. Things
that can be audited but are wrong (a missing leg, a leg out of place) are left for the checks to
report as findings.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import UserError
from core.sampling import Sampler, SamplerError
from core.schema import StreamFormatError, parse_stream, read_stream_bytes

# new tokens per decode a header may claim: far beyond any run, small enough that a forged N
# cannot make `audit retime` decode for days
MAX_NEW_TOKENS = 1 << 20


class BadInput(UserError):
    """The stream cannot be audited at all; shown as one line, exit 2."""


@dataclass
class PromptRun:
    """One prompt's records, in file order."""

    id: str
    line: int  # 1-based line of the prompt record
    token_ids: list[int]
    rank: object = None  # the prompt record's "rank" as written (runs under torchrun); None if absent
    warmup_ids: list[int] | None = None  # the prompt both sides warmed up on; None if not recorded
    text: str | None = None  # the prompt's text when the record holds it (a set of text)
    legs: list[dict] = field(default_factory=list)
    summaries: list[dict] = field(default_factory=list)
    # records that belong to this prompt but appear after another prompt's record
    out_of_place: list[str] = field(default_factory=list)

    def role_legs(self, role: str) -> list[dict]:
        return [r for r in self.legs if r["role"] == role]


@dataclass
class Run:
    path: Path
    header: dict
    prompts: list[PromptRun]
    end: dict | None
    integrity: dict  # from read_stream: present, count_ok, sha256_ok
    violations: list[tuple[int, dict]] = field(default_factory=list)  # (line, violation record)
    sha256: str = ""  # of the bytes read and audited (never read a second time: the file may change)

    @property
    def max_new_tokens(self) -> int:
        return self.header["max_new_tokens"]

    @property
    def legs(self) -> int:
        return self.header["legs"]

    @property
    def sampler(self) -> Sampler:
        """What decided the tokens: the header's ``sampler`` (``validate_header`` checked it);
        absent, greedy."""
        return header_sampler(self.header)

    @property
    def world_size(self) -> int:
        """Processes that recorded the run: 1 for one process and for files older than the key."""
        return self.header.get("world_size", 1)


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate_header(header: dict) -> None:
    """The header fields the audit cannot do without, with the types it relies on."""
    for key in ("max_new_tokens", "legs"):
        if not is_int(header.get(key)) or header[key] < 1:
            raise BadInput(f"header {key} must be a positive integer, not {header.get(key)!r}")
    if header["max_new_tokens"] > MAX_NEW_TOKENS:
        raise BadInput(f"header max_new_tokens {header['max_new_tokens']} is beyond any run (at most {MAX_NEW_TOKENS})")
    info = header.get("prompts")
    if info is not None and not (isinstance(info, dict) and is_int(info.get("count", 0))
                                 and isinstance(info.get("source", ""), str)
                                 and isinstance(info.get("sha256", ""), str)):
        raise BadInput("header prompts must be an object with string source and sha256 and an integer count")
    if not isinstance(header.get("model"), dict):
        raise BadInput("header model must be an object (the model identity)")
    dev = header.get("device")
    if not isinstance(dev, dict) or not isinstance(dev.get("name"), str) or not isinstance(dev.get("type"), str):
        raise BadInput("header device must be an object with string 'type' and 'name'")
    for side in ("control", "candidate"):
        if not isinstance(header.get(side), dict) or not isinstance(header[side].get("name"), str):
            raise BadInput(f"header {side} must be an object with a string 'name'")
    validate_ranks(header)
    header_sampler(header)


def header_sampler(header: dict) -> Sampler:
    """The header's sampler (``core.sampling.Sampler.to_json``); none recorded is greedy. One that
    does not define a sampler is bad input: the control's tokens would be unknown."""
    try:
        return Sampler.from_json(header.get("sampler"))
    except (SamplerError, TypeError) as exc:
        raise BadInput(f"header sampler: {exc}") from None


def is_device(dev) -> bool:
    return isinstance(dev, dict) and isinstance(dev.get("name"), str) and isinstance(dev.get("type"), str)


def validate_ranks(header: dict) -> None:
    """``world_size`` and ``ranks`` (absent in older files: one process). A run under torchrun
    lists every rank, in order, with the device it timed its prompts on."""
    if "world_size" not in header and "ranks" not in header:
        return
    world = header.get("world_size")
    if not is_int(world) or world < 1:
        raise BadInput(f"header world_size must be a positive integer, not {world!r}")
    ranks = header.get("ranks")
    if not isinstance(ranks, list) or len(ranks) != world:
        raise BadInput(f"header ranks must list the {world} rank(s) of world_size")
    for i, entry in enumerate(ranks):
        if not isinstance(entry, dict) or not is_int(entry.get("rank")) or entry["rank"] != i \
                or not is_device(entry.get("device")):
            raise BadInput(f"header ranks[{i}] must be an object with rank {i} and a device with string "
                           "'type' and 'name'")


def group_records(records: list[dict]) -> tuple[list[PromptRun], dict | None, list[tuple[int, dict]]]:
    """Group legs and summaries under their prompt; violations apart, with their lines. A record's
    line number is its index + 1."""
    prompts: dict[str, PromptRun] = {}
    current: PromptRun | None = None
    end = None
    violations = []
    for lineno, rec in enumerate(records, start=1):
        kind = rec["type"]
        if kind == "prompt":
            if rec["id"] in prompts:
                raise BadInput(f"line {lineno}: duplicate prompt id {rec['id']!r} "
                               f"(first at line {prompts[rec['id']].line})")
            current = prompts[rec["id"]] = PromptRun(rec["id"], lineno, list(rec["token_ids"]), rec.get("rank"),
                                                     rec.get("warmup_ids"),
                                                     rec["text"] if isinstance(rec.get("text"), str) else None)
        elif kind in ("leg", "summary"):
            pid = rec["prompt_id"]
            if pid not in prompts:
                raise BadInput(f"line {lineno}: {kind} for prompt {pid!r}, which no earlier prompt record declares")
            owner = prompts[pid]
            if owner is not current:
                owner.out_of_place.append(f"line {lineno}: {kind} after prompt {current.id!r} began")
            (owner.legs if kind == "leg" else owner.summaries).append(rec)
        elif kind == "violation":
            violations.append((lineno, rec))
        elif kind == "end":
            end = rec
    return list(prompts.values()), end, violations


def resolve_stream_path(path: Path) -> Path:
    """A run directory stands for its stream.jsonl."""
    path = Path(path)
    if path.is_dir():
        if not (path / "stream.jsonl").exists() and not (path / "stream.jsonl").is_symlink():
            raise BadInput(f"{path} is a directory without a stream.jsonl")
        return path / "stream.jsonl"
    return path


def check_proportions(header: dict, records: list[dict], prompts: list[PromptRun]) -> None:
    """Counts the header claims must fit the file: a claim beyond the records present would only
    make the audit do work out of proportion to what it reads."""
    if header["legs"] > len(records):
        raise BadInput(f"header legs={header['legs']} per side is out of proportion to the file's "
                       f"{len(records)} records")
    count = (header.get("prompts") or {}).get("count")
    if is_int(count) and not 0 <= count <= len(records):
        raise BadInput(f"header prompts count={count} is out of proportion to the file's {len(records)} records "
                       f"({len(prompts)} prompt records)")


def load_run(path: Path) -> Run:
    """Parse and group a stream; every structural problem is ``BadInput``."""
    path = resolve_stream_path(path)
    try:
        raw = read_stream_bytes(path)
        records, integrity = parse_stream(raw, path)
    except StreamFormatError as exc:
        raise BadInput(f"{path}: {exc}" if str(path) not in str(exc) else str(exc)) from None
    except OSError as exc:
        raise BadInput(f"{path}: cannot read ({exc.strerror or exc})") from None
    header = records[0]
    validate_header(header)
    prompts, end, violations = group_records(records)
    if not prompts:
        raise BadInput(f"{path}: no prompt records; nothing to audit")
    check_proportions(header, records, prompts)
    return Run(path, header, prompts, end, integrity, violations, hashlib.sha256(raw).hexdigest())
