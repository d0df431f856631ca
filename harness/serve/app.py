"""The routes: OpenAI's completions and chat completions (streamed as server-sent events or not),
the model list and a health check, over one ``DecodeWorker``.

A request is validated (``schemas``), queued (429 when the queue is full), and then answered from
the worker's events. Each request watches its connection: when the client goes away, while waiting
or mid-stream, the request is withdrawn: a waiting one leaves the queue at once (its place is free
for the next request), a running one stops at the decoder's next batch.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from core.errors import UserError
from harness.serve import responses as R
from harness.serve.schemas import (BadRequest, ChatBody, CompletionBody, Limits, chat_messages, check_supported,
                                   completion_prompt, include_usage, max_new_tokens, request_sampler)
from harness.serve.worker import DecodeWorker, Job

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(decoder, limits: Limits, worker: DecodeWorker, clock=time.time) -> FastAPI:
    """The server for ``decoder`` (anything with the ``decoders.api`` contract). The worker starts
    and stops with the app."""

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        await asyncio.to_thread(worker.stop, 30.0)

    app = FastAPI(title="qwen35-exact", summary="exact decoding, greedy or seeded sampling, behind OpenAI's API",
                  lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    started = int(clock())
    info = {"model": limits.served_model_name, "decoder": decoder.name}
    samples = getattr(decoder, "sampling", False) is True  # takes a request's temperature > 0

    @app.get("/health")
    async def health():
        return {"status": "ok", **info, **worker.status()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": limits.served_model_name, "object": "model", "created": started,
                                            "owned_by": "qwen35-exact", "decoder": decoder.name}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        check_supported(body, limits)
        job = Job(f"cmpl-{uuid.uuid4().hex}", completion_prompt(body, limits), max_new_tokens(body, limits),
                  sampler=request_sampler(body, samples))
        return await answer(request, job, R.COMPLETION, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request):
        check_supported(body, limits)
        job = Job(f"chatcmpl-{uuid.uuid4().hex}", None, max_new_tokens(body, limits), messages=chat_messages(body),
                  sampler=request_sampler(body, samples))
        return await answer(request, job, R.CHAT, body)

    async def answer(request: Request, job: Job, kind: str, body) -> Response:
        channel = Channel(request, job, worker)
        if not worker.submit(job):
            channel.close()
            return JSONResponse(R.error(429, f"the queue is full ({worker.queue.maxsize} requests waiting while "
                                             "one decodes): retry later", code="queue_full"),
                                status_code=429, headers={"Retry-After": "1"})
        head = (kind, job.id, int(clock()), limits.served_model_name)
        first = await channel.next()
        if first is None or first[0] != "prompt":  # the client left, or the prompt was refused
            channel.close()
            return failure(first)
        if body.stream:
            return StreamingResponse(stream(channel, head, first[1], include_usage(body), job.sampler),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            while (event := await channel.next()) is not None and event[0] == "tokens":
                pass
        finally:
            channel.close()
        if event is None or event[0] != "done" or event[1] is None or event[1].finish_reason == "cancelled":
            return failure(event)
        return JSONResponse(R.whole(*head, event[1], job.sampler))

    return app


class Channel:
    """The worker's events for one job, as an asyncio queue, raced against the client's disconnect."""

    def __init__(self, request: Request, job: Job, worker: DecodeWorker):
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.job = job
        self.worker = worker
        job.emit = lambda kind, payload: threadsafe(loop, self.events.put_nowait, (kind, payload))
        self.gone = asyncio.ensure_future(wait_disconnected(request))

    async def next(self):
        """The next event, or None once the client has gone (the job is then cancelled)."""
        get = asyncio.ensure_future(self.events.get())
        await asyncio.wait({get, self.gone}, return_when=asyncio.FIRST_COMPLETED)
        if get.done():
            return get.result()
        get.cancel()
        self.worker.withdraw(self.job)
        return None

    def close(self) -> None:
        """The answer is over (or abandoned): stop watching, and withdraw the job if it still waits or runs."""
        self.worker.withdraw(self.job)
        self.gone.cancel()


def threadsafe(loop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: the server has shut down, nobody is listening
        pass


async def wait_disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def stream(channel: Channel, head: tuple, prompt_ids: list[int], usage: bool, sampler):
    """The SSE body: a first chunk with the prompt's ids and the sampler, one chunk per emitted
    batch, the finish, then ``[DONE]``. Closed early (the client left), it cancels the decode."""
    try:
        yield R.sse({**R.chunk(*head, "", [], role=True), "prompt_token_ids": prompt_ids,
                     "sampler": sampler.to_json()})
        while (event := await channel.next()) is not None:
            kind, payload = event
            if kind == "tokens":
                yield R.sse(R.chunk(*head, payload[1], payload[0]))
                continue
            if kind == "done" and payload is not None and payload.finish_reason != "cancelled":
                yield R.sse(R.chunk(*head, None, [], finish_reason=payload.finish_reason))
                if usage:
                    yield R.sse(R.usage_chunk(*head, payload))
            else:
                yield R.sse(error_body(event)[0])
            yield R.sse("[DONE]")
            return
    finally:
        channel.close()


def error_body(event) -> tuple[dict, int]:
    """What a request that got no answer is told: its prompt refused, the decoder's fault, or shutdown."""
    if event is not None and event[0] == "error":
        exc = event[1]
        if isinstance(exc, UserError):
            return R.error(400, str(exc), "prompt"), 400
        return R.error(500, f"the decoder failed: {type(exc).__name__}: {exc}"), 500
    return R.error(503, "the decode was cancelled: the server is shutting down"), 503


def failure(event) -> Response:
    if event is None:  # the client has gone: nobody reads this
        return Response(status_code=499)
    body, status = error_body(event)
    return JSONResponse(body, status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: validation 400, unknown route 404, a fault 500."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        return JSONResponse(R.error(400, validation_message(exc.errors())), status_code=400)

    @app.exception_handler(BadRequest)
    async def bad(request, exc: BadRequest):
        return JSONResponse(R.error(400, str(exc), exc.param), status_code=400)

    @app.exception_handler(Exception)
    async def fault(request, exc: Exception):
        return JSONResponse(R.error(500, f"internal error: {type(exc).__name__}: {exc}"), status_code=500)

    @app.exception_handler(HTTPException)
    async def http(request, exc: HTTPException):
        return JSONResponse(R.error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"),
                            status_code=exc.status_code)


def validation_message(errors) -> str:
    """pydantic's errors as one line, one clause per field: ``field: what is wrong``. A field of
    several accepted types (prompt, content, stop) that matches none is said so once."""
    by_field: dict[str, list[dict]] = {}
    for e in errors:
        if e.get("type") == "json_invalid":
            return f"the body is not valid JSON ({e.get('ctx', {}).get('error', e.get('msg'))})"
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        by_field.setdefault(".".join(loc[:3] if loc[:1] == ["messages"] else loc[:1]) or "body", []).append(e)
    parts = [field_message(name, errs) for name, errs in by_field.items()]
    return "invalid request: " + "; ".join(parts)


def field_message(name: str, errs: list[dict]) -> str:
    kinds = {e.get("type") for e in errs}
    if kinds == {"extra_forbidden"}:
        return f"{name}: not a field this server knows (unknown fields are refused, not ignored)"
    if "missing" in kinds and len(errs) == 1:
        return f"{name}: required"
    if name == "prompt":
        return "prompt: must be a string or a list of token ids (integers)"
    if len(errs) > 1:
        return f"{name}: wrong type or value ({errs[0].get('msg')})"
    return f"{name}: {errs[0].get('msg')}"
