"""``harness``: time a decoder against the serial control and record everything to stream.jsonl."""
from __future__ import annotations

import datetime as _dt
import platform
import statistics
import sys
from pathlib import Path

import click

from harness.errors import UserError


def quiet_libraries() -> None:
    """transformers warns once per kernel it cannot find; that is expected here (plain PyTorch)."""
    import transformers

    transformers.logging.set_verbosity_error()


def fail(message: str, code: int = 2):
    # one line even when the message embeds a library's multi-line exception text
    message = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def run_cli(fn):
    """Turn user mistakes into one line and a non-zero exit; never a traceback for them."""
    try:
        return fn()
    except UserError as exc:
        fail(str(exc))
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
    from decoders import CONTROL, DEFAULT_DECODER, REGISTRY
    from harness.models import BUILTIN_MODELS
    from harness.prompts import BUILTIN_PROMPTS

    click.echo("decoders (--decoder NAME, or package.module:attr):")
    for name, (_, desc) in REGISTRY.items():
        tag = " [control]" if name == CONTROL else " [default]" if name == DEFAULT_DECODER else ""
        click.echo(f"  {name:<14}{desc}{tag}")
    click.echo("built-in models (--model NAME, or a checkpoint directory):")
    for name, desc in BUILTIN_MODELS.items():
        click.echo(f"  {name:<14}{desc}")
    click.echo("built-in prompt sets (--prompts NAME, or a jsonl file):")
    for name, desc in BUILTIN_PROMPTS.items():
        click.echo(f"  {name:<14}{desc}")


@main.command("time")
@click.option("--decoder", "decoder_spec", default=None, metavar="NAME",
              help="Candidate decoder: a registered name (see `harness list`) or package.module:attr. "
                   "Default: spec.")
@click.option("--decoder-arg", "decoder_args", multiple=True, metavar="KEY=VALUE",
              help="Constructor argument for the candidate decoder (repeatable), e.g. max_depth=4.")
@click.option("--model", "model_spec", default="tiny", show_default=True, metavar="MODEL",
              help="Built-in model name (tiny, synthetic-9b) or a Qwen3.5 checkpoint directory.")
@click.option("--prompts", "prompts_spec", default=None, metavar="PROMPTS",
              help="Built-in prompt set (dev, random-512) or a jsonl file of {id, text|token_ids}. "
                   "Default: dev for models with a tokenizer, random-512 otherwise.")
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
def time_cmd(decoder_spec, decoder_args, model_spec, prompts_spec, max_new_tokens, legs, limit, warmup_tokens, device,
             out_dir, force, seed, report):
    """Time DECODER against the serial control on every prompt, side by side in one process.

    Per prompt: an untimed warm-up of both, then LEGS timed decodes of each in ABBA order, each
    timed around the whole decode with device synchronisation, peak memory recorded on CUDA.
    Writes DIR/stream.jsonl atomically and prints tokens/s, ratio and acceptance per prompt.
    """
    stream_path = run_cli(lambda: run_time(decoder_spec, model_spec, prompts_spec, max_new_tokens, legs, limit,
                                           warmup_tokens, device, out_dir, force, seed, decoder_args))
    if report:
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
             out_dir, force, seed, decoder_args=()):
    from harness import determinism  # pins before anything touches CUDA

    settings = determinism.pin()
    quiet_libraries()
    import torch

    from decoders import CONTROL, DEFAULT_DECODER, get_decoder, parse_decoder_args
    from harness.models import device_name, load_model
    from harness.prompts import load_prompts
    from harness.schema import SCHEMA, AtomicJsonlWriter
    from harness.timing import Clock, summarize_prompt, time_prompt

    decoder_spec = decoder_spec or DEFAULT_DECODER
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = out_dir or Path("runs") / f"{decoder_spec.replace(':', '_').replace('/', '_')}-{stamp}"
    stream_path = out_dir / "stream.jsonl"
    if stream_path.exists() and not force:
        raise UserError(f"{stream_path} exists; pass --force to replace it or choose another --out")

    control = get_decoder(CONTROL)
    kwargs = parse_decoder_args(decoder_args)
    candidate = get_decoder(decoder_spec, **kwargs)
    click.echo(f"loading model {model_spec} ...", err=True)
    model = load_model(model_spec, device)
    dev = model.device
    if max_new_tokens is None:
        max_new_tokens = 512 if dev.type == "cuda" else 64
    prompts, prompt_info = load_prompts(prompts_spec, model, limit)
    resident = {role: resident_bytes(dec, model, dev) for role, dec in (("control", control), ("candidate", candidate))}
    torch.manual_seed(seed)

    header = {
        "type": "header",
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": ["harness", *sys.argv[1:]],
        "model": model.identity,
        "dtype": "bfloat16",
        "device": {"type": dev.type, "name": device_name(dev)},
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "cuda": torch.version.cuda,
        },
        "determinism": settings,
        "control": {"name": control.name, "config": control.config()},
        "candidate": {"name": candidate.name, "spec": decoder_spec, "args": kwargs, "config": candidate.config(),
                      "instrument": bool(getattr(candidate, "instrument", False))},
        "prompts": prompt_info,
        "max_new_tokens": max_new_tokens,
        "legs": legs,
        "warmup_tokens": warmup_tokens,
        "seed": seed,
        # Both decoders live in this process, so a leg's allocator peak also holds the other
        # decoder's persistent buffers (static caches, graph pools): recorded here so that a leg's
        # own peak is its raw peak minus the other decoder's resident bytes (null on CPU).
        "memory": {"resident_bytes": resident},
    }
    extra_header = getattr(candidate, "header_extra", None)
    if callable(extra_header):
        header["candidate"].update(extra_header())

    clock = Clock.start()
    summaries = []
    total = len(prompts) * 2 * legs
    click.echo(f"timing {candidate.name} vs {control.name} on {len(prompts)} prompts x {legs} legs, "
               f"N={max_new_tokens}, {dev.type}", err=True)
    with AtomicJsonlWriter(stream_path) as writer:
        writer.write(header)
        with click.progressbar(length=total, label="legs", file=sys.stderr, show_pos=True,
                               item_show_func=lambda s: s) as bar:
            for prompt in prompts:
                writer.write({"type": "prompt", "id": prompt.id, "token_ids": prompt.token_ids,
                              "text": prompt.text})

                def on_leg(rec, prompt=prompt):
                    bar.update(1, f"{prompt.id} {rec['role']} {rec['leg'] + 1}/{legs}")

                records = time_prompt(prompt, {"control": control, "candidate": candidate},
                                      max_new_tokens, legs, warmup_tokens, dev, clock, on_leg)
                for rec in records:
                    writer.write(rec)
                summary = summarize_prompt(prompt.id, records)
                summary["same_tokens_as_control"] = all(
                    r["tokens"] == records[0]["tokens"] for r in records)
                writer.write(summary)
                summaries.append((prompt, records, summary))
        median_ratio = statistics.median(s["ratio"] for _, _, s in summaries)
        writer.write_end(median_ratio=median_ratio)
        writer.commit()
    click.echo(render_table(summaries, median_ratio, candidate.name))
    click.echo(f"wrote {stream_path}  (check it: audit replay {stream_path})")
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
