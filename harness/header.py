"""The stream's header and prompt records: what ran, where, with which settings."""
from __future__ import annotations

import datetime as _dt
import platform
import sys

from core.schema import SCHEMA
from harness.options import TimeOptions
from harness.prepare import Setup


def device_json(dev) -> dict:
    import torch  # heavy: loads only when a command runs

    from core.models import device_name  # imports torch: loads only when a command runs

    out = {"type": dev.type, "name": device_name(dev)}
    if dev.type == "cuda":
        # which physical GPU (so runs made in separate calls can show whether they shared a host);
        # the audit matches devices on type and name only
        uuid = getattr(torch.cuda.get_device_properties(dev), "uuid", None)
        if uuid is not None:
            out["uuid"] = str(uuid)
    return out


def rank_info(setup: Setup, rank: int, world_size: int) -> dict:
    """A rank's entry in the header's ``ranks``. With several ranks each one prepared its own
    decoders (calibration and resident memory can differ by GPU), so those are recorded per rank."""
    info = {"rank": rank, "device": device_json(setup.dev)}
    if world_size > 1:
        info["resident_bytes"] = setup.resident
        info["candidate_config"] = setup.candidate.config()
    return info


def build_header(setup: Setup, settings: dict, opts: TimeOptions, ranks: list[dict]) -> dict:
    import torch  # heavy: loads only when a command runs
    import transformers  # heavy: loads only when a command runs

    from harness.timing import is_instrument  # imports torch: loads only when a command runs

    control, candidate = setup.control, setup.candidate
    header = {
        "type": "header",
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": ["harness", *sys.argv[1:]],
        "model": setup.model.identity,
        "dtype": "bfloat16",
        "device": device_json(setup.dev),
        # one process: one rank; under torchrun, every rank and the device it timed its prompts on
        "world_size": len(ranks),
        "ranks": ranks,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cuda": torch.version.cuda,
        },
        "determinism": settings,
        # the control's code as checked before anything was imported (core.provenance)
        "control_code": setup.control_code,
        # the harness re-read the settings and the timing's objects after prepare() and every leg;
        # each change is a violation record in this stream
        "integrity_checked": True,
        "control": {"name": control.name, "config": control.config()},
        "candidate": {"name": candidate.name, "spec": opts.decoder, "args": setup.decoder_kwargs,
                      "config": candidate.config(), "instrument": is_instrument(candidate)},
        "prompts": setup.prompt_info,
        "max_new_tokens": setup.max_new_tokens,
        # the longest prompt + max_new_tokens: both decoders were sized for it before any leg
        "reserved_positions": setup.positions,
        "legs": opts.legs,
        "warmup_tokens": opts.warmup_tokens,
        "seed": opts.seed,
        # what decided the tokens on both sides (core.sampling); absent: greedy
        **({} if opts.sampler.greedy else {"sampler": opts.sampler.to_json()}),
        # Both decoders live in this process, so a leg's allocator peak also holds the other
        # decoder's persistent buffers (static caches, graph pools): recorded here so that a leg's
        # own peak is its raw peak minus the other decoder's resident bytes (null on CPU).
        "memory": {"resident_bytes": setup.resident},
    }
    extra_header = getattr(candidate, "header_extra", None)
    if callable(extra_header):
        header["candidate"].update(extra_header())
    return header


def prompt_record(setup: Setup, prompt) -> dict:
    return {"type": "prompt", "id": prompt.id, "token_ids": prompt.token_ids, "text": prompt.text,
            "warmup_ids": setup.warmups[prompt.id]}
