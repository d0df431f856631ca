"""Where outputs go: whether a directory takes a new file (tried rather than asked: ``os.access``
says yes to root on a read-only mount or a kernel file system such as /proc, where nothing can be
made), and files that appear whole or not at all."""
from __future__ import annotations

import atexit
import os
import secrets
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


# file systems whose files are the kernel's interfaces, not storage: a write to one is an order
# (/proc/sysrq-trigger, /sys/...) or fails only when the data comes (/proc/version, as root)
KERNEL_FILESYSTEMS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs",
    "configfs", "bpf", "pstore", "efivarfs", "fusectl", "binfmt_misc", "mqueue", "autofs", "rpc_pipefs",
    "nsfs", "hugetlbfs"})


def kernel_filesystem(st: os.stat_result, mountinfo: Path = Path("/proc/self/mountinfo")) -> str | None:
    """The type of the file system a file of status ``st`` lies on, where it is one of
    ``KERNEL_FILESYSTEMS``; None for any other (and where the mount table cannot be read)."""
    device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    try:
        lines = mountinfo.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 2 and fields[2] == device and "-" in fields:
            fstype = fields[fields.index("-") + 1] if fields.index("-") + 1 < len(fields) else ""
            return fstype if fstype in KERNEL_FILESYSTEMS else None
    return None


def check_output_file(path: Path, flag: str = "--out") -> Path:
    """What writing a document to ``path`` would replace, checked before any work. A symbolic link
    is written through (its target gets the document and the link stays: ``AtomicFile``), so a
    dangling one is refused; so is anything there that is not a regular file (a directory, a
    FIFO, a device such as /dev/null): it is never replaced. Returns ``path``."""
    from core.errors import UserError

    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise UserError(f"{flag} {str(path)!r} is a symbolic link to {os.readlink(path)!r}, which does not exist")
    if path.is_dir():
        raise UserError(f"{flag} {str(path)!r} is a directory; give a file name")
    if path.exists() and not path.is_file():
        raise UserError(f"{flag} {str(path)!r} is not a regular file (a device, FIFO or socket): it is not "
                        "replaced; give a file name")
    return path


def check_new_output(path: Path, force: bool, flag: str = "--out") -> Path:
    """Refuse, before any work, an output file that cannot be written or would replace one the
    user has (unless ``force``): ``UserError`` naming ``flag``."""
    from core.errors import UserError

    path = check_output_file(path, flag)
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
    AtomicFile(Path(directory) / name, suffix=".probe").abort()


class AtomicFile:
    """A text file written under a temporary name beside ``path`` (``fh``) and renamed into place
    by ``commit``: ``path`` is whole or absent. Leaving the ``with`` block uncommitted, or the
    process exiting by any exception, removes the temporary file and the directories made for it,
    even when a signal handler raises in the middle of this constructor: the object is registered
    before it makes anything, and an exit handler aborts whatever is still registered."""

    def __init__(self, path: Path, suffix: str = ".tmp"):
        # through a symbolic link to its target: the user's link stays a link
        self.path = Path(os.path.realpath(path)) if Path(path).is_symlink() else Path(path)
        self.fh = None
        self.committed = False
        self.pid = os.getpid()  # a forked child's exit must not remove its parent's file
        self.made = [d for d in (self.path.parent, *self.path.parent.parents) if not d.exists()]
        self.tmp = self.path.parent / f".{self.path.name}.{secrets.token_hex(8)}{suffix}"
        self.found = file_identity(self.path)  # what commit may replace: nothing else
        _UNFINISHED.add(self)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # "x": made here or refused, with the mode a plain open gives under this umask
            self.fh = open(self.tmp, "x", encoding="utf-8")
        except FileExistsError:
            self.tmp = None  # another's file of the same random name: not ours to remove
            self.abort()
            raise
        except BaseException:
            self.abort()
            raise

    def commit(self) -> None:
        """Rename the finished file into place; ``UserError`` (the temporary file kept for the
        ``with`` block to remove) where another process wrote ``path`` since this writer began:
        two runs given one output must not both report success while one result is lost."""
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        if file_identity(self.path) != self.found:
            from core.errors import UserError

            raise UserError(f"{self.path} was written by another process while this one ran: it is not "
                            "replaced, and this result is not written; give each run its own output")
        os.replace(self.tmp, self.path)
        self.committed = True
        _UNFINISHED.discard(self)

    def abort(self) -> None:
        _UNFINISHED.discard(self)
        if self.fh is not None and not self.fh.closed:
            self.fh.close()
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)
        for made in self.made:  # innermost first; one that now holds something else stays
            try:
                made.rmdir()
            except OSError:
                break

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.committed:
            self.abort()
        return False


def file_identity(path: Path) -> tuple | None:
    """Which file is at ``path`` (device, inode, size, modification time), None where none is."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


_UNFINISHED: set[AtomicFile] = set()


@atexit.register
def _abort_unfinished() -> None:
    for unfinished in list(_UNFINISHED):
        if unfinished.pid == os.getpid():
            unfinished.abort()
