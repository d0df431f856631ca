"""The audit's outputs: the audit.json document (read by ``reports``) and the human table.

audit.json keys are a contract with the reports package; see ``build_document``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from core.schema import LEG_SPREAD_LIMIT, write_json_atomic

from audit import checks
from audit.interval import interval, significant
from audit.replay import NOT_PICK, Divergence, PromptReplay
from audit.stream import BadInput

SCHEMA = "qwen35-exact/audit/1"


def divergence_message(label: str, d: Divergence) -> str:
    control = "serial sampling" if d.sampled else "serial greedy"
    if d.greedy is None:
        return f"{label} at position {d.position}: {d.reason} (emitted {d.emitted})"
    if d.emitted is None:
        return f"{label} at position {d.position}: {d.reason} ({control} would emit {d.greedy})"
    top = ", ".join(f"{t}:{v:.4f}" for t, v in d.top5)
    scores = "sampler scores " if d.sampled else ""
    margin = "-" if d.margin is None else f"{d.margin:.4g}"
    return (f"{label} diverges at position {d.position}: emitted {d.emitted}, {control} {d.greedy} "
            f"(top-1/top-2 margin {margin}; top5 {scores}{top})")


def leg_orders(p) -> dict[str, int]:
    return {checks.leg_label(r): r["order"] for r in p.legs}


def divergence_findings(run, replayed: dict[str, PromptReplay]) -> list[dict]:
    """One finding per diverging leg, legs taken in the order they ran."""
    out = []
    for p in run.prompts:
        order = leg_orders(p)
        for label, d in sorted(replayed[p.id].divergences.items(), key=lambda kv: order.get(kv[0], 0)):
            out.append(checks.finding(d.check, "fail", p.id, divergence_message(label, d), **d.to_json(label)))
    return out


def first_divergence(p, rep: PromptReplay | None) -> dict | None:
    """The earliest divergence among a prompt's legs (ties: the leg that ran first)."""
    if rep is None or not rep.divergences:
        return None
    order = leg_orders(p)
    label, d = min(rep.divergences.items(), key=lambda kv: (kv[1].position, order.get(kv[0], 0)))
    return d.to_json(label)


def prompt_entry(run, p, medians: dict, rep: PromptReplay | None) -> dict:
    cand = p.role_legs("candidate")
    warm, _ = checks.warm_leg_flag(p, run.legs)
    return {
        "id": p.id,
        "exact": rep is not None and bool(p.legs) and not rep.divergences,
        # new tokens the candidate emitted on its first leg (equal to serial's when exact)
        "tokens": len(cand[0]["tokens"]) if cand else 0,
        "ratio": medians["ratio"],
        "harness_ratio": p.summaries[0]["ratio"] if p.summaries else None,
        "control_median_s": medians["control_median_s"],
        "candidate_median_s": medians["candidate_median_s"],
        "control_peak_bytes": checks.own_peak_bytes(p.role_legs("control"), "control", run.header),
        "candidate_peak_bytes": checks.own_peak_bytes(cand, "candidate", run.header),
        "first_divergence": first_divergence(p, rep),
        "warm_leg_flag": warm,
        # slowest / fastest - 1 over each role's legs (null under 2 legs)
        "leg_spread": checks.prompt_spreads(p),
    }


def build_document(run, stream_sha256: str, findings: list[dict], replayed: dict[str, PromptReplay] | None,
                   replay_info: dict, model_identity: dict, params: dict) -> dict:
    """Everything the audit found, as audit.json. ``findings`` must already hold every finding."""
    per_prompt, median = checks.recompute_ratios(run.prompts)
    legs = [r for p in run.prompts for r in p.legs]
    resident = checks.resident_bytes(run.header)
    ctl_peak = checks.own_peak_bytes([r for r in legs if r["role"] == "control"], "control", run.header)
    cand_peak = checks.own_peak_bytes([r for r in legs if r["role"] == "candidate"], "candidate", run.header)
    f_mem, mem_ratio = checks.memory_factor(ctl_peak, cand_peak, params["mem_allowance"])
    failed = any(f["severity"] == "fail" for f in findings)
    instrument = run.header["candidate"].get("instrument") is True
    exact = replayed is not None and not any(f["check"] in checks.EXACTNESS_CHECKS for f in findings)
    low, high, coverage, how = interval([e["ratio"] for e in per_prompt.values() if e["ratio"] is not None])
    # a median the stream's own prompts cannot tell from 1 scores nothing, as in audit retime
    claimed_score = checks.score(median, f_mem, params["s_max"], params["kappa"],
                                 failed or instrument or not checks.is_serial_control(run.header["control"])
                                 or not significant(low))
    consistent = not any(f["severity"] == "fail" and f["check"] in checks.CONSISTENCY_CHECKS for f in findings)
    return {
        "schema": SCHEMA,
        "stream": str(run.path),
        "stream_sha256": stream_sha256,
        "verdict": "fail" if failed else "pass",
        "exact": exact,
        # false when no token was replayed (another model, say): "exact" is then false unproven
        "replayed": replayed is not None,
        "consistent": consistent,
        # the claimed score: the stream's own ratios, from in-process timing; the verified score is
        # audit retime's (retime.json), from its own legs
        "score": claimed_score,
        "claimed_score": claimed_score,
        "score_params": dict(params),
        # more than UNSTABLE_RUN_SHARE of the prompts have legs apart by more than LEG_SPREAD_LIMIT:
        # the median ratio may be noise (a warning: verdict and score do not depend on it)
        "unstable": checks.run_unstable(run.prompts),
        "median_ratio": median,
        # the median's distribution-free interval over the stream's prompts (audit.interval): a
        # claimed score only when its bottom lies above 1
        "claimed_interval": {"low": low, "high": high, "confidence": coverage, "how": how,
                             "significant": significant(low)},
        "f_mem": f_mem,
        # peaks are each side's own: raw allocator peak less the other decoder's resident bytes
        # when the header records them (resident_bytes, null otherwise)
        "memory": {"control_peak_bytes": ctl_peak, "candidate_peak_bytes": cand_peak, "ratio": mem_ratio,
                   "resident_bytes": resident},
        "replay": replay_info,
        "model": model_identity,
        "header_model": run.header["model"],
        "candidate": run.header["candidate"]["name"],
        "reference": run.header["control"].get("name"),
        "instrument": instrument,
        "prompts": [prompt_entry(run, p, per_prompt[p.id], replayed[p.id] if replayed else None)
                    for p in run.prompts],
        "findings": findings,
    }


# --------------------------------------------------------------------------- table


def fmt_ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def fmt_divergence(d: dict | None) -> str:
    if d is None:
        return "-"
    if d["greedy"] is None:
        return f"{d['leg']} @{d['position']}: {d['emitted']} after serial stopped"
    if d["emitted"] is None:
        return f"{d['leg']} @{d['position']}: ended, greedy {d['greedy']}"
    margin = "-" if d["margin"] is None else f"{d['margin']:.3g}"
    control = "pick" if d.get("reason") == NOT_PICK else "greedy"
    return f"{d['leg']} @{d['position']}: {d['emitted']} vs {control} {d['greedy']} (margin {margin})"


def fmt_memory(ctl, cand) -> str:
    if ctl is None or cand is None:
        return "-"
    return f"{cand / ctl:.2f}x" if ctl > 0 else "?"


def fmt_exact(doc: dict, exact: bool) -> str:
    if not doc.get("replayed", True):
        return "not replayed"
    return "yes" if exact else "NO"


def render_table(doc: dict) -> str:
    rows = [("prompt", "tokens", "exact", "first divergence", "ratio", "harness", "mem", "warm")]
    for e in doc["prompts"]:
        rows.append((e["id"], str(e["tokens"]), "-" if not doc["replayed"] else "yes" if e["exact"] else "NO",
                     fmt_divergence(e["first_divergence"]),
                     fmt_ratio(e["ratio"]), fmt_ratio(e["harness_ratio"]),
                     fmt_memory(e["control_peak_bytes"], e["candidate_peak_bytes"]),
                     "FLAG" if e["warm_leg_flag"] else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i in (0, 3) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in rows]
    lines.insert(1, "-" * max(len(x) for x in lines))
    lines += finding_lines(doc["findings"])
    rp, sp = doc["replay"], doc["score_params"]
    lines.append("")
    if rp["tokens_replayed"]:
        workers = rp.get("workers", 1)
        lines.append(f"replay: {rp['tokens_replayed']} tokens in {rp['seconds']:.2f} s "
                     f"({rp['ms_per_token']:.2f} ms/token{f', {workers} workers' if workers > 1 else ''}) "
                     f"on {rp['device']} via {rp['path']}")
    else:
        lines.append("replay: no tokens replayed")
    lines.append(f"claimed (in-process timing): median ratio {fmt_ratio(doc['median_ratio'])}  f_mem {doc['f_mem']:.3f}  "
                 f"score {doc['claimed_score']:.4f}  (S_max {sp['s_max']:g}, kappa {sp['kappa']:g}, "
                 f"mem allowance {sp['mem_allowance']:g}); the verified score is audit retime's")
    lines.append(f"claimed interval: {interval_line(doc['claimed_interval'])}")
    unstable = len({f["prompt_id"] for f in doc["findings"] if f["check"] == "unstable"})
    if unstable:
        lines.append(f"WARNING: {unstable} of {len(doc['prompts'])} prompts have unstable legs (spread > "
                     f"{LEG_SPREAD_LIMIT:.0%})" + ("; the run is unstable: its median ratio may be within noise, "
                                                   "rerun with more --legs on a quieter machine"
                                                   if doc["unstable"] else ""))
    lines.append(f"verdict: {doc['verdict'].upper()}  exact: {fmt_exact(doc, doc['exact'])}  "
                 f"consistent: {'yes' if doc['consistent'] else 'NO'}  candidate: {doc['candidate']}"
                 + ("  (instrument: never scored)" if doc["instrument"] else ""))
    return "\n".join(lines)


def interval_line(ci: dict) -> str:
    """The median's interval and whether it lets a score be given."""
    if ci["low"] is None:
        return f"{ci['how']}: no score"
    told = "above 1" if ci["significant"] else "not above 1: no score"
    return f"[{ci['low']:.3f}, {ci['high']:.3f}] ({ci['how']}), {told}"


def finding_lines(findings: list[dict]) -> list[str]:
    """The findings section of a printed table (nothing when there are none)."""
    if not findings:
        return []
    return ["", "findings:"] + [f"  {f['severity'].upper():<4} {f['check']}"
                                f"{f' [' + f['prompt_id'] + ']' if f['prompt_id'] else ''}: {f['message']}"
                                for f in findings]


def printable(text: str) -> str:
    """``text`` as any UTF-8 terminal or pipe takes it: a lone surrogate (a JSON ``"\\ud800"`` in a
    prompt id, a file name that is not UTF-8) is escaped as ``\\ud800`` instead of failing the print."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def write_document(out_path: Path | None, doc: dict, table: str) -> None:
    """Write an audit's JSON document in one piece, then print its table and where it went.
    ``out_path`` None: the document goes to stdout, the table to stderr. A document that cannot
    be JSON (a non-finite number) is refused before anything is written."""
    try:
        text = json.dumps(doc, indent=2, sort_keys=True, allow_nan=False)
    except ValueError as exc:
        raise BadInput(f"the audit computed a value JSON cannot hold ({exc}); nothing was written") from None
    if out_path is None:
        click.echo(printable(table), err=True)
        try:
            if sys.stdout is None:
                raise OSError("stdout is closed")
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
        except OSError as exc:
            raise BadInput(f"cannot write the document to stdout ({exc.strerror or exc}); "
                           "nothing was written") from None
        return
    try:
        write_json_atomic(out_path, doc)
    except OSError as exc:
        raise BadInput(f"cannot write {out_path}: {exc.strerror or exc}") from None
    click.echo(printable(table))
    click.echo(printable(f"wrote {out_path}"))
