"""``harness``: time a decoder against the serial control and record everything to stream.jsonl.

torch, transformers, the decoders' modules and the reports load only when a command runs (so
``harness --help`` and ``harness list`` start fast): the imports inside functions here say so.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import os
import platform
import signal
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import click

from core.errors import DistError, Stopped, UserError, fail
from core.schema import LEG_SPREAD_LIMIT, SCHEMA, AtomicJsonlWriter, dumps, leg_spread
from decoders import CONTROL, DEFAULT_DECODER, REGISTRY, get_decoder, parse_decoder_args

# the 1-minute load average, as a share of the CPUs, above which timings are called noisy: torch's
# CPU ops use every core (and the eager control is host-bound on a GPU), so when other work keeps
# half of them busy a leg's time depends on the scheduler
BUSY_LOAD_SHARE = 0.5


@dataclass(frozen=True)
class TimeOptions:
    """Every ``harness time`` option, named once (``time_cmd`` builds it from the command line)."""

    decoder: str = DEFAULT_DECODER  # the candidate: a registered name or package.module:attr
    decoder_args: tuple[str, ...] = ()  # KEY=VALUE constructor arguments of the candidate
    control: str = CONTROL  # the reference timed against it
    model: str = "small"  # a built-in model name or a checkpoint directory
    prompts: str | None = None  # a built-in set or a jsonl file; None: the model's default set
    max_new_tokens: int | None = None  # per decode; None: 64 on CPU, 512 on GPU
    legs: int = 2  # timed legs per side per prompt, ABBA
    limit: int | None = None  # only the first K prompts
    warmup_tokens: int = 8  # new tokens of each side's untimed warm-up decode, per prompt
    device: str | None = None  # None: cuda if available, else cpu
    out_dir: Path | None = None  # None: runs/<decoder>-<timestamp>
    force: bool = False  # replace an existing DIR/stream.jsonl
    seed: int = 0  # set before decoding; also draws the warm-up prompts
    report: bool = False  # render DIR/report.md after the stream is written
    dist_timeout: float = 1800.0  # under torchrun: seconds without progress before a rank counts as hung

    def __post_init__(self):
        if not isinstance(self.decoder_args, tuple):
            raise ValueError("TimeOptions.decoder_args must be a tuple of KEY=VALUE strings")
        if self.legs < 1 or self.warmup_tokens < 0 or (self.max_new_tokens is not None and self.max_new_tokens < 1):
            raise ValueError(f"TimeOptions out of range: legs={self.legs}, warmup_tokens={self.warmup_tokens}, "
                             f"max_new_tokens={self.max_new_tokens}")


def quiet_libraries() -> None:
    """transformers warns once per kernel it cannot find; that is expected here (plain PyTorch)."""
    import transformers  # heavy: loads only when a command runs

    transformers.logging.set_verbosity_error()


def run_cli(fn):
    """Turn user mistakes into one line and a non-zero exit; never a traceback for them. Under
    torchrun every rank meets a user mistake alike, so only rank 0 prints it; a rank's own news
    (a hang it saw, a stop) is printed by that rank, prefixed with it."""
    from core import dist  # imports torch: loads only when a command runs

    try:
        return fn()
    except UserError as exc:
        fail(str(exc), quiet=dist.quiet_rank())
    except DistError as exc:
        fail(dist.rank_prefix() + str(exc), 1)
    except Stopped:
        fail(dist.rank_prefix() + "stopped by SIGTERM; nothing was written", 1)
    except KeyboardInterrupt:
        fail("interrupted; nothing was written", 130)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main():
    """Exact speculative decoding for Qwen3.5: time decoders against the serial greedy control.

    Every run writes each raw timing leg and token stream to DIR/stream.jsonl; `audit replay`
    then checks every token against serial greedy decoding and recomputes the speed ratios.
    """


@main.command("list")
def list_cmd():
    """Show the registered decoders, built-in models and built-in prompt sets."""
    from core.models import BUILTIN_MODELS, DEFAULT_MODEL  # imports torch: loads only when a command runs
    from core.prompts import BUILTIN_PROMPTS  # imports torch: loads only when a command runs

    width = 2 + max(len(n) for n in [*REGISTRY, *BUILTIN_MODELS, *BUILTIN_PROMPTS])
    click.echo("decoders (--decoder NAME, or package.module:attr):")
    for name, (_, desc) in REGISTRY.items():
        tag = " [control]" if name == CONTROL else " [default]" if name == DEFAULT_DECODER else ""
        click.echo(f"  {name:<{width}}{desc}{tag}")
    click.echo("built-in models (--model NAME, or a checkpoint directory):")
    for name, desc in BUILTIN_MODELS.items():
        click.echo(f"  {name:<{width}}{desc}{' [default]' if name == DEFAULT_MODEL else ''}")
    click.echo("built-in prompt sets (--prompts NAME, or a jsonl file):")
    for name, desc in BUILTIN_PROMPTS.items():
        click.echo(f"  {name:<{width}}{desc}")


@main.command("time")
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
@click.option("--max-new-tokens", "-n", type=click.IntRange(min=1), default=TimeOptions.max_new_tokens,
              help="New tokens per decode (stops earlier at EOS). Default: 64 on CPU, 512 on GPU.")
@click.option("--legs", "-l", type=click.IntRange(min=1), default=TimeOptions.legs, show_default=True,
              help="Timed legs per side per prompt, interleaved ABBA.")
@click.option("--limit", type=click.IntRange(min=1), default=TimeOptions.limit, help="Use only the first K prompts.")
@click.option("--warmup-tokens", type=click.IntRange(min=0), default=TimeOptions.warmup_tokens, show_default=True,
              help="New tokens in the untimed warm-up decode of each side, per prompt. The warm-up decodes "
                   "another prompt of the same length (random ids from --seed and the prompt's index).")
@click.option("--device", default=TimeOptions.device, help="torch device. Default: cuda if available, else cpu.")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=TimeOptions.out_dir,
              help="Output directory for stream.jsonl. Default: runs/<decoder>-<timestamp>.")
@click.option("--force", is_flag=True, help="Replace an existing DIR/stream.jsonl.")
@click.option("--seed", type=int, default=TimeOptions.seed, show_default=True,
              help="Seed recorded in the header, set before decoding (greedy decoding itself uses no "
                   "randomness), and drawing the warm-up prompts.")
@click.option("--report", is_flag=True, help="After writing the stream, also render DIR/report.md and "
              "DIR/figures/ (as `reports render DIR` does).")
@click.option("--dist-timeout", type=click.FloatRange(min=0, min_open=True), default=TimeOptions.dist_timeout,
              show_default=True, metavar="SECONDS",
              help="Under torchrun only: a rank that shows no progress (starts no new prompt and does not "
                   "finish) for this long is taken as hung; the run then fails with a message naming the "
                   "rank and its prompt, and writes nothing. Also the process group's timeout.")
def time_cmd(**options):
    """Time DECODER against the serial control on every prompt, side by side in one process.

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
    opts = TimeOptions(**options)
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
    click.echo(f'note: the report shows "NOT AUDITED" until `audit replay {run_dir / "stream.jsonl"}` runs')


def run_time(opts: TimeOptions) -> Path | None:
    """``harness time``: the stream's path (None on a torchrun rank other than 0)."""
    stream_path = choose_stream_path(opts.decoder, opts.out_dir, opts.force)
    load = machine_load()
    from core import determinism  # pins before anything touches CUDA

    settings = determinism.pin()
    quiet_libraries()
    from core import dist  # imports torch: after pin(), which must precede anything touching CUDA

    topo = dist.topology()
    if topo.active:
        return run_time_sharded(topo, settings, stream_path, opts, load)
    # a SIGTERM becomes Stopped, which leaves the `with` block of the stream's writer, which then
    # deletes its temporary file; once the stream is committed the default handling is back
    previous = signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        setup = prepare_run(opts, settings)
        header = build_header(setup, settings, opts, [rank_info(setup, 0, 1)])
        return time_in_one_process(setup, header, stream_path, opts, load)
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Stopped("SIGTERM")


def choose_stream_path(decoder_spec: str, out_dir: Path | None, force: bool) -> Path:
    """DIR/stream.jsonl, refusing to replace an existing stream without --force, and refusing an
    --out that cannot be a directory, before anything heavy runs."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = out_dir or Path("runs") / f"{decoder_spec.replace(':', '_').replace('/', '_')}-{stamp}"
    existing = next((p for p in (out_dir, *out_dir.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise UserError(f"--out {out_dir}: {existing} is a file, not a directory; give a directory for stream.jsonl")
    stream_path = out_dir / "stream.jsonl"
    if stream_path.is_dir():
        raise UserError(f"{stream_path} is a directory; choose another --out")
    if stream_path.exists() and not force:
        raise UserError(f"{stream_path} exists; pass --force to replace it or choose another --out")
    return stream_path


def machine_load() -> tuple[float, int] | None:
    """(1-minute load average, CPU count), read before this run adds to it; None where unknown."""
    try:
        return os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):  # no load average on this platform
        return None


def busy_warning(load: tuple[float, int] | None) -> str | None:
    if load is None or load[0] <= BUSY_LOAD_SHARE * load[1]:
        return None
    return (f"WARNING: this machine is busy (1-minute load average {load[0]:.2f} on {load[1]} CPUs, above "
            f"{BUSY_LOAD_SHARE:.0%} of them) before timing began: expect noisy legs")


@dataclass
class Setup:
    """Everything a process needs before its first timed leg: both decoders prepared on the model,
    the prompts with their warm-up prompts, and the run's clock and integrity watch."""

    control: object
    candidate: object
    decoder_kwargs: dict
    model: object
    dev: object
    max_new_tokens: int
    prompts: list
    prompt_info: dict
    warmups: dict  # prompt id -> warm-up token ids
    resident: dict
    clock: object
    watch: object
    violations: list = field(default_factory=list)  # found after prepare()


def prepare_run(opts: TimeOptions, settings: dict, log=None) -> Setup:
    """Load the model, prepare both decoders, then load the prompts (the same on every rank).
    The clock and the integrity watch start first, before a plug-in decoder's module is imported."""
    import torch  # heavy: loads only when a command runs

    from core.models import load_model  # imports torch: loads only when a command runs
    from core.prompts import load_prompts  # imports torch: loads only when a command runs
    from harness.timing import Clock, Watch, warmup_ids  # imports torch: loads only when a command runs

    log = log or (lambda message: click.echo(message, err=True))
    check_prompt_set(opts.prompts)
    clock = Clock.start()
    watch = Watch(settings, clock)
    control = get_decoder(opts.control)
    watch.watch_control(control)
    kwargs = parse_decoder_args(opts.decoder_args)
    candidate = get_decoder(opts.decoder, **kwargs)
    log(f"loading model {opts.model} ...")
    model = load_model(opts.model, opts.device)
    dev = model.device
    max_new_tokens = opts.max_new_tokens or (512 if dev.type == "cuda" else 64)
    # both decoders are prepared before the prompt set is loaded, so prepare() cannot find the
    # run's prompts in this process
    resident = {role: resident_bytes(dec, model, dev) for role, dec in (("control", control), ("candidate", candidate))}
    violations = watch.check("after prepare")
    prompts, prompt_info = load_prompts(opts.prompts, model, opts.limit)
    warmups = {p.id: warmup_ids(opts.seed, i, len(p.token_ids), model.vocab_size, p.token_ids)
               for i, p in enumerate(prompts)}
    torch.manual_seed(opts.seed)
    return Setup(control, candidate, kwargs, model, dev, max_new_tokens, prompts, prompt_info, warmups, resident,
                 clock, watch, violations)


def check_prompt_set(spec: str | None) -> None:
    """A prompt set that cannot exist is refused before the model loads and the decoders are
    prepared; the set itself is loaded after them."""
    from core.prompts import BUILTIN_PROMPTS, parse_corpus_spec  # imports torch: loads only when a command runs

    if spec is None or spec in BUILTIN_PROMPTS or parse_corpus_spec(spec) is not None or Path(spec).is_file():
        return
    raise UserError(f"prompt file {spec!r} not found, and {spec!r} is not a built-in prompt set "
                    f"({', '.join(BUILTIN_PROMPTS)}; corpus sets also as NAME:N, e.g. stdlib-train:2048)")


def device_json(dev) -> dict:
    import torch  # heavy: loads only when a command runs

    from core.models import device_name  # imports torch: loads only when a command runs

    out = {"type": dev.type, "name": device_name(dev)}
    if dev.type == "cuda":
        # which physical GPU (so runs made in separate calls can show whether they shared a host);
        # the audit matches devices on type and name only
        uuid = getattr(torch.cuda.get_device_properties(dev), "uuid", None)
        if uuid is not None:
            out["uuid"] = str(uuid)
    return out


def rank_info(setup: Setup, rank: int, world_size: int) -> dict:
    """A rank's entry in the header's ``ranks``. With several ranks each one prepared its own
    decoders (calibration and resident memory can differ by GPU), so those are recorded per rank."""
    info = {"rank": rank, "device": device_json(setup.dev)}
    if world_size > 1:
        info["resident_bytes"] = setup.resident
        info["candidate_config"] = setup.candidate.config()
    return info


def build_header(setup: Setup, settings: dict, opts: TimeOptions, ranks: list[dict]) -> dict:
    import torch  # heavy: loads only when a command runs
    import transformers  # heavy: loads only when a command runs

    from harness.timing import is_instrument  # imports torch: loads only when a command runs

    control, candidate = setup.control, setup.candidate
    header = {
        "type": "header",
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": ["harness", *sys.argv[1:]],
        "model": setup.model.identity,
        "dtype": "bfloat16",
        "device": device_json(setup.dev),
        # one process: one rank; under torchrun, every rank and the device it timed its prompts on
        "world_size": len(ranks),
        "ranks": ranks,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cuda": torch.version.cuda,
        },
        "determinism": settings,
        # the harness re-read the settings and the timing's objects after prepare() and every leg;
        # each change is a violation record in this stream
        "integrity_checked": True,
        "control": {"name": control.name, "config": control.config()},
        "candidate": {"name": candidate.name, "spec": opts.decoder, "args": setup.decoder_kwargs,
                      "config": candidate.config(), "instrument": is_instrument(candidate)},
        "prompts": setup.prompt_info,
        "max_new_tokens": setup.max_new_tokens,
        "legs": opts.legs,
        "warmup_tokens": opts.warmup_tokens,
        "seed": opts.seed,
        # Both decoders live in this process, so a leg's allocator peak also holds the other
        # decoder's persistent buffers (static caches, graph pools): recorded here so that a leg's
        # own peak is its raw peak minus the other decoder's resident bytes (null on CPU).
        "memory": {"resident_bytes": setup.resident},
    }
    extra_header = getattr(candidate, "header_extra", None)
    if callable(extra_header):
        header["candidate"].update(extra_header())
    return header


def prompt_record(setup: Setup, prompt) -> dict:
    return {"type": "prompt", "id": prompt.id, "token_ids": prompt.token_ids, "text": prompt.text,
            "warmup_ids": setup.warmups[prompt.id]}


def legs_only(records: list[dict]) -> list[dict]:
    return [r for r in records if r["type"] == "leg"]


def time_one(setup: Setup, prompt, opts: TimeOptions, on_leg=None) -> tuple[list[dict], dict]:
    """One prompt, side by side: its leg records (each followed by any violation its check found)
    and the harness's summary of the legs."""
    from harness.timing import summarize_prompt, time_prompt  # imports torch: loads only when a command runs

    records = time_prompt(prompt, setup.warmups[prompt.id], {"control": setup.control, "candidate": setup.candidate},
                          setup.max_new_tokens, opts.legs, opts.warmup_tokens, setup.dev, setup.clock, setup.watch,
                          on_leg)
    legs = legs_only(records)
    summary = summarize_prompt(prompt.id, legs)
    summary["same_tokens_as_control"] = all(r["tokens"] == legs[0]["tokens"] for r in legs)
    return records, summary


def warn_violations(records: list[dict], prefix: str = "") -> None:
    for rec in records:
        if rec["type"] == "violation":
            click.echo(f"{prefix}WARNING: in-process integrity, {rec['at']}: {rec['problem']} "
                       "(written to the stream; the audit fails it)", err=True)


def time_in_one_process(setup: Setup, header: dict, stream_path: Path, opts: TimeOptions, load) -> Path:
    """The single-process run: each prompt's records go to the temporary stream as they come."""
    prompts, candidate, control = setup.prompts, setup.candidate, setup.control
    summaries = []
    click.echo(f"timing {candidate.name} vs {control.name} on {len(prompts)} prompts x {opts.legs} legs, "
               f"N={setup.max_new_tokens}, {setup.dev.type}", err=True)
    busy = busy_warning(load)
    if busy:
        click.echo(busy, err=True)
    warn_violations(setup.violations)
    with AtomicJsonlWriter(stream_path) as writer, Progress(len(prompts), opts.legs) as progress:
        writer.write(header)
        for rec in setup.violations:
            writer.write(rec)
        for prompt in prompts:
            writer.write(prompt_record(setup, prompt))
            records, summary = time_one(setup, prompt, opts, lambda rec, pid=prompt.id: progress.leg(pid, rec))
            warn_violations(records)
            for rec in records:
                writer.write(rec)
            writer.write(summary)
            summaries.append((prompt, legs_only(records), summary))
            progress.prompt_done(prompt.id, summary["ratio"])
        median_ratio = statistics.median(s["ratio"] for _, _, s in summaries)
        writer.write_end(median_ratio=median_ratio)
        writer.commit()
    click.echo(render_table(summaries, median_ratio, candidate.name))
    click.echo(f"wrote {stream_path}  (check it: audit replay {stream_path})")
    return stream_path


class Progress:
    """Per leg, a bar on a terminal; elsewhere (a pipe, a log file) one complete line per prompt."""

    def __init__(self, prompts: int, legs: int):
        self.prompts, self.legs, self.done = prompts, legs, 0
        self.bar = None
        if sys.stderr.isatty():
            self.bar = click.progressbar(length=prompts * 2 * legs, label="legs", file=sys.stderr, show_pos=True,
                                         item_show_func=lambda s: s)

    def __enter__(self):
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)
        return False

    def leg(self, prompt_id: str, rec: dict) -> None:
        if self.bar is not None:
            self.bar.update(1, f"{prompt_id} {rec['role']} {rec['leg'] + 1}/{self.legs}")

    def prompt_done(self, prompt_id: str, ratio: float) -> None:
        self.done += 1
        if self.bar is None:
            click.echo(f"{prompt_id}: {self.done}/{self.prompts} prompts, ratio {ratio:.3f}", err=True)


# --------------------------------------------------------------------------- under torchrun


def run_time_sharded(topo, settings: dict, stream_path: Path, opts: TimeOptions, load) -> Path | None:
    """One rank of a torchrun job: time every world_size-th prompt on this rank's own device
    (both legs of each prompt in this process), then rank 0 writes the merged stream."""
    from core import dist  # imports torch: loads only when a command runs

    opts_here = replace(opts, device=dist.rank_device(opts.device, topo))
    session = dist.start(topo, opts.dist_timeout)
    try:
        return time_sharded(session, settings, stream_path, opts_here, load)
    except dist.Stopped:
        raise dist.DistError(dist.stop_report(session, "results") + "; nothing was written") from None
    except dist.DistError as exc:
        raise dist.DistError(f"{exc}; nothing was written") from None
    finally:
        close_quietly(session)


def close_quietly(session) -> None:
    try:
        session.close()
    except Exception:  # noqa: BLE001 - leaving anyway; the launcher reaps what is left
        pass


def rank_log(topo):
    return lambda message: click.echo(f"[rank {topo.rank}] {message}", err=True)


def check_setup(payloads: list[dict]) -> None:
    """Every rank raises the same error here, so all stop together (only rank 0 prints it)."""
    from core import dist  # imports torch: loads only when a command runs

    dist.raise_setup_errors(payloads)
    devices = [p["info"]["device"] for p in payloads]
    if any(d != devices[0] for d in devices):
        listing = ", ".join(f"rank {r}: {d['name']}" for r, d in enumerate(devices))
        raise UserError(f"the ranks run on different kinds of device ({listing}); one run's ratios must all "
                        "come from one kind")
    if any(p["prompts_sha256"] != payloads[0]["prompts_sha256"] for p in payloads):
        raise UserError("the ranks loaded different prompts (token ids differ); every rank must see the same set")


def prompts_digest(prompts) -> str:
    return hashlib.sha256(dumps([[p.id, p.token_ids] for p in prompts]).encode()).hexdigest()


def on_rank(records: list[dict], rank: int) -> list[dict]:
    """A rank's records for the merged stream: legs carry the rank; a violation says it in ``at``."""
    return [{**r, "rank": rank} if r["type"] == "leg" else {**r, "at": f"{r['at']} on rank {rank}"}
            if r["type"] == "violation" else r for r in records]


def time_sharded(session, settings: dict, stream_path: Path, opts: TimeOptions, load) -> Path | None:
    from core import dist  # imports torch: loads only when a command runs

    topo, log = session.topo, rank_log(session.topo)
    session.at("loading the model and preparing both decoders")
    setup, error = dist.guarded(topo, lambda: prepare_run(opts, settings, log))
    mine = {"error": error, "info": rank_info(setup, topo.rank, topo.world_size) if setup else None,
            "prompts_sha256": prompts_digest(setup.prompts) if setup else None}
    ready = session.all_gather("setup", mine)
    check_setup(ready)

    share = dist.shard(setup.prompts, topo)
    log(f"timing {setup.candidate.name} vs {setup.control.name} on {len(share)} of {len(setup.prompts)} prompts "
        f"x {opts.legs} legs, N={setup.max_new_tokens}, {setup.dev}")
    busy = busy_warning(load) if topo.main else None  # one machine: rank 0 says it once
    if busy:
        click.echo(busy, err=True)
    warn_violations(setup.violations, f"[rank {topo.rank}] ")
    entries, error = time_share(session, setup, share, opts, log)
    payloads = session.gather("results", {"error": error, "entries": entries,
                                          "violations": on_rank(setup.violations, topo.rank)})
    dist.ignore_stop()  # every rank has reported: a late SIGTERM must not become a traceback
    if not topo.main:
        return None
    failure = dist.first_failure(payloads)
    if failure:
        raise dist.DistError(dist.failure_message(failure))
    header = build_header(setup, settings, opts, [p["info"] for p in ready])
    violations = [v for p in payloads for v in p["violations"]]
    return write_merged(stream_path, header, violations, dist.unshard([p["entries"] for p in payloads]), setup)


def time_share(session, setup: Setup, share: list, opts: TimeOptions, log):
    """This rank's prompts, in order. Returns (entries, error): on the first failure the error
    names the prompt, and this rank stops; it also stops once another rank has failed."""
    from core import dist  # imports torch: loads only when a command runs

    entries, rank = [], session.topo.rank
    for n, prompt in enumerate(share, start=1):
        early = dist.stopped_early(session)
        if early:
            return entries, early
        session.at(f"prompt {prompt.id!r} ({n}/{len(share)})")
        try:
            records, summary = time_one(setup, prompt, opts)
        except Exception as exc:  # noqa: BLE001 - the whole run fails, by rank 0, naming this prompt
            dist.report_local_failure(session.topo, exc)
            return entries, session.record_failure(prompt.id, dist.error_text(exc))
        warn_violations(records, f"[rank {rank}] ")
        entries.append({"prompt": {**prompt_record(setup, prompt), "rank": rank},
                        "records": on_rank(records, rank), "summary": summary})
        log(f"{prompt.id}: {n}/{len(share)} prompts, ratio {summary['ratio']:.3f}")
    return entries, None


def write_merged(stream_path: Path, header: dict, violations: list[dict], entries: list[dict], setup: Setup) -> Path:
    """Rank 0: every rank's records, prompts in their original order, in one atomic write."""
    by_id = {p.id: p for p in setup.prompts}
    summaries = [(by_id[e["prompt"]["id"]], legs_only(e["records"]), e["summary"]) for e in entries]
    median_ratio = statistics.median(e["summary"]["ratio"] for e in entries)
    with AtomicJsonlWriter(stream_path) as writer:
        writer.write(header)
        for rec in violations:
            writer.write(rec)
        for e in entries:
            writer.write(e["prompt"])
            for rec in e["records"]:
                writer.write(rec)
            writer.write(e["summary"])
        writer.write_end(median_ratio=median_ratio)
        writer.commit()
    click.echo(render_table(summaries, median_ratio, setup.candidate.name))
    click.echo(f"wrote {stream_path} from {header['world_size']} ranks  (check it: audit replay {stream_path})")
    return stream_path


def resident_bytes(decoder, model, dev):
    """Prepare ``decoder`` and return the device memory it keeps allocated (None off CUDA)."""
    import torch  # heavy: loads only when a command runs

    if dev.type != "cuda":
        decoder.prepare(model)
        return None
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    decoder.prepare(model)
    torch.cuda.synchronize(dev)
    return max(0, torch.cuda.memory_allocated(dev) - before)


def unstable_prompts(summaries) -> int:
    """Prompts on which either side's legs spread beyond LEG_SPREAD_LIMIT (core.schema.leg_spread)."""
    count = 0
    for _, legs, _ in summaries:
        spreads = [leg_spread([r["wall_s"] for r in legs if r["role"] == role]) for role in ("control", "candidate")]
        count += any(s is not None and s > LEG_SPREAD_LIMIT for s in spreads)
    return count


def render_table(summaries, median_ratio: float, candidate_name: str) -> str:
    """Per prompt: tokens/s of the control's median leg and of the candidate's first leg (the two
    times the ratio divides), the ratio, mean accepted length and token agreement; then the
    median and, when legs disagree beyond the limit, a warning."""
    rows = [("prompt", "P", "new", "control tok/s", f"{candidate_name} tok/s", "ratio", "acc.len", "same")]
    for prompt, legs, s in summaries:
        cand = next(r for r in legs if r["role"] == "candidate" and r["leg"] == 0)
        mal = cand["stats"].get("mean_accepted_length")
        rows.append((prompt.id, str(len(prompt.token_ids)), str(len(cand["tokens"])),
                     f"{s['control_tokens_per_s']:.1f}", f"{len(cand['tokens']) / cand['wall_s']:.1f}",
                     f"{s['ratio']:.3f}", "-" if mal is None else f"{mal:.2f}",
                     "yes" if s["same_tokens_as_control"] else "NO"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append(f"median ratio (control median time / candidate's first leg): {median_ratio:.3f}  "
                 "[exactness: run `audit replay`; 'same' only compares with this run's control legs]")
    unstable = unstable_prompts(summaries)
    if unstable:
        lines.append(f"WARNING: {unstable} of {len(summaries)} prompts have unstable legs (spread > "
                     f"{LEG_SPREAD_LIMIT:.0%}); rerun with more --legs")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
