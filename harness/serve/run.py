"""``run_serve``: load the decoder, bind the socket, print the address, serve."""
from __future__ import annotations

import copy
import logging
import socket
import sys

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from core.errors import UserError
from core.models import check_fits, model_context
from core.records import check_record_path
from decoders import parse_decoder_args
from decoders.api import open_decoder
from harness.serve.app import create_app
from harness.serve.options import ServeOptions
from harness.serve.schemas import Limits
from harness.serve.worker import DecodeWorker, recorder


def run_serve(opts: ServeOptions) -> None:
    """Serve until interrupted. Every user mistake (a bad model, decoder, device, address or
    record path) is a UserError before anything listens."""
    args = parse_decoder_args(opts.decoder_args)
    if opts.record is not None:
        check_record_path(opts.record)  # before the load: a typo costs no model load
    if opts.max_context is not None:  # so does a context the model does not have
        check_fits(opts.model, model_context(opts.model), opts.max_context, "--max-context")
    sock = listen(opts.host, opts.port)  # a busy port or a bad address costs no model load either
    try:
        import transformers

        transformers.logging.set_verbosity_error()  # expected "no fast kernel" notices
        # sized once for the longest request the server takes: no request waits for the state to grow
        dec = open_decoder(opts.model, opts.decoder, device=opts.device, max_positions=opts.max_context, **args)
    except BaseException:
        sock.close()
        raise
    max_context = opts.context_for(dec.model.context)
    dec.reserve(max_context)  # the default's size, known once the model is: a no-op for --max-context
    on_finished = recorder(opts.record, dec) if opts.record is not None else None
    name = opts.served_model_name or dec.model.name
    limits = Limits(served_model_name=name, default_max_tokens=opts.default_max_tokens,
                    max_new_tokens_limit=opts.max_new_tokens_limit, vocab_size=dec.model.vocab_size)
    worker = DecodeWorker(dec, opts.queue_size, on_finished=on_finished, max_context=max_context)
    app = create_app(dec, limits, worker)
    setup_logging()
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"serving {name} with decoder {dec.name} on http://{shown}:{port}/v1", flush=True)
    config = uvicorn.Config(app, log_level="info", log_config=log_config(), timeout_graceful_shutdown=10)
    try:
        CancellingServer(config, worker).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on: the normal way to stop
        print("stopped", file=sys.stderr, flush=True)


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before uvicorn starts (so that port 0 gives the real port to print)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=128)
    except (OSError, OverflowError) as exc:
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def log_config() -> dict:
    """uvicorn's logging, with its access lines on stderr too: stdout carries only the address line."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return config


def setup_logging() -> None:
    """The per-request stats lines (logger ``harness.serve``) go to stderr, one line each."""
    log = logging.getLogger("harness.serve")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


class CancellingServer(uvicorn.Server):
    """Ctrl-C or SIGTERM cancels the running decode and every waiting one at once, so that the
    shutdown does not wait for a long answer to finish."""

    def __init__(self, config: uvicorn.Config, worker: DecodeWorker):
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig, frame):
        self.worker.cancel_all()
        super().handle_exit(sig, frame)
