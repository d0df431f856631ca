"""``harness time``: parse the options, time the candidate against the control, optionally render."""
from __future__ import annotations

import shlex
from pathlib import Path

import click

from core.clirun import FiniteFloat, IntRange, PathArg
from core.errors import fail
from core.version import version_option
from harness.commands.common import run_cli
from harness.options import SAMPLING_HELP, TimeOptions
from harness.run import run_time


@click.command("time")
@version_option
@click.option("--decoder", default=TimeOptions.decoder, metavar="NAME",
              help="Candidate decoder: a registered name (see `harness list`) or package.module:attr. "
                   f"Default: {TimeOptions.decoder}.")
@click.option("--decoder-arg", "decoder_args", multiple=True, metavar="KEY=VALUE",
              help="Constructor argument for the candidate decoder (repeatable), e.g. max_depth=4.")
@click.option("--control", default=TimeOptions.control, metavar="NAME",
              help="Reference decoder timed against the candidate. Default: serial, the control that "
                   "defines exactness. Another reference (e.g. fast-serial) measures the candidate against "
                   "it side by side; the audit still replays every token against serial greedy decoding, "
                   "but does not score such a run.")
@click.option("--model", default=TimeOptions.model, show_default=True, metavar="MODEL",
              help="Built-in model name (small: trained, the default; tiny: random, for tests; synthetic-9b: random, 9B-shaped, GPU) or a Qwen3.5 checkpoint directory.")
@click.option("--prompts", default=TimeOptions.prompts, metavar="PROMPTS",
              help="Built-in prompt set (dev, stdlib-heldout, stdlib-dev, stdlib-train, random-512, "
                   "random-512-offline; `harness list` describes them; the stdlib-* sets take a count as "
                   "NAME:N, e.g. stdlib-train:2048) or a jsonl file of {id, text|token_ids}. "
                   "Default: stdlib-heldout for small, dev for other models with a tokenizer, random-512 otherwise.")
@click.option("--max-new-tokens", "-n", type=IntRange(min=1), default=TimeOptions.max_new_tokens,
              help="New tokens per decode (stops earlier at EOS). Default: 64 on CPU, 512 on GPU.")
@click.option("--legs", "-l", type=IntRange(min=1), default=TimeOptions.legs, show_default=True,
              help="Timed legs per side per prompt, interleaved ABBA.")
@click.option("--limit", type=IntRange(min=1), default=TimeOptions.limit, help="Use only the first K prompts.")
@click.option("--warmup-tokens", type=IntRange(min=0), default=TimeOptions.warmup_tokens, show_default=True,
              help="New tokens in the untimed warm-up decode of each side, per prompt. The warm-up decodes "
                   "another prompt of the same length (random ids from --seed and the prompt's index).")
@click.option("--device", default=TimeOptions.device, help="torch device. Default: cuda if available, else cpu.")
@click.option("--out", "out_dir", type=PathArg(), default=TimeOptions.out_dir,
              help="Output directory for stream.jsonl. Default: runs/<decoder>-<timestamp>.")
@click.option("--force", is_flag=True, help="Replace an existing DIR/stream.jsonl.")
@click.option("--seed", type=int, default=TimeOptions.seed, show_default=True,
              help="Seed recorded in the header, set before decoding (the decoders draw no torch random "
                   "numbers; a sampler's seed is --sampling's seed=), and drawing the warm-up prompts.")
@click.option("--sampling", default=TimeOptions.sampling, metavar="SPEC",
              help=SAMPLING_HELP + " Both sides decode with it, each token the sampler's pick at its absolute "
                   "position; the header records it and `audit replay` replays with it. A candidate must "
                   "sample (sampling = True in its class).")
@click.option("--report", is_flag=True, help="After writing the stream, also render DIR/report.md and "
              "DIR/figures/ (as `reports render DIR` does).")
@click.option("--dist-timeout", type=FiniteFloat(min=0, min_open=True), default=TimeOptions.dist_timeout,
              show_default=True, metavar="SECONDS",
              help="Under torchrun only: a rank that shows no progress (starts no new prompt and does not "
                   "finish) for this long is taken as hung; the run then fails with a message naming the "
                   "rank and its prompt, and writes nothing. Also the process group's timeout.")
def time_cmd(**options):
    """Time DECODER against the serial control on every prompt, side by side in one process,
    greedy or under one seeded sampler (--sampling).

    Per prompt: an untimed warm-up of both on another prompt of the same length, then LEGS timed
    decodes of each in ABBA order, each timed around the whole decode with device
    synchronisation, peak memory recorded on CUDA. A prompt's ratio is the control's median time
    over the candidate's first leg. Writes DIR/stream.jsonl atomically and prints tokens/s, ratio
    and acceptance per prompt.

    Several GPUs: `torchrun --nproc-per-node G -m harness time ...` gives prompt i to rank i % G;
    each rank times both sides of its prompts on its own GPU (cuda:LOCAL_RANK), and rank 0 writes
    one stream.jsonl whose header records world_size and each rank's device. If any rank fails
    or hangs, the run fails naming the rank and prompt, and no stream.jsonl is written.
    """
    opts = run_cli(lambda: TimeOptions(**options))
    stream_path = run_cli(lambda: run_time(opts))
    if opts.report and stream_path is not None:  # under torchrun, only rank 0 wrote a stream
        render_report(stream_path.parent)


def render_report(run_dir: Path) -> None:
    """``--report``: runs only after the stream is committed, so a failed render cannot cost the stream."""
    from reports.render import render_run  # matplotlib: loads only when a report is asked for

    try:
        summary = render_run(run_dir)
    except Exception as exc:  # noqa: BLE001 - whatever went wrong, the stream is already on disk
        fail(f"the stream is intact, but the report could not be rendered ({type(exc).__name__}: {exc}); "
             f"retry with `reports render {run_dir}`", 1)
    click.echo(f"report: {summary['report']}")
    click.echo(f'note: the report shows "NOT AUDITED" until `audit replay {shlex.quote(str(run_dir / "stream.jsonl"))}` runs')
