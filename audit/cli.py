"""``audit``: check a harness run independently of the harness.

``audit replay STREAM`` pins the deterministic configuration, loads the model that recorded the
stream, replays every token through its own pristine serial greedy path, recomputes every ratio
from the raw legs, checks the file for tampering, scores the run and writes audit.json.
``audit retime STREAM`` times the candidate again on fresh prompts, each side in a worker process
of its own, on the audit's clock, and writes retime.json (``audit.retime``).

Exit codes: 0 everything exact and consistent; 1 the audit ran and found failures; 2 bad input,
or under torchrun a rank (with --workers, a replay worker) that failed or hung (one line on
stderr, nothing written).

Import rule: core only; never harness or decoders (tests/test_audit_imports.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

import click

from core.version import version_option
from core.errors import DistError, Stopped, UserError, fail

from audit.stream import BadInput

EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2


def parse_sampling(text: str | None):
    """``--sampling SPEC`` as a ``core.sampling.Sampler`` (None: greedy); bad SPEC is a UserError."""
    from core.sampling import GREEDY, Sampler, SamplerError  # imports torch: only when a command runs

    if text is None:
        return GREEDY
    try:
        return Sampler.parse(text)
    except SamplerError as exc:
        raise UserError(f"--sampling {text!r}: {exc}") from None


def check_device_option(device: str | None) -> None:
    """``--device`` checked before any file is read or model loaded (``core.devices``)."""
    from core.devices import check_device  # torch loads only when a command runs

    check_device(device)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@version_option
def main():
    """Independent audit of harness runs: exactness by replay (greedy or under the recorded seeded
    sampler), ratios from raw legs, tamper checks."""


@main.command("replay")
@version_option
@click.argument("streams", metavar="STREAM...", nargs=-1, required=True)
@click.option("--model", "model_spec", default=None, metavar="MODEL",
              help="Model to replay with (built-in name or checkpoint dir). Default: the one the header names.")
@click.option("--out", "out_path", default=None, metavar="AUDIT_JSON",
              help="Where to write the audit (one STREAM only). Default: audit.json beside each STREAM.")
@click.option("--device", default=None,
              help="Device for the replay: cpu, cuda or cuda:N (where present). Default: the recording device's "
                   "type if present, else cpu.")
@click.option("--allow-device-mismatch", is_flag=True,
              help="Replay even on a device other than the recording one (a warning, not a refusal).")
@click.option("--s-max", type=click.FloatRange(min=0), default=0.95, show_default=True, help="Score ceiling S_max.")
@click.option("--kappa", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True,
              help="Score scale: S_max * (1 - exp(-(m - 1) / kappa)) * f_mem.")
@click.option("--mem-allowance", type=click.FloatRange(min=0, min_open=True), default=1.2, show_default=True,
              help="Candidate/control peak memory allowed before the score is cut: f_mem = min(1, allowance / ratio).")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True, metavar="N",
              help="Replay N prompts at once in N worker processes on the one device, each with its own copy "
                   "of the model (N times its memory: about 19 GB a worker at the 9B shape) and its own "
                   "pristine serial path. Results are a lone replay's, bit for bit. 1: in this process.")
@click.option("--dist-timeout", type=click.FloatRange(min=0, min_open=True), default=1800, show_default=True,
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

    One device, several prompts at once (`--workers N`): N worker processes share the device, each
    loading its own copy of the model and walking one prompt at a time; audit.json is the one a
    lone replay writes apart from the replay's timing and its workers. A worker that fails or hangs
    fails the audit (exit 2) naming the worker and prompt; nothing is written.
    """
    from core.dist import quiet_rank, rank_prefix  # torch loads only when a command runs: --help stays fast

    from audit.pool import PoolOptions
    from audit.report import printable

    params = {"s_max": s_max, "kappa": kappa, "mem_allowance": mem_allowance}
    pool = PoolOptions(workers=workers, timeout_s=dist_timeout)
    try:
        check_device_option(device)
        if len(streams) > 1:
            if out_path:
                raise BadInput("--out names one file: with several streams each audit.json is written beside its stream")
            code = audit_streams([Path(s) for s in streams], model_spec, device, allow_device_mismatch, params, pool)
        else:
            code = audit_stream(Path(streams[0]), model_spec, Path(out_path) if out_path else None, device,
                                allow_device_mismatch, params, pool)
    except (BadInput, UserError) as exc:
        fail(printable(str(exc)), quiet=quiet_rank())  # every rank meets it alike: rank 0 says it
    except DistError as exc:
        fail(rank_prefix() + str(exc))
    except Stopped:
        fail(rank_prefix() + "stopped by the launcher (SIGTERM); nothing was written")
    except KeyboardInterrupt:
        fail("interrupted; nothing was written", 130)
    sys.exit(code)


@main.command("tokens")
@version_option
@click.argument("file", metavar="FILE", type=click.Path(path_type=Path))
@click.option("--model", "model_spec", required=True, metavar="MODEL",
              help="The model that generated FILE (built-in name or checkpoint dir).")
@click.option("--device", default=None,
              help="Device for the pristine path: cpu, cuda or cuda:N (where present). Default: cuda if available, "
                   "else cpu.")
@click.option("--out", "out_path", default=None, type=click.Path(path_type=Path), metavar="JSON",
              help="Where to write the document; '-' writes it to stdout (the table then goes to stderr). "
                   "Default: audit_tokens.json beside FILE.")
@click.option("--tie-margin", type=click.FloatRange(min=0), default=None, metavar="X",
              help="A divergence whose greedy logit exceeds the emitted token's by at most X is a near-tie. "
                   "Default: 4 ulps of the logits' dtype (bf16) at the top-1 logit.")
@click.option("--reference", type=click.Path(path_type=Path), default=None, metavar="OTHER.jsonl",
              help="The same requests from the engine without speculation: report where each output first "
                   "parts from its counterpart (matched by id, else by line) and what greedy says there. Every "
                   "generation of FILE needs a counterpart (else exit 2).")
@click.option("--limit", type=click.IntRange(min=1), default=None, metavar="K", help="Audit the first K records only.")
@click.option("-n", "--max-new-tokens", type=click.IntRange(min=1), default=None, metavar="N",
              help="N, where serial decoding stops without an EOS. Default: the longest output in FILE.")
@click.option("--sampling", default=None, metavar="SPEC",
              help="The seeded sampler FILE's outputs claim (core.sampling): greedy (the default), a preset "
                   "(qwen-thinking, qwen-instruct) or key=value items (temperature, top_k, top_p, min_p, seed), "
                   "e.g. qwen-thinking,seed=7. Each token must then be the sampler's pick at its absolute "
                   "position (prompt length + index). A line that records its own sampler must match it.")
def tokens_cmd(file, model_spec, device, out_path, tie_margin, reference, limit, max_new_tokens, sampling):
    """Check FILE's outputs (a jsonl of generations) against serial decoding, greedy or under --sampling.

    \b
    One generation per line, in any of these shapes:
      {"id": "q1", "prompt_token_ids": [...], "output_token_ids": [...]}   ("prompt": "text" also)
      {"prompt_token_ids": [...], "outputs": [{"token_ids": [...]}, ...]}  (serving engine; ids ID/k)
      {"sequences": [[prompt + output ids]], "prompt_length": P}          (generate; or prompt_token_ids)

    Each output is replayed through the audit's pristine serial path: its first divergence (position,
    emitted vs greedy token, top-5 logits, margin) and whether it stops where greedy stops. A divergence
    within the tie margin is a near-tie (arithmetic order can flip it); above it, or a wrong stop, it is
    real. Writes audit_tokens.json and prints a table. Exit 0 all exact, 1 any divergence, 2 bad input.
    """
    from audit.pipeline import log
    from audit.report import printable
    from audit.tokens import TokensOptions, run_tokens_audit  # torch loads only when a command runs

    try:
        opts = TokensOptions(file=file, model=model_spec, device=device, out=out_path, tie_margin=tie_margin,
                             reference=reference, limit=limit, max_new_tokens=max_new_tokens,
                             sampler=parse_sampling(sampling))
        check_device_option(device)
        code = run_tokens_audit(opts, log=log)
    except UserError as exc:
        fail(printable(str(exc)))
    except KeyboardInterrupt:
        fail("interrupted; nothing was written", 130)
    sys.exit(code)


@main.command("retime")
@version_option
@click.argument("stream", metavar="STREAM", type=click.Path(path_type=Path))
@click.option("--out", "out_path", default=None, type=click.Path(path_type=Path), metavar="RETIME_JSON",
              help="Where to write the result. Default: retime.json beside STREAM.")
@click.option("--prompts", "prompt_count", type=click.IntRange(min=1), default=9, show_default=True, metavar="K",
              help="Fresh prompts to time, each as long as one of the stream's (in turn); at least 6, the fewest "
                   "whose median has a 95% interval (9 and more give one inside the extremes).")
@click.option("--fresh", "fresh_file", default=None, type=click.Path(path_type=Path), metavar="FILE",
              help="Fresh prompts of your own (jsonl of {id, text | token_ids}, a regular file), used in file "
                   "order, each cut to the length of the stream prompt it stands in for; read before any worker "
                   "starts and hidden from the candidate's sandbox (at its real path; a copy or hard link "
                   "elsewhere is not). Default: drawn from a built-in source of the stream's kind (random ids, "
                   "or runs of stdlib lines from random line starts for text).")
@click.option("-n", "--max-new-tokens", type=click.IntRange(min=1), default=None, metavar="N",
              help="New tokens per decode. Default: the stream's N.")
@click.option("--legs", type=click.IntRange(min=1), default=2, show_default=True,
              help="Timed legs per side per fresh prompt, ABBA.")
@click.option("--model", "model_spec", default=None, metavar="MODEL",
              help="Model (built-in name or checkpoint dir). Default: the one the header names.")
@click.option("--device", default=None,
              help="torch device. Default: the recording device's type if present, else cpu.")
@click.option("--allow-device-mismatch", is_flag=True,
              help="Retime even on a device other than the recording one (a warning, not a refusal).")
@click.option("--trust-plugin", is_flag=True,
              help="Run a plug-in decoder (package.module:attr) that the stream names: its code runs in a worker.")
@click.option("--seed", type=click.IntRange(min=0), default=None, metavar="S",
              help="Draw the fresh prompts from seed S (a retime.json's seed "
                   "repeats its draw). Default: a secret seed drawn for this retime, shown once every leg ran.")
@click.option("--no-sandbox", "no_sandbox", is_flag=True,
              help="Run the candidate's worker outside the sandbox (bubblewrap, or unshare as root) even where the "
                   "machine offers one; retime.json and the table then warn candidate-not-sandboxed.")
@click.option("--s-max", type=click.FloatRange(min=0), default=0.95, show_default=True,
              help="Verified score ceiling S_max (as audit replay's).")
@click.option("--kappa", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True,
              help="Verified score saturation kappa (as audit replay's).")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True, metavar="N",
              help="Replay the retimed legs N prompts at once, in N processes on the one device, each with its "
                   "own copy of the model (as audit replay --workers). 1: in the audit's own process.")
def retime_cmd(stream, out_path, prompt_count, fresh_file, max_new_tokens, legs, model_spec, device,
               allow_device_mismatch, trust_plugin, seed, no_sandbox, s_max, kappa, workers):
    """Measure STREAM's candidate again, against the control, on fresh prompts and the audit's clock:
    the verified ratio, its interval and score.

    The candidate (with its recorded arguments) and the control each run in a process of their own
    (python -m harness.worker), started cold, both decoding with the header's sampler (greedy when
    it records none; the retimed legs are replayed with it and retime.json records it); the audit times every request to its answer, ABBA,
    on K fresh prompts of the stream's lengths that no decoder can enumerate (a secret seed; never
    the stream's own prompts), with a second look at K more when the first falls short, and
    replays every retimed token through its pristine serial path. The verified figures are the
    retime's own: per-prompt ratios (the control's first leg over the candidate's first), their
    median, a distribution-free 95% interval, and the score (0 unless the interval's bottom is
    above 1). The stream's claimed ratio is shown beside them and fails (claim-not-reproduced) when it lies
    above the interval's top by more than the margin. A stream that fails audit replay's file
    checks is not retimed; a header the decoders contradict fails (header-disagrees).

    While one side is timed the other is stopped with every process it started. Around every leg
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
                         s_max=s_max, kappa=kappa, workers=workers)
    try:
        code = retime(opts)
    except (BadInput, UserError) as exc:
        fail(str(exc))
    except WorkerError as exc:
        fail(f"retime could not start: {exc}")
    except DistError as exc:  # a replay worker (--workers) failed or hung
        fail(str(exc))
    except KeyboardInterrupt:
        fail("interrupted; nothing was written", 130)
    sys.exit(code)


def audit_stream(path: Path, model_spec: str | None, out_path: Path | None, device: str | None,
                 allow_device_mismatch: bool, params: dict, pool=None) -> int:
    """The whole audit; returns the exit code. Writes audit.json once, at the end. ``pool``: an
    ``audit.pool.PoolOptions`` (workers on the one device, and the hang timeout)."""
    from audit.pipeline import pin_replay_environment  # torch loads only when a command runs: --help stays fast

    pin_replay_environment()
    from core import dist

    from audit import checks
    from audit.pipeline import (check_out_path, check_writable, choose_device, file_findings, finish,
                                load_replay_model, log, model_spec_from_header, replay_device_json, replay_info)
    from audit.pool import PoolOptions, replay_walker
    from audit.progress import Progress
    from audit.replay import planned_positions, replay_run
    from audit.report import divergence_findings
    from audit.sharded import audit_sharded
    from audit.stream import load_run, resolve_stream_path

    pool = pool or PoolOptions()
    path = resolve_stream_path(path)
    out_path = check_out_path(out_path or path.parent / "audit.json", path)
    run = load_run(path)
    topo = dist.topology()
    if topo.active:
        if pool.workers > 1:
            raise BadInput("--workers shares one device between processes; under torchrun every rank has a "
                           "device of its own: leave --workers at 1")
        return audit_sharded(topo, run, path, model_spec, out_path, device, allow_device_mismatch, params,
                             pool.timeout_s)
    dev = choose_device(device, run.header["device"])
    replay_dev = replay_device_json(dev)
    findings = checks.check_devices(run.header, [replay_dev], allow_device_mismatch)
    model = load_replay_model(run, model_spec, dev)
    more, model_findings = file_findings(run, model)
    findings += more

    check_writable(out_path)

    replayed, tokens, seconds = None, 0, 0.0
    if not model_findings:  # replaying with another model would only report noise
        log(f"replaying {sum(len(p.legs) for p in run.prompts)} legs of {len(run.prompts)} prompts "
            f"on {replay_dev['name']} ...")
        with replay_walker(model, model_spec or model_spec_from_header(run.header), dev, pool, log) as walker, \
                Progress(planned_positions([run]), "replay", log) as bar:
            replayed, tokens, seconds = replay_run(walker, run, bar.log, bar=bar)
        findings += divergence_findings(run, replayed)
    else:
        log("not replayed: the model is not the one that recorded the stream")
    return finish(run, path, out_path, findings, replayed, replay_info([replay_dev], tokens, seconds, pool.workers),
                  model.identity, params)


def prepare_job(path: Path, models: dict, model_spec, device, allow_device_mismatch) -> tuple:
    """One stream of a multi-stream audit: read, device-checked, its model loaded (or reused) and
    every replay-free finding computed. Returns (path, run, replay device, findings, model key,
    whether to replay it)."""
    from audit import checks  # torch loads only when a command runs: --help stays fast
    from audit.pipeline import (check_prompt_ids, choose_device, file_findings, load_replay_model,
                                model_spec_from_header, replay_device_json)
    from audit.stream import load_run

    run = load_run(path)
    dev = choose_device(device, run.header["device"])
    replay_dev = replay_device_json(dev)
    findings = checks.check_devices(run.header, [replay_dev], allow_device_mismatch)
    key = (model_spec or model_spec_from_header(run.header), dev)
    if key not in models:
        models[key] = load_replay_model(run, model_spec, dev)
    check_prompt_ids(run, models[key].vocab_size, getattr(models[key].text_config, "max_position_embeddings", None))
    more, model_findings = file_findings(run, models[key])
    return path, run, replay_dev, findings + more, key, not model_findings


def audit_streams(paths: list[Path], model_spec: str | None, device: str | None, allow_device_mismatch: bool,
                  params: dict, pool=None) -> int:
    """Several streams in one process, sharing the replay walks (``audit.replay.replay_shared``),
    on ``pool``'s workers (``audit.pool.PoolOptions``). Bad input in any file stops everything
    before a replay or a write."""
    from audit.pipeline import pin_replay_environment  # torch loads only when a command runs

    pin_replay_environment()
    from core import dist

    from audit.pipeline import check_out_path, check_writable, finish, log, replay_info
    from audit.pool import PoolOptions, replay_walker
    from audit.progress import Progress
    from audit.replay import planned_positions, replay_shared
    from audit.report import divergence_findings, printable
    from audit.stream import resolve_stream_path

    if dist.topology().active:
        raise BadInput("under torchrun, audit one stream per launch (the sharded replay splits one run's prompts)")
    pool = pool or PoolOptions()
    paths = [resolve_stream_path(p) for p in paths]
    for path in paths:
        check_out_path(path.parent / "audit.json", path)
    resolved = [p.resolve() for p in paths]
    dup = next((p for i, p in enumerate(resolved) if p in resolved[:i]), None)
    if dup is not None:
        raise BadInput(f"{dup} is named twice")
    models: dict[tuple[str, str], object] = {}
    jobs = []  # (path, run, replay device, findings, model key, replay?)
    for path in paths:
        try:
            jobs.append(prepare_job(path, models, model_spec, device, allow_device_mismatch))
        except (BadInput, UserError) as exc:
            raise type(exc)(str(exc) if str(path) in str(exc) else f"{path}: {exc}") from None

    for path in paths:
        check_writable(path.parent / "audit.json")

    replays: dict[int, tuple] = {}
    for key, model in models.items():
        members = [i for i, job in enumerate(jobs) if job[4] == key and job[5]]
        if not members:
            continue
        log(f"replaying {len(members)} stream(s) with {key[0]} on {jobs[members[0]][2]['name']}, "
            "each distinct prompt once ...")
        member_runs = [jobs[i][1] for i in members]
        with replay_walker(model, key[0], key[1], pool, log) as walker, \
                Progress(planned_positions(member_runs, shared=True), "replay", log) as bar:
            for i, result in zip(members, replay_shared(walker, member_runs, bar.log, bar)):
                replays[i] = result

    codes = []
    for i, (path, run, replay_dev, findings, key, _) in enumerate(jobs):
        replayed, tokens, seconds = replays.get(i, (None, 0, 0.0))
        if replayed is not None:
            findings = findings + divergence_findings(run, replayed)
        click.echo(printable(f"\n== {path}"))
        codes.append(finish(run, path, path.parent / "audit.json", findings, replayed,
                            replay_info([replay_dev], tokens, seconds, pool.workers), models[key].identity,
                            params))
    failed = [str(p) for p, c in zip(paths, codes) if c != EXIT_PASS]
    click.echo(printable(f"\n{len(paths) - len(failed)} of {len(paths)} streams pass" +
                         (f"; failing: {', '.join(failed)}" if failed else "")))
    return EXIT_FAIL if failed else EXIT_PASS


if __name__ == "__main__":
    main()
