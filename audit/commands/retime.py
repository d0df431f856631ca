"""``audit retime``: parse the options, retime the stream's candidate (``audit.retime``)."""
from __future__ import annotations


import click

from core.clirun import FiniteFloat, IntRange, PathArg
from core.version import version_option

from audit.commands.common import run_command


@click.command("retime")
@version_option
@click.argument("stream", metavar="STREAM", type=PathArg())
@click.option("--out", "out_path", default=None, type=PathArg(), metavar="RETIME_JSON",
              help="Where to write the result. Default: retime.json beside STREAM.")
@click.option("--prompts", "prompt_count", type=int, default=9, show_default=True, metavar="K",
              help="Fresh prompts to time, each as long as one of the stream's (in turn); at least 6, the fewest "
                   "whose median has a 95% interval (9 and more give one inside the extremes).")
@click.option("--fresh", "fresh_file", default=None, type=PathArg(), metavar="FILE",
              help="Fresh prompts of your own (jsonl of {id, text | token_ids}, a regular file), used in file "
                   "order, each cut to the length of the stream prompt it stands in for; read before any worker "
                   "starts and hidden from the candidate's sandbox (at its real path; a copy or hard link "
                   "elsewhere is not). Default: drawn from a built-in source of the stream's kind (random ids, "
                   "or runs of stdlib lines from random line starts for text).")
@click.option("-n", "--max-new-tokens", type=IntRange(min=1), default=None, metavar="N",
              help="New tokens per decode. Default: the stream's N.")
@click.option("--legs", type=IntRange(min=1), default=2, show_default=True,
              help="Timed legs per side per fresh prompt, ABBA.")
@click.option("--model", "model_spec", default=None, metavar="MODEL",
              help="Model (built-in name or checkpoint dir): the recorded weights, e.g. where a checkpoint has moved; "
                   "another model is refused. Default: the one the header names.")
@click.option("--device", default=None,
              help="torch device. Default: the recording device's type if present, else cpu.")
@click.option("--allow-device-mismatch", is_flag=True,
              help="Retime even on a device other than the recording one (a warning, not a refusal).")
@click.option("--trust-plugin", is_flag=True,
              help="Run a plug-in decoder (package.module:attr) that the stream names: its code runs in a worker.")
@click.option("--seed", type=IntRange(min=0), default=None, metavar="S",
              help="Draw the fresh prompts from seed S (a retime.json's seed "
                   "repeats its draw). Default: a secret seed drawn for this retime, shown once every leg ran.")
@click.option("--no-sandbox", "no_sandbox", is_flag=True,
              help="Run the candidate's worker outside the sandbox (bubblewrap, or unshare as root) even where the "
                   "machine offers one; retime.json and the table then warn candidate-not-sandboxed.")
@click.option("--s-max", type=FiniteFloat(min=0), default=0.95, show_default=True,
              help="Verified score ceiling S_max (as audit replay's).")
@click.option("--kappa", type=FiniteFloat(min=0, min_open=True), default=2.0, show_default=True,
              help="Verified score saturation kappa (as audit replay's).")
@click.option("--mem-allowance", type=FiniteFloat(min=0, min_open=True), default=1.2, show_default=True,
              help="Candidate/control peak memory, measured outside each worker, allowed before the verified score "
                   "is cut: f_mem = min(1, allowance / ratio) (as audit replay's).")
@click.option("--workers", type=IntRange(min=1), default=1, show_default=True, metavar="N",
              help="Replay the retimed legs N prompts at once, in N processes on the one device, all reading "
                   "the audit's one copy of the weights (as audit replay --workers). 1: in the audit's own "
                   "process.")
@click.option("--dist-timeout", type=FiniteFloat(min=0, min_open=True), default=1800, show_default=True,
              metavar="SECONDS",
              help="With --workers above 1: a replay worker that shows no progress for this long is taken as "
                   "hung; the retime then fails (exit 2) naming it and its prompt, and writes nothing "
                   "(as audit replay's).")
def retime_cmd(stream, out_path, prompt_count, fresh_file, max_new_tokens, legs, model_spec, device,
               allow_device_mismatch, trust_plugin, seed, no_sandbox, s_max, kappa, mem_allowance, workers,
               dist_timeout):
    """Measure STREAM's candidate again, against the control, on fresh prompts and the audit's clock:
    the verified ratio, its interval and score.

    The candidate (with its recorded arguments) and the control each run in a process of their own
    (python -m harness.worker), started cold, both decoding with the header's sampler (greedy when
    it records none; the retimed legs are replayed with it and retime.json records it); the audit times every request to its answer, ABBA,
    on K fresh prompts of the stream's lengths that no decoder can enumerate (a secret seed; never
    the stream's own prompts), with a second look at K more when the first falls short, and
    replays every retimed token through its pristine serial path. The verified figures are the
    retime's own: per-prompt ratios (the control's first leg over the candidate's first), their
    median, a distribution-free 95% interval, and the score, cut by the memory each side held
    (measured outside its process), 0 unless the interval's bottom is above 1, and withheld without
    the candidate's sandbox or a control whose code was proven unchanged. The stream's claimed ratio is shown beside them and fails (claim-not-reproduced) when it lies
    above the interval's top by more than the margin. A stream that fails audit replay's file
    checks is not retimed; a header the decoders contradict fails (header-disagrees).

    Each side runs only while it is timed: the other is stopped with every process it started. On
    a GPU the audit's own probe waits for the GPU to be idle before every leg, and the time it
    stays busy after an answer is the answering side's (gpu-work-after-answer). Around every leg
    the audit measures how long the timed side waited for a CPU and how much CPU other work took;
    it fails (load-against-control) when most prompts ran their control on a machine loaded
    against it, and (stopped-by-others) when another process paused the control's worker or the
    audit itself. On a GPU it asks nvidia-smi every second which processes hold a context, and
    fails (gpu-shared) when one is out of its reach. Before the workers start, the control's code is
    checked against git HEAD and the installed RECORDs (control-code-modified names a changed
    file); the candidate's worker runs sandboxed where the machine allows (read-only filesystem, no
    network, its processes dying with it, the --fresh file hidden). Details: docs/audit.md.

    Writes retime.json, prints both ratios per prompt and median. Exit 0 verified (pass), 1 findings
    or unverified (no fresh prompts fit), 2 bad input.
    """
    from audit.retime import RetimeOptions, WorkerError, retime  # torch loads only when a command runs

    opts = RetimeOptions(stream=stream, out=out_path, prompts=prompt_count, max_new_tokens=max_new_tokens, legs=legs,
                         model=model_spec, device=device, allow_device_mismatch=allow_device_mismatch,
                         trust_plugin=trust_plugin, seed=seed, fresh=fresh_file, sandbox=not no_sandbox,
                         s_max=s_max, kappa=kappa, mem_allowance=mem_allowance, workers=workers,
                         dist_timeout=dist_timeout)
    run_command(lambda: retime(opts), worded={WorkerError: "retime could not start"})
