"""Replay workers on one device: ``audit replay --workers N`` and ``audit retime --workers N``.

The eager serial path is host-bound: one process keeps a GPU mostly idle (about 19 tokens/s at
the 9B shape). Here N processes share the device, each with its own CUDA context and pristine
serial path (``audit.replay.PristineSerial``), each walking one prompt at a time. The
parent hands the walks out in file order to whichever worker is free, and shows their ticks on
its one progress bar. A walk's arithmetic is the lone replay's: the same calls, in a process
pinned to the same configuration (``core.determinism``, checked against the parent's) with the
same torch thread count, so every logit and result is the same; only the seconds differ.

Memory: the workers read the audit's own copy of the weights, sent to each as it starts (CUDA IPC
handles on a GPU, shared memory on a CPU: nothing is copied) and never written; each holds only
its context, activations and cache. A worker fingerprints the weights it was sent
(``core.models.weights_fingerprint``) and is refused unless that equals the audit's identity. A
worker out of device memory fails the replay with one line that says so (no traceback: the fix is
fewer ``--workers``).

A worker that fails, dies, or sends nothing for ``timeout_s`` while it starts or walks fails the
replay (``DistError``, one line naming the worker and its prompt) before anything is written,
and every other worker is killed. The workers are spawned (``multiprocessing``'s ``spawn``:
CUDA cannot be forked) and import ``core`` and ``audit`` only.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
import threading
import time
import traceback
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler

from core.errors import DistError

DEFAULT_TIMEOUT_S = 1800  # as core.dist: a worker silent this long is hung
POLL_S = 0.5  # how often the parent looks for a hung worker while none has spoken
CLOSE_S = 60  # a worker told to stop gets this long to exit before it is killed


@dataclass(frozen=True)
class PoolOptions:
    """How a replay's walks are spread: ``workers`` processes on the replay's one device (1:
    in the audit's own process), each taken as hung after ``timeout_s`` without a word."""

    workers: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S

    def for_walks(self, walks: int, log=None) -> "PoolOptions":
        """No more workers than there are walks to hand out: each idle one would still hold a process,
        a device context and a pipe."""
        if self.workers <= max(1, walks):
            return self
        if log:
            log(f"--workers {self.workers}: {walks} walk(s) to hand out, so {max(1, walks)} worker(s)")
        return dataclasses.replace(self, workers=max(1, walks))


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker is told once, at its start: how many torch threads it runs."""

    threads: int


# --------------------------------------------------------------------------- the worker side


class Relay:
    """A worker's stand-in for the parent's progress bar and log: each tick, settle and line goes
    to the parent, which shows it. Every message also tells the parent the worker is alive."""

    def __init__(self, conn):
        self.conn = conn

    def tick(self, n: int = 1) -> None:
        self.conn.send(("tick", n))

    def settle(self, estimated: int, walked: int, ticked: int) -> None:
        self.conn.send(("settle", estimated, walked, ticked))

    def log(self, message: str) -> None:
        self.conn.send(("log", message))


def serve(conn, index: int, setup: WorkerSetup) -> None:
    """One worker's life (the spawned process's target): take the audit's model, say so, then walk
    each ``audit.replay.Walk`` the parent sends until it sends None."""
    try:
        from audit.pipeline import pin_replay_environment

        pin_replay_environment()  # before CUDA starts, as the audit's own process
        import torch

        from core import determinism

        from audit import replay

        torch.set_num_threads(setup.threads)
        exit_with_the_audit()
        model = take_model(conn)
        conn.send(("ready", model.identity, determinism.current()))
        stepper, eos, relay = replay.PristineSerial(model), set(model.eos_token_ids), Relay(conn)
        while (walk := conn.recv()) is not None:
            conn.send(("done", replay.walk_one(stepper, walk, eos, relay, relay.log)))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):  # the parent is gone, or stopping
        return
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the replay
        from core.dist import error_text

        oom = out_of_memory(exc)
        if oom is None:  # a bug's traceback, for whoever debugs it
            print(f"[worker {index}] {''.join(traceback.format_exception(exc)).rstrip()}", file=sys.stderr, flush=True)
        try:
            conn.send(("error", error_text(exc)) if oom is None else ("error", oom, "out-of-memory"))
        except OSError:
            pass


def exit_with_the_audit() -> None:
    """End this worker as soon as the audit's process ends, whatever the worker is doing (a worker
    waiting on its pipe sees the end anyway; one stuck elsewhere would outlive the audit)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="audit-replay-parent-watch").start()


def take_model(conn):
    """The audit's model as the parent sends it, its tensors the parent's own (shared, not copied),
    with the weights fingerprint this process computes from them in its identity: the parent
    refuses a worker whose weights are not the audit's."""
    from core.models import weights_fingerprint

    model = conn.recv()
    model.identity = {**model.identity, "weights_fingerprint": weights_fingerprint(model.backbone, model.mtp)}
    return model


def out_of_memory(exc: BaseException) -> str | None:
    """The first two sentences of a device out-of-memory error (torch's: what ran out, and the
    allocation that failed), else None."""
    import torch

    if not isinstance(exc, torch.OutOfMemoryError):
        return None
    return ". ".join(" ".join(str(exc).split()).split(". ")[:2]).rstrip(".")


# --------------------------------------------------------------------------- the parent side


@dataclass
class Worker:
    index: int
    process: object
    conn: object
    at: tuple | str | None  # (walk index, label) while walking, a stage while starting, None when idle
    last: float  # monotonic time of its last message
    sender: threading.Thread | None = None  # the thread writing the model to it, while starting

    def doing(self) -> str:
        return f"on prompt {self.at[1]!r}" if isinstance(self.at, tuple) else f"while {self.at or 'idle'}"


class WorkerPool:
    """``opts.workers`` replay workers on ``model``'s device, each computing with ``model``'s own
    weights (which the pool's owner keeps until it closes); ``walk`` is a walker for
    ``audit.replay.replay_run`` and ``replay_shared``. A context manager: the workers start (and
    take the model) on entry and are stopped on exit."""

    def __init__(self, model, opts: PoolOptions, log=None):
        self.model, self.setup = model, WorkerSetup(threads())
        self.identity, self.opts, self.log = model.identity, opts, log
        self.workers: list[Worker] = []

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.close(graceful=False)
            raise
        return self

    def __exit__(self, exc_type, *exc):
        self.close(graceful=exc_type is None)
        return False

    def stall_limit(self, worker: Worker) -> float:
        """Seconds without a message after which a busy worker is taken as hung."""
        return self.opts.timeout_s

    # ------------------------------------------------------------------ start and stop

    def start(self) -> None:
        import torch.multiprocessing

        from core import determinism

        # CPU tensors travel as named shared-memory files, not as descriptors handed over by a
        # listener thread, which prints a traceback when a worker is killed mid-handover
        torch.multiprocessing.set_sharing_strategy("file_system")
        ctx = multiprocessing.get_context("spawn")
        t0 = time.monotonic()
        if self.log:
            self.log(f"starting {self.opts.workers} replay workers on {self.model.device}, sharing this "
                     f"process's copy of {self.model.name}'s weights ...")
        for index in range(self.opts.workers):
            parent_end, child_end = ctx.Pipe()
            process = ctx.Process(target=serve, args=(child_end, index, self.setup), daemon=True,
                                  name=f"audit-replay-worker-{index}")
            process.start()
            child_end.close()
            self.workers.append(Worker(index, process, parent_end, "taking the model", time.monotonic()))
        for w in self.workers:
            # pickled here, once per worker: its tensors travel as handles to this process's own
            # memory, and each pickling counts one more reader of them, which that worker releases.
            # Written by a thread: a write waits until the worker has imported torch and reads, and
            # meanwhile this thread watches for a worker that dies or hangs first
            payload = bytes(ForkingPickler.dumps(self.model))
            w.sender = threading.Thread(target=hand_over, args=(w.conn, payload), daemon=True,
                                        name=f"audit-replay-model-to-{w.index}")
            w.sender.start()
        mine = determinism.current()
        while any(w.at is not None for w in self.workers):
            for w, message in self.poll():
                if message[0] != "ready":
                    self.unexpected(w, message)
                elif message[1] != self.identity:
                    raise self.failure(w, f"computes with other weights than the audit's (identity "
                                          f"{changed(message[1], self.identity)})")
                elif message[2] != mine:
                    raise self.failure(w, f"runs in another configuration than the audit's "
                                          f"({'; '.join(determinism.differences(message[2], mine))})")
                else:
                    w.at = None
        if self.log:
            self.log(f"{len(self.workers)} replay workers ready in {time.monotonic() - t0:.1f} s")

    def close(self, graceful: bool) -> None:
        """Stop every worker: told to finish after a replay that went well, killed otherwise."""
        for w in self.workers:
            if graceful:
                try:
                    w.conn.send(None)
                except OSError:
                    pass
            elif w.process.is_alive():
                w.process.kill()
        for w in self.workers:
            w.process.join(CLOSE_S if graceful else None)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            if w.sender is not None:  # its worker is gone, so an unfinished write fails at once
                w.sender.join()
            w.conn.close()
        self.workers = []

    # ------------------------------------------------------------------ walking

    def walk(self, walks: list, bar=None, log=None):
        """Every walk on some worker; yields (index, Walked) in the order they finish."""
        todo = deque(enumerate(walks))
        idle = deque(self.workers)
        busy = 0
        while todo or busy:
            while todo and idle:
                self.hand(idle.popleft(), *todo.popleft())
                busy += 1
            for w, message in self.poll():
                kind = message[0]
                if kind == "tick":
                    if bar is not None:
                        bar.tick(message[1])
                elif kind == "settle":
                    if bar is not None:
                        bar.settle(*message[1:])
                elif kind == "log":
                    if log:
                        log(f"{message[1]} [worker {w.index}]")
                elif kind == "done" and isinstance(w.at, tuple):
                    walked, (i, _) = message[1], w.at
                    walked.worker, w.at = w.index, None
                    idle.append(w)
                    busy -= 1
                    yield i, walked
                else:
                    self.unexpected(w, message)

    def hand(self, w: Worker, i: int, walk) -> None:
        w.at, w.last = (i, walk.label), time.monotonic()
        try:
            w.conn.send(walk)
        except OSError:
            raise self.died(w) from None

    def poll(self) -> list[tuple[Worker, tuple]]:
        """The messages the workers have sent, waiting up to POLL_S for one. A worker that reports
        an error, dies, or stays silent past its limit while busy raises."""
        ready = wait([*(w.conn for w in self.workers), *(w.process.sentinel for w in self.workers)], timeout=POLL_S)
        out, now = [], time.monotonic()
        for w in self.workers:
            got = []
            if w.conn in ready:
                try:
                    while w.conn.poll():
                        got.append(w.conn.recv())
                except (EOFError, OSError):
                    pass  # its end is closed: what it sent is in, and its sentinel says it is gone
            errors = [m for m in got if m[0] == "error"]
            if errors and errors[0][2:] == ("out-of-memory",):
                raise self.failure(w, f"{errors[0][1]}: each of the {len(self.workers)} workers holds its own "
                                      f"activations and cache on {self.model.device}; use fewer --workers")
            if errors:
                raise self.failure(w, errors[0][1])
            if got:
                w.last = now
                out += [(w, m) for m in got]
            elif w.process.sentinel in ready:
                raise self.died(w)
            elif isinstance(w.at, str) and now - w.last > self.stall_limit(w):
                raise DistError(f"replay worker {w.index} was not ready after {self.stall_limit(w):g} s "
                                f"{w.doing()}: it starts too slowly or hung; nothing was written")
            elif w.at is not None and now - w.last > self.stall_limit(w):
                raise DistError(f"replay worker {w.index} made no progress for {self.stall_limit(w):g} s "
                                f"{w.doing()}: it hung; nothing was written")
        return out

    # ------------------------------------------------------------------ failures

    def failure(self, w: Worker, message: str) -> DistError:
        return DistError(f"replay worker {w.index} failed {w.doing()}: {message}; nothing was written")

    def died(self, w: Worker) -> DistError:
        w.process.join(CLOSE_S)
        code = w.process.exitcode
        how = (f"was killed by signal {-code}" if code is not None and code < 0 else
               f"exited (exit code {code})" if code is not None else "closed its pipe")
        return DistError(f"replay worker {w.index} {how} {w.doing()}; nothing was written")

    def unexpected(self, w: Worker, message: tuple) -> None:
        raise self.failure(w, f"sent {message[0]!r} out of turn")


def hand_over(conn, payload: bytes) -> None:
    """Write a pickled model to a worker's pipe (a thread's target). A worker that is gone leaves
    the write unfinished; the pool's poll reports it."""
    try:
        conn.send_bytes(payload)
    except OSError:
        pass


def changed(theirs: dict, mine: dict) -> str:
    """The identity fields on which a worker's differs from the audit's, as 'key: theirs vs mine'."""
    keys = sorted(set(theirs) | set(mine), key=str)
    return "; ".join(f"{k}: {theirs.get(k)} vs {mine.get(k)}" for k in keys if theirs.get(k) != mine.get(k))


def threads() -> int:
    """The parent's torch thread count, which each worker takes: a CPU reduction's bits may depend
    on how many threads share it, so the workers compute what the lone replay computes."""
    import torch

    return torch.get_num_threads()


@contextmanager
def replay_walker(model, opts: PoolOptions, log=None):
    """Where a replay's walks run: in this process on ``model`` for one worker; else on a pool of
    ``opts.workers`` processes on ``model``'s device, sharing its weights."""
    from audit.replay import walk_here

    if opts.workers <= 1:
        yield walk_here(model)
        return
    with WorkerPool(model, opts, log) as pool:
        yield pool.walk
