"""One decode at a time: a single worker thread consumes a bounded queue of jobs.

The GPU runs one decode, so requests wait in a queue of ``queue_size`` places; a request that finds
it full is refused at once (``submit`` returns False, the app answers 429). A job reports through
``job.emit(kind, payload)``, called from the worker thread: ("prompt", ids) once its prompt is
encoded, ("tokens", (ids, text)) per emitted batch, then exactly one of ("done", Generation | None)
or ("error", exception). A withdrawn job (its client left) that still waits leaves the queue at once,
so its place is free (its "done" payload is None); one already running stops at the decoder's next
batch. The worker thread does all the
tokenizer's work (prompts, chat templates, text), so that no two threads use the tokenizer at once.
Nothing here knows HTTP or asyncio.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from core.errors import UserError
from core.records import append_record, generation_record
from core.sampling import GREEDY, Sampler

log = logging.getLogger("harness.serve")


@dataclass
class Job:
    id: str
    prompt: str | list[int] | None  # text (encoded by the decoder) or token ids
    max_new_tokens: int
    messages: list[dict] | None = None  # a chat: encoded with the decoder's chat template instead
    emit: Callable[[str, object], None] = lambda kind, payload: None
    cancel: threading.Event = field(default_factory=threading.Event)
    queued_at: float = 0.0  # the worker's clock when submitted
    sampler: Sampler = GREEDY  # what decides the tokens (the request's temperature, top_k, ...)


@dataclass
class Counters:
    """What became of the requests (``GET /health`` shows them)."""

    finished: int = 0  # answered in full (finish_reason stop or length)
    cancelled: int = 0  # their client went away: stopped mid-decode or withdrawn from the queue
    rejected: int = 0  # the queue was full (429)
    failed: int = 0  # the decoder raised

    def to_json(self) -> dict:
        return dict(vars(self))


class DecodeWorker:
    """The queue and the thread. ``on_finished(job, generation)`` runs on the worker thread after each
    decode that finished (not cancelled), before the next starts (the --record writer). A job whose
    prompt + max_new_tokens exceeds ``max_context`` (None: no bound) fails with a UserError."""

    def __init__(self, decoder, queue_size: int, on_finished: Callable | None = None,
                 clock: Callable[[], float] = time.perf_counter, max_context: int | None = None):
        self.decoder = decoder
        self.max_context = max_context
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self.on_finished = on_finished
        self.clock = clock
        self.counters = Counters()
        self.running: Job | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="decode-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> bool:
        job.queued_at = self.clock()
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            self._count("rejected")
            return False
        return True

    def status(self) -> dict:
        return {"waiting": self.queue.qsize(), "capacity": self.queue.maxsize,
                "running": self.running.id if self.running else None, "requests": self.counters.to_json()}

    def withdraw(self, job: Job) -> None:
        """Cancel ``job`` (thread-safe). Still waiting, it leaves the queue now, freeing its place,
        and is finished as cancelled; already taken by the worker, it stops at the next batch."""
        with self.queue.mutex:
            waiting = self.queue.queue
            at = next((i for i, queued in enumerate(waiting) if queued is job), None)
            if at is not None:
                del waiting[at]
                self.queue.not_full.notify()
        job.cancel.set()  # after the place is free: whoever sees the cancel may take the place
        if at is not None:  # else running, finished, or never queued (refused with 429)
            self._finish(job, "done", None, "cancelled")

    def cancel_all(self) -> None:
        """Cancel the running decode and every waiting one (they end at once; thread-safe)."""
        if (job := self.running) is not None:
            job.cancel.set()
        with self.queue.mutex:
            for job in self.queue.queue:
                if job is not None:
                    job.cancel.set()

    def stop(self, timeout: float | None = None) -> None:
        """Cancel the running decode and every waiting one, then end the thread."""
        self.cancel_all()
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel.set()
                self._finish(job, "done", None, "cancelled")
        self.queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _count(self, what: str) -> None:
        with self._lock:
            setattr(self.counters, what, getattr(self.counters, what) + 1)

    def _loop(self) -> None:
        while (job := self.queue.get()) is not None:
            self.running = job
            try:
                self._run(job)
            finally:
                self.running = None

    def _run(self, job: Job) -> None:
        if job.cancel.is_set():  # its client left while it waited
            return self._finish(job, "done", None, "cancelled")
        started = self.clock()
        try:
            ids = self._encode(job)
            job.emit("prompt", ids)
            # a greedy job passes no sampler (a decoder that does not sample takes none)
            sampled = {} if job.sampler.greedy else {"sampler": job.sampler}
            gen = self.decoder.generate(ids, job.max_new_tokens, cancel=job.cancel,
                                        on_token=lambda ids, text: job.emit("tokens", (list(ids), text)), **sampled)
        except UserError as exc:  # e.g. a prompt longer than the model takes: the client's to fix
            return self._finish(job, "error", exc, "failed")
        except Exception as exc:  # noqa: BLE001 - a decoder fault fails this request, not the server
            log.exception("serve: %s failed", job.id)
            return self._finish(job, "error", exc, "failed")
        log.info(stats_line(job, gen, queued=started - job.queued_at))  # before the answer goes out
        if gen.finish_reason == "cancelled":
            self._finish(job, "done", gen, "cancelled")
        else:
            self._record(job, gen)
            self._finish(job, "done", gen, "finished")

    def _encode(self, job: Job) -> list[int]:
        if job.messages is not None:
            ids = self.decoder.encode_chat(job.messages)
        elif isinstance(job.prompt, str):
            ids = self.decoder.encode(job.prompt)
        else:
            ids = list(job.prompt)
        if not ids:
            raise UserError("the prompt encodes to no tokens: greedy decoding needs at least one")
        if self.max_context is not None and len(ids) + job.max_new_tokens > self.max_context:
            raise UserError(f"the prompt's {len(ids)} tokens + max_tokens {job.max_new_tokens} exceed this server's "
                            f"context of {self.max_context} tokens (--max-context)")
        return list(ids)

    def _record(self, job: Job, gen) -> None:
        if self.on_finished is None:
            return
        try:
            self.on_finished(job, gen)
        except UserError as exc:  # the file became unwritable: the answer stands, the loss is logged
            log.error("serve: %s: not recorded: %s", job.id, exc)
        except Exception:  # noqa: BLE001 - likewise, with the traceback of the unexpected
            log.exception("serve: %s: not recorded", job.id)

    def _finish(self, job: Job, kind: str, payload, counter: str) -> None:
        self._count(counter)
        job.emit(kind, payload)


def stats_line(job: Job, gen, queued: float) -> str:
    """One line per decode for the log: what the lead measures the server by."""
    s = gen.stats
    return (f"serve: {job.id} finish={gen.finish_reason} prompt_tokens={s.prompt_tokens} "
            f"new_tokens={s.new_tokens} ttft={fmt(s.time_to_first_token_s, '.4f')}s "
            f"tok/s={fmt(s.tokens_per_s, '.1f')} seconds={s.seconds:.3f} queued={queued:.3f}s "
            f"drafted={s.drafted} accepted={s.accepted} mean_accepted_length={fmt(s.mean_accepted_length, '.2f')}")


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def recorder(path, decoder) -> Callable:
    """--record FILE: each finished answer as one line of ``audit tokens`` shape (a), with the
    request's max_new_tokens so that the audit knows where serial decoding stops, and the sampler
    that decided it (greedy too), which ``audit tokens`` judges it under."""
    def write(job: Job, gen) -> None:
        append_record(path, generation_record(job.id, gen.prompt_ids, gen.token_ids, job.max_new_tokens,
                                              decoder.name, decoder.model.name, job.sampler))

    return write
