"""What a run finds beside the stream it writes."""
from __future__ import annotations

from pathlib import Path

import click


def note_stale_documents(stream_path: Path) -> None:
    """A replaced stream (--force) leaves the audits of the one before it beside it: say so."""
    stale = [p.name for p in (stream_path.parent / "audit.json", stream_path.parent / "retime.json")
             if p.is_file() and p.stat().st_mtime < stream_path.stat().st_mtime]
    if stale:
        click.echo(f"note: {' and '.join(stale)} in {stream_path.parent} describe the stream this run replaced; "
                   "audit the new one again", err=True)
