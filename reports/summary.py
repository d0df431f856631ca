"""Every number the report shows, computed from the raw records of one run.

``summarize_run`` returns a plain dict (floats unrounded) that both the figures and the markdown
are built from, so what the report says can be checked against ``stream.jsonl`` / ``audit.json``.

Speed comes from the raw legs only: per prompt and role, the median of the legs' ``wall_s``; the
ratio of a role is ``core.schema.prompt_ratio``, the control's median over the role's first timed
leg (above 1 = faster than the control), as the harness and the audit compute it; the run's
median ratio is the median of the per-prompt ratios. The harness's own summary and end records
are shown beside these, never instead of them. Score, verdict and exactness come from audit.json
only, and only when it names this stream's sha256; otherwise the run counts as not audited.
"""
from __future__ import annotations

import shlex
import statistics
from collections import Counter

from core.schema import prompt_ratio
from reports.load import CONTROL_ROLE, Run, header_sampler

PRIMARY_ROLE = "candidate"  # the role the harness header and the audit describe
PHASES = ("step", "draft", "verify", "rollback", "other")  # time_split order; unknown phases follow
REL_TOL = 1e-9  # harness summaries are the same floats recomputed; anything more is a disagreement


def summarize_run(run: Run) -> dict:
    """The report's content as data: run identity, banners, per-prompt rows and per-role aggregates."""
    header = run.header
    audit = audit_section(run)
    audit_rows = {p["id"]: p for p in run.audit["prompts"]} if audit["status"] in ("pass", "fail") else {}
    prompts = [prompt_row(run, p, audit_rows.get(p["id"])) for p in run.prompts]
    others = [r for r in run.roles if r != CONTROL_ROLE]
    # a role missing on some prompt (possible once runs carry more roles) just has fewer ratios
    median_ratio = {r: _median([p["ratio"].get(r) for p in prompts]) for r in others}
    primary = PRIMARY_ROLE if PRIMARY_ROLE in others else others[0]
    summary = {
        "run_dir": str(run.run_dir),
        "stream": {"path": str(run.stream_path), "sha256": run.stream_sha256,
                   "records": run.end["records"] + 1, "integrity": dict(run.integrity),
                   "created": header.get("created"), "command": header.get("command")},
        "model": dict(header["model"]) if isinstance(header["model"], dict) else {"name": str(header["model"])},
        "device": dict(header["device"]) if isinstance(header["device"], dict) else {"name": str(header["device"])},
        "dtype": header.get("dtype"),
        "versions": header.get("versions") or {},
        "decoders": [decoder_info(header, r) for r in run.roles],
        "roles": list(run.roles),
        "primary_role": primary,
        "prompt_count": len(prompts),
        "prompt_source": (header.get("prompts") or {}).get("source"),
        "max_new_tokens": header["max_new_tokens"],
        "legs_per_side": header["legs"],
        "leg_records": len(run.legs),
        "median_ratio": median_ratio,
        "harness_median_ratio": run.end.get("median_ratio"),
        "ms_per_token_median": {r: _median([p["ms_per_token"][r] for p in prompts]) for r in run.roles},
        "audit": audit,
        "retime": retime_section(run),
        "first_divergence": first_divergence(prompts),
        "prompts": prompts,
        "acceptance": {r: acceptance(run, r) for r in others},
        # what decided the tokens on every side (the header's sampler; greedy when it records none)
        "sampler": sampler_info(header_sampler(header, run.stream_path)),
        "depth": depth_info(header, prompts, others),
        "memory": memory_info(header, prompts),
        "time_split_recorded": any(p["time_split"].get(r) for p in prompts for r in run.roles),
    }
    summary["banners"] = banners(summary)
    return summary


def sampler_info(sampler) -> dict:
    """The run's sampler for the report: its fields, its one-line description, and greedy or not."""
    return {**sampler.to_json(), "text": sampler.describe(), "greedy": sampler.greedy}


def decoder_info(header: dict, role: str) -> dict:
    entry = header.get(role) if isinstance(header.get(role), dict) else {}
    return {"role": role, "name": entry.get("name", role), "spec": entry.get("spec"),
            "config": entry.get("config") or {}}


def prompt_row(run: Run, prompt: dict, audit_row: dict | None) -> dict:
    """One prompt: per-role medians from its raw legs, the harness's summary beside them, the audit's row."""
    pid = prompt["id"]
    legs = {r: [leg for leg in run.legs if leg["prompt_id"] == pid and leg["role"] == r] for r in run.roles}
    legs = {r: v for r, v in legs.items() if v}
    median_s = {r: statistics.median(leg["wall_s"] for leg in v) for r, v in legs.items()}
    leg_ms = {r: [leg["wall_s"] * 1e3 / len(leg["tokens"]) for leg in v if leg["tokens"]] for r, v in legs.items()}
    harness = run.summaries.get(pid)
    return {
        "id": pid,
        "prompt_tokens": len(prompt["token_ids"]),
        "legs": {r: len(v) for r, v in legs.items()},
        "new_tokens": {r: len(v[0]["tokens"]) for r, v in legs.items()},
        "median_s": median_s,
        "first_s": {r: first_leg_wall(v) for r, v in legs.items()},
        "leg_wall_s": {r: [leg["wall_s"] for leg in v] for r, v in legs.items()},
        "leg_ms_per_token": leg_ms,
        "ms_per_token": {r: _median(v) for r, v in leg_ms.items()},
        "ratio": {r: prompt_ratio([leg["wall_s"] for leg in legs[CONTROL_ROLE]], first_leg_wall(v))
                  for r, v in legs.items() if r != CONTROL_ROLE},
        "harness_ratio": harness["ratio"] if harness else None,
        "harness_same_tokens": harness.get("same_tokens_as_control") if harness else None,
        # peak over the legs: the figure is a capacity question, so the worst leg counts
        "peak_mem_bytes": {r: max((leg["peak_mem_bytes"] for leg in v if leg["peak_mem_bytes"] is not None),
                                  default=None) for r, v in legs.items()},
        "time_split": {r: time_split(v) for r, v in legs.items()},
        "depth_trace": {r: next((leg["stats"]["depth_trace"] for leg in v
                                 if leg.get("stats", {}).get("depth_trace") is not None), None)
                        for r, v in legs.items()},
        "audit": audit_row,
        "exact": audit_row["exact"] if audit_row else None,
        "verdict": prompt_verdict(audit_row),
        "first_divergence": audit_row.get("first_divergence") if audit_row else None,
        "audit_ratio": audit_row.get("ratio") if audit_row else None,
        "warm_leg_flag": bool(audit_row.get("warm_leg_flag")) if audit_row else False,
    }


def first_leg_wall(legs: list[dict]) -> float | None:
    """The wall time of a role's first timed leg (``leg == 0``), its first encounter with the prompt."""
    return next((leg["wall_s"] for leg in legs if leg["leg"] == 0), None)


def prompt_verdict(audit_row: dict | None) -> str:
    """exact / diverged / not replayed (the audit could not check the tokens) / not audited."""
    if audit_row is None:
        return "not audited"
    if audit_row["exact"]:
        return "exact"
    return "diverged" if audit_row.get("first_divergence") else "not replayed"


def time_split(legs: list[dict]) -> dict | None:
    """Median seconds per phase over the legs that recorded a split; None when none did."""
    splits = [leg["stats"]["time_split"] for leg in legs if leg.get("stats", {}).get("time_split")]
    if not splits:
        return None
    phases = [p for p in PHASES if any(p in s for s in splits)]
    phases += sorted({p for s in splits for p in s} - set(phases))
    return {p: statistics.median(s.get(p, 0.0) for s in splits) for p in phases}


def acceptance(run: Run, role: str) -> dict | None:
    """Acceptance over every leg of a role (legs repeat the same decodes, so shares are unaffected)."""
    hist, drafted, accepted, n = Counter(), [], [], 0
    for leg in run.legs:
        if leg["role"] != role:
            continue
        n += 1
        stats = leg.get("stats", {})
        for k, v in stats.get("accept_hist", {}).items():
            hist[int(k)] += v
        for total, part in ((drafted, stats.get("drafted_by_depth", [])),
                            (accepted, stats.get("accepted_by_depth", []))):
            total.extend([0] * (len(part) - len(total)))
            for d, v in enumerate(part):
                total[d] += v
    rounds = sum(hist.values())
    if rounds == 0 and not any(drafted):
        return None  # this role does not speculate (or did not record it)
    accepted_total = sum(k * v for k, v in hist.items())
    return {
        "legs": n,
        "rounds": rounds,
        "hist": dict(sorted(hist.items())),
        "drafted_by_depth": drafted,
        "accepted_by_depth": accepted + [0] * (len(drafted) - len(accepted)),
        "rate_by_depth": [a / d if d else None for a, d in zip(accepted + [0] * len(drafted), drafted)],
        # tokens emitted per verification round: the accepted drafts plus the model's own token
        "mean_accepted_length": (accepted_total + rounds) / rounds if rounds else None,
    }


def depth_info(header: dict, prompts: list[dict], roles: list[str]) -> dict:
    traced = [p["id"] for p in prompts if any(p["depth_trace"].get(r) for r in roles)]
    k = ((header.get(PRIMARY_ROLE) or {}).get("config") or {}).get("k")
    return {"recorded": bool(traced), "prompts": traced,
            "fixed_k": k if isinstance(k, int) and not isinstance(k, bool) else None}


def memory_info(header: dict, prompts: list[dict]) -> dict:
    measured = any(v is not None for p in prompts for v in p["peak_mem_bytes"].values())
    device = header["device"].get("type") if isinstance(header["device"], dict) else str(header["device"])
    if measured:
        note = None
    elif device == "cpu":
        note = "n/a on CPU: peak memory is measured only on CUDA devices, so no numbers are shown"
    else:
        note = f"n/a: no leg recorded peak memory on {device}"
    return {"measured": measured, "device_type": device, "note": note}


def audit_section(run: Run) -> dict:
    """The audit as the report may present it: pass/fail only for an audit of this very stream."""
    if run.audit is None:
        return {"status": "not audited", "path": None}
    a = run.audit
    base = {"path": str(run.audit_path), "stream": a.get("stream"), "stream_sha256": a["stream_sha256"]}
    if not run.audit_matches:
        return {"status": "mismatch", **base}
    return {
        "status": a["verdict"],
        **base,
        "verdict": a["verdict"],
        "exact": a["exact"],
        "consistent": a["consistent"],
        "score": a["score"],
        "score_params": a.get("score_params") or {},
        "median_ratio": a.get("median_ratio"),
        "f_mem": a.get("f_mem"),
        "memory": a.get("memory") or {},
        "replay": a.get("replay") or {},
        "candidate": a.get("candidate"),
        "instrument": a.get("instrument"),
        "findings": list(a["findings"]),
        "inexact_prompts": [p["id"] for p in a["prompts"] if not p["exact"]],
    }


def retime_section(run: Run) -> dict:
    """The verified figures of ``audit retime`` beside the claimed ones, for this very stream only."""
    if run.retime is None:
        return {"status": "not retimed"}
    r = run.retime
    if r["stream_sha256"] != run.stream_sha256:
        return {"status": "mismatch", "stream_sha256": r["stream_sha256"]}
    v = r.get("verified") or {}
    return {"status": r["verdict"], "verified_ratio": v.get("ratio"), "ci_low": v.get("ci_low"),
            "ci_high": v.get("ci_high"), "verified_score": v.get("score"), "prompts": v.get("prompts"),
            "claimed_ratio": r["claimed"].get("ratio"), "fresh": r.get("fresh_prompts"),
            "reason": r.get("unverified_reason"),
            "failing": [f.get("check") for f in r.get("findings") or [] if f.get("severity") == "fail"]}


def first_divergence(prompts: list[dict]) -> dict | None:
    """The first divergence in stream order (audited prompts whose tokens were replayed)."""
    for p in prompts:
        if p["first_divergence"]:
            return {"prompt_id": p["id"], **p["first_divergence"]}
    return None


def banners(s: dict) -> list[dict]:
    """What must be seen before any number: missing or foreign audit, failure, a modified stream."""
    out, audit = [], s["audit"]
    stream = s["stream"]["path"]
    if audit["status"] == "not audited":
        sampler = s["sampler"]
        control = "serial greedy decoding" if sampler["greedy"] else f"serial sampling under `{sampler['text']}`"
        out.append({"kind": "not-audited", "title": "NOT AUDITED",
                    "text": "There is no audit.json in this run directory: the tokens have not been checked "
                            f"against {control} and there is no score. Nothing below is verified. "
                            f"Check it with `audit replay {shlex.quote(str(stream))}`."})
    elif audit["status"] == "mismatch":
        out.append({"kind": "audit-mismatch", "title": "AUDIT DOES NOT MATCH THIS STREAM",
                    "text": f"audit.json was made from a stream with sha256 {audit['stream_sha256'][:16]}…, but "
                            f"this stream.jsonl has sha256 {s['stream']['sha256'][:16]}…. Its verdict and score "
                            "describe another stream, so this run is treated as NOT AUDITED. "
                            f"Re-run `audit replay {shlex.quote(str(stream))}`."})
    elif audit["status"] == "fail":
        fails = [f for f in audit["findings"] if f["severity"] == "fail"]
        text = (f"The audit's verdict is FAIL (exact: {'yes' if audit['exact'] else 'NO'}, consistent: "
                f"{'yes' if audit['consistent'] else 'NO'}; {len(fails)} failing finding(s)).")
        div = s["first_divergence"]
        if div:
            text += " First divergence: " + describe_divergence(div) + "."
        unchecked = [p["id"] for p in s["prompts"] if p["verdict"] == "not replayed"]
        if unchecked:
            text += (f" {len(unchecked)} prompt(s) were not replayed, so their tokens are unverified "
                     "(see the findings).")
        out.append({"kind": "audit-fail", "title": "AUDIT FAILED", "text": text})
    integrity = s["stream"]["integrity"]
    if not (integrity["count_ok"] and integrity["sha256_ok"]):
        out.append({"kind": "stream-modified", "title": "STREAM MODIFIED AFTER WRITING",
                    "text": "The end record's record count or sha256 does not match the lines before it: "
                            "records were added, removed or edited after the harness wrote the file."})
    off = [p["id"] for p in s["prompts"] if p["harness_ratio"] is not None
           and not _close(p["harness_ratio"], p["ratio"].get(PRIMARY_ROLE))]
    hm = s["harness_median_ratio"]
    if off or (hm is not None and not _close(hm, s["median_ratio"].get(PRIMARY_ROLE))):
        out.append({"kind": "harness-disagrees", "title": "HARNESS SUMMARY DISAGREES WITH ITS RAW LEGS",
                    "text": "The harness's own ratio differs from the one recomputed from the raw legs"
                            + (f" for {', '.join(off)}" if off else " for the run's median") +
                            "; this report uses the raw legs."})
    return out


def describe_divergence(div: dict) -> str:
    """One line, in the audit's own terms (a missing token means one side had stopped)."""
    parts = [f"prompt {div['prompt_id']}"]
    if div.get("leg"):
        parts.append(f"leg {div['leg']}")
    parts.append(f"position {div.get('position')}")
    emitted, greedy = div.get("emitted"), div.get("greedy")
    # under a sampler the audit's "greedy" is the sampler's pick, its margin one of sampler scores
    sampled = div.get("reason") == "emitted token is not the sampler's pick"
    if greedy is None:
        what = f"emitted {emitted} after serial greedy had stopped"
    elif emitted is None:
        what = f"the candidate stopped where serial greedy emits {greedy}"
    else:
        what = f"emitted {emitted}, {'the sampler picks' if sampled else 'greedy'} {greedy}"
    text = ", ".join(parts) + ": " + what
    if div.get("margin") is not None:
        text += f" ({'sampler score' if sampled else 'logit'} margin {div['margin']:.4g})"
    return text


def _close(a, b) -> bool:
    return a is not None and b is not None and abs(a - b) <= REL_TOL * max(abs(a), abs(b), 1e-300)


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None
