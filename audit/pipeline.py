"""The steps of an audit that the one-process and the sharded (torchrun) audit share: choosing the
replay device, loading the replay model, every replay-free finding, and writing audit.json.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import click
import torch
import transformers

from core import determinism
from core.errors import UserError
from core.models import device_name, load_model
from core.schema import write_json_atomic

from audit import checks
from audit.report import build_document, render_table
from audit.stream import BadInput

EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2


def log(message: str) -> None:
    click.echo(message, err=True)


def model_spec_from_header(header: dict) -> str:
    """Built-ins by name; checkpoints by the path recorded (pass --model when it moved)."""
    name = header["model"].get("name")
    if not isinstance(name, str) or not name:
        raise BadInput("header model has no name; pass --model")
    return name


def choose_device(requested: str | None, recorded: dict) -> str:
    if requested:
        if requested.startswith("cuda") and not torch.cuda.is_available():
            raise BadInput(f"device {requested!r} requested but this machine has no CUDA GPU")
        return requested
    if recorded.get("type") == "cuda" and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def check_prompt_ids(run, vocab_size: int) -> None:
    for p in run.prompts:
        bad = [t for t in p.token_ids if not 0 <= t < vocab_size]
        if bad:
            raise BadInput(f"prompt {p.id!r}: token id {bad[0]} outside the model's vocabulary (0..{vocab_size - 1})")


def replay_device_json(dev: str) -> dict:
    d = torch.device(dev)
    return {"type": d.type, "name": device_name(d)}


def load_replay_model(run, model_spec: str | None, dev: str):
    """The model to replay with, checked against the prompts' token ids."""
    spec = model_spec or model_spec_from_header(run.header)
    try:
        model = load_model(spec, dev)
    except UserError as exc:
        raise UserError(f"cannot load model {spec!r} to replay with: {exc}") from None
    check_prompt_ids(run, model.vocab_size)
    return model


def file_findings(run, model_identity: dict) -> tuple[list[dict], list[dict]]:
    """Every finding that needs no replay: (all of them, the model-identity ones alone)."""
    findings = checks.check_header(run.header, {"torch": torch.__version__, "transformers": transformers.__version__})
    findings += checks.check_determinism(run.header.get("determinism"), determinism.differences)
    model_findings = checks.check_model_identity(run.header["model"], model_identity)
    findings += model_findings
    findings += checks.check_instrument(run.header)
    findings += checks.check_reference(run.header)
    findings += checks.run_checks(run)
    return findings, model_findings


def replay_info(devices: list[dict], tokens: int, seconds: float) -> dict:
    """audit.json ``replay``: how the tokens were replayed, and where (one entry per rank)."""
    return {"path": "pristine-serial", "device": devices[0]["name"], "tokens_replayed": tokens,
            "seconds": seconds, "ms_per_token": 1000 * seconds / tokens if tokens else None,
            "world_size": len(devices), "ranks": [{"rank": r, "device": d} for r, d in enumerate(devices)]}


def finish(run, path: Path, out_path: Path, findings, replayed, info: dict, model_identity: dict,
           params: dict) -> int:
    """Build, write and print audit.json; the exit code from its verdict."""
    doc = build_document(run, hashlib.sha256(path.read_bytes()).hexdigest(), findings, replayed, info,
                         model_identity, params)
    try:
        write_json_atomic(out_path, doc)
    except OSError as exc:
        raise BadInput(f"cannot write {out_path}: {exc.strerror or exc}") from None
    click.echo(render_table(doc))
    click.echo(f"wrote {out_path}")
    return EXIT_PASS if doc["verdict"] == "pass" else EXIT_FAIL


def pin_replay_environment() -> None:
    determinism.pin()  # before anything can touch CUDA, as the harness does
    transformers.logging.set_verbosity_error()  # expected "no fast kernel" notices
