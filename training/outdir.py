"""``--out`` of a training run: which directories it may write, and writing a checkpoint there
whole or not at all.

A directory is this command's own output when it holds ``corpus_manifest.json`` (the mark of a
training export) and nothing but files of the names an export and its quality phase write. Such
a directory is replaced; an empty or missing one is created. Anything else is refused unless
``--force``, and then only the files of the checkpoint's own names are written there: every other
file is kept. The checkpoint is written into a temporary directory first and moved into place
only once complete, so an interruption leaves ``--out`` as it was.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from core.errors import UserError
from core.paths import AtomicFile, nearest_existing, plain_permissions, try_new_file

MANIFEST_FILE = "corpus_manifest.json"
OWN_FILES = frozenset({"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                       "tokenizer_config.json", MANIFEST_FILE, "quality.json", "quality.remeasured.json"})
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def own_name(name: str) -> bool:
    return name in OWN_FILES or SHARD.fullmatch(name) is not None


def foreign_entries(out: Path) -> list[str]:
    """The entries of the existing directory ``out`` that make it not this command's output
    (sorted); [] for an empty directory or an earlier run's checkpoint. Without the manifest,
    every entry counts: a checkpoint this command did not write is someone else's."""
    entries = sorted(out.iterdir())
    if not entries:
        return []
    own = {p.name for p in entries if p.is_file() and not p.is_symlink() and own_name(p.name)}
    if MANIFEST_FILE not in own:
        return [p.name for p in entries]
    return [p.name for p in entries if p.name not in own]


def probe(out: Path, directory: Path) -> None:
    try:
        try_new_file(directory, "training")
    except OSError as exc:
        raise UserError(f"cannot write --out {str(out)!r} (under {str(directory)!r}: {exc.strerror or exc})") from None


def check_out(out: Path, force: bool) -> None:
    """Refuse, before any work, an ``out`` this run may not write: one it could not make or fill
    (tried with a probe file, as ``os.access`` says yes to root on /proc or a read-only mount), or
    one holding files of other names (unless ``force``)."""
    if not out.exists() and not out.is_symlink():
        parent = nearest_existing(out.absolute().parent)
        if not parent.is_dir():
            raise UserError(f"cannot write --out {str(out)!r}: {str(parent)!r} is not a directory")
        probe(out, parent)
        return
    if not out.is_dir():
        raise UserError(f"--out {str(out)!r} exists and is not a directory")
    probe(out, out)
    foreign = foreign_entries(out)
    if foreign and not force:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UserError(f"--out {str(out)!r} is not a checkpoint this command wrote (it holds {shown}); pick a new "
                        "or empty directory, or pass --force to write the checkpoint into it (its other files are "
                        "kept, files of the checkpoint's names replaced)")


def replace_checkpoint(out: Path, write: Callable[[Path], None], force: bool) -> None:
    """Run ``write(directory)`` into a temporary directory, then put what it wrote at ``out``:
    a new ``out`` is the renamed temporary directory; an earlier run's checkpoint loses its own
    files first (old shards, quality records); with ``force``, a directory with other files gets
    the new files beside them. Nothing at ``out`` changes unless ``write`` completed."""
    check_out(out, force)
    fresh = not out.exists()
    earlier_run = not fresh and not foreign_entries(out)  # before the stage directory is made inside it
    try:
        parent = out.parent if fresh else out
        parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=".training-export-", dir=parent))
    except OSError as exc:
        raise UserError(f"cannot write --out {str(out)!r}: {exc.strerror or exc}") from None
    try:
        write(stage)
        for p in (stage, *stage.iterdir()):  # mkdtemp's directory and some writers' files are private
            plain_permissions(p)
        written = sorted(p.name for p in stage.iterdir())
        assert all(own_name(n) for n in written), f"an export wrote files of unknown names: {written}"
        if fresh:
            stage.rename(out)
            return
        if earlier_run:  # none of its files outlive it
            for p in out.iterdir():
                if p.is_file() and own_name(p.name) and p.name not in written:
                    p.unlink()
        for name in written:
            os.replace(stage / name, out / name)
    except OSError as exc:
        raise UserError(f"cannot write --out {str(out)!r}: {exc.strerror or exc}") from None
    finally:
        if stage.exists():
            shutil.rmtree(stage)


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` at ``path``, renamed into place whole."""
    with AtomicFile(path) as out:
        out.fh.write(text)
        out.commit()
