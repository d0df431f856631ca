"""The text of ``report.md``, built from the summary dict alone (see ``reports.summary``).

Order matters: the title, then any banner that changes how everything else must be read (NOT
AUDITED, an audit of another stream, a failed audit, a modified stream), then a one-screen summary
table, then one section per figure, the audit's details and the run's provenance. Where the run did
not record something the section says so in words ("not recorded", "n/a") instead of a figure.
"""
from __future__ import annotations

import json
from pathlib import Path

from reports.load import CONTROL_ROLE
from reports.summary import PHASES, describe_divergence

RENDERED_BY = "Rendered by `reports render`."  # a line of every report: how a render knows its own

FIGURE_TITLES = {
    "speedup": "Speedup per prompt",
    "ms_per_token": "Time per generated token",
    "acceptance": "Draft acceptance",
    "depth_trace": "Draft depth per round",
    "memory": "Peak memory per prompt",
    "time_split": "Time split of a decode",
}


def write_report(summary: dict, figures: dict, path: Path) -> Path:
    """Write the markdown report to ``path``; ``figures`` maps figure stems to relative paths (or None)."""
    path = Path(path)
    path.write_text(report_text(summary, figures), encoding="utf-8")
    return path


def report_text(summary: dict, figures: dict) -> str:
    parts = [title(summary), *[banner(b) for b in summary["banners"]], summary_table(summary),
             speedup_section(summary, figures), ms_per_token_section(summary, figures),
             acceptance_section(summary, figures), depth_section(summary, figures),
             memory_section(summary, figures), time_split_section(summary, figures),
             audit_section(summary), provenance_section(summary), appendix_section(summary)]
    return "\n\n".join(p.rstrip() for p in parts if p) + "\n"


# --------------------------------------------------------------------------- formatting


def ratio(x) -> str:
    return "—" if x is None else f"{x:.3f}×"


def secs(x) -> str:
    return "—" if x is None else f"{x:.4f}"


def ms(x) -> str:
    return "—" if x is None else f"{x:.2f}"


def mib(x) -> str:
    return "n/a" if x is None else f"{x / 2 ** 20:,.1f} MiB"


def cell(text) -> str:
    """Table cells: pipes and newlines would break the row."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def name_of(summary: dict, role: str) -> str:
    return next(d["name"] for d in summary["decoders"] if d["role"] == role)


def config_text(config: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in config.items()) if config else "no settings"


BRIEF_SETTINGS = 4  # settings a table cell shows; the appendix has every one


def config_brief(config: dict) -> str:
    """A decoder's configuration in a table cell: its first few plain settings (nested tables such as
    a calibration or measured costs, and unset values, are left to the appendix)."""
    plain = [(k, v) for k, v in config.items() if v is not None and not isinstance(v, (dict, list))]
    text = ", ".join(f"{k}={v}" for k, v in plain[:BRIEF_SETTINGS]) or "no settings"
    return text + ("; the full configuration is in the appendix" if len(config) > min(len(plain), BRIEF_SETTINGS) else "")


def figure(figures: dict, stem: str) -> str:
    return f"![{FIGURE_TITLES[stem]}]({figures[stem]})"


def others(summary: dict) -> list[str]:
    return [r for r in summary["roles"] if r != CONTROL_ROLE]


# --------------------------------------------------------------------------- sections


def title(summary: dict) -> str:
    cands = " / ".join(name_of(summary, r) for r in others(summary))
    model = summary["model"].get("name", "?")
    device = summary["device"].get("name") or summary["device"].get("type", "?")
    return f"# Run report: {cands} vs {name_of(summary, CONTROL_ROLE)} · {model} · {device}"


def banner(b: dict) -> str:
    return f"> ## ⚠ {b['title']}\n>\n> {b['text']}"


def summary_table(summary: dict) -> str:
    audit, model, primary = summary["audit"], summary["model"], summary["primary_role"]
    sampling = summary["sampler"]
    audited = audit["status"] in ("pass", "fail")
    model_bits = [model.get("kind")]
    if model.get("weights_fingerprint"):
        model_bits.append(f"weights {model['weights_fingerprint'][:12]}…")
    device = summary["device"]
    decoders = " · ".join(f"{d['role']}: **{d['name']}** ({config_brief(d['config'])})" for d in summary["decoders"])
    med = []
    for role in others(summary):
        text = f"**{ratio(summary['median_ratio'][role])}**"
        if len(summary["roles"]) > 2:
            text += f" {name_of(summary, role)}"
        med.append(text)
    med_text = ", ".join(med) + " control median ÷ candidate's first leg, recomputed from the raw legs"
    extra = [f"harness's own: {ratio(summary['harness_median_ratio'])}"]
    if audited:
        extra.append(f"audit's: {ratio(audit.get('median_ratio'))}")
    med_text += f" ({'; '.join(extra)})"
    if audited:
        params = ", ".join(f"{k}={v}" for k, v in audit["score_params"].items())
        score = (f"**{audit['score']:.3f}** (claimed, from in-process timing; audit verdict: "
                 f"**{audit['verdict'].upper()}**{'; ' + params if params else ''})")
        n_div = sum(p["verdict"] == "diverged" for p in summary["prompts"])
        n_unchecked = sum(p["verdict"] == "not replayed" for p in summary["prompts"])
        control = "serial greedy decoding" if sampling["greedy"] else f"serial sampling ({sampling['text']})"
        if audit["exact"]:
            exact = f"yes: every prompt's tokens equal {control} (audit)"
        else:
            bits = [f"{n_div} of {summary['prompt_count']} prompts diverge from {control.replace(' decoding', '')}"
                    ] if n_div else []
            bits += [f"{n_unchecked} not replayed (tokens unverified)"] if n_unchecked else []
            exact = "**NO**" + (": " + ", ".join(bits) if bits else "") + " (audit)"
    else:
        why = "not audited" if audit["status"] == "not audited" else "audit.json is for another stream: not audited"
        score, exact = f"— ({why})", f"unknown ({why})"
    div = summary["first_divergence"]
    rows = [
        ["Model", " ".join([f"`{model.get('name', '?')}`"] + [f"({', '.join(b for b in model_bits if b)})"])],
        ["Device", f"{device.get('name', '?')} [{device.get('type', '?')}], {summary['dtype']}"],
        ["Decoders", decoders],
        ["Prompts", str(summary["prompt_count"])
         + (f" ({summary['prompt_source']})" if summary["prompt_source"] else "")],
        ["N (max new tokens)", str(summary["max_new_tokens"])],
        ["Sampling", sampling_text(sampling)],
        ["Legs", f"{summary['legs_per_side']} per side per prompt, ABBA ({summary['leg_records']} timed decodes)"],
        ["Median ratio", med_text],
        ["Score", score],
        ["Verified (audit retime)", verified_text(summary["retime"])],
        ["Exact", exact],
        ["First divergence", describe_divergence(div) + (f" — {div['reason']}" if div.get("reason") else "")
         if div else ("unknown (not audited)" if not audited else "none" if audit["exact"]
                      else "none recorded: the audit did not replay the tokens (see its findings)")],
        ["ms/token", " · ".join(f"{name_of(summary, r)} {ms(summary['ms_per_token_median'][r])}"
                                for r in summary["roles"]) + " (median over prompts)"],
    ]
    acc = summary["acceptance"].get(primary)
    if acc and acc["mean_accepted_length"] is not None:
        rows.append(["Mean accepted length", f"{acc['mean_accepted_length']:.2f} tokens per verification round "
                                             f"({name_of(summary, primary)}, {temperature_text(sampling)})"])
    return "## Summary\n\n" + table(["", ""], rows)


def sampling_text(sampling: dict) -> str:
    if sampling["greedy"]:
        return "greedy (argmax)"
    return (f"`{sampling['text']}` ({sampling['name']}): each token the sampler's pick at its absolute position, "
            "on both sides; the audit replays with it")


def temperature_text(sampling: dict) -> str:
    return "greedy" if sampling["greedy"] else f"temperature {sampling['temperature']:g}"


def speedup_section(summary: dict, figures: dict) -> str:
    roles = others(summary)
    primary = summary["primary_role"]
    head = ["prompt", "prompt tokens", "new tokens", f"{name_of(summary, CONTROL_ROLE)} median (s)"]
    head += [h for r in roles for h in (f"{name_of(summary, r)} first leg (s)", f"{name_of(summary, r)} median (s)")]
    head += [f"ratio {name_of(summary, r)} (raw legs)" for r in roles]
    head += ["harness ratio", "audit ratio", "exact"]
    rows = []
    for p in summary["prompts"]:
        verdict = {"not audited": "not audited", "exact": "yes",
                   "not replayed": "**unverified** (not replayed)"}.get(p["verdict"])
        if verdict is None:
            verdict = f"**NO** (token {p['first_divergence'].get('position', '?')})"
        if p["warm_leg_flag"]:
            verdict += "; warm-leg flag"
        rows.append([f"`{p['id']}`", p["prompt_tokens"], p["new_tokens"].get(primary, "—"),
                     secs(p["median_s"][CONTROL_ROLE])]
                    + [secs(v) for r in roles for v in (p["first_s"].get(r), p["median_s"].get(r))]
                    + [ratio(p["ratio"].get(r)) for r in roles]
                    + [ratio(p["harness_ratio"]), ratio(p["audit_ratio"]), verdict])
    return ("## Speedup per prompt\n\n" + figure(figures, "speedup") + "\n\n"
            "Medians over each prompt's timed legs; ratio = control median ÷ the candidate's first timed leg "
            "(its first encounter with the prompt), so the control median divided by the first-leg column "
            "gives the ratio column; the candidate's median is shown beside it. "
            "The harness and audit columns are their own numbers, shown for comparison.\n\n"
            + table(head, rows))


def ms_per_token_section(summary: dict, figures: dict) -> str:
    roles = summary["roles"]
    head = ["prompt"] + [f"{name_of(summary, r)} ms/token" for r in roles] + \
           [f"{name_of(summary, r)} legs (ms/token)" for r in roles]
    rows = [[f"`{p['id']}`"] + [ms(p["ms_per_token"].get(r)) for r in roles]
            + [", ".join(f"{v:.2f}" for v in p["leg_ms_per_token"].get(r, [])) for r in roles]
            for p in summary["prompts"]]
    return ("## Time per generated token\n\n" + figure(figures, "ms_per_token") + "\n\n"
            "Per leg: wall time ÷ tokens emitted; per prompt: the median over legs.\n\n" + table(head, rows))


def acceptance_section(summary: dict, figures: dict) -> str:
    acc = {r: a for r, a in summary["acceptance"].items() if a}
    if not acc:
        return "## Draft acceptance\n\nNot recorded: no decoder in this run drafted tokens."
    rows = []
    sampling = summary["sampler"]
    for role, a in acc.items():
        by_depth = ", ".join("—" if r is None else f"{100 * r:.0f}%" for r in a["rate_by_depth"])
        hist = ", ".join(f"{k}: {v}" for k, v in a["hist"].items())
        rows.append([name_of(summary, role), temperature_text(sampling), a["legs"], a["rounds"],
                     "—" if a["mean_accepted_length"] is None else f"{a['mean_accepted_length']:.2f}",
                     hist, by_depth])
    # a draft is accepted when it equals the control's token: the argmax, or under a sampler its pick
    accepted = ("" if sampling["greedy"] else
                f" Under the sampler `{sampling['text']}` a draft counts as accepted when it equals the "
                "sampler's pick at its position.")
    return ("## Draft acceptance\n\n" + figure(figures, "acceptance") + "\n\n"
            "Summed over all timed legs. Mean accepted length = tokens emitted per verification round "
            f"(accepted drafts + the model's own token).{accepted}\n\n"
            + table(["decoder", "sampler", "legs", "rounds", "mean accepted length", "rounds by drafts accepted",
                     "accepted by depth (1, 2, …)"], rows))


def depth_section(summary: dict, figures: dict) -> str:
    depth = summary["depth"]
    if figures.get("depth_trace"):
        n = len(depth["prompts"])
        return ("## Draft depth per round\n\n" + figure(figures, "depth_trace") + "\n\n"
                f"From the decoders' `depth_trace` (first leg of each prompt); {n} prompt(s) carry one.")
    text = "## Draft depth per round\n\nNot recorded: no leg's stats carry a `depth_trace`."
    if depth["fixed_k"] is not None:
        text += (f" The candidate's configuration fixes the draft depth at k = {depth['fixed_k']} in every "
                 "round (from the header, not measured).")
    return text


def memory_section(summary: dict, figures: dict) -> str:
    audit_mem = summary["audit"].get("memory") or {}
    lines = ["## Peak memory"]
    if figures.get("memory"):
        roles = summary["roles"]
        rows = [[f"`{p['id']}`"] + [mib(p["peak_mem_bytes"].get(r)) for r in roles] for p in summary["prompts"]]
        lines += [figure(figures, "memory"), "Peak allocated device memory per prompt, max over legs.",
                  table(["prompt"] + [name_of(summary, r) for r in roles], rows)]
    else:
        lines.append(summary["memory"]["note"] + ".")
    if audit_mem and summary["audit"]["status"] in ("pass", "fail"):
        lines.append(f"Audit: control peak {mib(audit_mem.get('control_peak_bytes'))}, candidate peak "
                     f"{mib(audit_mem.get('candidate_peak_bytes'))}, ratio "
                     f"{'n/a' if audit_mem.get('ratio') is None else format(audit_mem['ratio'], '.3f')}, "
                     f"f_mem {summary['audit'].get('f_mem')}.")
    return "\n\n".join(lines)


def time_split_section(summary: dict, figures: dict) -> str:
    if not figures.get("time_split"):
        return ("## Time split of a decode\n\nNot recorded: no leg's stats carry a `time_split` "
                "(step / draft / verify / rollback / other).")
    rows_data = [(p, r) for p in summary["prompts"] for r in summary["roles"] if p["time_split"].get(r)]
    phases = list(PHASES)
    for p, r in rows_data:
        phases += [ph for ph in p["time_split"][r] if ph not in phases]
    rows = []
    for p, r in rows_data:
        split = p["time_split"][r]
        total = sum(split.values())
        rows.append([f"`{p['id']}`", name_of(summary, r)]
                    + [f"{1e3 * split[ph]:.2f} ({100 * split[ph] / total:.0f}%)" if ph in split and total else "—"
                       for ph in phases] + [f"{1e3 * total:.2f}"])
    return ("## Time split of a decode\n\n" + figure(figures, "time_split") + "\n\n"
            "Milliseconds per decode by phase (median over legs that recorded a split), share of the total in "
            "brackets. step: plain steps (a probe's step included); verify: the verify windows of drafted "
            "rounds.\n\n" + table(["prompt", "decoder"] + phases + ["total"], rows))


def verified_text(retime: dict) -> str:
    """The retime's verified ratio, interval and score (the figures to quote), or why there are none."""
    status = retime["status"]
    if status == "not retimed":
        return "— (not retimed: `audit retime` measures the verified figures)"
    if status == "mismatch":
        return "— (retime.json is for another stream)"
    if retime["verified_ratio"] is None:
        return f"— ({status.upper()}: {retime.get('reason') or 'nothing verified'})"
    ci = ("" if retime["ci_low"] is None else f", 95% interval [{retime['ci_low']:.3f}, {retime['ci_high']:.3f}]")
    failing = f"; failing: {', '.join(retime['failing'])}" if retime["failing"] else ""
    return (f"**{ratio(retime['verified_ratio'])}**{ci}, score **{retime['verified_score']:.3f}** "
            f"(retime verdict: **{status.upper()}**{failing}; claimed {ratio(retime['claimed_ratio'])}, "
            f"{retime['prompts']} fresh prompts)")


def audit_section(summary: dict) -> str:
    audit = summary["audit"]
    if audit["status"] == "not audited":
        return ("## Audit\n\n**NOT AUDITED.** No audit.json next to this stream. Speed numbers above are the "
                "harness's raw measurements; exactness and score are unknown.")
    if audit["status"] == "mismatch":
        return ("## Audit\n\n**audit.json does not match this stream.** It names stream "
                f"`{audit.get('stream')}` with sha256 `{audit['stream_sha256']}`; this run's stream.jsonl has "
                f"sha256 `{summary['stream']['sha256']}`. None of its results are shown.")
    replay = audit["replay"]
    lines = [
        "## Audit",
        table(["", ""], [
            ["audit.json", f"`{audit['path']}`"],
            ["Verdict", f"**{audit['verdict'].upper()}**"],
            ["Exact", "yes" if audit["exact"] else "**NO**"],
            ["Consistent", "yes" if audit["consistent"] else "**NO**"],
            ["Score", f"{audit['score']:.4f} claimed, from in-process timing ({config_text(audit['score_params'])})"],
            ["Verified (audit retime)", verified_text(summary["retime"])],
            ["Median ratio (audit)", ratio(audit["median_ratio"])],
            ["Replay", replay_text(replay)],
            ["Candidate", f"{audit.get('candidate')} (instrumented: {'yes' if audit.get('instrument') else 'no'})"],
        ]),
    ]
    divs = [p for p in summary["prompts"] if p["first_divergence"]]
    if divs:
        rows = []
        for p in divs:
            d = p["first_divergence"]
            top5 = ", ".join(f"{t}:{v:.3g}" for t, v in d.get("top5") or [])
            rows.append([f"`{p['id']}`", d.get("leg", "—"), d.get("position", "—"), d.get("emitted"),
                         d.get("greedy"), "—" if d.get("margin") is None else f"{d['margin']:.4g}", top5 or "—",
                         d.get("reason", "—")])
        lines += ["### Divergences", table(["prompt", "leg", "position", "emitted", "greedy", "margin",
                                            "top-5 (id:logit)", "reason"], rows)]
    findings = audit["findings"]
    if findings:
        order = sorted(findings, key=lambda f: f["severity"] != "fail")
        lines += ["### Findings", table(["severity", "check", "prompt", "message"],
                                        [[f["severity"].upper(), f["check"], f.get("prompt_id") or "—",
                                          f["message"]] for f in order])]
    else:
        lines.append("No findings.")
    return "\n\n".join(lines)


def replay_text(replay: dict) -> str:
    if not replay.get("tokens_replayed"):
        return "no tokens replayed"
    per_token = replay.get("ms_per_token")
    return (f"{replay.get('path', '?')} on {replay.get('device', '?')}: {replay['tokens_replayed']} tokens in "
            f"{replay.get('seconds') or 0:.1f} s" + (f" ({per_token:.2f} ms/token)" if per_token is not None else ""))


def provenance_section(summary: dict) -> str:
    s = summary["stream"]
    integ = s["integrity"]
    versions = ", ".join(f"{k} {v}" for k, v in summary["versions"].items() if v)
    rows = [
        ["stream.jsonl", f"`{s['path']}`"],
        ["sha256", f"`{s['sha256']}`"],
        ["Records", f"{s['records']} (end record: count {'ok' if integ['count_ok'] else 'MISMATCH'}, "
                    f"sha256 {'ok' if integ['sha256_ok'] else 'MISMATCH'})"],
        ["Created", s.get("created") or "—"],
        ["Command", f"`{' '.join(s['command'])}`" if s.get("command") else "—"],
        ["Versions", versions or "—"],
        ["Model identity", f"`{json.dumps(summary['model'], sort_keys=True)}`"],
    ]
    return "## Provenance\n\n" + table(["", ""], rows) + "\n\n" + RENDERED_BY


def appendix_section(summary: dict) -> str:
    """Every decoder's full configuration, as the stream's header records it."""
    parts = ["## Appendix: decoder configurations"]
    for d in summary["decoders"]:
        parts += [f"### {d['role']}: {d['name']}",
                  "```json\n" + json.dumps(d["config"], indent=2, sort_keys=True) + "\n```"]
    return "\n\n".join(parts)
