"""The command line of bench's table scripts (retime_table, replay_table, sampling_exact_table):
the documents they tabulate, each a file that exists, and any it cannot read refused in one
``error:`` line that names it."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

UNREADABLE = (KeyError, TypeError, ValueError, IndexError, AttributeError, UnicodeDecodeError)  # JSONDecodeError is a ValueError


def parse_files(doc: str, argv: list[str], metavar: str) -> list[Path]:
    """``--help`` from the script's docstring; every FILE must exist (a shell pattern that matched
    nothing arrives as itself, and is refused as such)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[-1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", metavar=metavar)
    files = [Path(f) for f in ap.parse_args(argv).files]
    for f in files:
        if not f.is_file():
            glob = any(c in str(f) for c in "*?[")
            ap.error(f"{f}: no such file" + (" (a pattern that matched nothing)" if glob else ""))
    return files


def read_all(files: list[Path], read: Callable[[Path], object], what: str) -> list | None:
    """``read(path)`` of every file, or None after one ``error:`` line for the first it cannot read."""
    out = []
    for f in files:
        try:
            out.append(read(f))
        except UNREADABLE as exc:
            detail = f"no field {exc}" if isinstance(exc, KeyError) else str(exc).splitlines()[0]
            print(f"error: {f}: not {what} ({detail})", file=sys.stderr)
            return None
    return out


def load_json(path: Path) -> dict:
    doc = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    return doc
