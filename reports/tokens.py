"""A token audit (``audit tokens``' ``audit_tokens.json``) in the report: a per-generation exactness
table and a histogram of the divergences' logit gaps against the near-tie tolerance, wrong stops
beside them.

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
from reports.markdown import RENDERED_BY, cell, table

KIND = "tokens-audit"
SCHEMA = "qwen35-exact/tokens-audit/1"
FIGURE_STEM = "token_margins"
VERDICTS = ("exact", "near-ties only", "real divergences")
CLASSES = ("near-tie", "real", "stop")
CLASS_COLORS = {"near-tie": "#ef6c00", "real": "#c62828"}
STOP_COLOR = "#6a1b9a"


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
    """The divergences figure (``margins_figure``) saved to ``path``; False when nothing diverged."""
    fig = margins_figure(doc)
    return fig is not None and save(fig, path)


def margins_figure(doc: dict):
    """Histogram of the logit gap (greedy − emitted) at each first divergence on a token, by class,
    with the near-tie tolerance the class was decided by; wrong stops (no gap to draw) as a bar of
    their own at the right. None when nothing diverged."""
    gens = [g["first_divergence"] for g in doc["generations"] if g["first_divergence"]]
    divs = [d for d in gens if d["class"] in CLASS_COLORS and d.get("gap") is not None]
    stops = [d for d in gens if d["class"] == "stop"]
    if not divs and not stops:
        return None
    fig = new_figure(3.8)
    ax = fig.add_subplot()
    tols = sorted({d["tolerance"] for d in divs if d.get("tolerance") is not None})
    if doc["tie_margin"]["mode"] == "fixed":
        tols = [doc["tie_margin"]["value"]]
    top = max([d["gap"] for d in divs] + tols + [0.0]) or 1.0
    bins = [top * i / 20 for i in range(21)]
    data = [[d["gap"] for d in divs if d["class"] == c] for c in CLASS_COLORS]
    ax.hist(data, bins=bins, stacked=True, color=list(CLASS_COLORS.values()),
            label=[f"{c} ({len(v)})" for c, v in zip(CLASS_COLORS, data)])
    for i, tol in enumerate(tols):  # in ulps mode, one line per top-1 magnitude met
        ax.axvline(tol, color="black", linestyle="--", linewidth=1,
                   label=f"tie tolerance ({tolerance_text(doc)})" if i == 0 else None)
    stop_x = top * 1.12
    if stops:
        ax.bar(stop_x, len(stops), width=top / 20, color=STOP_COLOR, hatch="//", edgecolor="black",
               linewidth=0.4, label=f"stop ({len(stops)}): wrong stop, no gap")
        ticks = [t for t in ax.get_xticks() if 0 <= t <= top]
        ax.set_xticks(ticks + [stop_x], [f"{t:g}" for t in ticks] + ["stop"])
    ax.set_xlim(0, stop_x + top / 10 if stops else top * 1.05)
    ax.set_xlabel("greedy − emitted logit at the first divergence")
    ax.set_ylabel("generations")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(frameon=False, loc="upper center")
    sub = f"near-tie: gap at most the tolerance, {tolerance_text(doc)}"
    titles(ax, f"Divergences ({len(divs) + len(stops)} of {doc['counts']['generations']} generations)", sub)
    return fig


# --------------------------------------------------------------------------- text


def num(x) -> str:
    return "—" if x is None else f"{x:.4g}"


def divergence_cell(d: dict | None, sampled: bool = False) -> str:
    """The emitted token against the control's: the argmax, or under a sampler its pick."""
    if d is None:
        return "—"
    if d["class"] == "stop":
        return f"@{d['position']}: {d.get('stop') or d.get('reason')}"
    return f"@{d['position']}: {d.get('emitted')} vs {'pick' if sampled else 'greedy'} {d.get('greedy')}"


def judged_sampler(doc: dict, g: dict):
    """The sampler a generation was judged under: its entry's, else the document's (``--sampling``)."""
    from core.sampling import Sampler, SamplerError

    try:
        return Sampler.from_json(g.get("sampler", doc.get("sampler")))
    except (SamplerError, TypeError) as exc:
        raise UserError(f"generation {g.get('id')!r}: sampler: {exc}") from None


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
    samplers = [judged_sampler(doc, g) for g in doc["generations"]]
    named = not all(sm.greedy for sm in samplers)  # then each line names what it was judged under
    head = ["generation", "tokens", "exact", "first divergence", "margin", "gap", "tolerance", "class"]
    gen_rows = []
    for g, sampler in zip(doc["generations"], samplers):
        d = g["first_divergence"]
        gen_rows.append([f"`{g['id']}`", g["output_tokens"], "yes" if g["exact"] else "**NO**",
                         divergence_cell(d, not sampler.greedy), num(d and d.get("margin")), num(d and d.get("gap")),
                         num(d and d.get("tolerance")), d["class"] if d else "—"]
                        + ([f"`{sampler.describe()}`"] if named else [])
                        + ([parting_cell(g.get("reference"))] if ref else []))
    parts = ["## Token audit", table(["", ""], rows)]
    if figure:
        parts.append(f"![Divergences]({figure})")
    else:
        parts.append("No generation diverged on a token or a stop: nothing to draw.")
    parts += ["A divergence is a near-tie when the pristine logit of the greedy token exceeds the emitted "
              "token's by at most the tolerance (the order of the arithmetic alone can flip it); above it, or a "
              "wrong stop, it is real. Margin: greedy top-1 − top-2 logit; gap: greedy − emitted logit.",
              table(head + (["sampler"] if named else []) + (["vs reference"] if ref else []), gen_rows)]
    return "\n\n".join(parts)


def report_text(doc: dict, figure: str | None, source: str) -> str:
    """A whole report for a directory that holds a token audit and no run."""
    model = (doc.get("model") or {}).get("name", "?")
    title = f"# Token audit: {cell(Path(doc['file']).name)} · {model} · {doc['verdict']}"
    return title + "\n\n" + section(doc, figure, source) + "\n\n" + RENDERED_BY + "\n"
