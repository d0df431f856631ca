"""What a run finds beside the stream it writes."""
from __future__ import annotations

from pathlib import Path

import click


def note_stale_documents(stream_path: Path) -> None:
    """A replaced stream (--force) leaves the audits of the one before it, and the report rendered
    from them, beside it: say so."""
    stale = [p.name for p in (stream_path.parent / name for name in ("audit.json", "retime.json", "report.md"))
             if p.is_file() and p.stat().st_mtime < stream_path.stat().st_mtime]
    if stale:
        names = stale[0] if len(stale) == 1 else f"{', '.join(stale[:-1])} and {stale[-1]}"
        click.echo(f"note: {names} in {stream_path.parent} describe the stream this run replaced; "
                   "audit the new one again (audit replay renders report.md anew)", err=True)
