"""``python -m harness.worker``: one decoder in a process of its own, decoding on request.

``audit retime`` starts two of these, the candidate and the serial control, and times each
request from outside with its own clock, so nothing the decoder does inside its process can
reach the timing or the other side. Protocol, one JSON object per line:

  start    pin the deterministic configuration, load the model, build the decoder
           (``decoders.get_decoder``, with ``--decoder-args`` / ``--decoder-arg``), run its
           ``prepare()`` and, with ``--positions N``, its ``reserve(N)`` (room for every request of
           ``len(prompt_ids) + max_new_tokens <= N``: no request builds state in its own time),
           then print ``{"ready": true, "decoder": NAME, "config": {...},
           "instrument": BOOL, "device": ...}``: what the decoder itself says of its name, its
           config and whether it is an instrument (``harness.timing.is_instrument``), which the
           audit holds against the stream's header; on a setup failure print ``{"error": "..."}``
           and exit 2.
  request  stdin ``{"prompt_ids": [...], "max_new_tokens": N}`` -> stdout ``{"tokens": [...]}``,
           written once the decode returned and the device is synchronised, on CUDA with
           ``"alloc_retries"``: how often the caching allocator had to free its cache and retry
           during the decode (the audit holds the control's to account); a request that
           fails gets ``{"error": "..."}`` and the worker goes on. Every decode is under the
           ``--sampling`` sampler (default greedy), as ``harness time --sampling`` decodes.
  prepare  stdin ``{"prepare_prompt": [...], "max_new_tokens": N}`` -> ``{"prepared": true}``: a
           benchmark instrument's untimed per-prompt preparation (as ``harness time`` calls it,
           with the sampler);
           refused with ``{"error": ...}`` for a decoder that is not marked ``instrument = True``.
  end      stdin closed: the worker exits 0.

Every answer also carries ``"continued": K``, how many times this process has been continued
after a stop (SIGCONT) since it started: the audit stops the side it is not timing and counts its
own continues, so a count above them means another process stopped this one, perhaps in a leg.

stdout carries protocol lines only: anything else the decoder prints goes to stderr.
"""
from __future__ import annotations

import json
import sys

import click
import torch
import transformers

from core import determinism
from core.clirun import IntRange
from core.continues import ContinueCounter
from core.errors import UserError
from core.models import load_model
from core.sampling import GREEDY, Sampler, SamplerError
from decoders import get_decoder, parse_decoder_args
from decoders.base import reserve_positions
from harness.prepare import check_sampling
from harness.timing import is_instrument, sampling_kwargs


def reply(channel, obj: dict, continues: ContinueCounter) -> None:
    obj = {**obj, "continued": continues.count}
    channel.write(json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n")
    channel.flush()


def parse_sampler(text: str | None) -> Sampler:
    """``--sampling``: a stream header's sampler (its JSON object, exact) or a SPEC as ``harness
    time --sampling`` takes it; None is greedy."""
    if text is None:
        return GREEDY
    try:
        return Sampler.from_json(json.loads(text)) if text.lstrip().startswith("{") else Sampler.parse(text)
    except (SamplerError, json.JSONDecodeError) as exc:
        raise UserError(f"--sampling {text!r}: {exc}") from None


def setup(model_spec: str, device: str | None, decoder_spec: str, kwargs: dict, positions: int | None = None,
          sampler: Sampler = GREEDY):
    """The model and the prepared decoder, sized for ``positions`` when given."""
    transformers.logging.set_verbosity_error()  # expected "no fast kernel" notices
    decoder = get_decoder(decoder_spec, **kwargs)
    check_sampling({"decoder": decoder}, sampler)
    model = load_model(model_spec, device)
    decoder.prepare(model)
    if positions is not None:
        reserve_positions(decoder, positions)
    return model, decoder


def serve(channel, model, decoder, continues: ContinueCounter, sampler: Sampler = GREEDY) -> None:
    """Answer requests until stdin closes, every decode under ``sampler``."""
    kwargs = sampling_kwargs(sampler)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            if "prepare_prompt" in request:
                if not is_instrument(decoder):
                    raise UserError(f"{decoder.name} is not an instrument: it gets no untimed preparation")
                decoder.prepare_prompt(list(request["prepare_prompt"]), int(request["max_new_tokens"]), **kwargs)
                reply(channel, {"prepared": True}, continues)
                continue
            ids, n = request["prompt_ids"], request["max_new_tokens"]
            retries = alloc_retries(model.device)
            tokens = [int(t) for t in decoder.decode(list(ids), int(n), **kwargs).tokens]
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            extra = {} if retries is None else {"alloc_retries": alloc_retries(model.device) - retries}
        except Exception as exc:  # noqa: BLE001 - the caller judges a failed request; this process stays up
            reply(channel, {"error": f"{type(exc).__name__}: {exc}"}, continues)
            continue
        reply(channel, {"tokens": tokens, **extra}, continues)


def alloc_retries(device) -> int | None:
    """How often the CUDA caching allocator has had to free its cache and retry a device allocation
    in this process (None off CUDA): a decode that needed it ran short of device memory."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", "model_spec", required=True, help="Built-in model name or checkpoint directory.")
@click.option("--device", default=None, help="torch device. Default: cuda if available, else cpu.")
@click.option("--decoder", "decoder_spec", required=True, help="Registered decoder name or package.module:attr.")
@click.option("--decoder-args", "args_json", default="{}", metavar="JSON",
              help="Constructor arguments as a JSON object (as the stream header records them).")
@click.option("--decoder-arg", "decoder_args", multiple=True, metavar="KEY=VALUE",
              help="Constructor argument as harness time takes it (repeatable); added to --decoder-args.")
@click.option("--positions", type=IntRange(min=1), default=None, metavar="N",
              help="Reserve room for every request of len(prompt_ids) + max_new_tokens <= N before the ready line.")
@click.option("--sampling", default=None, metavar="SPEC|JSON",
              help="Decode every request under this seeded sampler: a SPEC as harness time --sampling takes it, "
                   "or a stream header's sampler object as JSON. Default: greedy.")
def main(model_spec, device, decoder_spec, args_json, decoder_args, positions, sampling):
    """Serve decode requests for one decoder on stdin/stdout (see the module docstring)."""
    continues = ContinueCounter().install()  # for the life of this process
    determinism.pin()  # before anything touches CUDA, as harness time and the audit do
    channel, sys.stdout = sys.stdout, sys.stderr  # a decoder's prints must not corrupt the protocol
    try:
        kwargs = json.loads(args_json)
        if not isinstance(kwargs, dict):
            raise UserError(f"--decoder-args must be a JSON object, not {args_json!r}")
        kwargs.update(parse_decoder_args(decoder_args))
        sampler = parse_sampler(sampling)
        model, decoder = setup(model_spec, device, decoder_spec, kwargs, positions, sampler)
    except (UserError, json.JSONDecodeError) as exc:  # a bug's traceback goes to stderr as it is
        reply(channel, {"error": str(exc)}, continues)
        sys.exit(2)
    reply(channel, {"ready": True, "decoder": decoder.name, "config": decoder.config(),
                    "instrument": is_instrument(decoder), "device": str(model.device),
                    "sampler": sampler.to_json()}, continues)
    serve(channel, model, decoder, continues, sampler)


if __name__ == "__main__":
    main()
