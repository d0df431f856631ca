"""The retime's two worker processes (``python -m harness.worker``): how each side is built from
the stream's header, how it is launched (``worker_command`` / ``start_worker``, the one place a
worker's command line is made), and the protocol the audit speaks with it.

Where the OS offers a writable cgroup v2, each worker starts inside a cgroup of its own
(``audit.cgroups.Box``): the side that is not being timed is frozen there by the kernel, both
sides are pinned to the same CPUs where cpusets are delegated, and at the end everything in the
box is killed. Each worker also runs in a session of its own, so without a cgroup, or for any
process found outside its box, it is stopped by signals as its process group and, through /proc,
as its whole process tree (``audit.processes.ProcessTree``); the candidate's also adopts the
orphans the audit reaps.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

from core.continues import ContinueCounter
from core.provenance import PROCESS_PYCACHE
from core.sampling import GREEDY, Sampler
from core.schema import ROLES, loads

from audit import cgroups, checks, sandbox
from audit.pipeline import log
from audit.processes import ProcessTree, parent_table, tree_control
from audit.stream import BadInput, header_sampler

WORKER_MODULE = "harness.worker"
# seconds a worker may take to exit after its stdin closes, before it is killed
WORKER_EXIT_S = 30


class WorkerError(Exception):
    """A worker failed to start or to answer; the message names the side and what it said."""

    prompt_id: str | None = None  # the fresh prompt it failed on, once timing began


@dataclass(frozen=True)
class Side:
    """A decoder as the stream recorded it: how ``harness time`` was told to build it."""

    role: str
    spec: str  # a registered name, or package.module:attr (a plug-in)
    args: dict  # constructor arguments as recorded (header ``args``)
    raw_args: tuple[str, ...] = ()  # KEY=VALUE from the header's command line, when ``args`` is absent
    sampler: Sampler = GREEDY  # the header's sampler: both sides decode with it

    @property
    def plugin(self) -> bool:
        return ":" in self.spec

    def describe(self) -> str:
        return " ".join([self.spec] + ([json.dumps(self.args)] if self.args else []) + list(self.raw_args)
                        + ([] if self.sampler.greedy else [f"sampling {self.sampler.describe()}"]))


def worker_command(side: Side, model_spec: str, device: str, positions: int | None = None) -> list[str]:
    """The command line of one side's worker (``start_worker`` runs it, in the sandbox for the
    candidate). Isolated: no PYTHONPATH, no user site; a trusted plug-in keeps PYTHONPATH, where
    it is found. ``positions``: the longest prompt + N it will be sent, reserved before it is ready."""
    sized = ["--positions", str(positions)] if positions is not None else []
    # the header's sampler object itself, so the worker samples with exactly the recorded numbers
    sampled = [] if side.sampler.greedy else ["--sampling", json.dumps(side.sampler.to_json(), sort_keys=True)]
    return [sys.executable, "-s" if side.plugin else "-I", "-m", WORKER_MODULE, "--model", model_spec, "--device", device,
            *sized, *sampled, "--decoder", side.spec, "--decoder-args", json.dumps(side.args),
            *(f"--decoder-arg={a}" for a in side.raw_args)]


def command_decoder_args(command) -> tuple[str, ...]:
    """``--decoder-arg`` values of a recorded ``harness time`` command line."""
    if not isinstance(command, list):
        return ()
    out = []
    for i, word in enumerate(command):
        if word == "--decoder-arg" and i + 1 < len(command) and isinstance(command[i + 1], str):
            out.append(command[i + 1])
        elif isinstance(word, str) and word.startswith("--decoder-arg="):
            out.append(word.partition("=")[2])
    return tuple(out)


def recorded_sides(header: dict, trust_plugins: bool) -> list[Side]:
    """The control and the candidate as recorded. The candidate's arguments come from the header's
    ``args``, else from its command line. A plug-in is code the stream names: it runs only with
    ``trust_plugins``."""
    sides = []
    sampler = header_sampler(header)
    for role in ROLES:
        entry = header[role]
        spec = entry.get("spec") if entry.get("spec") is not None else entry["name"]
        args = entry.get("args")
        if not isinstance(spec, str) or not spec:
            raise BadInput(f"header {role} spec must be a non-empty string, not {spec!r}")
        if args is not None and not isinstance(args, dict):
            raise BadInput(f"header {role} args must be an object, not {args!r}")
        raw = command_decoder_args(header.get("command")) if role == "candidate" and args is None else ()
        side = Side(role, spec, args or {}, raw, sampler)
        if side.plugin and not trust_plugins:
            raise BadInput(f"the {role} is the plug-in {spec!r}: retiming runs its code; pass --trust-plugin "
                           "if you trust it")
        sides.append(side)
    return sides


class Worker:
    """One side's process; ``decode`` is timed by the caller. ``audit_continues`` counts the
    audit's own SIGCONTs, shared by both sides."""

    def __init__(self, role: str, command: list[str], audit_continues: ContinueCounter, sandboxed: bool = False,
                 boxed: bool = True, pycache: str | None = None, hide: tuple[str, ...] = ()):
        self.role = role
        self.audit_continues = audit_continues
        self.resumes = 0  # SIGCONTs the audit sent the worker
        self.continued: int | None = None  # SIGCONTs the worker last said it received
        self.continues_judged = 0  # of the others' continues, those already put down to a request
        # a private pycache (the control's: the one its code check compiled) and temporary
        # directory; for the candidate, the sandbox (audit.sandbox), out of which ``hide`` is kept
        self.launch = sandbox.launch(command, sandboxed, pycache=pycache, hide=hide)
        self.box, self.unboxed = cgroups.Box.create(f"qwen35-{role}", cpus=shared_cpus()) if boxed else (None, "not asked")
        argv = self.box.enter_argv(self.launch.argv) if self.box else self.launch.argv
        # a session of its own: stopped as its process group and, through /proc, as its whole tree
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                         bufsize=1, env=self.launch.env, start_new_session=True)
        except BaseException:
            self.launch.cleanup()
            if self.box:
                self.box.kill()
            raise
        # orphans go with the candidate: the control is the audit's own decoder, which starts none
        self.tree = ProcessTree(self.proc.pid, adopts_orphans=role == "candidate")
        self.ready: dict | None = None
        self.alloc_retries: int | None = None  # what its last answer said of its allocator
        self.killed_at_close = 0

    def pause(self) -> None:
        if self.box is not None:
            try:
                self.box.freeze()
            except cgroups.CgroupError as exc:
                raise WorkerError(f"the {self.role}'s worker: {exc}") from None
            self.tree.stop(frozen=self.box.holds)
        else:
            self.tree.stop()

    def resume(self) -> None:
        if self.tree.resume():
            self.resumes += 1  # a thaw sends no SIGCONT: only a signalled resume is the audit's own
        if self.box is not None:
            self.box.thaw()

    def isolation(self) -> dict:
        """How this side was stopped while the other was timed, for retime.json."""
        if self.box is None:
            return {"freeze": "signals", "cgroup": None, "why": self.unboxed, "pinned": None}
        return {**self.box.describe(), "outside_box": sorted(self.tree.outside_box)}

    def continues_by_others(self) -> int | None:
        """SIGCONTs the worker received from others since the last call (None if it does not say):
        each one ended a stop that the audit did not make."""
        if not checks.is_int(self.continued):
            return None
        new = max(0, self.continued - self.resumes - self.continues_judged)
        self.continues_judged += new
        return new

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise WorkerError(f"the {self.role}'s worker exited (code {code}); its stderr is above")
        try:
            msg = loads(line)  # the stream's strict rules: a worker runs code the audit does not trust
        except ValueError:
            raise WorkerError(f"the {self.role}'s worker wrote {line.strip()[:200]!r}, not a protocol line") from None
        if not isinstance(msg, dict) or "error" in msg:
            raise WorkerError(f"the {self.role}'s worker: {msg.get('error') if isinstance(msg, dict) else msg!r}")
        self.continued = msg.get("continued")
        return msg

    def wait_ready(self) -> dict:
        self.ready = self.read()
        if self.ready.get("ready") is not True:
            raise WorkerError(f"the {self.role}'s worker did not start with a ready line: {self.ready!r}")
        return self.ready

    @property
    def instrument(self) -> bool:
        """Whether the decoder itself says it is an instrument (its worker asks it)."""
        return bool(self.ready) and self.ready.get("instrument") is True

    def prepare_prompt(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        """An instrument's untimed per-prompt preparation, as ``harness time`` gives it."""
        self.send(prompt_ids, max_new_tokens, key="prepare_prompt")
        if self.read().get("prepared") is not True:
            raise WorkerError(f"the {self.role}'s worker did not confirm its preparation")

    def send(self, prompt_ids: list[int], max_new_tokens: int, key: str = "prompt_ids") -> None:
        try:
            self.proc.stdin.write(json.dumps({key: prompt_ids, "max_new_tokens": max_new_tokens}) + "\n")
            self.proc.stdin.flush()
        except OSError:  # a closed pipe: the worker is gone
            raise WorkerError(f"the {self.role}'s worker exited (code {self.proc.wait()}); its stderr is above") from None

    def tokens(self) -> list[int]:
        """The answer's token ids; ``alloc_retries`` keeps what it says of its allocator (None
        where it says nothing, off CUDA)."""
        answer = self.read()
        tokens = answer.get("tokens")
        if not isinstance(tokens, list) or not all(checks.is_int(t) for t in tokens):
            raise WorkerError(f"the {self.role}'s worker answered without a list of token ids")
        retries = answer.get("alloc_retries")
        self.alloc_retries = retries if checks.is_int(retries) else None
        return tokens

    def close(self, graceful: bool = True) -> None:
        """End the worker: ``graceful``, its stdin closed and WORKER_EXIT_S for it to exit; else
        (the retime stopped or failed) killed at once, wherever it is, loading a model included."""
        self.resume()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=WORKER_EXIT_S if graceful else 0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.box is not None:
            self.killed_at_close = self.box.kill()
        self.killed_at_close += self.tree.kill_members()
        self.launch.cleanup()


def shared_cpus() -> str | None:
    """The CPUs the audit may use, as a cpuset list: both sides are pinned to the same ones."""
    try:
        return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return None


def start_worker(side: Side, model_spec: str, device: str, audit_continues: ContinueCounter,
                 sandboxed: bool, positions: int | None = None, control_pycache: str | None = None,
                 hide: tuple[str, ...] = ()) -> Worker:
    """One side's worker, started cold (not yet ready); the candidate's in the sandbox when
    ``sandboxed``, unable to read the paths ``hide`` names; the control's with ``control_pycache``,
    the candidate's with the interpreter's own ``__pycache__`` files (``audit.sandbox.launch``)."""
    log(f"starting the {side.role}'s worker: {side.describe()}")
    control = side.role == "control"
    return Worker(side.role, worker_command(side, model_spec, device, positions), audit_continues,
                  sandboxed=sandboxed and not control, pycache=control_pycache if control else PROCESS_PYCACHE,
                  hide=() if control else hide)


def start_workers(sides: list[Side], model_spec: str, device: str,
                  audit_continues: ContinueCounter, sandboxed: bool = True,
                  positions: int | None = None, control_pycache: str | None = None,
                  hide: tuple[str, ...] = (), check_control: Callable[[], object] = lambda: None
                  ) -> tuple[dict[str, Worker], object]:
    """Both sides cold, in processes of their own, each ready (sized for ``positions``: the longest
    prompt + N they will be sent, so that no timed request pays for growing), and what
    ``check_control()`` returned. The candidate starts first and loads while ``check_control``
    runs (the check of the control's code, which compiles ``control_pycache``); the control starts
    after it, with that private pycache. The candidate's sandbox keeps ``hide`` (the auditor's
    --fresh file) out of its sight; the audit's children from before are no one's orphans."""
    older = {pid for pid, (ppid, _) in parent_table().items() if ppid == os.getpid()} if tree_control() else set()
    workers = {}
    try:
        candidate = next(s for s in sides if s.role == "candidate")
        workers["candidate"] = start_worker(candidate, model_spec, device, audit_continues, sandboxed, positions,
                                            hide=hide)
        checked = check_control()
        for side in sides:
            if side.role != "candidate":
                workers[side.role] = start_worker(side, model_spec, device, audit_continues, sandboxed, positions,
                                                  control_pycache, hide)
        workers = {side.role: workers[side.role] for side in sides}
        for w in workers.values():
            w.tree.not_orphans = older | {x.proc.pid for x in workers.values()}
        for w in workers.values():
            w.wait_ready()
    except BaseException:
        for w in workers.values():
            w.close(graceful=False)
        raise
    return workers, checked
