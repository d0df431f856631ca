"""``harness time`` under torchrun: each rank times its share of the prompts on its own device,
then rank 0 writes the merged stream."""
from __future__ import annotations

import hashlib
import shlex
import statistics
from dataclasses import replace
from pathlib import Path

import click

from core.errors import UserError
from core.schema import AtomicJsonlWriter, dumps
from harness.header import build_header, prompt_record, rank_info
from harness.options import TimeOptions
from harness.outputs import note_stale_documents
from harness.prepare import Setup, prepare_run
from harness.load import busy_warning
from harness.timed import legs_only, time_one, warn_violations
from harness.table import render_table


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
    click.echo(f"wrote {stream_path} from {header['world_size']} ranks  (check it: audit replay {shlex.quote(str(stream_path))})")
    note_stale_documents(stream_path)
    return stream_path
