"""``audit replay``: the whole audit of one stream, of several streams that share their replay
walks, or of one stream sharded across torchrun's ranks (``audit.sharded``). Each audit writes
its audit.json once, at the end; bad input in any file stops everything before a replay or a write.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click

from core import dist
from core.errors import UserError

from audit import checks
from audit.pipeline import (EXIT_FAIL, EXIT_PASS, check_out_path, check_prompt_ids, check_writable, choose_device,
                            file_findings, finish, load_replay_model, log, model_spec_from_header,
                            pin_replay_environment, replay_device_json, replay_info)
from audit.pool import DEFAULT_TIMEOUT_S, PoolOptions, replay_walker
from audit.progress import Progress
from audit.replay import planned_positions, planned_walks, replay_run, replay_shared
from audit.report import divergence_findings, printable
from audit.sharded import audit_sharded
from audit.stream import BadInput, Run, load_run, resolve_stream_path


@dataclass(frozen=True)
class ReplayOptions:
    """Every ``audit replay`` option, named once."""

    streams: tuple[Path, ...]
    model: str | None = None  # None: the model each header names
    out: Path | None = None  # one stream only; None: audit.json beside each stream
    device: str | None = None  # None: the recording device's type where present, else cpu
    allow_device_mismatch: bool = False
    s_max: float = 0.95
    kappa: float = 2.0
    mem_allowance: float = 1.2
    workers: int = 1  # replay processes on the one device (audit.pool)
    dist_timeout: float = DEFAULT_TIMEOUT_S  # a rank or worker silent this long is hung

    @property
    def score_params(self) -> dict:
        """The score's parameters, as audit.json records them."""
        return {"s_max": self.s_max, "kappa": self.kappa, "mem_allowance": self.mem_allowance}

    @property
    def pool(self) -> PoolOptions:
        return PoolOptions(workers=self.workers, timeout_s=self.dist_timeout)


@dataclass(frozen=True)
class Job:
    """One stream of a multi-stream audit, read and checked, before any replay."""

    path: Path
    run: Run
    replay_device: dict
    findings: list[dict]  # every finding that needs no replay
    model_key: tuple[str, str]  # (model spec, device): streams with one key share one model and its walks
    replays: bool  # False when the model is not the one that recorded the stream


def run_replay(opts: ReplayOptions) -> int:
    """The whole ``audit replay``; returns the exit code."""
    if len(opts.streams) > 1:
        if opts.out:
            raise BadInput("--out names one file: with several streams each audit.json is written beside its stream")
        return audit_streams(opts)
    return audit_stream(opts)


def audit_stream(opts: ReplayOptions) -> int:
    """One stream, in this process (on ``opts.pool``'s workers) or, under torchrun, sharded."""
    pin_replay_environment()  # before anything touches CUDA, as the harness does
    path = resolve_stream_path(opts.streams[0])
    out_path = check_out_path(opts.out or path.parent / "audit.json", path)
    run = load_run(path)
    topo = dist.topology()
    if topo.active:
        if opts.workers > 1:
            raise BadInput("--workers shares one device between processes; under torchrun every rank has a "
                           "device of its own: leave --workers at 1")
        return audit_sharded(topo, run, path, out_path, opts)
    dev = choose_device(opts.device, run.header["device"])
    replay_dev = replay_device_json(dev)
    findings = checks.check_devices(run.header, [replay_dev], opts.allow_device_mismatch)
    model = load_replay_model(run, opts.model, dev)
    more, model_findings = file_findings(run, model)
    findings += more

    check_writable(out_path)

    replayed, tokens, seconds = None, 0, 0.0
    pool = opts.pool.for_walks(planned_walks([run]), log)
    if not model_findings:  # replaying with another model would only report noise
        log(f"replaying {sum(len(p.legs) for p in run.prompts)} legs of {len(run.prompts)} prompts "
            f"on {replay_dev['name']} ...")
        with replay_walker(model, pool, log) as walker, \
                Progress(planned_positions([run]), "replay", log) as bar:
            replayed, tokens, seconds = replay_run(walker, run, bar.log, bar=bar)
        findings += divergence_findings(run, replayed)
    else:
        log("not replayed: the model is not the one that recorded the stream")
    return finish(run, path, out_path, findings, replayed,
                  replay_info([replay_dev], tokens, seconds, pool.workers if replayed is not None else 0),
                  model.identity, opts.score_params)


def prepare_job(path: Path, models: dict, opts: ReplayOptions) -> Job:
    """One stream of a multi-stream audit: read, device-checked, its model loaded (or reused from
    ``models``, keyed by (model spec, device)) and every replay-free finding computed."""
    run = load_run(path)
    dev = choose_device(opts.device, run.header["device"])
    replay_dev = replay_device_json(dev)
    findings = checks.check_devices(run.header, [replay_dev], opts.allow_device_mismatch)
    key = (opts.model or model_spec_from_header(run.header), dev)
    if key not in models:
        models[key] = load_replay_model(run, opts.model, dev)
    check_prompt_ids(run, models[key].vocab_size, getattr(models[key].text_config, "max_position_embeddings", None))
    more, model_findings = file_findings(run, models[key])
    return Job(path, run, replay_dev, findings + more, key, not model_findings)


def audit_streams(opts: ReplayOptions) -> int:
    """Several streams in one process, sharing the replay walks (``audit.replay.replay_shared``),
    on ``opts.pool``'s workers."""
    pin_replay_environment()  # before anything touches CUDA, as the harness does
    if dist.topology().active:
        raise BadInput("under torchrun, audit one stream per launch (the sharded replay splits one run's prompts)")
    paths = [resolve_stream_path(p) for p in opts.streams]
    for path in paths:
        check_out_path(path.parent / "audit.json", path)
    resolved = [p.resolve() for p in paths]
    dup = next((p for i, p in enumerate(resolved) if p in resolved[:i]), None)
    if dup is not None:
        raise BadInput(f"{dup} is named twice")
    models: dict[tuple[str, str], object] = {}
    jobs = []
    for path in paths:
        try:
            jobs.append(prepare_job(path, models, opts))
        except UserError as exc:  # type(exc): a BadInput stays one
            raise type(exc)(str(exc) if str(path) in str(exc) else f"{path}: {exc}") from None

    for path in paths:
        check_writable(path.parent / "audit.json")

    replays: dict[int, tuple] = {}
    workers: dict[int, int] = {}  # per job: the workers its replay ran on (none where it was not replayed)
    for key, model in models.items():
        members = [i for i, job in enumerate(jobs) if job.model_key == key and job.replays]
        if not members:
            continue
        log(f"replaying {len(members)} stream(s) with {key[0]} on {jobs[members[0]].replay_device['name']}, "
            "each distinct prompt once ...")
        member_runs = [jobs[i].run for i in members]
        pool = opts.pool.for_walks(planned_walks(member_runs, shared=True), log)
        workers.update((i, pool.workers) for i in members)
        with replay_walker(model, pool, log) as walker, \
                Progress(planned_positions(member_runs, shared=True), "replay", log) as bar:
            for i, result in zip(members, replay_shared(walker, member_runs, bar.log, bar)):
                replays[i] = result

    codes = []
    for i, job in enumerate(jobs):
        replayed, tokens, seconds = replays.get(i, (None, 0, 0.0))
        findings = job.findings
        if replayed is not None:
            findings = findings + divergence_findings(job.run, replayed)
        click.echo(printable(f"\n== {job.path}"))
        codes.append(finish(job.run, job.path, job.path.parent / "audit.json", findings, replayed,
                            replay_info([job.replay_device], tokens, seconds, workers.get(i, 0)),
                            models[job.model_key].identity, opts.score_params))
    failed = [str(p) for p, c in zip(paths, codes) if c != EXIT_PASS]
    click.echo(printable(f"\n{len(paths) - len(failed)} of {len(paths)} streams pass" +
                         (f"; failing: {', '.join(failed)}" if failed else "")))
    return EXIT_FAIL if failed else EXIT_PASS
