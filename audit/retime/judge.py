"""The retime's judgement: the verified figures from its own legs, the claim beside them, and
every finding about the workers, the machine and the header.

Verified figures (``verified``): each fresh prompt's ratio, like for like (``verified_ratio``:
the control's first leg over the candidate's first, each side's first encounter with the prompt,
the side that opens alternating from prompt to prompt), their median ``m``, a distribution-free
95% confidence interval for it (``interval``: the two order statistics a sign test inverts, at a
coverage that holds for any distribution of independent prompt ratios; it needs MIN_PROMPTS), and
the score ``S_max * (1 - exp(-(m - 1) / kappa))`` (``audit.checks.score``; f_mem 1: a retime
measures no memory), 0 unless the interval's bottom is above 1, 0 on any failing finding, for an
instrument, for a run not timed against the serial control and when nothing was verified.

Why not the median of the control's legs, nor a bootstrap: the median of two legs is their mean,
which under load's right-skewed noise lies above a single leg's, so a candidate no faster than the
control drew ratios above 1; and a percentile bootstrap of a median of a few prompts is
[min, max], whose true coverage at 3 prompts is 75% (``bench/retime_null.py`` simulates both
rules). With the like-for-like ratio a
candidate no faster than the control has a ratio above 1 on a prompt at most half the time, so
its interval's bottom lies above 1 with probability at most 2.5%, whatever the machine's noise.

The stream's claim (its median ratio, recomputed from its raw legs) counts only as a claim: it
fails (``claim-not-reproduced``) when it lies above the interval's top by more than CLAIM_MARGIN,
and nothing in the stream widens that allowance.
"""
from __future__ import annotations

import json

from core.sampling import GREEDY
from core.schema import ROLES

from audit import checks
from audit.interval import CONFIDENCE, MIN_PROMPTS, interval, significant
from audit.processes import GpuWatch
from audit.stream import PromptRun, header_sampler

# A claim more than this far above the top of the verified interval fails. In-process and
# separate-process timings of an honest decoder differ: the harness times both sides in one
# process, where the candidate's first leg follows the control's on the same prompt, the retime
# each side in a process of its own. On a loaded 2-core CPU (load 3 to 8), nine honest tiny
# streams claimed up to 27% above the interval's top (spec, 1.049x claimed, interval top 0.829x;
# serial against serial 15%), and a 9B instrument stream on the H200 claimed 2.11x against 1.97x
# retimed, 7% (bench/NOTES.md, the 2026-12-02 CPU entry). A claim beyond that fails; whatever a
# stream claims, the verified score is the retime's own.
CLAIM_MARGIN = 0.35
# An interval whose top is more than this times its bottom cannot hold a claim to account: a claim
# it would fail is judged "too noisy to verify" (UNVERIFIED, no score) rather than false. Honest
# tiny retimes on a loaded 2-core CPU spanned 1.1x to 2.0x (bench/NOTES.md, 2026-12-02 CPU).
NOISY_SPAN = 1.5
# the header facts a worker re-derives from the decoder itself
HEADER_FACTS = ("name", "config", "instrument")


def verified_ratio(p: PromptRun) -> float | None:
    """One prompt's verified ratio: the control's first leg over the candidate's first leg. Both
    are their side's first encounter with the prompt, so under the null (the candidate no faster)
    the two are alike and the ratio is above 1 at most half the time."""
    first = {role: next((r["wall_s"] for r in p.role_legs(role) if r["leg"] == 0), None) for role in ROLES}
    if not first["control"] or not first["candidate"] or first["candidate"] <= 0:
        return None
    return first["control"] / first["candidate"]


def prompt_ratios(timed: list[PromptRun]) -> list[float]:
    return [r for r in (verified_ratio(p) for p in timed) if r is not None]


def verified_figures(timed: list[PromptRun], disqualified: bool, s_max: float, kappa: float, f_mem: float = 1.0,
                     withheld: tuple[str, ...] = ()) -> dict:
    """The verified ratio, its interval and the score: ``S_max * (1 - exp(-(m - 1) / kappa)) * f_mem``,
    0 when ``disqualified``, when the interval does not lie above 1, and while anything the score
    rests on is ``withheld`` (``score_withheld``: why the retime cannot stand behind a score)."""
    ratios = prompt_ratios(timed)
    m = checks.median_ratio(ratios)
    low, high, coverage, how = interval(ratios)
    # a speed-up the interval cannot tell from none (its bottom at or below 1) scores 0: a decoder
    # at serial speed gets no score from noise that lifts its median above 1
    told = significant(low)
    return {"ratio": m, "ci_low": low, "ci_high": high, "confidence": coverage, "interval": how,
            "prompts": len(ratios), "f_mem": f_mem, "significant": told, "withheld": list(withheld),
            "score": checks.score(m, f_mem, s_max, kappa, disqualified or not told or bool(withheld))}


# what a verified score rests on, and the finding that says it is missing
SCORE_RESTS_ON = {
    "candidate-not-sandboxed": "the candidate's worker ran outside a sandbox: it could read the audit's memory "
                               "(the secret seed), the auditor's files, or reach the control's worker",
    "control-code-unchecked": "the control's code was not proven unchanged against git HEAD or RECORD",
    "control-code-unverified": "files of the control's own code are covered by no reference (git HEAD, RECORD): "
                               "it is not proven unchanged",
    "gpu-unmeasured": "the driver could not say which processes used the GPU, or how much memory each side held",
}


def withheld_reasons(findings: list[dict], memory: dict) -> tuple[str, ...]:
    """Why the retime cannot stand behind a score although nothing failed: a precondition of the
    verified score (``SCORE_RESTS_ON``) that this machine or these options did not give, or memory
    that was not measured."""
    checks_found = {f["check"] for f in findings}
    out = [why for check, why in SCORE_RESTS_ON.items() if check in checks_found]
    if memory.get("measured") is None and not any(c == "gpu-unmeasured" for c in checks_found):
        out.append("neither side's memory was measured")
    return tuple(out)


def too_noisy(low: float | None, high: float | None) -> bool:
    """The interval is too wide to judge a claim by (see NOISY_SPAN)."""
    return low is not None and high is not None and low > 0 and high > NOISY_SPAN * low


def claim_findings(claimed: float | None, low: float | None, high: float | None) -> list[dict]:
    """``claim-not-reproduced`` when the claim lies above ``high * (1 + CLAIM_MARGIN)``."""
    if claimed is None or high is None or claimed <= high * (1 + CLAIM_MARGIN):
        return []
    return [checks.finding("claim-not-reproduced", "fail", None,
                           f"the stream claims a median ratio of {claimed:.3f}, {claimed / high - 1:.0%} above the "
                           f"top of the retime's interval [{low:.3f}, {high:.3f}] (allowed "
                           f"{CLAIM_MARGIN:.0%}): the stream's speed is not the candidate's",
                           claimed=claimed, ci_low=low, ci_high=high, margin=CLAIM_MARGIN)]


def falls_short(claimed: float | None):
    """For the measurement: why a look's prompts would fail the claim (None when they hold it)."""
    def why(timed: list[PromptRun]) -> str | None:
        low, high, _, _ = interval(prompt_ratios(timed))
        found = claim_findings(claimed, low, high)
        return found[0]["message"] if found else None
    return why


def canonical(value) -> str:
    return json.dumps(value, sort_keys=True, allow_nan=False, default=repr)


def settled(config):
    """A config without what a process measures or sizes for itself: keys ending in ``_s``
    (seconds, such as spec's cost estimates) and ``sizing`` (the positions its state holds, which
    follow the longest decode each process reserved) differ honestly between the harness's
    process and a worker's."""
    if isinstance(config, dict):
        return {k: settled(v) for k, v in config.items()
                if not (isinstance(k, str) and (k.endswith("_s") or k == "sizing"))}
    if isinstance(config, list):
        return [settled(v) for v in config]
    return config


def header_findings(header: dict, workers: dict, device_mismatch: bool) -> list[dict]:
    """``header-disagrees`` (fail) for each fact the header records about a side (name, config,
    instrument) that its decoder, asked in its own worker, says otherwise. Configs are compared
    without their measured seconds (``settled``); a config recorded on another device
    (``--allow-device-mismatch``) may honestly differ there: a warning."""
    out = []
    for role in ROLES:
        ready = getattr(workers.get(role), "ready", None) or {}
        said = {"name": ready.get("decoder"), "config": settled(ready.get("config")),
                "instrument": ready.get("instrument") is True}
        entry = header[role]
        recorded = {"name": entry.get("name"), "config": settled(entry.get("config")),
                    "instrument": entry.get("instrument") is True}
        # the sampler both sides decode with: the header's (greedy when absent)
        said["sampler"] = ready.get("sampler", GREEDY.to_json())
        recorded["sampler"] = header_sampler(header).to_json()
        for fact in (*HEADER_FACTS, "sampler"):
            if fact == "config" and "config" not in entry:
                continue
            if canonical(said[fact]) == canonical(recorded[fact]):
                continue
            severity = "warn" if fact == "config" and device_mismatch else "fail"
            out.append(checks.finding("header-disagrees", severity, None,
                                      f"the header records the {role}'s {fact} as {canonical(recorded[fact])[:200]}, "
                                      f"its decoder says {canonical(said[fact])[:200]}",
                                      side=role, fact=fact, recorded=recorded[fact], decoder_says=said[fact]))
    return out


def process_findings(workers: dict) -> list[dict]:
    """A warning for each side whose worker ran processes outside its process group, or left any
    running when it exited: stopped with it all the same, and killed at the end."""
    out = []
    for w in workers.values():
        outside, killed = sorted(w.tree.outside_group), w.killed_at_close
        escaped = sorted(w.tree.outside_box)
        if escaped:
            # a process that left its worker's cgroup could run on while the other side was timed:
            # it was stopped by signal instead, but a decoder that leaves its box is not trusted
            out.append(checks.finding(
                "left-its-cgroup", "fail", None,
                f"the {w.role}'s worker ran {len(escaped)} process(es) outside its cgroup", role=w.role,
                outside_box=escaped))
        if outside or killed:
            out.append(checks.finding(
                "worker-processes", "warn", None,
                f"the {w.role}'s worker ran {len(outside)} process(es) outside its process group, stopped with it "
                f"whenever the other side was timed; {killed} still ran when it exited and were killed",
                role=w.role, outside_group=outside, killed_at_close=killed))
    return out


def listed(items: list[str]) -> str:
    return ", ".join(items[:4]) + (", ..." if len(items) > 4 else "")


def stop_findings(timed: list[PromptRun]) -> list[dict]:
    """``stopped-by-others`` (fail) when another process stopped the control's worker (it received
    more SIGCONTs than the audit sent it) or the audit itself during a leg. The candidate's own
    stops only slow the candidate."""
    control, audit = [], []
    for p in timed:
        for r in p.legs:
            if r["role"] == "control" and (r.get("continued_by_others") or 0) > 0:
                control.append(f"{p.id} leg {r['leg']}")
            if (r.get("audit_continued") or 0) > 0:
                audit.append(f"{p.id} {r['role']} leg {r['leg']}")
    out = []
    if control:
        out.append(checks.finding("stopped-by-others", "fail", None,
                                  f"another process stopped the control's worker (SIGSTOP, then SIGCONT) before or "
                                  f"during {len(control)} of its legs ({listed(control)}): its time holds pauses "
                                  "that are not its own", side="control", legs=control))
    if audit:
        out.append(checks.finding("stopped-by-others", "fail", None,
                                  f"the audit itself was stopped and continued during {len(audit)} leg(s) "
                                  f"({listed(audit)}; a job stopped from a shell, or another process): those legs' "
                                  "times are not the decoders'", side="audit", legs=audit))
    return out


def gpu_findings(gpu: GpuWatch | None) -> list[dict]:
    """``gpu-shared`` (fail) when a process out of the audit's reach held a GPU context while the
    legs ran; ``gpu-unmeasured`` (warn) when the driver could not say."""
    if gpu is None:
        return []
    if gpu.foreign:
        named = ", ".join(f"{pid} ({name or '?'})" for pid, name in sorted(gpu.foreign.items()))
        return [checks.finding("gpu-shared", "fail", None,
                               f"{len(gpu.foreign)} process(es) out of the audit's reach held a GPU context while "
                               f"the legs ran: {named}; their GPU work can slow the control unseen: retime on a "
                               "GPU no other process uses", pids=sorted(gpu.foreign))]
    if gpu.unmeasured:
        return [checks.finding("gpu-unmeasured", "warn", None,
                               f"which processes use the GPU could not be told ({gpu.unmeasured}): GPU work of a "
                               "process out of the audit's reach would go unseen")]
    return []
