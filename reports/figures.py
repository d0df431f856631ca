"""The report's figures: one ``plot_*`` function per PNG, each drawn from the summary dict alone.

Headless by construction: figures are ``matplotlib.figure.Figure`` objects on an explicit Agg
canvas, never pyplot, so no display or global backend state is involved. Each function returns
True when it wrote ``path`` and False when the run has nothing to draw (the report then says
"not recorded" / "n/a" instead of showing an empty or invented figure).

Per-prompt figures use horizontal bars so long prompt ids stay readable on the y axis, and grow
in height with the number of prompts. Every role in the run (control, candidate, and any future
ones) is one series; nothing assumes exactly two decoders.
"""
from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from reports.load import CONTROL_ROLE
from reports.summary import PRIMARY_ROLE

DPI = 110
WIDTH = 9.0  # inches; ~1000 px at DPI, readable on one screen
LABEL_CHARS = 38  # longer prompt ids are shortened in tick labels (the report's tables show them whole)
ROLE_COLORS = {CONTROL_ROLE: "#7f7f7f", PRIMARY_ROLE: "#1f77b4"}
EXTRA_COLORS = ["#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
VERDICT_COLORS = {"exact": "#2e7d32", "diverged": "#c62828", "not replayed": "#ef6c00", "not audited": "#9e9e9e"}
PHASE_COLORS = {"step": "#55a868", "draft": "#4c72b0", "verify": "#dd8452", "rollback": "#c44e52",
                "other": "#b0b0b0"}
DEPTH_TRACE_PROMPTS = 4
LABEL_BOX = {"facecolor": "white", "edgecolor": "none", "pad": 0.6}


# --------------------------------------------------------------------------- helpers


PHASE_LABELS = {"step": "step (plain steps)", "verify": "verify (windows)"}


def new_figure(height: float, width: float = WIDTH) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)  # the Agg canvas, explicitly: no GUI backend is ever consulted
    return fig


def save(fig: Figure, path: Path) -> bool:
    fig.savefig(path, dpi=DPI, facecolor="white")
    return True


def per_prompt_height(rows: int) -> float:
    """Room for one labelled bar group per row plus title, axis label and a legend underneath."""
    return max(3.2, 0.42 * rows + 2.3)


def short(text: str, limit: int = LABEL_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def role_color(summary: dict, role: str) -> str:
    if role in ROLE_COLORS:
        return ROLE_COLORS[role]
    extras = [r for r in summary["roles"] if r not in ROLE_COLORS]
    return EXTRA_COLORS[extras.index(role) % len(EXTRA_COLORS)]


def role_label(summary: dict, role: str) -> str:
    """The decoder's name; the control says so, and a name shared by two roles gets its role."""
    names = [d["name"] for d in summary["decoders"]]
    name = names[summary["roles"].index(role)]
    if role == CONTROL_ROLE:
        return f"{name} (control)"
    return f"{name} [{role}]" if names.count(name) > 1 else name


def titles(ax, main: str, sub: str | None = None) -> None:
    """A bold title centred on the plot area (a figure suptitle drifts off-centre next to long
    prompt labels) and an optional smaller line under it."""
    ax.set_title(main, fontsize=12, fontweight="bold", pad=20 if sub else 8)
    if sub:
        ax.text(0.5, 1.015, sub, transform=ax.transAxes, ha="center", va="bottom", fontsize=9.5)


def legend_below(fig: Figure, handles: list) -> None:
    """One legend under the plot, in as many columns as fit the figure's width (a legend wider than
    the figure is clipped at both edges)."""
    budget = fig.get_figwidth() * 13  # characters of 8.5 pt text per row, with room for the patches
    ncols = len(handles)
    while ncols > 1:
        rows = -(-len(handles) // ncols)
        columns = [handles[i:i + rows] for i in range(0, len(handles), rows)]  # legends fill column-wise
        if sum(max(len(h.get_label()) + 6 for h in col) for col in columns) <= budget:
            break
        ncols -= 1
    fig.legend(handles=handles, loc="outside lower center", ncols=ncols, fontsize=8.5, frameon=False)


def amount(v: float) -> str:
    """Values written next to bars: three significant digits, never scientific notation."""
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def candidate_roles(summary: dict) -> list[str]:
    return [r for r in summary["roles"] if r != CONTROL_ROLE]


def group_offsets(n: int, band: float = 0.8) -> tuple[list[float], float]:
    """Offsets of n bars sharing one category slot, and each bar's thickness."""
    h = band / n
    return [(i - (n - 1) / 2) * h for i in range(n)], h


def prompt_axis(ax, summary: dict) -> None:
    ids = [p["id"] for p in summary["prompts"]]
    ax.set_yticks(range(len(ids)), [short(i) for i in ids])
    ax.set_ylim(len(ids) - 0.5, -0.5)  # first prompt on top, as in the tables
    ax.set_ylabel("prompt")


def verdict_text(verdict: str) -> str:
    return {"diverged": "DIVERGED", "not replayed": "NOT REPLAYED"}.get(verdict, verdict)


def bytes_unit(max_bytes: int) -> tuple[float, str]:
    return (2 ** 30, "GiB") if max_bytes >= 2 ** 30 else (2 ** 20, "MiB")


# --------------------------------------------------------------------------- figures


def plot_speedup(summary: dict, path: Path) -> bool:
    """Per-prompt speedup bars, coloured by the audit's per-prompt verdict, with the run's median."""
    prompts, roles = summary["prompts"], candidate_roles(summary)
    primary, audit = summary["primary_role"], summary["audit"]
    fig = new_figure(per_prompt_height(len(prompts) * max(1, len(roles) * 0.7)))
    ax = fig.add_subplot()
    offsets, h = group_offsets(len(roles))
    top = max([p["ratio"][r] for p in prompts for r in roles if r in p["ratio"]] + [1.0])
    for role, off in zip(roles, offsets):
        for i, p in enumerate(prompts):
            ratio = p["ratio"].get(role)
            if ratio is None:
                continue
            verdict = p["verdict"] if role == primary else "not audited"
            color = VERDICT_COLORS[verdict] if role == primary else role_color(summary, role)
            ax.barh(i + off, ratio, height=h * 0.9, color=color, edgecolor="black", linewidth=0.4)
            ax.text(ratio + top * 0.01, i + off, f"{ratio:.2f}×", va="center", fontsize=8.5,
                    bbox=LABEL_BOX, zorder=4)  # the box keeps reference lines from striking through
            tag = verdict_text(verdict)
            if verdict == "diverged":
                tag += f" at token {p['first_divergence'].get('position')}"
            # verdicts in a column right of the axes: never in the way of bars, lines or values
            ax.text(1.015, i + off, tag, transform=ax.get_yaxis_transform(), va="center", fontsize=8.5,
                    color=VERDICT_COLORS[verdict] if role == primary else "#555555",
                    fontweight="bold" if verdict in ("diverged", "not replayed") else "normal")
    ax.text(1.015, 1.01, "audit verdict", transform=ax.transAxes, va="bottom", fontsize=8.5, style="italic")
    ax.axvline(1.0, color="black", linewidth=1.0)
    handles = [Line2D([], [], color="black", linewidth=1.0, label="break-even (1×)")]
    for role in roles:
        m = summary["median_ratio"][role]
        ax.axvline(m, color=role_color(summary, role), linestyle="--", linewidth=1.4)
        handles.append(Line2D([], [], color=role_color(summary, role), linestyle="--", linewidth=1.4,
                              label=f"median {m:.2f}× ({role_label(summary, role)})"))
    shown = [v for v in VERDICT_COLORS if any(p["verdict"] == v for p in prompts)]
    owner = f"{role_label(summary, primary)}: " if len(roles) > 1 else ""  # verdicts are the audited role's
    handles += [Patch(color=VERDICT_COLORS[v], label=owner + verdict_text(v)) for v in shown]
    handles += [Patch(color=role_color(summary, r), label=f"{role_label(summary, r)}, not audited")
                for r in roles if r != primary]
    ax.set_xlim(0, top * 1.15)  # room for the value written after each bar
    prompt_axis(ax, summary)
    ax.set_xlabel("speedup = control median time ÷ candidate's first leg  (×; above 1 is faster)")
    ax.grid(axis="x", alpha=0.3)
    control = role_label(summary, CONTROL_ROLE)
    titles(ax, f"Speedup per prompt vs {control}",
           f"median {summary['median_ratio'][primary]:.3f}×  ·  score {_score_text(audit)}  ·  "
           f"audit: {_audit_text(audit)}")
    legend_below(fig, handles)
    return save(fig, path)


def plot_ms_per_token(summary: dict, path: Path) -> bool:
    """Median ms per generated token per prompt and role, with each leg as a dot."""
    prompts, roles = summary["prompts"], summary["roles"]
    fig = new_figure(per_prompt_height(len(prompts) * max(1, len(roles) * 0.6)))
    ax = fig.add_subplot()
    offsets, h = group_offsets(len(roles))
    top = max((v for p in prompts for vals in p["leg_ms_per_token"].values() for v in vals), default=1.0)
    for role, off in zip(roles, offsets):
        color = role_color(summary, role)
        for i, p in enumerate(prompts):
            med = p["ms_per_token"].get(role)
            if med is None:
                continue
            ax.barh(i + off, med, height=h * 0.9, color=color, alpha=0.85, edgecolor="black", linewidth=0.4)
            legs = p["leg_ms_per_token"][role]
            # the legs' spread as a line from the bar, so the value written after it reads as this bar's
            ax.plot([min([med] + legs), max([med] + legs)], [i + off] * 2, color="black", linewidth=0.8, zorder=3)
            ax.plot(legs, [i + off] * len(legs), "o", color="black", markersize=3.5, zorder=3)
            ax.text(max([med] + legs) + top * 0.012, i + off, amount(med), va="center", fontsize=8.5,
                    bbox=LABEL_BOX, zorder=4)
    handles = [Patch(color=role_color(summary, r), alpha=0.85,
                     label=f"{role_label(summary, r)}: median {summary['ms_per_token_median'][r]:.1f} ms/token")
               for r in roles]
    handles.append(Line2D([], [], marker="o", color="black", linestyle="none", markersize=3.5,
                          label="one timed leg"))
    ax.set_xlim(0, top * 1.15)
    prompt_axis(ax, summary)
    ax.set_xlabel("milliseconds per generated token  (bar: median over legs; lower is faster)")
    ax.grid(axis="x", alpha=0.3)
    titles(ax, "Time per generated token",
           f"N = {summary['max_new_tokens']} new tokens, {summary['legs_per_side']} legs per side, "
           f"{summary['device'].get('name', '?')}")
    legend_below(fig, handles)
    return save(fig, path)


def plot_acceptance(summary: dict, path: Path) -> bool:
    """Left: share of verification rounds accepting k drafts. Right: acceptance rate per draft depth."""
    acc = {r: a for r, a in summary["acceptance"].items() if a}
    if not acc:
        return False
    fig = new_figure(4.3, WIDTH + 1)
    left, right = fig.subplots(1, 2)
    offsets, w = group_offsets(len(acc))
    dmax = max(len(a["drafted_by_depth"]) for a in acc.values())
    kmax = max([dmax] + [max(a["hist"], default=0) for a in acc.values()])  # a round accepts 0..depth drafts
    for (role, a), off in zip(acc.items(), offsets):
        color = role_color(summary, role)
        ks = list(range(kmax + 1))
        share = [100 * a["hist"].get(k, 0) / a["rounds"] if a["rounds"] else 0 for k in ks]
        left.bar([k + off for k in ks], share, width=w * 0.9, color=color, edgecolor="black", linewidth=0.4,
                 label=f"{role_label(summary, role)}: mean {a['mean_accepted_length']:.2f} tokens/round, "
                       f"{a['rounds']} rounds" if a["mean_accepted_length"] else role_label(summary, role))
        if len(ks) <= 10 and len(acc) == 1:  # values on bars only while they cannot touch a neighbour's
            for k, s in zip(ks, share):
                left.text(k + off, s + 1.5, f"{s:.0f}%", ha="center", fontsize=8)
        depths = [d + 1 for d, r in enumerate(a["rate_by_depth"]) if r is not None]
        rates = [100 * r for r in a["rate_by_depth"] if r is not None]
        right.bar([d + off for d in depths], rates, width=w * 0.9, color=color, edgecolor="black", linewidth=0.4)
        if len(depths) <= 10 and len(acc) == 1:
            for d, r in zip(depths, rates):
                right.text(d + off, r + 1.5, f"{r:.0f}%", ha="center", fontsize=8)
    left.set_xticks(range(kmax + 1))
    left.set_xlabel("drafts accepted in one verification round")
    left.set_ylabel("share of verification rounds (%)")
    left.set_ylim(0, 112)
    left.set_title("Accepted drafts per round", fontsize=10.5)
    right.set_xticks(range(1, dmax + 1))
    right.set_xlim(0.4, dmax + 0.6)
    right.set_xlabel("draft depth (1 = first drafted token of a round)")
    right.set_ylabel("drafted tokens accepted (%)")
    right.set_ylim(0, 112)
    right.set_title("Acceptance by draft depth", fontsize=10.5)
    for ax in (left, right):
        ax.grid(axis="y", alpha=0.3)
    sampling = summary.get("sampler") or {"greedy": True}
    under = "greedy" if sampling["greedy"] else f"sampled, {sampling['text']}"
    fig.suptitle(f"Draft acceptance (all timed legs; {under})", fontsize=12, fontweight="bold")
    legend_below(fig, left.get_legend_handles_labels()[0])
    return save(fig, path)


def plot_depth_trace(summary: dict, path: Path) -> bool:
    """Draft depth per verification round, in decoding order, for the first few traced prompts."""
    roles = candidate_roles(summary)
    traced = [p for p in summary["prompts"] if any(p["depth_trace"].get(r) for r in roles)]
    if not traced:
        return False
    shown = traced[:DEPTH_TRACE_PROMPTS]
    fig = new_figure(1.55 * len(shown) + 1.6)
    axes = fig.subplots(len(shown), 1, sharex=True, squeeze=False)[:, 0]
    top = max(max(p["depth_trace"].get(r) or [0]) for p in shown for r in roles)
    for ax, p in zip(axes, shown):
        for role, style in zip(roles, ["-", "--", ":", "-."] * len(roles)):  # styles keep equal traces apart
            trace = p["depth_trace"].get(role)
            if trace:
                ax.step(range(1, len(trace) + 1), trace, where="mid", color=role_color(summary, role),
                        linestyle=style, linewidth=1.4, label=role_label(summary, role))
        ax.set_ylim(-0.3, top + 0.8)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=4))
        ax.set_ylabel("draft depth")
        ax.grid(alpha=0.3)
        ax.set_title(short(p["id"], 70), fontsize=9.5, loc="left")
    axes[-1].set_xlabel("verification round (decoding order)")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    more = f", first {len(shown)} of {len(traced)} traced prompts" if len(traced) > len(shown) else ""
    who = ", ".join(role_label(summary, r) for r in roles if any(p["depth_trace"].get(r) for p in shown))
    fig.suptitle(f"Draft depth per verification round: {who} (first leg{more})", fontsize=12, fontweight="bold")
    if len(roles) > 1:
        legend_below(fig, axes[0].get_legend_handles_labels()[0])
    return save(fig, path)


def plot_memory(summary: dict, path: Path) -> bool:
    """Peak device memory per prompt and role (max over legs); nothing is drawn where none was measured."""
    if not summary["memory"]["measured"]:
        return False
    prompts, roles = summary["prompts"], summary["roles"]
    peak = max(v for p in prompts for v in p["peak_mem_bytes"].values() if v is not None)
    scale, unit = bytes_unit(peak)
    fig = new_figure(per_prompt_height(len(prompts) * max(1, len(roles) * 0.6)))
    ax = fig.add_subplot()
    offsets, h = group_offsets(len(roles))
    for role, off in zip(roles, offsets):
        for i, p in enumerate(prompts):
            v = p["peak_mem_bytes"].get(role)
            if v is None:
                ax.text(peak / scale * 0.01, i + off, "n/a (not measured)", va="center", fontsize=8.5,
                        color="#555555")
                continue
            ax.barh(i + off, v / scale, height=h * 0.9, color=role_color(summary, role), edgecolor="black",
                    linewidth=0.4)
            ax.text(v / scale * 1.01, i + off, f"{v / scale:.2f}", va="center", fontsize=8.5, bbox=LABEL_BOX)
    ax.set_xlim(0, peak / scale * 1.15)
    prompt_axis(ax, summary)
    ax.set_xlabel(f"peak allocated device memory ({unit}, max over legs)")
    ax.grid(axis="x", alpha=0.3)
    mem = summary["audit"].get("memory") or {}
    titles(ax, "Peak memory per prompt",
           f"audit: candidate ÷ control peak = {mem['ratio']:.3f}" if mem.get("ratio") is not None else None)
    handles = [Patch(color=role_color(summary, r), label=role_label(summary, r)) for r in roles]
    legend_below(fig, handles)
    return save(fig, path)


def plot_time_split(summary: dict, path: Path) -> bool:
    """Stacked bars: a decode's time in step (plain steps) / draft / verify (windows) / rollback /
    other (median over legs)."""
    rows = [(p, r) for p in summary["prompts"] for r in summary["roles"] if p["time_split"].get(r)]
    if not rows:
        return False
    multi_role = len({r for _, r in rows}) > 1
    phases = []
    for p, r in rows:
        phases += [ph for ph in p["time_split"][r] if ph not in phases]
    extra = iter(EXTRA_COLORS)
    colors = {ph: PHASE_COLORS.get(ph) or next(extra, "#333333") for ph in phases}
    longest = max(sum(p["time_split"][r].values()) for p, r in rows)
    scale, unit = (1.0, "s") if longest >= 2.0 else (1e3, "ms")
    fig = new_figure(per_prompt_height(len(rows)))
    ax = fig.add_subplot()
    for i, (p, r) in enumerate(rows):
        left = 0.0
        split = p["time_split"][r]
        for ph in phases:
            v = split.get(ph, 0.0) * scale
            ax.barh(i, v, left=left, height=0.7, color=colors[ph], edgecolor="black", linewidth=0.4)
            left += v
        ax.text(left + longest * scale * 0.01, i, f"{amount(left)} {unit}", va="center", fontsize=8.5)
    labels = [short(p["id"]) + (f" · {role_label(summary, r)}" if multi_role else "") for p, r in rows]
    ax.set_yticks(range(len(rows)), labels)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_ylabel("prompt" + (" · decoder" if multi_role else ""))
    ax.set_xlim(0, longest * scale * 1.15)
    ax.set_xlabel(f"time per decode ({unit}, median over legs, by phase)")
    ax.grid(axis="x", alpha=0.3)
    titles(ax, "Where a decode's time goes", None if multi_role else role_label(summary, rows[0][1]))
    handles = [Patch(color=colors[ph], label=PHASE_LABELS.get(ph, ph)) for ph in phases]
    legend_below(fig, handles)
    return save(fig, path)


FIGURES = {  # file stem -> plot function, in report order
    "speedup": plot_speedup,
    "ms_per_token": plot_ms_per_token,
    "acceptance": plot_acceptance,
    "depth_trace": plot_depth_trace,
    "memory": plot_memory,
    "time_split": plot_time_split,
}


def _score_text(audit: dict) -> str:
    return f"{audit['score']:.3f}" if audit["status"] in ("pass", "fail") else "—"


def _audit_text(audit: dict) -> str:
    return {"pass": "PASS", "fail": "FAIL", "not audited": "NOT AUDITED",
            "mismatch": "audit.json is for another stream (NOT AUDITED)"}[audit["status"]]
