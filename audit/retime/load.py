"""What other work took from each side around its legs, and the judgement of it.

Around every leg the audit reads how long the timed worker's threads waited, runnable, for a CPU
and how much CPU the machine spent on other work (``audit.processes.cpu_sample``). A prompt whose
control waited WAIT_GAP more of its time than its candidate did, or ran beside OTHERS_GAP more
cores of other work, ran its control on a machine loaded against it: it is measured again on its
spare, and more than half of the judged prompts so loaded fail the retime.
"""
from __future__ import annotations

from core.schema import ROLES

from audit import checks
from audit.stream import PromptRun

# Waiting shows a full machine; the other work's cores show a machine with CPUs to spare, where a
# loading process still slows the control through what cores share (caches, memory, a
# hyperthread's sibling, a VM's host) without making it wait. Honest retimes under steady and
# fluctuating background load stayed below both (bench/NOTES.md).
WAIT_GAP = 0.1
OTHERS_GAP = 0.5


def leg_walls(p: PromptRun) -> dict[str, list[float]]:
    return {role: [r["wall_s"] for r in p.role_legs(role)] for role in ROLES}


def leg_shares(p: PromptRun, key: str) -> dict[str, float | None]:
    """Per side, a per-leg measure (``others_cpu_s``, ``waited_s``) summed over its legs, over their
    wall time; None where it was not measured."""
    out = {}
    for role in ROLES:
        legs = p.role_legs(role)
        values, wall = [r.get(key) for r in legs], sum(r["wall_s"] for r in legs)
        out[role] = None if not legs or None in values or wall <= 0 else sum(values) / wall
    return out


def others_load(p: PromptRun) -> dict[str, float | None]:
    """Per side, the CPU that other work took while its legs were timed, in cores."""
    return leg_shares(p, "others_cpu_s")


def waited(p: PromptRun) -> dict[str, float | None]:
    """Per side, the share of its legs' time its threads spent waiting for a CPU."""
    return leg_shares(p, "waited_s")


def gap(share: dict[str, float | None]) -> float | None:
    """The control's value less the candidate's; None where either was not measured."""
    control, candidate = share["control"], share["candidate"]
    return None if control is None or candidate is None else control - candidate


def loaded_against_control(p: PromptRun) -> bool:
    """The control waited for a CPU for WAIT_GAP more of its legs' time than the candidate did, or
    ran beside OTHERS_GAP more cores of other work: work that is not its own took the machine, or
    what its cores share, from the control alone, and inflated the ratio."""
    waited_gap, others_gap = gap(waited(p)), gap(others_load(p))
    return ((waited_gap is not None and waited_gap > WAIT_GAP)
            or (others_gap is not None and others_gap > OTHERS_GAP))


def describe_load(p: PromptRun) -> str:
    share, load = waited(p), others_load(p)

    def cores(x):
        return "?" if x is None else f"{x:.2f}"
    text = (f"other work took {cores(load['control'])} cores while the control was timed, "
            f"{cores(load['candidate'])} while the candidate was")
    if share["control"] is not None and share["candidate"] is not None:
        text += (f"; the control waited for a CPU {share['control']:.0%} of its legs' time, "
                 f"the candidate {share['candidate']:.0%}")
    return text


def load_findings(timed: list[PromptRun]) -> list[dict]:
    """``load-against-control`` (fail) when more than half of the judged prompts ran their control on
    a machine loaded against it, even after their spares; ``machine-load`` (warn) for a minority."""
    loaded = [p for p in timed if loaded_against_control(p)]
    if not loaded:
        return []
    if 2 * len(loaded) > len(timed):
        return [checks.finding("load-against-control", "fail", None,
                               f"{len(loaded)} of {len(timed)} prompts: {describe_load(loaded[0])} "
                               f"(first of them, {loaded[0].id}): the control was slowed by work that is not its own",
                               prompts=[p.id for p in loaded])]
    return [checks.finding("machine-load", "warn", p.id, describe_load(p) + ": this prompt's ratio "
                           "is inflated by work that is not the control's") for p in loaded]
