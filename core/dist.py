"""Several processes under torchrun: which rank does what, and how ranks agree, fail and finish.

``harness time`` and ``audit replay`` run unchanged in one process. Launched by torchrun
(``WORLD_SIZE`` > 1 in the environment), each rank takes every ``world_size``-th prompt
(prompt i -> rank i % world_size), works on its own device, and rank 0 gathers the results
into one file. Only small Python objects cross between ranks, so the object collectives run
on gloo (CPU) even when the default group is NCCL: a gloo collective that times out raises a
Python exception, where an NCCL one would abort the process without a message.

Progress and failures also go to the launcher's key-value store (the one torchrun's
rendezvous created): each rank says what it is working on before each prompt, marks itself
arrived at each exchange, and records its error if it fails. So a waiting rank can tell a slow
rank from a hung one (no progress for ``timeout_s``) and name the rank and its prompt, and the
other ranks stop at their next prompt once one rank has failed.

No timing or decoder imports here: the audit uses this module too.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch

from core.errors import DistError, Stopped, UserError  # noqa: F401 - re-exported

DEFAULT_TIMEOUT_S = 1800
POLL_S = 0.1
KEY_ROOT = "qwen35-exact"


@dataclass(frozen=True)
class Topology:
    """This process's place in the job; the defaults are the plain single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def topology(environ=None) -> Topology:
    """torchrun sets WORLD_SIZE, RANK and LOCAL_RANK; without them, or with WORLD_SIZE=1, this is
    one process and nothing about the run changes."""
    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE") or 1)
    if world <= 1:
        return Topology()
    rank = int(env["RANK"])
    return Topology(rank, world, int(env.get("LOCAL_RANK") or rank))


def quiet_rank() -> bool:
    """Errors every rank meets alike (a bad flag, a refused input) are printed by rank 0 only."""
    return not topology().main


def rank_prefix() -> str:
    topo = topology()
    return f"[rank {topo.rank}] " if topo.active and not topo.main else ""


# --------------------------------------------------------------------------- sharding


def owner(index: int, world_size: int) -> int:
    """The rank that runs prompt ``index``: round-robin, so ranks get equal counts to within one."""
    return index % world_size


def shard(items: list, topo: Topology) -> list:
    """This rank's items, in their original order."""
    return list(items[topo.rank::topo.world_size])


def unshard(shards: list[list]) -> list:
    """Inverse of ``shard`` over every rank's list: the items back in their original order."""
    total = sum(len(s) for s in shards)
    world = len(shards)
    return [shards[owner(i, world)][i // world] for i in range(total)]


def rank_device(chosen: str | None, topo: Topology) -> str | None:
    """Under torchrun each rank owns one GPU, cuda:LOCAL_RANK. ``chosen`` is what one process
    would use (None: the default); a CPU choice stays the CPU. An explicit cuda:N cannot be
    honoured by every rank at once, so it is refused rather than silently overridden."""
    if not topo.active:
        return chosen
    if chosen is None:
        chosen = "cuda" if torch.cuda.is_available() else "cpu"
    if not chosen.startswith("cuda"):
        return chosen
    if chosen != "cuda":
        raise UserError(f"under torchrun every rank uses cuda:LOCAL_RANK; pass --device cuda (or leave it "
                        f"out), not --device {chosen}")
    if torch.cuda.is_available() and topo.local_rank >= torch.cuda.device_count():
        raise UserError(f"rank {topo.rank} has LOCAL_RANK {topo.local_rank} but this machine has "
                        f"{torch.cuda.device_count()} GPU(s); use --nproc-per-node <= the GPU count")
    return f"cuda:{topo.local_rank}"


# --------------------------------------------------------------------------- the job


def describe(stage: dict | None) -> str:
    return stage["what"] if stage else "starting up"


@dataclass
class Session:
    """One rank's membership of the torchrun job: the process group and the launcher's store."""

    topo: Topology
    timeout_s: float
    store: object | None
    prefix: str
    step: int = 0
    seen: dict = field(default_factory=dict)  # rank -> (last stage value, local time it changed)

    # ------------------------------------------------------------------ store keys

    def key(self, *parts) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def read(self, key: str):
        """A JSON value from the store, or None when absent (``check`` never blocks, ``get`` can)."""
        if self.store is None or not self.store.check([key]):
            return None
        return json.loads(self.store.get(key).decode())

    def write(self, key: str, value) -> None:
        if self.store is not None:
            self.store.set(key, json.dumps(value))

    # ------------------------------------------------------------------ progress and failure

    def at(self, what: str) -> None:
        """Say what this rank works on now: a rank whose value stops changing is hung."""
        self.step += 1
        self.write(self.key("at", self.topo.rank), {"step": self.step, "what": what})

    def record_failure(self, prompt_id: str | None, message: str) -> dict:
        """Publish this rank's failure so the others stop early and rank 0 can name it."""
        error = {"rank": self.topo.rank, "prompt_id": prompt_id, "message": message}
        self.write(self.key("error", self.topo.rank), error)
        return error

    def failures(self) -> list[dict]:
        """Failures any rank has published so far, by rank."""
        found = (self.read(self.key("error", r)) for r in range(self.topo.world_size))
        return [e for e in found if e is not None]

    def unfinished(self, stage: str) -> list[str]:
        """'rank R (at WHAT)' for every rank that has not arrived at ``stage``."""
        out = []
        for r in range(self.topo.world_size):
            if self.read(self.key("arrived", stage, r)) is None:
                out.append(f"rank {r} (at {describe(self.read(self.key('at', r)))})")
        return out

    # ------------------------------------------------------------------ exchanges

    def arrive(self, stage: str) -> None:
        self.at(f"the {stage} exchange")
        self.write(self.key("arrived", stage, self.topo.rank), True)

    def stalled(self, rank: int, now: float) -> dict | None:
        """The stage ``rank`` is stuck at when its progress value has not changed for timeout_s."""
        value = self.read(self.key("at", rank))
        last = self.seen.get(rank)
        if last is None or last[0] != value:
            self.seen[rank] = (value, now)
            return None
        return {"stage": value} if now - last[1] > self.timeout_s else None

    def wait_for(self, stage: str) -> None:
        """Block until every rank arrived at ``stage``; a rank that shows no progress for
        timeout_s is a hang, reported by rank and what it was doing. Without the store, the
        collective that follows waits instead, up to the process group's timeout."""
        if self.store is None:
            return
        self.seen.clear()
        while True:
            missing = [r for r in range(self.topo.world_size)
                       if self.read(self.key("arrived", stage, r)) is None]
            if not missing:
                return
            now = time.monotonic()
            for r in missing:
                hung = self.stalled(r, now)
                if hung is not None:
                    raise DistError(f"rank {r} made no progress for {self.timeout_s:g} s (--dist-timeout) "
                                    f"while at {describe(hung['stage'])}: it hung or died")
            time.sleep(POLL_S)

    def all_gather(self, stage: str, payload) -> list:
        """Every rank's payload, on every rank, once all have arrived."""
        self.arrive(stage)
        self.wait_for(stage)
        out = [None] * self.topo.world_size
        torch.distributed.all_gather_object(out, payload)
        return out

    def gather(self, stage: str, payload) -> list | None:
        """Every rank's payload on rank 0 (None elsewhere), once all have arrived."""
        self.arrive(stage)
        self.wait_for(stage)
        out = [None] * self.topo.world_size if self.topo.main else None
        torch.distributed.gather_object(payload, out, dst=0)
        return out

    def close(self) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def store_prefix() -> str:
    """Keys of one attempt: torchrun may restart the job, and the store outlives an attempt."""
    return f"{KEY_ROOT}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def default_store():
    """The store torchrun's rendezvous made (private API, stable for years); None if unavailable,
    and then a hang is only caught by the process group's own timeout."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store  # private: reached only under torchrun

        return _get_default_store()
    except Exception:  # noqa: BLE001 - progress reports are a convenience, never a requirement
        return None


def start(topo: Topology, timeout_s: float) -> Session:
    """Join the job. Call after determinism.pin() (this touches CUDA). NCCL serves CUDA tensors,
    gloo the CPU and every object collective; both time out after ``timeout_s``."""
    cuda = torch.cuda.is_available()
    if cuda and topo.local_rank < torch.cuda.device_count():
        torch.cuda.set_device(topo.local_rank)
    backend = "cuda:nccl,cpu:gloo" if cuda else "gloo"
    torch.distributed.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    session = Session(topo, float(timeout_s), default_store(), store_prefix())
    session.at("starting up")
    install_stop_handler()
    return session


def install_stop_handler() -> None:
    """torchrun answers a rank's exit with an error by sending SIGTERM to the others: raise
    ``Stopped`` so this rank reports it and cleans up instead of dying mid-write."""
    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process
        raise Stopped("stopped by the launcher (SIGTERM)")

    signal.signal(signal.SIGTERM, handler)


def ignore_stop() -> None:
    """Once every rank has reported, rank 0's verdict stands: a SIGTERM that torchrun sends while
    the ranks exit (after rank 0 exits non-zero) must not turn into a second error or a traceback."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


# --------------------------------------------------------------------------- per-rank work


def error_text(exc: BaseException) -> str:
    """One line: the exception's type and its message."""
    message = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def report_local_failure(topo: Topology, exc: BaseException) -> None:
    """The failing rank prints its own traceback (for whoever debugs the decoder); rank 0 prints
    the one-line verdict for the whole run."""
    print(f"[rank {topo.rank}] {''.join(traceback.format_exception(exc)).rstrip()}", file=sys.stderr, flush=True)


def guarded(topo: Topology, fn, user_errors=(UserError,)) -> tuple[object, dict | None]:
    """Run this rank's setup; a failure becomes an error dict for the next exchange, so the other
    ranks learn of it there instead of waiting for this one. A user's mistake keeps its message
    (and its exit code); anything else also prints its traceback on this rank."""
    try:
        return fn(), None
    except user_errors as exc:
        return None, {"rank": topo.rank, "prompt_id": None, "message": str(exc), "user": True}
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then the run fails
        report_local_failure(topo, exc)
        return None, {"rank": topo.rank, "prompt_id": None, "message": error_text(exc)}


def raise_setup_errors(payloads: list[dict], user_error=UserError) -> None:
    """After the setup exchange every rank holds every rank's error, so all raise the same one
    and stop together (only rank 0 prints it). The rank is named unless every rank failed alike."""
    errors = [p["error"] for p in payloads if p.get("error")]
    if not errors:
        return
    first = errors[0]
    alike = len(errors) == len(payloads) and all(e["message"] == first["message"] for e in errors)
    message = first["message"] if alike else f"rank {first['rank']}: {first['message']}"
    raise (user_error if first.get("user") else DistError)(message)


def failure_message(error: dict) -> str:
    """``rank R failed on prompt 'ID': Type: message`` (no prompt when it failed outside one)."""
    where = f" on prompt {error['prompt_id']!r}" if error.get("prompt_id") else ""
    return f"rank {error['rank']} failed{where}: {error['message']}"


def first_failure(payloads: list[dict]) -> dict | None:
    """The failure rank 0 reports: the lowest rank's that failed of its own accord, else any
    (a rank that only stopped because another failed says so in its own message)."""
    failed = [p["error"] for p in payloads if p.get("error")]
    own = [e for e in failed if not e.get("stopped_early")]
    return (own or failed or [None])[0]


def stopped_early(session: Session) -> dict | None:
    """When another rank has failed, this rank's remaining prompts are not worth running."""
    others = [e for e in session.failures() if e["rank"] != session.topo.rank]
    if not others:
        return None
    return {"rank": session.topo.rank, "prompt_id": None, "stopped_early": True,
            "message": f"stopped early because rank {others[0]['rank']} failed"}


def stop_report(session: Session, stage: str) -> str:
    """What rank 0 can say when the launcher stops it: which ranks had not finished, and where."""
    try:
        left = [u for u in session.unfinished(stage) if not u.startswith(f"rank {session.topo.rank} ")]
    except Exception:  # noqa: BLE001 - the store may be gone with the launcher
        left = []
    tail = f"; unfinished: {', '.join(left)}" if left else ""
    return ("stopped by the launcher because another rank exited (its own error line, or torchrun's summary "
            f"with its exit code, says why){tail}")
