"""Print one markdown table of `audit replay --workers N` throughput: ``python bench/replay_table.py DIR/audit-w*.json``.

Each audit.json is one replay of the same stream with a number of workers (``replay.workers``).
Per document (named by its file): tokens replayed, the replay's seconds (from the first walk handed out to the last
result; worker start-up and model loads excluded), tokens/s, the speed-up over the fewest
workers, and whether the document equals that one field by field, apart from the replay's
timing and worker count. Exits 1 when any document differs (each differing field is printed
before the table).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: its scripts' shared modules

from table_inputs import load_json, parse_files, read_all  # noqa: E402

POOL_KEYS = ("seconds", "ms_per_token", "workers")  # the replay fields a pool may change


def differences(a, b, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in one" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            out += differences(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if (a == b and type(a) is type(b)) else [f"{path}: {a!r} vs {b!r}"]


def comparable(doc: dict) -> dict:
    doc = json.loads(json.dumps(doc))
    for key in POOL_KEYS:
        doc["replay"].pop(key, None)
    return doc


def replay_doc(path: Path) -> tuple[str, dict]:
    """(name, document) of one audit.json, with every field the table reads."""
    doc = load_json(path)
    rp = doc["replay"]
    missing = ([k for k in ("stream", "verdict") if k not in doc]
               + [f"replay.{k}" for k in ("device", "tokens_replayed", "seconds", "ms_per_token") if k not in rp])
    if missing:
        raise KeyError(missing[0])
    if not rp["seconds"] > 0:
        raise ValueError("replay.seconds is not above 0")
    return path.stem, doc


def main(argv: list[str]) -> int:
    named = read_all(parse_files(__doc__, argv, "AUDIT.json"), replay_doc, "an audit replay document")
    if named is None:
        return 2
    named.sort(key=lambda nd: nd[1]["replay"].get("workers", 1))
    base = named[0][1]
    base_rate = base["replay"]["tokens_replayed"] / base["replay"]["seconds"]
    rows, agree = [], True
    for name, d in named:
        rp = d["replay"]
        rate = rp["tokens_replayed"] / rp["seconds"]
        diff = differences(comparable(base), comparable(d))
        for line in diff:
            print(f"workers {rp.get('workers', 1)} differs at {line}")
        agree = agree and not diff
        rows.append(f"| {name} | {rp.get('workers', 1)} | {rp['tokens_replayed']} | {rp['seconds']:.1f} | {rate:.1f} | "
                    f"{rate / base_rate:.2f}x | {rp['ms_per_token']:.1f} | {d['verdict']} | "
                    f"{'yes' if not diff else f'NO ({len(diff)} fields)'} |")
    print(f"\nreplay of {base['stream']} on {base['replay']['device']}; "
          f"audit.json documents {'agree' if agree else 'DIFFER'}\n")
    print(f"| document | workers | tokens replayed | replay s | tokens/s | vs {base['replay'].get('workers', 1)} worker(s) "
          "| ms/token (all workers) | verdict | same audit.json |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
