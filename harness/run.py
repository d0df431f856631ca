"""``harness time``: choose the stream's path, pin the configuration, prepare, time every prompt
side by side, write the stream atomically and print the table (under torchrun: ``harness.sharded``).
"""
from __future__ import annotations

import datetime as _dt
import os
import shlex
import signal
import statistics
import tempfile
from pathlib import Path

import click

from core.devices import check_device
from core.errors import Stopped, UserError
from core.paths import check_output_file
from core.schema import AtomicJsonlWriter
from harness.header import build_header, prompt_record, rank_info
from harness.load import busy_warning, machine_load
from harness.options import TimeOptions
from harness.outputs import note_stale_documents
from harness.prepare import Setup, prepare_run
from harness.progress import Progress
from harness.sharded import run_time_sharded
from harness.table import render_table
from harness.timed import legs_only, time_one, warn_violations


def quiet_libraries() -> None:
    """transformers warns once per kernel it cannot find; that is expected here (plain PyTorch)."""
    import transformers  # heavy: loads only when a command runs

    transformers.logging.set_verbosity_error()



def run_time(opts: TimeOptions) -> Path | None:
    """``harness time``: the stream's path (None on a torchrun rank other than 0)."""
    stream_path = choose_stream_path(opts.decoder, opts.out_dir, opts.force)
    check_device(opts.device)
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


def check_writable(out_dir: Path, existing: Path) -> None:
    """A file can be made in the nearest existing directory of ``out_dir`` (tried, then removed):
    a directory nobody may write to, or a filesystem such as /proc, is refused before the model loads."""
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise UserError(f"--out {out_dir}: cannot write under {existing} ({exc.strerror or exc})") from None


def choose_stream_path(decoder_spec: str, out_dir: Path | None, force: bool) -> Path:
    """DIR/stream.jsonl, refusing to replace an existing stream without --force, and refusing an
    --out that cannot be a directory, before anything heavy runs."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = out_dir or Path("runs") / f"{decoder_spec.replace(':', '_').replace('/', '_')}-{stamp}"
    if out_dir.is_symlink() and not out_dir.exists():
        raise UserError(f"--out {out_dir} is a symbolic link to {os.readlink(out_dir)}, which does not exist")
    existing = next((p for p in (out_dir, *out_dir.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise UserError(f"--out {out_dir}: {existing} is a file, not a directory; give a directory for stream.jsonl")
    check_writable(out_dir, existing or Path("."))
    stream_path = check_output_file(out_dir / "stream.jsonl", "--out")
    if stream_path.exists() and not force:
        raise UserError(f"{stream_path} exists; pass --force to replace it or choose another --out")
    return stream_path


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
    click.echo(f"wrote {stream_path}  (check it: audit replay {shlex.quote(str(stream_path))})")
    note_stale_documents(stream_path)
    return stream_path
