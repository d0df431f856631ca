"""``audit``: check a harness run independently of the harness.

``audit replay STREAM`` pins the deterministic configuration, loads the model that recorded the
stream, replays every token through its own pristine serial greedy path, recomputes every ratio
from the raw legs, checks the file for tampering, scores the run and writes audit.json.

Exit codes: 0 everything exact and consistent; 1 the audit ran and found failures; 2 bad input
(one line on stderr, nothing written).

Import rule: harness.schema / models / determinism / errors only; never harness.timing,
harness.cli or decoders (tests/test_audit_imports.py).
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import click

from harness.errors import UserError

from audit.stream import BadInput

EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2


def fail(message: str, code: int = EXIT_BAD_INPUT):
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def log(message: str) -> None:
    click.echo(message, err=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main():
    """Independent audit of harness runs: exactness by replay, ratios from raw legs, tamper checks."""


@main.command("replay")
@click.argument("stream", metavar="STREAM")
@click.option("--model", "model_spec", default=None, metavar="MODEL",
              help="Model to replay with (built-in name or checkpoint dir). Default: the one the header names.")
@click.option("--out", "out_path", default=None, metavar="AUDIT_JSON",
              help="Where to write the audit. Default: audit.json beside STREAM.")
@click.option("--device", default=None,
              help="torch device for the replay. Default: the recording device's type if present, else cpu.")
@click.option("--allow-device-mismatch", is_flag=True,
              help="Replay even on a device other than the recording one (a warning, not a refusal).")
@click.option("--s-max", type=click.FloatRange(min=0), default=0.95, show_default=True, help="Score ceiling S_max.")
@click.option("--kappa", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True,
              help="Score scale: S_max * (1 - exp(-(m - 1) / kappa)) * f_mem.")
@click.option("--mem-allowance", type=click.FloatRange(min=0, min_open=True), default=1.2, show_default=True,
              help="Candidate/control peak memory allowed before the score is cut: f_mem = min(1, allowance / ratio).")
def replay_cmd(stream, model_spec, out_path, device, allow_device_mismatch, s_max, kappa, mem_allowance):
    """Replay STREAM (a harness stream.jsonl) and audit it.

    Every leg's tokens must be exactly what serial greedy decoding emits (teacher-forced replay,
    first divergence reported with its top-5 logits and margin); control legs must agree with
    each other; ratios are recomputed from the raw legs and compared with the harness's; leg
    times, ABBA order, the end record's count and sha256 are checked; a candidate much faster
    on later legs than on its first is flagged. Writes audit.json and prints a table.
    """
    params = {"s_max": s_max, "kappa": kappa, "mem_allowance": mem_allowance}
    try:
        code = audit_stream(Path(stream), model_spec, Path(out_path) if out_path else None, device,
                            allow_device_mismatch, params)
    except (BadInput, UserError) as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        fail("interrupted; nothing was written", 130)
    sys.exit(code)


def model_spec_from_header(header: dict) -> str:
    """Built-ins by name; checkpoints by the path recorded (pass --model when it moved)."""
    name = header["model"].get("name")
    if not isinstance(name, str) or not name:
        raise BadInput("header model has no name; pass --model")
    return name


def choose_device(requested: str | None, recorded: dict) -> str:
    import torch

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


def audit_stream(path: Path, model_spec: str | None, out_path: Path | None, device: str | None,
                 allow_device_mismatch: bool, params: dict) -> int:
    """The whole audit; returns the exit code. Writes audit.json once, at the end."""
    from harness import determinism

    determinism.pin()  # before anything can touch CUDA, as the harness does
    import torch
    import transformers

    transformers.logging.set_verbosity_error()  # expected "no fast kernel" notices
    from harness.models import device_name, load_model
    from harness.schema import write_json_atomic

    from audit import checks
    from audit.replay import replay_run
    from audit.report import build_document, divergence_findings, render_table
    from audit.stream import load_run

    run = load_run(path)
    out_path = out_path or path.parent / "audit.json"
    dev = choose_device(device, run.header["device"])
    replay_device = device_name(torch.device(dev))
    findings = checks.check_device(run.header["device"], torch.device(dev).type, replay_device, allow_device_mismatch)

    spec = model_spec or model_spec_from_header(run.header)
    try:
        model = load_model(spec, dev)
    except UserError as exc:
        raise UserError(f"cannot load model {spec!r} to replay with: {exc}") from None
    check_prompt_ids(run, model.vocab_size)

    findings += checks.check_header(run.header, {"torch": torch.__version__, "transformers": transformers.__version__})
    findings += checks.check_determinism(run.header.get("determinism"), determinism.differences)
    model_findings = checks.check_model_identity(run.header["model"], model.identity)
    findings += model_findings
    findings += checks.check_instrument(run.header)
    findings += checks.run_checks(run)

    replayed, tokens, seconds = None, 0, 0.0
    if not model_findings:  # replaying with another model would only report noise
        log(f"replaying {sum(len(p.legs) for p in run.prompts)} legs of {len(run.prompts)} prompts "
            f"on {replay_device} ...")
        replayed, tokens, seconds = replay_run(model, run, log)
        findings += divergence_findings(run, replayed)
    replay_info = {"path": "pristine-serial", "device": replay_device, "tokens_replayed": tokens,
                   "seconds": seconds, "ms_per_token": 1000 * seconds / tokens if tokens else None}

    doc = build_document(run, hashlib.sha256(path.read_bytes()).hexdigest(), findings, replayed, replay_info,
                         model.identity, params)
    try:
        write_json_atomic(out_path, doc)
    except OSError as exc:
        raise BadInput(f"cannot write {out_path}: {exc.strerror or exc}") from None
    click.echo(render_table(doc))
    click.echo(f"wrote {out_path}")
    return EXIT_PASS if doc["verdict"] == "pass" else EXIT_FAIL


if __name__ == "__main__":
    main()
