"""``heads``: draft-head tools.

``heads train`` trains (distils) a backbone's MTP draft head on the backbone's own greedy
generations (heads/train.py) and saves it as a head directory (heads/__init__.py).

Exit codes: 0 head saved; 1 not saved because it is not better than the starting head on held-out
mean accepted length (pass --force-save to save it anyway); 2 bad input, an --out that cannot be
written (found before training) or a save that failed (one ``error:`` line, nothing left behind);
130 interrupted (Ctrl-C; one line saying what was written). Progress goes to stderr (a bar with
an ETA on a terminal); the before/after summary to stdout.
"""
from __future__ import annotations

import sys

import click

from core.clirun import FiniteFloat, IntRange, PathArg, run_command
from core.version import version_option
from heads.run import TrainRequest, run_train

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
POSITIVE = IntRange(min=1)


@click.group(context_settings=CONTEXT)
@version_option
def heads():
    """Draft-head tools: train a backbone's MTP draft head for `spec`."""


@heads.command("train", short_help="Train/distil the MTP draft head on the backbone's own greedy generations.")
@version_option
@click.option("--model", required=True, metavar="MODEL",
              help="Checkpoint directory or built-in name (small, tiny, synthetic-9b).")
@click.option("--prompts", required=True, metavar="PROMPTS",
              help="Prompt set: a jsonl file, or a built-in set (stdlib-train for small, or stdlib-train:N for N "
                   "snippets, e.g. stdlib-train:2048; random-512-offline for synthetic-9b; dev).")
@click.option("--out", required=True, type=PathArg(), metavar="DIR",
              help="Head directory to write (mtp.safetensors, draft_shortlist.json, report.json). Refused if it "
                   "already holds a head or is the model's own directory.")
@click.option("-n", "--max-new-tokens", type=IntRange(min=2), default=128, show_default=True,
              help="Greedy tokens generated per prompt.")
@click.option("--steps", type=POSITIVE, default=200, show_default=True,
              help="Optimizer steps at most (early stopping may end sooner).")
@click.option("--lr", type=FiniteFloat(min=0), default=3e-4, show_default=True,
              help="AdamW learning rate of the fp32 head copy.")
@click.option("--eval-every", type=POSITIVE, default=50, show_default=True,
              help="Steps between evaluations (dev loss, held-out acceptance).")
@click.option("--depth", type=POSITIVE, default=4, show_default=True, help="Draft depth of the acceptance measurement.")
@click.option("--batch", type=POSITIVE, default=4, show_default=True, help="Train sequences per step.")
@click.option("--patience", type=POSITIVE, default=3, show_default=True,
              help="Evaluations without dev-loss improvement before stopping.")
@click.option("--shortlist-size", type=POSITIVE, default=32768, show_default=True,
              help="Draft shortlist ids (capped at the vocabulary).")
@click.option("--seed", type=int, default=0, show_default=True, help="torch's seed and the batch sampler's.")
@click.option("--gen-batch", type=POSITIVE, default=32, show_default=True, metavar="B",
              help="Generate the TRAIN split's continuations B sequences at a time (plain HF forwards; each batch's "
                   "prompts left-truncated to its shortest; may differ from exact greedy at near-ties, which is "
                   "fine for training data). Dev and held-out are always generated exactly by fast-serial. "
                   "1: train exactly too (slow).")
@click.option("--gen-dtype", type=click.Choice(["model", "float32"]), default="model", show_default=True,
              help="Dtype of the batched train generation: the model's own, or a float32 copy of the backbone (on "
                   "a CPU ~4x faster than bf16, but its greedy stream departs from the bf16 backbone's more "
                   "often). Hidden states and evaluation always use the model itself.")
@click.option("--max-heldout", type=POSITIVE, default=None, show_default="20% of the set", metavar="N",
              help="At most N held-out prompts. Held-out and dev streams are generated exactly, one prompt at a "
                   "time: cap them for a large set; the rest goes to train.")
@click.option("--max-dev", type=POSITIVE, default=None, show_default="10% of the set", metavar="N",
              help="At most N dev prompts.")
@click.option("--device", default=None, show_default="cuda if available, else cpu", metavar="DEV",
              help="cpu, cuda or cuda:N; checked before anything loads.")
@click.option("--force-save", is_flag=True, show_default=True, help="Save the head even if it is not better than the starting head.")
def train_cmd(model, prompts, out, device, force_save, gen_dtype, **settings):
    """Train (distil) MODEL's MTP draft head on its own greedy continuations of PROMPTS.

    The prompts are split by sha256 of their id into held-out (~20%), dev (~10%) and train. Dev
    loss stops training early; held-out mean accepted length selects the checkpoint and gives the
    before/after figures. The backbone is never written. The head is saved to --out only if it is
    better than the starting head on held-out mean accepted length (or with --force-save); `spec`
    drafts with it given `--decoder-arg head=DIR`.

    \b
    Exit codes: 0 head saved; 1 not saved (not better; pass --force-save);
    2 bad input, an unwritable --out or a failed save (one `error:` line);
    130 interrupted (Ctrl-C).
    """
    return run_train(TrainRequest(model=model, prompts=prompts, out=out, device=device, force_save=force_save,
                                  gen_dtype=gen_dtype, settings=tuple(sorted(settings.items()))))


def main(argv: list[str] | None = None) -> int:
    """The ``heads`` command; returns its exit status (the console script exits with it)."""
    return run_command(heads, argv, "heads")


if __name__ == "__main__":
    sys.exit(main())
