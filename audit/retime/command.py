"""``audit retime STREAM``: the whole retime, from the stream to retime.json."""
from __future__ import annotations

import hashlib
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from core.continues import ContinueCounter

from audit import checks
from audit.pipeline import (EXIT_FAIL, EXIT_PASS, check_out_path, check_writable, choose_device, file_findings, load_replay_model,
                            log, model_spec_from_header, pin_replay_environment, replay_device_json)
from audit.processes import GpuWatch, set_subreaper, tree_control
from audit.pool import DEFAULT_TIMEOUT_S, PoolOptions, replay_walker
from audit.replay import planned_walks, replay_run
from audit.report import divergence_findings, write_document
from audit.retime.judge import (CONFIDENCE, MIN_PROMPTS, NOISY_SPAN, claim_findings, falls_short, gpu_findings,
                                 header_findings, process_findings, stop_findings, too_noisy, verified_figures,
                                 withheld_reasons)
from audit.retime.document import Outcome, build_document, gpu_document, render_table
from audit.retime.fresh import Draw, NoFreshPrompts, fresh_prompts
from audit.retime.load import load_findings
from audit.retime.measure import Measured, Measurement, PerfClock, Progress, time_looks
from audit.retime.provenance import control_code, control_code_findings, sandbox_findings
from audit.retime.quiet import CudaProbe, GpuBusy, NoProbe, Quiet
from audit.retime.resources import gpu_device_findings, lingering_findings, memory_figures, squeeze_findings
from audit.retime.workers import WorkerError, recorded_sides, start_workers
from audit.stream import BadInput, Run, load_run, resolve_stream_path

# a retime's secret seed: any integer of this many bits (what --seed takes back)
SEED_BITS = 63


@dataclass(frozen=True)
class RetimeOptions:
    """Every ``audit retime`` option, named once."""

    stream: Path
    out: Path | None = None
    prompts: int = 9
    max_new_tokens: int | None = None
    legs: int = 2
    model: str | None = None
    device: str | None = None
    allow_device_mismatch: bool = False
    trust_plugin: bool = False  # run a plug-in decoder the stream names (its code, in the workers)
    sandbox: bool = True  # the candidate's worker in this machine's sandbox (audit.sandbox), where it has one
    seed: int | None = None  # the fresh prompts' draw (None: a secret one, drawn for this retime)
    # the auditor's own fresh prompts (jsonl of {id, text | token_ids}), hidden from the candidate's sandbox
    fresh: Path | None = None
    s_max: float = 0.95
    kappa: float = 2.0
    mem_allowance: float = 1.2  # candidate/control peak memory allowed before the score is cut
    workers: int = 1  # processes that replay the retimed legs on the one device (audit.pool)
    dist_timeout: float = DEFAULT_TIMEOUT_S  # a replay worker silent this long is hung

    @property
    def pool(self) -> PoolOptions:
        return PoolOptions(workers=self.workers, timeout_s=self.dist_timeout)


@dataclass(frozen=True)
class Context:
    """What every step of one retime shares once the stream is read."""

    opts: RetimeOptions
    run: Run
    path: Path
    out_path: Path
    sha256: str
    seed: int
    device: str
    model_spec: str
    max_new_tokens: int
    warmup_tokens: int
    claimed: dict
    started: float


def retime(opts: RetimeOptions) -> int:
    """The whole retime; returns the exit code. Writes retime.json once, at the end."""
    started = time.perf_counter()
    if opts.prompts < MIN_PROMPTS:
        raise BadInput(f"--prompts {opts.prompts}: a {CONFIDENCE:.0%} interval for the median ratio needs at least "
                       f"{MIN_PROMPTS} fresh prompts")
    pin_replay_environment()
    path = resolve_stream_path(opts.stream)
    out_path = check_out_path(opts.out or path.parent / "retime.json", path, "retime.json")
    check_writable(out_path)  # before the workers start: a retime takes minutes
    run = load_run(path)  # a malformed stream is bad input, as for audit replay
    sides = recorded_sides(run.header, opts.trust_plugin)
    # drawn here and shown only once every leg ran: a decoder could read the stream file, a seed
    # derived from it, and whatever the audit has printed to a file, but not this process's memory
    seed = opts.seed if opts.seed is not None else secrets.randbits(SEED_BITS)
    dev = choose_device(opts.device, run.header["device"])
    findings = checks.check_devices(run.header, [replay_device_json(dev)], opts.allow_device_mismatch)
    model = load_replay_model(run, opts.model, dev)
    mismatch = checks.check_model_identity(run.header["model"], model.identity)
    if mismatch:
        raise BadInput(f"{mismatch[0]['message']}; retime with the stream's own model (--model)")
    n = opts.max_new_tokens or run.max_new_tokens
    context = model.context
    if context is not None and n >= context:  # before any worker sizes itself for it
        raise BadInput(f"-n {n}: beyond the model's context of {context} positions (a prompt needs one more)")
    warmup = run.header.get("warmup_tokens")
    per_prompt, claimed = checks.recompute_ratios(run.prompts)
    ctx = Context(opts, run, path, out_path, hashlib.sha256(path.read_bytes()).hexdigest(), seed, dev,
                  opts.model or model_spec_from_header(run.header), n,
                  min(warmup, n) if checks.is_int(warmup) and warmup >= 0 else min(8, n),
                  {"ratio": claimed, "per_prompt": {k: v["ratio"] for k, v in per_prompt.items()}}, started)
    # the stream is read and checked exactly as audit replay does; one that fails is not retimed
    stream_findings, _ = file_findings(run, model)
    findings += stream_findings
    if any(f["severity"] == "fail" for f in findings):
        log("the stream fails audit replay's file checks: it is not retimed")
        return finish(ctx, Outcome(**base(ctx), source=None, verdict="fail", findings=findings, verified=None,
                                   instrument=run.header["candidate"].get("instrument") is True,
                                   unverified_reason="the stream fails the file checks"))
    try:
        draw = fresh_prompts(run, model, opts.prompts, seed, opts.fresh)
    except NoFreshPrompts as exc:
        return finish(ctx, Outcome(**base(ctx), source=None, verdict="unverified", findings=findings, verified=None,
                                   instrument=run.header["candidate"].get("instrument") is True,
                                   unverified_reason=f"no fresh prompts: {exc}"))
    longest = longest_request(draw, n)
    if context is not None and longest > context:
        raise BadInput(f"-n {n}: the longest fresh prompt + N = {longest} positions, beyond the model's context of "
                       f"{context}; give a smaller -n")
    return measure_and_judge(ctx, model, sides, draw, findings)


def base(ctx: Context) -> dict:
    return {"run": ctx.run, "sha256": ctx.sha256, "seed": ctx.seed, "claimed": ctx.claimed,
            "max_new_tokens": ctx.max_new_tokens, "legs": ctx.opts.legs,
            "seconds": time.perf_counter() - ctx.started}


def finish(ctx: Context, outcome: Outcome) -> int:
    doc = build_document(outcome)
    write_document(ctx.out_path, doc, render_table(doc))
    return EXIT_PASS if doc["verdict"] == "pass" else EXIT_FAIL


def measure(ctx: Context, sides, draw: Draw, findings: list) -> tuple[dict, Measured, GpuWatch | None, object, dict]:
    """Both workers started, every look timed; a worker that fails on a fresh prompt, or a GPU that
    never goes quiet, is a finding. Between requests both workers are stopped."""
    log(f"retiming {ctx.run.header['candidate']['name']} vs {ctx.run.header['control']['name']} on "
        f"{len(draw.first)} fresh prompts x {ctx.opts.legs} legs, N={ctx.max_new_tokens}, {ctx.device}: "
        f"{draw.source['how']}")
    if not tree_control():
        log("no /proc here: a side is stopped as its worker's process group only, not as its whole process tree")
    measured = Measured()
    # checked while the candidate's worker loads, before the control's starts: the code the
    # control will load, compiled into a private pycache that only the control's worker then uses
    control_pycache = tempfile.mkdtemp(prefix="qwen35-control-pycache-")
    was_reaper = set_subreaper(True)
    clock = PerfClock()
    quiet = device_quiet(ctx.device, clock)  # its solo probe timed before any worker holds the GPU
    gpu = GpuWatch().start() if watches_gpu(ctx.device) else None  # before the workers: no orphan of theirs
    audit_continues = ContinueCounter().install()
    hide = hidden_from_candidate(ctx.opts)
    try:
        workers, provenance = start_workers(
            sides, ctx.model_spec, ctx.device, audit_continues, ctx.opts.sandbox,
            positions=longest_request(draw, ctx.max_new_tokens), control_pycache=control_pycache, hide=hide,
            check_control=lambda: control_code(sides, control_pycache))
        findings += control_code_findings(provenance)
        if gpu is not None:
            gpu.assign({role: w.tree for role, w in workers.items()})
        findings += sandbox_findings(workers["candidate"].launch.sandbox, hide)
        # the decoders' own word on what they are, against the header's: a stream about another
        # decoder than the one that runs is not retimed
        disagree = header_findings(ctx.run.header, workers, ctx.opts.allow_device_mismatch)
        findings += disagree
        progress = Progress(0 if disagree_fails(disagree) else 2 * ctx.opts.legs * len(draw.first), clock)
        # the decoder's own word on whether it is an instrument, not the header's
        m = Measurement(workers, ctx.max_new_tokens, ctx.opts.legs, ctx.warmup_tokens, clock,
                        instrument=workers["candidate"].instrument, progress=progress, quiet=quiet)
        graceful = True
        try:
            for w in workers.values():  # each runs only while it is timed
                w.pause()
            if not disagree_fails(disagree):
                time_looks(m, (draw.first, draw.second), measured, falls_short(ctx.claimed["ratio"]))
        except WorkerError as exc:  # the decoder failed on a fresh prompt: a finding, not bad input
            findings.append(checks.finding("retime-error", "fail", exc.prompt_id, str(exc)))
        except GpuBusy as exc:
            findings.append(checks.finding("gpu-busy", "fail", None, f"{exc}: no leg can be timed fairly on it"))
        except BaseException:  # stopped (SIGTERM, Ctrl-C) or broken: no worker is waited for
            graceful = False
            raise
        finally:
            progress.close()
            for w in workers.values():
                w.close(graceful)
    finally:
        shutil.rmtree(control_pycache, ignore_errors=True)
        audit_continues.restore()
        if gpu is not None:
            gpu.stop()
        if was_reaper is False:
            set_subreaper(False)
    return workers, measured, gpu, provenance, quiet.describe()


def device_quiet(device: str, clock) -> Quiet | NoProbe:
    """On a GPU, the probe that tells when it is idle (``audit.retime.quiet``), timed alone now."""
    if not str(device).startswith("cuda"):
        return NoProbe()
    quiet = Quiet(CudaProbe(device), clock)
    log(f"the GPU's idle probe takes {quiet.calibrate() * 1e3:.2f} ms alone")
    return quiet


def hidden_from_candidate(opts: RetimeOptions) -> tuple[str, ...]:
    """What the candidate's sandbox must not let it read: the auditor's own fresh prompts (read
    into the audit's memory before any worker starts), by its resolved path."""
    return (str(opts.fresh.resolve()),) if opts.fresh is not None else ()


def longest_request(draw: Draw, max_new_tokens: int) -> int:
    """The longest prompt + N a worker will be sent (every look, spares and warm-ups included)."""
    prompts = [q for fp in (*draw.first, *draw.second) for q in (fp, fp.spare) if q is not None]
    return max(max(len(q.token_ids), len(q.warmup_ids)) for q in prompts) + max_new_tokens


def measure_and_judge(ctx: Context, model, sides, draw: Draw, findings: list) -> int:
    workers, measured, gpu, provenance, quiet = measure(ctx, sides, draw, findings)
    header = ctx.run.header
    findings += process_findings(workers)
    findings += gpu_findings(gpu)
    findings += gpu_device_findings(gpu)
    findings += stop_findings(measured.timed)
    timed = measured.timed
    findings += lingering_findings(timed)
    findings += squeeze_findings(timed)
    fresh_run = Run(ctx.path, {**header, "max_new_tokens": ctx.max_new_tokens}, timed, None, {})
    log(f"replaying the {sum(len(p.legs) for p in timed)} retimed legs through the pristine serial path ...")
    pool = ctx.opts.pool.for_walks(planned_walks([fresh_run]), log)
    with replay_walker(model, pool, log) as walker:
        replayed, _, _ = replay_run(walker, fresh_run, log)
    findings += divergence_findings(fresh_run, replayed)
    for p in timed:
        findings += checks.check_control_consistency(p)
        findings += checks.check_leg_spread(p)
    findings += load_findings(timed)
    instrument = workers["candidate"].instrument or header["candidate"].get("instrument") is True
    provisional = verified_figures(timed, True, ctx.opts.s_max, ctx.opts.kappa)
    claim = claim_findings(ctx.claimed["ratio"], provisional["ci_low"], provisional["ci_high"])
    noisy = bool(claim) and too_noisy(provisional["ci_low"], provisional["ci_high"])
    findings += [noisy_finding(claim[0], provisional)] if noisy else claim
    failed = any(f["severity"] == "fail" for f in findings)
    disqualified = failed or noisy or instrument or not checks.is_serial_control(header["control"])
    memory = memory_figures(timed, gpu, ctx.opts.mem_allowance)
    verified = verified_figures(timed, disqualified, ctx.opts.s_max, ctx.opts.kappa, memory["f_mem"],
                                withheld_reasons(findings, memory))
    verdict = "fail" if failed else ("pass" if verified["ratio"] is not None and not noisy else "unverified")
    reason = ("no prompt was timed" if verified["ratio"] is None else
              "the machine was too noisy to verify the claim" if noisy else None)
    if not timed:
        log("nothing was timed: no verified figures")
    return finish(ctx, Outcome(**base(ctx), source=draw.source, verdict=verdict, findings=findings,
                               verified=verified, instrument=instrument, fresh=[fp for fp, _ in measured.ran],
                               timed=timed, exact={p.id: not replayed[p.id].divergences for p in timed},
                               remeasured=measured.remeasured, second_look=measured.second_look,
                               gpu_processes=gpu_document(gpu), memory=memory, quiet=quiet,
                               control_code=provenance.summary() if provenance is not None else None,
                               sandbox=(workers["candidate"].launch.sandbox.describe()
                                        if workers["candidate"].launch.sandbox else None),
                               isolation={role: w.isolation() for role, w in workers.items()},
                               unverified_reason=reason))


def noisy_finding(claim: dict, verified: dict) -> dict:
    """What a claim the interval would fail becomes when the interval is too wide to judge by."""
    return checks.finding("too-noisy-to-verify", "warn", None,
                          f"{claim['message']}; but the interval spans {verified['ci_high'] / verified['ci_low']:.2f}x "
                          f"(more than {NOISY_SPAN}x): the machine was too noisy to verify the claim either way; "
                          "retime on a quieter machine", claimed=claim["claimed"], ci_low=verified["ci_low"],
                          ci_high=verified["ci_high"])


def disagree_fails(found: list[dict]) -> bool:
    return any(f["severity"] == "fail" for f in found)


def watches_gpu(device: str) -> bool:
    """A retime on a GPU asks which processes hold a context there (``audit.processes.GpuWatch``)."""
    return str(device).startswith("cuda")
