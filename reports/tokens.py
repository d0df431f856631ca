"""A token audit (``audit tokens``' ``audit_tokens.json``) in the report: a per-generation exactness
table and a histogram of the divergence margins.

A run directory holding only ``audit_tokens.json`` (beside the engine's generations) gets a report
of its own (``report_text``); beside a ``stream.jsonl`` the same section is appended to the run's
report (``section``). The document is checked for the fields read here (``load_tokens_audit``);
anything wrong is a ``UserError`` naming the field.
"""
from __future__ import annotations

import math
from pathlib import Path

from matplotlib.ticker import MaxNLocator

from core.errors import UserError
from reports.figures import new_figure, save, titles
from reports.load import read_json
from reports.markdown import cell, table

KIND = "tokens-audit"
SCHEMA = "qwen35-exact/tokens-audit/1"
FIGURE_STEM = "token_margins"
VERDICTS = ("exact", "near-ties only", "real divergences")
CLASSES = ("near-tie", "real", "stop")
CLASS_COLORS = {"near-tie": "#ef6c00", "real": "#c62828"}


# --------------------------------------------------------------------------- reading


def load_tokens_audit(path: Path) -> dict:
    """Parse ``audit_tokens.json`` and check every field the report reads."""
    doc = read_json(path)
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise UserError(f"{path}: not a token audit (its 'kind' is not {KIND!r})")
    if doc.get("schema") != SCHEMA:
        raise UserError(f"{path}: unknown token-audit schema {doc.get('schema')!r} (this tool reads {SCHEMA})")
    need(path, doc, "verdict", lambda v: v in VERDICTS, " or ".join(map(repr, VERDICTS)))
    need(path, doc, "file", lambda v: isinstance(v, str), "a path")
    need(path, doc, "max_new_tokens", is_int, "an integer")
    need(path, doc, "counts", lambda v: isinstance(v, dict) and all(is_int(v.get(k)) for k in ("generations", "exact")
                                                                   + CLASSES), "counts of each class")
    need(path, doc, "tie_margin", lambda v: isinstance(v, dict) and v.get("mode") in ("ulps", "fixed"),
         "an object with mode 'ulps' or 'fixed'")
    need(path, doc, "generations", lambda v: isinstance(v, list), "a list")
    for i, g in enumerate(doc["generations"]):
        where = f"generations[{i}]."
        if not isinstance(g, dict):
            raise UserError(f"{path}: generations[{i}] is not an object")
        need(path, g, "id", lambda v: isinstance(v, str) and v != "", "a string", where)
        need(path, g, "exact", lambda v: isinstance(v, bool), "true or false", where)
        need(path, g, "output_tokens", is_int, "an integer", where)
        d = g.get("first_divergence")
        if d is not None:
            where += "first_divergence."
            if not isinstance(d, dict):
                raise UserError(f"{path}: {where[:-1]} must be an object or null")
            need(path, d, "position", is_int, "a token position", where)
            need(path, d, "class", lambda v: v in CLASSES, " or ".join(CLASSES), where)
            for key in ("margin", "gap", "tolerance"):
                if d.get(key) is not None and not is_num(d[key]):
                    raise UserError(f"{path}: {where}{key} must be a finite number or null")
    return doc


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def need(path, obj: dict, key: str, ok, what: str, prefix: str = "") -> None:
    if key not in obj:
        raise UserError(f"{path}: lacks '{prefix}{key}'")
    if not ok(obj[key]):
        raise UserError(f"{path}: {prefix}{key} must be {what}, not {obj[key]!r:.60}")


# --------------------------------------------------------------------------- figure


def plot_margins(doc: dict, path: Path) -> bool:
    """Histogram of the top-1/top-2 margin at each first divergence (stops have none), by class.
    False when no generation diverged on a token."""
    divs = [g["first_divergence"] for g in doc["generations"]
            if g["first_divergence"] and g["first_divergence"]["margin"] is not None
            and g["first_divergence"]["class"] in CLASS_COLORS]
    if not divs:
        return False
    fig = new_figure(3.8)
    ax = fig.add_subplot()
    top = max(d["margin"] for d in divs)
    bins = [top * i / 20 for i in range(21)] if top > 0 else [0.0, 1.0]
    data = [[d["margin"] for d in divs if d["class"] == c] for c in CLASS_COLORS]
    ax.hist(data, bins=bins, stacked=True, color=list(CLASS_COLORS.values()),
            label=[f"{c} ({len(v)})" for c, v in zip(CLASS_COLORS, data)])
    tm = doc["tie_margin"]
    if tm["mode"] == "fixed":
        ax.axvline(tm["value"], color="black", linestyle="--", linewidth=1, label=f"tie margin {tm['value']:g}")
        sub = f"near-tie: greedy logit at most {tm['value']:g} above the emitted token's"
    else:
        sub = f"near-tie: within {tm['ulps']} ulps of {tm.get('dtype', 'bf16')} at the top-1 logit"
    ax.set_xlabel("top-1 − top-2 logit at the first divergence")
    ax.set_ylabel("generations")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(frameon=False, loc="upper center")
    titles(ax, f"Divergence margins ({len(divs)} of {doc['counts']['generations']} generations)", sub)
    return save(fig, path)


# --------------------------------------------------------------------------- text


def num(x) -> str:
    return "—" if x is None else f"{x:.4g}"


def divergence_cell(d: dict | None) -> str:
    if d is None:
        return "—"
    if d["class"] == "stop":
        return f"@{d['position']}: {d.get('stop') or d.get('reason')}"
    return f"@{d['position']}: {d.get('emitted')} vs greedy {d.get('greedy')}"


def parting_cell(p) -> str:
    if p is None:
        return "no counterpart"
    if not p.get("parts"):
        return "same output"
    greedy = "serial stops" if p.get("greedy") is None else f"greedy {p['greedy']}"
    return (f"@{p['position']}: {p.get('emitted')} vs ref {p.get('reference')}, {greedy}, margin {num(p.get('margin'))} "
            f"({p.get('class')}); {p.get('cause')}")


def tolerance_text(doc: dict) -> str:
    tm = doc["tie_margin"]
    if tm["mode"] == "fixed":
        return f"{tm['value']:g} (--tie-margin)"
    return f"{tm['ulps']} ulps of {tm.get('dtype', 'bf16')} at the top-1 logit"


def section(doc: dict, figure: str | None, source: str) -> str:
    """The token audit as one report section; ``figure`` is the histogram's relative path or None."""
    c = doc["counts"]
    model = doc.get("model") or {}
    replay = doc.get("replay") or {}
    rows = [
        ["Verdict", f"**{doc['verdict'].upper()}**"],
        ["Generations", f"{c['generations']}: {c['exact']} exact, {c['near-tie']} near-tie, {c['real']} real, "
                        f"{c['stop']} stop"],
        ["File", f"`{doc['file']}`"],
        ["Model", f"`{model.get('name', '?')}`"],
        ["Replay", f"{replay.get('path', '?')} on {replay.get('device', '?')}, "
                   f"{replay.get('tokens_replayed', '?')} positions"],
        ["N", f"{doc['max_new_tokens']} ({doc.get('n_from', '?')})"],
        ["Near-tie tolerance", tolerance_text(doc)],
        ["audit_tokens.json", f"`{source}`"],
    ]
    ref = doc.get("reference")
    if ref:
        rows.append(["Reference", f"`{ref.get('file')}` (matched by {ref.get('matched_by')}): {ref.get('parted')} part, "
                                  f"{ref.get('speculation_changed')} where speculation changed a greedy output"])
    head = ["generation", "tokens", "exact", "first divergence", "margin", "gap", "tolerance", "class"]
    gen_rows = []
    for g in doc["generations"]:
        d = g["first_divergence"]
        gen_rows.append([f"`{g['id']}`", g["output_tokens"], "yes" if g["exact"] else "**NO**", divergence_cell(d),
                         num(d and d.get("margin")), num(d and d.get("gap")), num(d and d.get("tolerance")),
                         d["class"] if d else "—"] + ([parting_cell(g.get("reference"))] if ref else []))
    parts = ["## Token audit", table(["", ""], rows)]
    if figure:
        parts.append(f"![Divergence margins]({figure})")
    else:
        parts.append("No generation diverged on a token: no margins to draw.")
    parts += ["A divergence is a near-tie when the pristine logit of the greedy token exceeds the emitted "
              "token's by at most the tolerance (the order of the arithmetic alone can flip it); above it, or a "
              "wrong stop, it is real. Margin: greedy top-1 − top-2 logit; gap: greedy − emitted logit.",
              table(head + (["vs reference"] if ref else []), gen_rows)]
    return "\n\n".join(parts)


def report_text(doc: dict, figure: str | None, source: str) -> str:
    """A whole report for a directory that holds a token audit and no run."""
    model = (doc.get("model") or {}).get("name", "?")
    title = f"# Token audit: {cell(Path(doc['file']).name)} · {model} · {doc['verdict']}"
    return title + "\n\n" + section(doc, figure, source) + "\n\nRendered by `reports render`.\n"
