"""``audit replay``: parse the options, audit the streams by replay (``audit.replay_audit``)."""
from __future__ import annotations

from pathlib import Path

import click

from core.clirun import FiniteFloat, IntRange
from core.version import version_option

from audit.commands.common import check_device_option, run_command


@click.command("replay")
@version_option
@click.argument("streams", metavar="STREAM...", nargs=-1, required=True)
@click.option("--model", "model_spec", default=None, metavar="MODEL",
              help="Model to replay with (built-in name or checkpoint dir): the recorded weights, e.g. where a checkpoint "
                   "has moved; another model is refused. Default: the one the header names.")
@click.option("--out", "out_path", default=None, metavar="AUDIT_JSON",
              help="Where to write the audit (one STREAM only). Default: audit.json beside each STREAM.")
@click.option("--device", default=None,
              help="Device for the replay: cpu, cuda or cuda:N (where present). Default: the recording device's "
                   "type if present, else cpu.")
@click.option("--allow-device-mismatch", is_flag=True,
              help="Replay even on a device other than the recording one (a warning, not a refusal).")
@click.option("--s-max", type=FiniteFloat(min=0), default=0.95, show_default=True, help="Score ceiling S_max.")
@click.option("--kappa", type=FiniteFloat(min=0, min_open=True), default=2.0, show_default=True,
              help="Score scale: S_max * (1 - exp(-(m - 1) / kappa)) * f_mem.")
@click.option("--mem-allowance", type=FiniteFloat(min=0, min_open=True), default=1.2, show_default=True,
              help="Candidate/control peak memory allowed before the score is cut: f_mem = min(1, allowance / ratio).")
@click.option("--workers", type=IntRange(min=1), default=1, show_default=True, metavar="N",
              help="Replay N prompts at once in N worker processes on the one device, each with its own "
                   "pristine serial path, all reading this process's one copy of the weights (a worker adds "
                   "only its context, activations and cache). Results are a lone replay's, bit for bit. "
                   "1: in this process.")
@click.option("--dist-timeout", type=FiniteFloat(min=0, min_open=True), default=1800, show_default=True,
              metavar="SECONDS",
              help="Under torchrun, or with --workers above 1: a rank or worker that shows no progress for "
                   "this long is taken as hung; the audit then fails (exit 2) naming it and its prompt, and "
                   "writes nothing. Also the process group's timeout.")
def replay_cmd(streams, model_spec, out_path, device, allow_device_mismatch, s_max, kappa, mem_allowance,
               workers, dist_timeout):
    """Replay STREAM (a harness stream.jsonl) and audit it.

    Every leg's tokens must be exactly what serial decoding emits (teacher-forced replay, first
    divergence reported with its top-5 logits and margin): greedy, or under the seeded sampler the
    header records (`harness time --sampling`), each token the sampler's pick at its absolute
    position (prompt length + index); a header sampler that defines none is bad input (exit 2). Control legs must agree with
    each other; ratios are recomputed from the raw legs and compared with the harness's; leg
    times, ABBA order, the end record's count and sha256 are checked; a candidate much faster
    on later legs than on its first is flagged. A prompt's ratio is the control's median leg over
    the candidate's first leg. The header's prompt set (sha256, count), each warm-up prompt, and
    the harness's own violation records are checked too; a side whose legs spread beyond
    core.schema.LEG_SPREAD_LIMIT is warned about (unstable), without changing the verdict. STREAM may be a run directory
    (its stream.jsonl). Writes audit.json and prints a table.

    Several GPUs: `torchrun --nproc-per-node G -m audit replay STREAM` replays prompt i on rank
    i % G (cuda:LOCAL_RANK) and rank 0 writes the one audit.json, the same document as one
    process would write apart from the replay's timing and its world_size/ranks. A rank that
    fails or hangs fails the audit (exit 2) naming the rank and prompt; nothing is written.

    Several streams in one process (`audit replay a/stream.jsonl b/stream.jsonl ...`): each gets
    its own audit.json beside it, the same document a separate audit would write, but every
    distinct (model, prompt, N) is walked once for all of them, so auditing K runs of one
    benchmark costs one replay instead of K. Every file is read and checked for bad input before
    anything is replayed or written.

    One device, several prompts at once (`--workers N`): N worker processes share the device and
    the audit's copy of the weights, each walking one prompt at a time; audit.json is the one a
    lone replay writes apart from the replay's timing and its workers. A worker that fails or hangs
    fails the audit (exit 2) naming the worker and prompt; nothing is written.
    """
    from audit.replay_audit import ReplayOptions, run_replay  # torch loads only when a command runs

    def replay() -> int:
        check_device_option(device)
        return run_replay(ReplayOptions(
            streams=tuple(Path(s) for s in streams), model=model_spec, out=Path(out_path) if out_path else None,
            device=device, allow_device_mismatch=allow_device_mismatch, s_max=s_max, kappa=kappa,
            mem_allowance=mem_allowance, workers=workers, dist_timeout=dist_timeout))

    run_command(replay)
