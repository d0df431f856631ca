"""``harness``: time a decoder against the serial control and record everything to stream.jsonl."""
from __future__ import annotations

import datetime as _dt
import platform
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from core.errors import DistError, Stopped, UserError


def quiet_libraries() -> None:
    """transformers warns once per kernel it cannot find; that is expected here (plain PyTorch)."""
    import transformers

    transformers.logging.set_verbosity_error()


def fail(message: str, code: int = 2, quiet: bool = False):
    # one line even when the message embeds a library's multi-line exception text
    message = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    if not quiet:
        click.echo(f"error: {message}", err=True)
    sys.exit(code)


def run_cli(fn):
    """Turn user mistakes into one line and a non-zero exit; never a traceback for them. Under
    torchrun every rank meets a user mistake alike, so only rank 0 prints it; a rank's own news
    (a hang it saw, a stop) is printed by that rank, prefixed with it."""
    try:
        return fn()
    except UserError as exc:
        fail(str(exc), quiet=quiet_rank())
    except DistError as exc:
        fail(rank_prefix() + str(exc), 1)
    except Stopped:
        fail(rank_prefix() + "stopped by the launcher (SIGTERM); nothing was written", 1)
    except KeyboardInterrupt:
        fail("interrupted; nothing was written", 130)


def quiet_rank() -> bool:
    from core.dist import quiet_rank

    return quiet_rank()


def rank_prefix() -> str:
    from core.dist import rank_prefix

    return rank_prefix()


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main():
    """Exact speculative decoding for Qwen3.5: time decoders against the serial greedy control.

    Every run writes each raw timing leg and token stream to DIR/stream.jsonl; `audit replay`
    then checks every token against serial greedy decoding and recomputes the speed ratios.
    """


@main.command("list")
def list_cmd():
    """Show the registered decoders, built-in models and built-in prompt sets."""
    from decoders import CONTROL, DEFAULT_DECODER, REGISTRY
    from core.models import BUILTIN_MODELS, DEFAULT_MODEL
    from core.prompts import BUILTIN_PROMPTS

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
@click.option("--decoder", "decoder_spec", default=None, metavar="NAME",
              help="Candidate decoder: a registered name (see `harness list`) or package.module:attr. "
                   "Default: spec.")
@click.option("--decoder-arg", "decoder_args", multiple=True, metavar="KEY=VALUE",
              help="Constructor argument for the candidate decoder (repeatable), e.g. max_depth=4.")
@click.option("--control", "control_spec", default=None, metavar="NAME",
              help="Reference decoder timed against the candidate. Default: serial, the control that "
                   "defines exactness. Another reference (e.g. fast-serial) measures the candidate against "
                   "it side by side; the audit still replays every token against serial greedy decoding, "
                   "but does not score such a run.")
@click.option("--model", "model_spec", default="small", show_default=True, metavar="MODEL",
              help="Built-in model name (small: trained, the default; tiny: random, for tests; synthetic-9b: random, 9B-shaped, GPU) or a Qwen3.5 checkpoint directory.")
@click.option("--prompts", "prompts_spec", default=None, metavar="PROMPTS",
              help="Built-in prompt set (dev, stdlib-heldout, stdlib-dev, stdlib-train, random-512, "
                   "random-512-offline; `harness list` describes them; the stdlib-* sets take a count as "
                   "NAME:N, e.g. stdlib-train:2048) or a jsonl file of {id, text|token_ids}. "
                   "Default: stdlib-heldout for small, dev for other models with a tokenizer, random-512 otherwise.")
@click.option("--max-new-tokens", "-n", type=click.IntRange(min=1), default=None,
              help="New tokens per decode (stops earlier at EOS). Default: 64 on CPU, 512 on GPU.")
@click.option("--legs", "-l", type=click.IntRange(min=1), default=2, show_default=True,
              help="Timed legs per side per prompt, interleaved ABBA.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Use only the first K prompts.")
@click.option("--warmup-tokens", type=click.IntRange(min=0), default=8, show_default=True,
              help="New tokens in the untimed warm-up decode of each side, per prompt.")
@click.option("--device", default=None, help="torch device. Default: cuda if available, else cpu.")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Output directory for stream.jsonl. Default: runs/<decoder>-<timestamp>.")
@click.option("--force", is_flag=True, help="Replace an existing DIR/stream.jsonl.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed recorded in the header and set "
              "before decoding (greedy decoding itself uses no randomness).")
@click.option("--report", is_flag=True, help="After writing the stream, also render DIR/report.md and "
              "DIR/figures/ (as `reports render DIR` does).")
@click.option("--dist-timeout", type=click.FloatRange(min=0, min_open=True), default=1800, show_default=True,
              metavar="SECONDS",
              help="Under torchrun only: a rank that shows no progress (starts no new prompt and does not "
                   "finish) for this long is taken as hung; the run then fails with a message naming the "
                   "rank and its prompt, and writes nothing. Also the process group's timeout.")
def time_cmd(decoder_spec, decoder_args, control_spec, model_spec, prompts_spec, max_new_tokens, legs, limit, warmup_tokens, device,
             out_dir, force, seed, report, dist_timeout):
    """Time DECODER against the serial control on every prompt, side by side in one process.

    Per prompt: an untimed warm-up of both, then LEGS timed decodes of each in ABBA order, each
    timed around the whole decode with device synchronisation, peak memory recorded on CUDA.
    Writes DIR/stream.jsonl atomically and prints tokens/s, ratio and acceptance per prompt.

    Several GPUs: `torchrun --nproc-per-node G -m harness time ...` gives prompt i to rank i % G;
    each rank times both sides of its prompts on its own GPU (cuda:LOCAL_RANK), and rank 0 writes
    one stream.jsonl whose header records world_size and each rank's device. If any rank fails
    or hangs, the run fails naming the rank and prompt, and no stream.jsonl is written.
    """
    stream_path = run_cli(lambda: run_time(decoder_spec, model_spec, prompts_spec, max_new_tokens, legs, limit,
                                           warmup_tokens, device, out_dir, force, seed, decoder_args, dist_timeout,
                                           control_spec))
    if report and stream_path is not None:  # under torchrun, only rank 0 wrote a stream
        render_report(stream_path.parent)


def render_report(run_dir: Path) -> None:
    """``--report``: runs only after the stream is committed, so a failed render cannot cost the stream."""
    from reports.render import render_run

    try:
        summary = render_run(run_dir)
    except Exception as exc:  # noqa: BLE001 - whatever went wrong, the stream is already on disk
        fail(f"the stream is intact, but the report could not be rendered ({type(exc).__name__}: {exc}); "
             f"retry with `reports render {run_dir}`", 1)
    click.echo(f"report: {summary['report']}")


def run_time(decoder_spec, model_spec, prompts_spec, max_new_tokens, legs, limit, warmup_tokens, device,
             out_dir, force, seed, decoder_args=(), dist_timeout=None, control_spec=None):
    from core import determinism  # pins before anything touches CUDA

    settings = determinism.pin()
    quiet_libraries()
    from core import dist

    stream_path = choose_stream_path(decoder_spec, out_dir, force)
    topo = dist.topology()
    if topo.active:
        return run_time_sharded(topo, settings, stream_path, decoder_spec, model_spec, prompts_spec,
                                max_new_tokens, legs, limit, warmup_tokens, device, seed, decoder_args,
                                dist_timeout or dist.DEFAULT_TIMEOUT_S, control_spec)
    setup = prepare_run(decoder_spec, decoder_args, model_spec, device, max_new_tokens, prompts_spec, limit, seed,
                        control_spec=control_spec)
    header = build_header(setup, settings, legs, warmup_tokens, seed, [rank_info(setup, 0, 1)])
    return time_in_one_process(setup, header, stream_path, legs, warmup_tokens)


def choose_stream_path(decoder_spec, out_dir, force) -> Path:
    """DIR/stream.jsonl, refusing to replace an existing stream without --force."""
    from decoders import DEFAULT_DECODER

    decoder_spec = decoder_spec or DEFAULT_DECODER
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = out_dir or Path("runs") / f"{decoder_spec.replace(':', '_').replace('/', '_')}-{stamp}"
    stream_path = out_dir / "stream.jsonl"
    if stream_path.exists() and not force:
        raise UserError(f"{stream_path} exists; pass --force to replace it or choose another --out")
    return stream_path


@dataclass
class Setup:
    """Everything a process needs before its first timed leg: both decoders prepared on the model."""

    control: object
    candidate: object
    decoder_spec: str
    decoder_kwargs: dict
    model: object
    dev: object
    max_new_tokens: int
    prompts: list
    prompt_info: dict
    resident: dict


def prepare_run(decoder_spec, decoder_args, model_spec, device, max_new_tokens, prompts_spec, limit, seed,
                log=None, control_spec=None) -> Setup:
    """Load the model and the prompts and prepare both decoders (the same on every rank)."""
    import torch

    from decoders import CONTROL, DEFAULT_DECODER, get_decoder, parse_decoder_args
    from core.models import load_model
    from core.prompts import load_prompts

    log = log or (lambda message: click.echo(message, err=True))
    decoder_spec = decoder_spec or DEFAULT_DECODER
    control = get_decoder(control_spec or CONTROL)
    kwargs = parse_decoder_args(decoder_args)
    candidate = get_decoder(decoder_spec, **kwargs)
    log(f"loading model {model_spec} ...")
    model = load_model(model_spec, device)
    dev = model.device
    if max_new_tokens is None:
        max_new_tokens = 512 if dev.type == "cuda" else 64
    prompts, prompt_info = load_prompts(prompts_spec, model, limit)
    resident = {role: resident_bytes(dec, model, dev) for role, dec in (("control", control), ("candidate", candidate))}
    torch.manual_seed(seed)
    return Setup(control, candidate, decoder_spec, kwargs, model, dev, max_new_tokens, prompts, prompt_info, resident)


def device_json(dev) -> dict:
    import torch

    from core.models import device_name

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


def build_header(setup: Setup, settings: dict, legs: int, warmup_tokens: int, seed: int, ranks: list[dict]) -> dict:
    import torch

    from core.schema import SCHEMA

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
            "transformers": __import__("transformers").__version__,
            "cuda": torch.version.cuda,
        },
        "determinism": settings,
        "control": {"name": control.name, "config": control.config()},
        "candidate": {"name": candidate.name, "spec": setup.decoder_spec, "args": setup.decoder_kwargs,
                      "config": candidate.config(), "instrument": bool(getattr(candidate, "instrument", False))},
        "prompts": setup.prompt_info,
        "max_new_tokens": setup.max_new_tokens,
        "legs": legs,
        "warmup_tokens": warmup_tokens,
        "seed": seed,
        # Both decoders live in this process, so a leg's allocator peak also holds the other
        # decoder's persistent buffers (static caches, graph pools): recorded here so that a leg's
        # own peak is its raw peak minus the other decoder's resident bytes (null on CPU).
        "memory": {"resident_bytes": setup.resident},
    }
    extra_header = getattr(candidate, "header_extra", None)
    if callable(extra_header):
        header["candidate"].update(extra_header())
    return header


def prompt_record(prompt) -> dict:
    return {"type": "prompt", "id": prompt.id, "token_ids": prompt.token_ids, "text": prompt.text}


def time_one(setup: Setup, prompt, legs: int, warmup_tokens: int, clock, on_leg=None) -> tuple[list[dict], dict]:
    """One prompt, side by side: its leg records and the harness's summary of them."""
    from harness.timing import summarize_prompt, time_prompt

    records = time_prompt(prompt, {"control": setup.control, "candidate": setup.candidate},
                          setup.max_new_tokens, legs, warmup_tokens, setup.dev, clock, on_leg)
    summary = summarize_prompt(prompt.id, records)
    summary["same_tokens_as_control"] = all(r["tokens"] == records[0]["tokens"] for r in records)
    return records, summary


def time_in_one_process(setup: Setup, header: dict, stream_path: Path, legs: int, warmup_tokens: int) -> Path:
    """The single-process run: each prompt's records go to the temporary stream as they come."""
    from core.schema import AtomicJsonlWriter
    from harness.timing import Clock

    prompts, candidate, control = setup.prompts, setup.candidate, setup.control
    clock = Clock.start()
    summaries = []
    total = len(prompts) * 2 * legs
    click.echo(f"timing {candidate.name} vs {control.name} on {len(prompts)} prompts x {legs} legs, "
               f"N={setup.max_new_tokens}, {setup.dev.type}", err=True)
    with AtomicJsonlWriter(stream_path) as writer:
        writer.write(header)
        with click.progressbar(length=total, label="legs", file=sys.stderr, show_pos=True,
                               item_show_func=lambda s: s) as bar:
            for prompt in prompts:
                writer.write(prompt_record(prompt))

                def on_leg(rec, prompt=prompt):
                    bar.update(1, f"{prompt.id} {rec['role']} {rec['leg'] + 1}/{legs}")

                records, summary = time_one(setup, prompt, legs, warmup_tokens, clock, on_leg)
                for rec in records:
                    writer.write(rec)
                writer.write(summary)
                summaries.append((prompt, records, summary))
        median_ratio = statistics.median(s["ratio"] for _, _, s in summaries)
        writer.write_end(median_ratio=median_ratio)
        writer.commit()
    click.echo(render_table(summaries, median_ratio, candidate.name))
    click.echo(f"wrote {stream_path}  (check it: audit replay {stream_path})")
    return stream_path


# --------------------------------------------------------------------------- under torchrun


def run_time_sharded(topo, settings, stream_path, decoder_spec, model_spec, prompts_spec, max_new_tokens, legs,
                     limit, warmup_tokens, device, seed, decoder_args, dist_timeout, control_spec=None):
    """One rank of a torchrun job: time every world_size-th prompt on this rank's own device
    (both legs of each prompt in this process), then rank 0 writes the merged stream."""
    from core import dist

    device = dist.rank_device(device, topo)
    session = dist.start(topo, dist_timeout)
    try:
        return time_sharded(session, settings, stream_path, decoder_spec, model_spec, prompts_spec,
                            max_new_tokens, legs, limit, warmup_tokens, device, seed, decoder_args, control_spec)
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
    from core import dist

    dist.raise_setup_errors(payloads)
    devices = [p["info"]["device"] for p in payloads]
    if any(d != devices[0] for d in devices):
        listing = ", ".join(f"rank {r}: {d['name']}" for r, d in enumerate(devices))
        raise UserError(f"the ranks run on different kinds of device ({listing}); one run's ratios must all "
                        "come from one kind")
    if any(p["prompts_sha256"] != payloads[0]["prompts_sha256"] for p in payloads):
        raise UserError("the ranks loaded different prompts (token ids differ); every rank must see the same set")


def prompts_digest(prompts) -> str:
    import hashlib

    from core.schema import dumps

    return hashlib.sha256(dumps([[p.id, p.token_ids] for p in prompts]).encode()).hexdigest()


def time_sharded(session, settings, stream_path, decoder_spec, model_spec, prompts_spec, max_new_tokens, legs,
                 limit, warmup_tokens, device, seed, decoder_args, control_spec=None):
    from core import dist
    from harness.timing import Clock

    topo, log = session.topo, rank_log(session.topo)
    session.at("loading the model and preparing both decoders")
    setup, error = dist.guarded(topo, lambda: prepare_run(decoder_spec, decoder_args, model_spec, device,
                                                          max_new_tokens, prompts_spec, limit, seed, log,
                                                          control_spec))
    mine = {"error": error, "info": rank_info(setup, topo.rank, topo.world_size) if setup else None,
            "prompts_sha256": prompts_digest(setup.prompts) if setup else None}
    ready = session.all_gather("setup", mine)
    check_setup(ready)

    clock = Clock.start()
    share = dist.shard(setup.prompts, topo)
    log(f"timing {setup.candidate.name} vs {setup.control.name} on {len(share)} of {len(setup.prompts)} prompts "
        f"x {legs} legs, N={setup.max_new_tokens}, {setup.dev}")
    entries, error = time_share(session, setup, share, legs, warmup_tokens, clock, log)
    payloads = session.gather("results", {"error": error, "entries": entries})
    dist.ignore_stop()  # every rank has reported: a late SIGTERM must not become a traceback
    if not topo.main:
        return None
    failure = dist.first_failure(payloads)
    if failure:
        raise dist.DistError(dist.failure_message(failure))
    header = build_header(setup, settings, legs, warmup_tokens, seed, [p["info"] for p in ready])
    return write_merged(stream_path, header, dist.unshard([p["entries"] for p in payloads]), setup)


def time_share(session, setup: Setup, share: list, legs: int, warmup_tokens: int, clock, log):
    """This rank's prompts, in order. Returns (entries, error): on the first failure the error
    names the prompt, and this rank stops; it also stops once another rank has failed."""
    from core import dist

    entries, rank = [], session.topo.rank
    for n, prompt in enumerate(share, start=1):
        early = dist.stopped_early(session)
        if early:
            return entries, early
        session.at(f"prompt {prompt.id!r} ({n}/{len(share)})")
        try:
            records, summary = time_one(setup, prompt, legs, warmup_tokens, clock)
        except Exception as exc:  # noqa: BLE001 - the whole run fails, by rank 0, naming this prompt
            dist.report_local_failure(session.topo, exc)
            return entries, session.record_failure(prompt.id, dist.error_text(exc))
        entries.append({"prompt": {**prompt_record(prompt), "rank": rank},
                        "legs": [{**r, "rank": rank} for r in records], "summary": summary})
        log(f"{prompt.id}: {n}/{len(share)} prompts, ratio {summary['ratio']:.3f}")
    return entries, None


def write_merged(stream_path: Path, header: dict, entries: list[dict], setup: Setup) -> Path:
    """Rank 0: every rank's records, prompts in their original order, in one atomic write."""
    from core.schema import AtomicJsonlWriter

    by_id = {p.id: p for p in setup.prompts}
    summaries = [(by_id[e["prompt"]["id"]], e["legs"], e["summary"]) for e in entries]
    median_ratio = statistics.median(e["summary"]["ratio"] for e in entries)
    with AtomicJsonlWriter(stream_path) as writer:
        writer.write(header)
        for e in entries:
            writer.write(e["prompt"])
            for rec in e["legs"]:
                writer.write(rec)
            writer.write(e["summary"])
        writer.write_end(median_ratio=median_ratio)
        writer.commit()
    click.echo(render_table(summaries, median_ratio, setup.candidate.name))
    click.echo(f"wrote {stream_path} from {header['world_size']} ranks  (check it: audit replay {stream_path})")
    return stream_path


def resident_bytes(decoder, model, dev):
    """Prepare ``decoder`` and return the device memory it keeps allocated (None off CUDA)."""
    import torch

    if dev.type != "cuda":
        decoder.prepare(model)
        return None
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    decoder.prepare(model)
    torch.cuda.synchronize(dev)
    return max(0, torch.cuda.memory_allocated(dev) - before)


def render_table(summaries, median_ratio: float, candidate_name: str) -> str:
    rows = [("prompt", "P", "new", "control tok/s", f"{candidate_name} tok/s", "ratio", "acc.len", "same")]
    for prompt, records, s in summaries:
        cand = next(r for r in records if r["role"] == "candidate")
        mal = cand["stats"].get("mean_accepted_length")
        rows.append((prompt.id, str(len(prompt.token_ids)), str(len(cand["tokens"])),
                     f"{s['control_tokens_per_s']:.1f}", f"{s['candidate_tokens_per_s']:.1f}",
                     f"{s['ratio']:.3f}", "-" if mal is None else f"{mal:.2f}",
                     "yes" if s["same_tokens_as_control"] else "NO"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append(f"median ratio (control time / candidate time): {median_ratio:.3f}  "
                 "[exactness: run `audit replay`; 'same' only compares with this run's control legs]")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
