"""Whether a directory takes a new file, tried rather than asked: ``os.access`` says yes to root
on a read-only mount or a kernel file system (/proc, /sys), where nothing can be made."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def nearest_existing(path: Path) -> Path:
    """``path`` itself or its nearest ancestor that exists: where a path still to be made would
    be made (the current directory at worst, for a relative path)."""
    path = Path(path)
    return next((p for p in (path, *path.parents) if p.exists()), Path("."))


def plain_permissions(path: Path) -> None:
    """The mode a plain ``open`` or ``mkdir`` would have given ``path`` under this umask: files
    made by ``mkstemp``/``mkdtemp`` (and some writers, such as safetensors') are private to their
    owner, which a user's other outputs are not."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~umask)


def check_new_output(path: Path, force: bool, flag: str = "--out") -> Path:
    """Refuse, before any work, an output file that cannot be written or would replace one the
    user has (unless ``force``): ``UserError`` naming ``flag``."""
    from core.errors import UserError

    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {str(path)!r} is a directory; give a file name")
    if path.exists() and not force:
        raise UserError(f"{flag} {str(path)!r} exists; pass --force to replace it")
    parent = path.resolve().parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise UserError(f"{flag} {str(path)!r}: {str(parent)!r} {what}")
    try:
        try_new_file(parent, path.name)
    except OSError as exc:
        raise UserError(f"{flag} {str(path)!r}: cannot write under {str(parent)!r} ({exc.strerror or exc})") from None
    return path


def try_new_file(directory: Path, name: str = "probe") -> None:
    """Make and remove an empty file in ``directory``; raises the OSError that refused it."""
    fd, probe = tempfile.mkstemp(prefix=f".{name}.", suffix=".probe", dir=directory)
    os.close(fd)
    os.unlink(probe)
