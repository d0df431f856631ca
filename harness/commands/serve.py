"""``harness serve``: parse the options, then serve one exact decoder over OpenAI's HTTP API."""
from __future__ import annotations

import importlib.util

import click

from core.errors import UserError
from core.version import version_option
from core.clirun import IntRange, PathArg
from harness.commands.common import run_cli
from harness.serve.options import DEFAULT_MAX_CONTEXT, ServeOptions


@click.command("serve")
@version_option
@click.option("--model", default=ServeOptions.model, show_default=True, metavar="MODEL",
              help="Built-in model name (small, tiny, synthetic-9b) or a Qwen3.5 checkpoint directory.")
@click.option("--decoder", default=ServeOptions.decoder, show_default=True, metavar="NAME",
              help="Decoder that answers every request: a registered name (see `harness list`) or "
                   "package.module:attr. Every decoder the audit gates is greedy-exact.")
@click.option("--decoder-arg", "decoder_args", multiple=True, metavar="KEY=VALUE",
              help="Constructor argument for the decoder (repeatable), e.g. max_depth=4.")
@click.option("--device", default=ServeOptions.device, help="torch device. Default: cuda if available, else cpu.")
@click.option("--host", default=ServeOptions.host, show_default=True,
              help="Address to listen on (0.0.0.0 for every interface: the server has no authentication).")
@click.option("--port", type=IntRange(0, 65535), default=ServeOptions.port, show_default=True,
              help="TCP port; 0 picks a free one. The address is printed on stdout once it listens.")
@click.option("--queue-size", type=IntRange(min=1), default=ServeOptions.queue_size, show_default=True,
              help="Requests that may wait while one decodes (one decode runs at a time); a request "
                   "beyond that is answered 429.")
@click.option("--max-new-tokens-limit", type=IntRange(min=1), default=ServeOptions.max_new_tokens_limit,
              show_default=True, metavar="N",
              help="Largest max_tokens a request may ask for (more is answered 400). A request that "
                   "names none gets min(256, N).")
@click.option("--max-context", type=IntRange(min=2), default=None, metavar="N",
              help="Longest request, prompt tokens + max_tokens (longer is answered 400); at most the "
                   f"model's context. Default: the model's context, at most {DEFAULT_MAX_CONTEXT}. The "
                   "decoder's static state is sized for it at start, so no request waits for it to grow.")
@click.option("--record", type=PathArg(), default=None, metavar="FILE",
              help="Append every finished request's prompt and output token ids to FILE as one JSON line "
                   "in `audit tokens` shape (a), with the sampler that decided it (greedy too), so that the "
                   "answers can be audited afterwards (`audit tokens FILE --model M`: each line under its own "
                   "sampler). "
                   "Requests whose client went away are not recorded.")
@click.option("--served-model-name", default=None, metavar="NAME",
              help="Model name that /v1/models lists and requests must name. Default: the model's name.")
def serve_cmd(**options):
    """Serve DECODER on MODEL over OpenAI's HTTP API until interrupted (Ctrl-C).

    Endpoints: POST /v1/completions, POST /v1/chat/completions (streaming as server-sent events,
    or not), GET /v1/models, GET /health. Decoding is exact: every answer is the tokens serial
    decoding gives, greedy, or under the seeded sampler a request's temperature, top_k, top_p,
    min_p and seed define (temperature absent or 0: greedy; seed absent: 0), with the token ids
    in each choice's `token_ids`, the prompt's in `prompt_token_ids` and the sampler in `sampler`.
    Anything the server cannot honour (n > 1, stop sequences, penalties, a filter at temperature 0,
    temperature > 0 with a decoder that does not sample, ...) is answered 400. A per-request stats line (prompt and new tokens, time
    to first token, tokens/s) goes to stderr. Needs the [serve] extra:
    pip install 'qwen35-exact[serve]'.
    """
    opts = ServeOptions(**{**options, "decoder_args": tuple(options["decoder_args"])})

    def serve():
        require_extra()
        from harness.serve.run import run_serve  # fastapi, uvicorn, torch: only when serving

        run_serve(opts)

    run_cli(serve)


def require_extra() -> None:
    """fastapi and uvicorn are optional: without them, one line that says how to get them."""
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"harness serve needs the [serve] extra ({', '.join(missing)} not installed): "
                        "pip install 'qwen35-exact[serve]'")
