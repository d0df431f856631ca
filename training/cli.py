"""``python -m training``: trains a small Qwen3.5 with a real MTP head from scratch on the Python
standard library (the pipeline is training/pipeline.py).

    python -m training --out DIR [--minutes 5.5] [--steps N] [--device cuda] [--seed 0] [--smoke]
    python -m training --out DIR --init-from CKPT --unloop-steps N   # fine-tune only
    python -m training --out CKPT --measure-only                      # re-measure quality

Exit status: 0 done; 2 bad input (one ``error:`` line on stderr, before anything is written);
130 interrupted (Ctrl-C; one line saying what is at ``--out``).
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from core.clirun import FiniteFloat, IntRange, run_command
from core.errors import EXIT_INTERRUPTED, UserError, fail
from core.version import version_option
from training.model import PRESETS, require_checkpoint
from training.outdir import check_out
from training.pipeline import run
from training.quality import remeasure

PROG = "python -m training"
OVERRIDES = ("batch", "prompts", "dropout", "weight_decay", "max_epochs", "unloop_steps", "unloop_lr")


@dataclass(frozen=True)
class Request:
    """One invocation: what to do and where, and the preset fields the command line overrides."""

    out: Path
    measure_only: bool = False
    smoke: bool = False
    minutes: float | None = None
    steps: int | None = None
    device: str | None = None
    seed: int = 0
    spec: bool = True
    init_from: Path | None = None
    force: bool = False
    overrides: tuple = ()  # (Preset field, value) pairs


def _preset(field: str) -> str:
    """An override's default, as --help shows it: each preset's own value."""
    return f"the preset's: small {getattr(PRESETS['small'], field)}, smoke {getattr(PRESETS['smoke'], field)}"


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@version_option
@click.option("--out", required=True, type=click.Path(path_type=Path), metavar="DIR",
              help="Checkpoint directory to write; with --measure-only, the checkpoint to measure. A new or empty "
                   "directory, or an earlier run's checkpoint (replaced); anything else needs --force.")
@click.option("--force", is_flag=True, show_default=True,
              help="Write the checkpoint into an --out that holds other files: those are kept, and only files of "
                   "the checkpoint's own names are replaced.")
@click.option("--measure-only", is_flag=True, show_default=True,
              help="Train nothing: measure --out's checkpoint as a run would (quality.remeasured.json).")
@click.option("--smoke", is_flag=True, show_default=True,
              help="CPU-sized run: small config, corpus slice, few steps.")
@click.option("--minutes", type=FiniteFloat(min=0, min_open=True), default=None,
              show_default="5.5, or none with --smoke", help="Cap on training time, before the unloop fine-tune.")
@click.option("--steps", type=IntRange(min=1), default=None,
              show_default="the preset's: smoke 8; small planned, up to --max-epochs, lowered to fit --minutes",
              help="Optimizer steps.")
@click.option("--device", default=None, metavar="DEV", show_default="cuda if available, else cpu",
              help="cpu, cuda or cuda:N; checked before anything loads.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of every phase.")
@click.option("--batch", type=IntRange(min=1), default=None, show_default=_preset("batch"),
              help="Rows per step.")
@click.option("--prompts", type=IntRange(min=1), default=None, show_default=_preset("prompts"),
              help="Held-out prompts for quality.")
@click.option("--no-spec-check", is_flag=True, show_default=True,
              help="Skip decoding the quality prompts with `spec` too.")
@click.option("--dropout", type=FiniteFloat(min=0, max=1, max_open=True), default=None,
              show_default=_preset("dropout"), help="Residual dropout.")
@click.option("--weight-decay", type=FiniteFloat(min=0), default=None, show_default=_preset("weight_decay"),
              help="AdamW weight decay.")
@click.option("--max-epochs", type=FiniteFloat(min=0, min_open=True), default=None,
              show_default=_preset("max_epochs"), help="Passes over the train split that planned steps never exceed.")
@click.option("--unloop-steps", type=IntRange(min=0), default=None, show_default=_preset("unloop_steps"),
              help="Updates of the sequence-level unlikelihood fine-tune against greedy loops, after training.")
@click.option("--unloop-lr", type=FiniteFloat(min=0, min_open=True), default=None,
              show_default=_preset("unloop_lr"), help="The unloop fine-tune's learning rate.")
@click.option("--init-from", type=click.Path(path_type=Path), default=None, metavar="CKPT",
              show_default="none: train from scratch",
              help="Start from this exported checkpoint (its tokenizer too) instead of training, and run only the "
                   "unloop fine-tune on it (--unloop-steps).")
def command(out, force, measure_only, smoke, minutes, steps, device, seed, no_spec_check, init_from, **overrides):
    """Train the built-in `small` model (a Qwen3.5 with its MTP head) from scratch on the Python
    standard library, export it to --out and measure its quality into DIR/quality.json.

    \b
    Exit status: 0 done; 2 bad input (one `error:` line, nothing written);
    130 interrupted (Ctrl-C; the line says what is at --out).
    """
    if init_from is not None and measure_only:
        raise click.UsageError("--init-from trains; --measure-only does not")
    if init_from is not None and init_from.resolve() == out.resolve():
        raise click.UsageError("--init-from and --out must differ (--out is replaced)")
    if force and measure_only:
        raise click.UsageError("--force is for a run's --out; --measure-only writes only quality.remeasured.json")
    return execute(Request(out=out, measure_only=measure_only, smoke=smoke, minutes=minutes, steps=steps,
                           device=device, seed=seed, spec=not no_spec_check, init_from=init_from, force=force,
                           overrides=tuple((k, v) for k, v in overrides.items() if v is not None)))


def execute(req: Request) -> dict:
    """The run (or re-measure) ``req`` asks for; returns its record. Bad input: one ``error:`` line
    and exit 2, before anything is written; Ctrl-C: one line and exit 130."""
    from core import determinism
    from core.devices import check_device

    try:
        determinism.pin()  # before anything touches CUDA
        device = check_device(req.device)
        preset = dataclasses.replace(PRESETS["smoke" if req.smoke else "small"], **dict(req.overrides))
        minutes = req.minutes if req.minutes is not None else (None if req.smoke else 5.5)
        if req.measure_only:
            return remeasure(req.out, preset, device, spec=req.spec)
        check_out(req.out, req.force)  # before minutes of work
        if req.init_from is not None:
            require_checkpoint(req.init_from)  # before minutes of corpus and tokenizer work
        return run(req.out, preset, device=device, seed=req.seed, minutes=minutes, steps=req.steps, spec=req.spec,
                   init_from=req.init_from, force=req.force)
    except UserError as exc:
        fail(exc)
    except KeyboardInterrupt as exc:  # pipeline.Interrupted says what was kept
        fail(str(exc) or "interrupted; nothing was written", EXIT_INTERRUPTED)


def main(argv: list[str] | None = None) -> dict:
    """The command line; returns the run's (or the re-measure's) record. ``--help`` and
    ``--version`` exit 0; bad input exits 2 with one ``error:`` line."""
    result = run_command(command, argv, PROG)
    if isinstance(result, int):  # click ended the command itself: help, version or a usage error
        sys.exit(result)
    return result
