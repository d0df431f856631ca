"""Argument types and the error line that bench's scripts share: a value out of range is an
argparse error, and a mistake found later (an unknown model, a bad sampler, a trace that is not
there) is one ``error:`` line and exit 2, never a traceback."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from core.errors import UserError  # noqa: E402
from core.paths import check_new_output  # noqa: E402


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {text!r}")
    return value


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number within 0..1, not {text!r}")
    return value


def listed(kind: Callable[[str], object]) -> Callable[[str], list]:
    """A comma-separated list of ``kind`` values, at least one."""
    def parse(text: str) -> list:
        items = [kind(part.strip()) for part in text.split(",") if part.strip()]
        if not items:
            raise argparse.ArgumentTypeError("names no value")
        return items
    parse.__name__ = f"list of {getattr(kind, '__name__', 'values')}"
    return parse


def new_output(text: str) -> Path:
    """A file to write at the end (replaced if it exists): its directory must take a file now, so
    the work is not lost."""
    try:
        return check_new_output(Path(text), force=True, flag="file")
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run_main(main: Callable[[], int]) -> int:
    """``main()``'s exit code; a user's mistake it raises is one line on stderr and exit 2."""
    try:
        return main()
    except Exception as exc:
        sampling = sys.modules.get("core.sampling")  # a sampler's mistake, where the script parsed one
        if isinstance(exc, UserError) or (sampling is not None and isinstance(exc, sampling.SamplerError)):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        raise
