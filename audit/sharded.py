"""``audit replay`` under torchrun: each rank replays its share of the prompts, rank 0 audits.

Prompt i is replayed on rank i % world_size (the harness's sharding, ``core.dist``), on that
rank's own device. Every rank reads the stream and loads the model itself; rank 0 alone runs
the model-free checks, gathers every rank's ``PromptReplay`` results and writes audit.json, the
same document one process would write except for the replay's timing (``seconds``,
``ms_per_token``) and its ``world_size`` and ``ranks``. A rank that fails or hangs fails the
audit (exit 2) with one line naming the rank and prompt, and nothing is written.
"""
from __future__ import annotations

import time

import click

from core import dist
from core.errors import DistError, UserError

from audit import checks
from audit.pipeline import choose_device, file_findings, finish, load_replay_model, replay_device_json, replay_info
from audit.replay import PristineSerial, log_prompt, replay_one
from audit.report import divergence_findings
from audit.stream import BadInput


def rank_log(topo):
    return lambda message: click.echo(f"[rank {topo.rank}] {message}", err=True)


def audit_sharded(topo, run, path, out_path, opts) -> int:
    """One rank's part of the audit of ``run`` (read from ``path``) under ``opts`` (an
    ``audit.replay_audit.ReplayOptions``); rank 0 returns the audit's exit code, the others 0."""
    dev = dist.rank_device(choose_device(opts.device, run.header["device"]), topo)
    session = dist.start(topo, opts.dist_timeout)
    try:
        return audit_on_rank(session, run, path, out_path, dev, opts)
    except dist.Stopped:
        raise DistError(dist.stop_report(session, "replayed") + "; nothing was written") from None
    except DistError as exc:
        raise DistError(f"{exc}; nothing was written") from None
    finally:
        try:
            session.close()
        except Exception:  # noqa: BLE001 - leaving anyway; the launcher reaps what is left
            pass


def setup_rank(run, dev: str, opts):
    """This rank's device must be the recording's kind (refused before the model is loaded, as
    in one process); then the model."""
    replay_dev = replay_device_json(dev)
    checks.check_devices(run.header, [replay_dev], opts.allow_device_mismatch)
    return replay_dev, load_replay_model(run, opts.model, dev)


def check_ready(ready: list[dict]) -> None:
    """Raised alike on every rank: a setup failure, or ranks that loaded different models."""
    dist.raise_setup_errors(ready, BadInput)
    ids = [p["identity"] for p in ready]
    odd = [r for r, i in enumerate(ids) if i != ids[0]]
    if odd:
        raise BadInput(f"rank {odd[0]} loaded another model than rank 0 (identity {ids[odd[0]]} vs {ids[0]})")


def replay_share(session, model, run, share: list, log) -> tuple[dict, int, float, dict | None]:
    """This rank's prompts through the pristine path. Returns (replayed, tokens, seconds, error):
    on the first failure the error names the prompt and this rank stops; it also stops once
    another rank has failed."""
    stepper, eos = PristineSerial(model), set(model.eos_token_ids)
    out, tokens, t0 = {}, 0, time.perf_counter()
    for n, p in enumerate(share, start=1):
        early = dist.stopped_early(session)
        if early:
            return out, tokens, time.perf_counter() - t0, early
        session.at(f"prompt {p.id!r} ({n}/{len(share)})")
        t_prompt = time.perf_counter()
        try:
            rep = replay_one(stepper, p, run.max_new_tokens, eos, log, sampler=run.sampler)
        except Exception as exc:  # noqa: BLE001 - the audit fails, by rank 0, naming this prompt
            dist.report_local_failure(session.topo, exc)
            return out, tokens, time.perf_counter() - t0, session.record_failure(p.id, dist.error_text(exc))
        out[p.id] = rep
        tokens += rep.positions
        log_prompt(log, n, len(share), p, rep, time.perf_counter() - t_prompt)
    return out, tokens, time.perf_counter() - t0, None


def audit_on_rank(session, run, path, out_path, dev, opts) -> int:
    topo, log = session.topo, rank_log(session.topo)
    session.at("loading the model")
    loaded, error = dist.guarded(topo, lambda: setup_rank(run, dev, opts), (BadInput, UserError))
    replay_dev, model = loaded if loaded else (None, None)
    ready = session.all_gather("setup", {"error": error, "device": replay_dev,
                                         "identity": model.identity if model else None})
    check_ready(ready)

    replayed, tokens, seconds, error = {}, 0, 0.0, None
    if not checks.check_model_identity(run.header["model"], model.identity):
        share = dist.shard(run.prompts, topo)
        log(f"replaying {len(share)} of {len(run.prompts)} prompts on {replay_dev['name']} ...")
        replayed, tokens, seconds, error = replay_share(session, model, run, share, log)
    results = session.gather("replayed", {"error": error, "replayed": replayed, "tokens": tokens,
                                          "seconds": seconds})
    dist.ignore_stop()  # every rank has reported: a late SIGTERM must not become a traceback
    if not topo.main:
        return 0
    failure = dist.first_failure(results)
    if failure:
        raise DistError(dist.failure_message(failure))

    devices = [p["device"] for p in ready]
    findings = checks.check_devices(run.header, devices, opts.allow_device_mismatch)
    more, model_findings = file_findings(run, model)
    findings += more
    merged = None
    if not model_findings:  # as in one process: replaying with another model would only report noise
        merged = {pid: rep for p in results for pid, rep in p["replayed"].items()}
        findings += divergence_findings(run, merged)
    # the sharded replay's wall time is its slowest rank's
    info = replay_info(devices, sum(p["tokens"] for p in results), max(p["seconds"] for p in results))
    return finish(run, path, out_path, findings, merged, info, model.identity, opts.score_params)
