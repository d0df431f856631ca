"""What a retime knows of its workers' code and confinement: the control's import closure checked
against git HEAD / the distributions' RECORD (``core.provenance``) before the control's worker
starts, and whether the candidate's worker ran in a sandbox (``audit.sandbox``)."""
from __future__ import annotations

import subprocess

from core.provenance import check_control_code

from audit import checks, sandbox
from audit.pipeline import log
from audit.retime.workers import Side

# the modules the control's worker runs, whose import closure is checked
CONTROL_MODULES = ("harness.worker", "decoders", "decoders.serial", "core.models", "core.determinism")


def control_code(sides: list[Side], pycache: str):
    """The control's import closure checked against git HEAD / RECORD, compiled into the private
    ``pycache`` the control's worker then starts with; None where the check could not run. A
    plug-in control's own module joins the closure."""
    control = next(s for s in sides if s.role == "control")
    try:
        return check_control_code(CONTROL_MODULES + ((control.spec.partition(":")[0],) if control.plugin else ()),
                                  pycache=pycache)
    except (OSError, subprocess.SubprocessError) as exc:
        log(f"the control's code could not be checked: {exc}")
        return None


def control_code_findings(report) -> list[dict]:
    """``control-code-modified`` (fail, from the report) or ``control-code-unchecked`` (warn)."""
    if report is None:
        return [checks.finding("control-code-unchecked", "warn", None, "the control's code could not be checked "
                               "against git HEAD or RECORD: a changed file in its import closure would go unseen")]
    return report.findings()


def sandbox_findings(plan: "sandbox.Sandbox | None", hide: tuple[str, ...] = ()) -> list[dict]:
    """``candidate-not-sandboxed`` (warn) where the candidate's worker ran without a sandbox, naming
    what a sandbox would have hidden from it (``hide``: the auditor's --fresh file)."""
    if plan is not None and plan.warning is None:
        return []
    why = plan.warning if plan is not None else f"{sandbox.NOT_SANDBOXED}: --no-sandbox"
    if hide:
        why += f"; it could read {', '.join(hide)}, which a sandbox hides from it"
    return [checks.finding(sandbox.NOT_SANDBOXED, "warn", None, why)]


def sandbox_line(sb: dict | None) -> str:
    return "none (--no-sandbox)" if sb is None else sb["tool"] or "none"


def control_code_line(cc: dict | None) -> str:
    if cc is None:
        return "not checked"
    return (f"{cc['checked']} files against {cc['reference']}, "
            + (f"{len(cc['modified'])} modified" if cc["modified"] else "unchanged") + f" ({cc['seconds']:.1f} s)")
