"""Proof that the control runs unchanged code: its import closure checked against references.

``check_control_code()`` finds the files the control's decode path loads and hashes each against
a reference that a decoder running later cannot rewrite from inside the audit's processes:

  closure      a fresh isolated interpreter (``python -I``, no user site, a private empty
               ``PYTHONPYCACHEPREFIX`` so no stale or planted ``.pyc`` is loaded) imports the
               control's modules (``CONTROL_MODULES``) and prints the file of every module it
               loaded. To these come every ``.py`` file of the distributions in ``FULL_DISTRIBUTIONS``
               (torch and transformers load more of themselves lazily, during a forward) and every
               tracked ``.py`` file of this project's packages the closure touched.
  this project a file inside a git work tree is checked against git ``HEAD``: its bytes hashed as
               a git blob here (no git filter or hook runs) against ``git ls-tree -r HEAD``, run
               with a clean environment and no user or system configuration. A file outside a work
               tree is checked against its installed distribution's ``RECORD``.
  libraries    a file a distribution installed is checked against the sha256 in its ``RECORD``.
  startup      ``.pth`` files and ``sitecustomize`` / ``usercustomize`` modules (code every
               interpreter runs at startup, ``-I`` or not) are listed; a ``.pth`` a ``RECORD`` lists
               is checked like any other file, the others are reported (``unowned``).

The work tree is the one holding the files the closure loaded (the first control module's),
whatever this process's own import path would find. A loaded file that no reference covers (not
the standard library's, not in a ``RECORD``, not tracked at ``HEAD``) is listed under
``unverified``, and those of the control's own packages or of torch / transformers under
``unproven`` as well (one ``control-code-unverified`` warning); a changed or missing file under
``modified``, each a ``control-code-modified`` finding naming it. A control that runs in the
checking process itself (``harness time``) has the closure resolve on that process's import path
(``sys_path``), and ``loaded_elsewhere`` then compares the files it imported with those checked.

Limits: the references live on the same machine. A process that can rewrite the checkout's
``.git`` (its objects and ``HEAD``) or a distribution's ``RECORD`` together with the files can make
a changed file pass; the standard library and compiled extension modules are not hashed. Run the
audit from a checkout, and an environment, that the candidate never had write access to.
"""
from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

CONTROL_MODULES = ("harness.worker", "decoders.serial", "decoders", "core.models", "core.determinism")
FULL_DISTRIBUTIONS = ("torch", "transformers")
STARTUP_MODULES = ("sitecustomize", "usercustomize")
CHUNK = 1 << 20
CLOSURE_TIMEOUT_S = 300
# ``pycache=`` for a closure that loads the interpreter's own ``__pycache__`` files (see Closure)
PROCESS_PYCACHE = "process"

# run by the fresh interpreter: import the modules, print every loaded module's file by name. A
# module that hides its file (``del __file__``, as startup code found on the path may) is found
# through its spec, else where the path finder finds its name
CLOSURE = """
import importlib.machinery, json, sys
for name in sys.argv[1:]:
    __import__(name)
def origin(name, module):
    where = getattr(module, "__file__", None)
    if not isinstance(where, str):
        where = getattr(getattr(module, "__spec__", None), "origin", None)
    if not isinstance(where, str) and "." not in name and name not in sys.builtin_module_names:
        try:
            where = getattr(importlib.machinery.PathFinder.find_spec(name), "origin", None)
        except (ImportError, ValueError):
            where = None
    return where if isinstance(where, str) else None
print(json.dumps({n: f for n, m in list(sys.modules.items()) if (f := origin(n, m)) is not None}))
"""


@dataclass
class ProvenanceReport:
    checked: int = 0
    references: list[str] = field(default_factory=list)
    modified: list[dict] = field(default_factory=list)  # path, reference, expected, actual
    unverified: list[str] = field(default_factory=list)  # loaded, covered by no reference
    startup: list[dict] = field(default_factory=list)  # path, kind, owner (a distribution or None)
    seconds: float = 0.0
    modules: dict[str, str] = field(default_factory=dict)  # the closure's module name -> file
    # the unverified files of the control's own packages and of FULL_DISTRIBUTIONS' (a copy of the
    # project outside any work tree, say): the code the control's result rests on, not proven
    unproven: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.modified

    def summary(self) -> dict:
        """The check for a header or retime.json."""
        gits = [r for r in self.references if r.startswith("git ")]
        dists = len(self.references) - len(gits)
        reference = "; ".join(gits + ([f"RECORD of {dists} distributions"] if dists else []))
        return {"checked": self.checked, "reference": reference, "modified": self.modified,
                "unverified": self.unverified, "unproven": self.unproven, "startup": self.startup,
                "seconds": round(self.seconds, 3)}

    def findings(self) -> list[dict]:
        """``control-code-modified`` (fail) per changed file; ``control-code-unverified`` (warn) for
        the ``unproven`` files; ``control-startup-code`` (warn) for startup code no distribution
        owns. Shaped as the audit's findings. Other libraries' files no reference covers (a
        virtualenv's own ``_virtualenv.py``, say) are listed in the summary only."""
        out = [{"check": "control-code-modified", "severity": "fail", "prompt_id": None,
                "message": f"{m['path']} differs from its reference ({m['reference']}: expected {m['expected']}, "
                           f"found {m['actual']}): the control would not run the code it names", **m}
               for m in self.modified]
        if self.unproven:
            shown = ", ".join(self.unproven[:3]) + (f" and {len(self.unproven) - 3} more"
                                                    if len(self.unproven) > 3 else "")
            out.append({"check": "control-code-unverified", "severity": "warn", "prompt_id": None,
                        "message": f"{len(self.unproven)} file(s) of the control's own packages or of "
                                   f"{' / '.join(FULL_DISTRIBUTIONS)} are covered by no reference (not at git HEAD, "
                                   f"not in a RECORD), so they are not proven unchanged: {shown}",
                        "paths": self.unproven})
        unowned = [s["path"] for s in self.startup if s["owner"] is None]
        if unowned:
            out.append({"check": "control-startup-code", "severity": "warn", "prompt_id": None,
                        "message": f"startup code no distribution owns runs in every interpreter: {', '.join(unowned)}",
                        "paths": unowned})
        return out


def sha256_file(path: str) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.digest()


def git_blob_sha(path: str) -> str:
    """The git blob id of a file's bytes, as ``git hash-object`` gives it without filters."""
    h = hashlib.sha1()
    h.update(b"blob %d\0" % os.path.getsize(path))
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def record_hash(path: str) -> str:
    """``sha256=...`` as a RECORD writes it (urlsafe base64, no padding)."""
    return "sha256=" + base64.urlsafe_b64encode(sha256_file(path)).rstrip(b"=").decode()


def clean_git_env() -> dict:
    return {"PATH": os.environ.get("PATH", os.defpath), "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": os.devnull, "LC_ALL": "C"}


def git(root: str, *args: str) -> str:
    exe = shutil.which("git")
    if exe is None:
        raise OSError("git is not installed")
    done = subprocess.run([exe, "-c", "safe.directory=*", "-c", "core.fsmonitor=false", "-C", root, *args],
                          env=clean_git_env(), capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise OSError(done.stderr.decode(errors="replace").strip() or f"git {args[0]} failed")
    return done.stdout.decode("utf-8", errors="surrogateescape")


@dataclass
class GitReference:
    """The blobs at ``HEAD`` of the work tree ``root``."""

    root: str
    head: str
    blobs: dict[str, str]  # absolute path -> blob id

    @classmethod
    def find(cls, directory: str) -> "GitReference | None":
        try:
            root = git(directory, "rev-parse", "--show-toplevel").strip()
            head = git(root, "rev-parse", "--verify", "HEAD").strip()
            listing = git(root, "ls-tree", "-r", "-z", "--full-tree", "HEAD")
        except (OSError, subprocess.TimeoutExpired):
            return None
        blobs = {}
        for entry in filter(None, listing.split("\0")):
            meta, _, rel = entry.partition("\t")
            mode, kind, sha = meta.split()
            if kind == "blob":
                blobs[os.path.normpath(os.path.join(root, rel))] = sha
        return cls(root, head, blobs)

    @property
    def name(self) -> str:
        return f"git HEAD {self.head}"


def record_index(names=None) -> dict[str, tuple[str, str]]:
    """Absolute path -> (RECORD hash, distribution) of every file installed distributions list
    with a hash; ``names`` limits it to those distributions."""
    out = {}
    dists = [importlib.metadata.distribution(n) for n in names] if names else importlib.metadata.distributions()
    for dist in dists:
        base = str(dist.locate_file(""))
        label = f"RECORD {dist.metadata['Name']} {dist.version}"
        for f in dist.files or ():
            if f.hash is not None and f.hash.mode == "sha256":
                out.setdefault(os.path.normpath(os.path.join(base, str(f))), (f"sha256={f.hash.value}", label))
    return out


class Closure:
    """The module files a fresh isolated interpreter loads importing ``modules``; started at once,
    read by ``files()`` (so the hashing of what is known already overlaps the imports).

    ``pycache``: None, a fresh private pycache, removed afterwards (no ``.pyc`` written before is
    loaded, so a planted one cannot make the closure lie; everything is compiled from source); a
    directory, the private pycache to use and keep (``audit retime`` hands it on to the control's
    worker, which then loads what the closure compiled instead of compiling it again);
    ``PROCESS_PYCACHE``, the interpreter's own ``__pycache__`` files (``harness time``, whose own
    process goes on to import the control from those same files, so a private one would guard
    nothing its control does not already load). ``sys_path``: the import path to resolve the
    modules on (default: the isolated interpreter's own, as a ``python -I`` worker has it)."""

    def __init__(self, modules, python: str = sys.executable, pycache: str | None = None,
                 sys_path: list[str] | None = None):
        self.cache = tempfile.TemporaryDirectory(prefix="qwen35-pycache-") if pycache is None else None
        prefix = self.cache.name if self.cache is not None else pycache
        # -I ignores PYTHONPYCACHEPREFIX: a private pycache is given with -X
        flags = [] if prefix == PROCESS_PYCACHE else ["-X", f"pycache_prefix={prefix}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        # sys_path: the import path of the process that runs the control, where it is not an
        # isolated interpreter's (``harness time`` runs it in its own process)
        script = CLOSURE if sys_path is None else f"import sys\nsys.path[:] = {list(sys_path)!r}\n{CLOSURE}"
        self.proc = subprocess.Popen([python, "-I", *flags, "-c", script, *modules],
                                     env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)

    def files(self) -> dict[str, str]:
        """Module name -> the absolute, normalised file it was loaded from."""
        try:
            out, err = self.proc.communicate(timeout=CLOSURE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        finally:
            if self.cache is not None:
                self.cache.cleanup()
        if self.proc.returncode != 0 or not out.strip():
            raise OSError(f"importing the control's modules failed: {err.strip()[-400:]}")
        loaded = json.loads(out.strip().splitlines()[-1])
        return {name: os.path.normpath(f) for name, f in loaded.items() if os.path.isabs(f)}


def stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(os.path.normpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib"))


def site_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    return sorted({os.path.normpath(paths[k]) for k in ("purelib", "platlib")})


def startup_files(site: list[str], records: dict) -> list[dict]:
    """``.pth`` files in the site directories and startup modules found there."""
    out = []
    for d in site:
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for name in names:
            stem = name.split(".")[0]
            if name.endswith(".pth") or stem in STARTUP_MODULES:
                path = os.path.join(d, name)
                owner = records.get(path, (None, None))[1]
                out.append({"path": path, "kind": "pth" if name.endswith(".pth") else stem, "owner": owner})
    return out


def python_files(root: str, packages: set[str], blobs: dict[str, str]) -> list[str]:
    """Tracked ``.py`` files of ``packages`` (top-level directories of ``root``)."""
    tops = tuple(os.path.join(root, p) + os.sep for p in packages)
    return [p for p in blobs if p.endswith(".py") and p.startswith(tops)]


def check_control_code(control_modules=CONTROL_MODULES, full_distributions=FULL_DISTRIBUTIONS,
                       python: str = sys.executable, git_reference=None, records=None,
                       clock=time.perf_counter, pycache: str | None = None,
                       sys_path: list[str] | None = None) -> ProvenanceReport:
    """Check the control's code (see the module docstring). ``git_reference`` (a ``GitReference``,
    or a directory to find one from; by default the work tree of the first control module's
    package) and ``records`` (``record_index()``'s map) are injectable; ``pycache`` is the
    closure's, and ``sys_path`` the import path it resolves the modules on (``Closure``)."""
    start = clock()
    git_reference_given = git_reference
    closure = Closure(control_modules, python, pycache, sys_path)
    report, done = ProvenanceReport(), set()
    try:
        records = record_index() if records is None else records
        if git_reference is None or isinstance(git_reference, (str, os.PathLike)):
            anchor = str(git_reference) if git_reference is not None else package_dir(control_modules)
            git_reference = GitReference.find(anchor) if anchor else None
        names = {n.lower() for n in full_distributions}
        first = {p for p, (_, label) in records.items() if p.endswith(".py") and label.split(" ")[1].lower() in names}
        report.startup = startup_files(site_dirs(), records)
        first |= {s["path"] for s in report.startup if s["owner"] is not None}
        check_files(first, git_reference, records, report, done)
    finally:
        modules = closure.files()
    report.modules = modules
    loaded = set(modules.values())
    # the work tree is that of the files the closure loaded, which this process's import path
    # (a PYTHONPATH, the current directory) may not share
    first_file = modules.get(control_modules[0]) if control_modules else None
    if first_file is not None and not isinstance(git_reference_given, GitReference) \
            and (git_reference is None or not first_file.startswith(git_reference.root + os.sep)):
        git_reference = GitReference.find(os.path.dirname(first_file)) or git_reference
    later = set(loaded)
    if git_reference is not None:
        packages = {os.path.relpath(p, git_reference.root).split(os.sep)[0] for p in loaded
                    if p.startswith(git_reference.root + os.sep)}
        later |= set(python_files(git_reference.root, packages, git_reference.blobs))
    check_files(later, git_reference, records, report, done)
    tops = {m.split(".")[0] for m in control_modules} | {n.lower() for n in full_distributions}
    own_files = {f for name, f in modules.items() if name.split(".")[0].lower() in tops}
    report.unproven = [p for p in report.unverified if p in own_files]
    report.seconds = clock() - start
    return report


def check_files(paths, git_reference, records, report: ProvenanceReport, done: set) -> None:
    stdlib, site = stdlib_dirs(), site_dirs()
    for path in sorted(set(paths) - done):
        done.add(path)
        if path.startswith(stdlib) and not any(path.startswith(s + os.sep) for s in site):
            continue
        reference = check_file(path, git_reference, records, report)
        if reference is None:
            report.unverified.append(path)
        elif reference not in report.references:
            report.references.append(reference)


def check_file(path: str, git_reference: GitReference | None, records: dict, report: ProvenanceReport) -> str | None:
    """Hash one file against its reference; returns the reference's name, or None if none covers it."""
    if git_reference is not None and path in git_reference.blobs:
        expected, name = git_reference.blobs[path], git_reference.name
        actual = git_blob_sha(path) if os.path.isfile(path) else "missing"
    elif path in records:
        expected, name = records[path]
        actual = record_hash(path) if os.path.isfile(path) else "missing"
    elif git_reference is not None and path.startswith(git_reference.root + os.sep):
        expected, name, actual = "absent", git_reference.name, "untracked file"
    else:
        return None
    report.checked += 1
    if actual != expected:
        report.modified.append({"path": path, "reference": name, "expected": expected, "actual": actual})
    return name


def package_dir(modules) -> str | None:
    """The directory holding the first control module's top-level package, found without
    importing it (``importlib.util.find_spec`` of a top-level name runs no project code)."""
    import importlib.util

    top = modules[0].split(".")[0] if modules else None
    try:
        spec = importlib.util.find_spec(top) if top else None
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(Path(list(spec.submodule_search_locations)[0]).parent)


def loaded_elsewhere(modules: dict[str, str], loaded: dict | None = None) -> list[dict]:
    """The modules of the check's closure (``modules``: name -> file) that this process
    (``loaded``: ``sys.modules`` by default) loaded from another file, as ``modified`` entries: a
    control running in this process whose import path differs from the check's interpreter's (a
    ``PYTHONPATH``, the current directory) runs code the check never read."""
    loaded = sys.modules if loaded is None else loaded
    out = []
    for name, checked in sorted(modules.items()):
        here = getattr(loaded.get(name), "__file__", None)
        if isinstance(here, str) and os.path.isabs(here) and os.path.normpath(here) != checked:
            out.append({"path": os.path.normpath(here), "reference": f"the file the check read for {name}",
                        "expected": checked, "actual": os.path.normpath(here)})
    return out


def control_code_header(**kwargs) -> tuple[dict, list[dict], dict[str, str]]:
    """For ``harness time``: the check's summary for the run header (``control_code``), its
    findings (a non-empty ``control-code-modified`` list means the control's code changed) and the
    closure's module files, for ``loaded_elsewhere`` once the control is imported here."""
    report = check_control_code(**kwargs)
    return report.summary(), report.findings(), report.modules
