"""The table ``harness time`` prints at the end: one row per prompt, then the median."""
from __future__ import annotations

from core.schema import LEG_SPREAD_LIMIT, leg_spread


def unstable_prompts(summaries) -> int:
    """Prompts on which either side's legs spread beyond LEG_SPREAD_LIMIT (core.schema.leg_spread)."""
    count = 0
    for _, legs, _ in summaries:
        spreads = [leg_spread([r["wall_s"] for r in legs if r["role"] == role]) for role in ("control", "candidate")]
        count += any(s is not None and s > LEG_SPREAD_LIMIT for s in spreads)
    return count


def render_table(summaries, median_ratio: float, candidate_name: str) -> str:
    """Per prompt: tokens/s of the control's median leg and of the candidate's first leg (the two
    times the ratio divides), the ratio, mean accepted length and token agreement; then the
    median and, when legs disagree beyond the limit, a warning."""
    rows = [("prompt", "P", "new", "control tok/s", f"{candidate_name} tok/s", "ratio", "acc.len", "same")]
    for prompt, legs, s in summaries:
        cand = next(r for r in legs if r["role"] == "candidate" and r["leg"] == 0)
        mal = cand["stats"].get("mean_accepted_length")
        rows.append((prompt.id, str(len(prompt.token_ids)), str(len(cand["tokens"])),
                     f"{s['control_tokens_per_s']:.1f}", f"{len(cand['tokens']) / cand['wall_s']:.1f}",
                     f"{s['ratio']:.3f}", "-" if mal is None else f"{mal:.2f}",
                     "yes" if s["same_tokens_as_control"] else "NO"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append(f"median ratio (control median time / candidate's first leg): {median_ratio:.3f}  "
                 "[exactness: run `audit replay`; 'same' only compares with this run's control legs]")
    unstable = unstable_prompts(summaries)
    if unstable:
        lines.append(f"WARNING: {unstable} of {len(summaries)} prompts have unstable legs (spread > "
                     f"{LEG_SPREAD_LIMIT:.0%}); rerun with more --legs")
    return "\n".join(lines)
