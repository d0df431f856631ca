"""Export a harness stream's legs as generations for `audit tokens` (shape (a), one line per prompt).

    python bench/stream_to_tokens.py STREAM OUT.jsonl [--role candidate|control] [--leg 0]

Writes {"id": prompt id, "prompt_token_ids": [...], "output_token_ids": [...]} from each prompt's
leg ``--leg`` of ``--role`` (default: the candidate's first timed leg, the one its ratio is timed
on). With the control exported too, `audit tokens` compares the two (``--reference``):

    python bench/stream_to_tokens.py runs/x/stream.jsonl runs/x/candidate.jsonl
    python bench/stream_to_tokens.py runs/x/stream.jsonl runs/x/control.jsonl --role control
    audit tokens runs/x/candidate.jsonl --model M -n N --reference runs/x/control.jsonl

N is the stream's max_new_tokens (printed): without ``-n``, `audit tokens` takes the longest
output, which is shorter than N when every output stopped at an EOS.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.schema import ROLES, AtomicJsonlWriter, StreamFormatError, read_stream  # noqa: E402


def export(stream: Path, out: Path, role: str = "candidate", leg: int = 0) -> tuple[int, dict]:
    """Write OUT.jsonl; returns (generations written, the stream's header)."""
    records, _ = read_stream(stream)
    header = records[0]
    prompts = [r for r in records if r["type"] == "prompt"]
    legs = {r["prompt_id"]: r for r in records if r["type"] == "leg" and r["role"] == role and r["leg"] == leg}
    missing = [p["id"] for p in prompts if p["id"] not in legs]
    if missing:
        raise StreamFormatError(f"{stream}: prompt {missing[0]!r} has no {role} leg {leg}")
    with AtomicJsonlWriter(out) as w:
        for p in prompts:
            w.write({"id": p["id"], "prompt_token_ids": p["token_ids"], "output_token_ids": legs[p["id"]]["tokens"]})
        w.commit()
    return len(prompts), header


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stream", type=Path, metavar="STREAM")
    ap.add_argument("out", type=Path, metavar="OUT.jsonl")
    ap.add_argument("--role", choices=ROLES, default="candidate", help="whose legs to export (default: candidate)")
    ap.add_argument("--leg", type=int, default=0, help="which timed leg of that role (default: 0, the first)")
    args = ap.parse_args()
    try:
        count, header = export(args.stream, args.out, args.role, args.leg)
    except (StreamFormatError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n, model = header["max_new_tokens"], header["model"].get("name", "MODEL")
    print(f"wrote {count} generations ({args.role} leg {args.leg}) to {args.out}; the stream's N is {n}: "
          f"audit tokens {args.out} --model {model} -n {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
