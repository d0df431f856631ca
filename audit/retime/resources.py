"""What each side took of the machine besides its time, measured from outside its process: its
memory (the verified score's memory factor), the GPUs it held, the GPU work it left running
after its answers, and whether the control's device memory ran short.

- Memory, per side: on a GPU the most device memory the side's processes held together in one of
  the driver's answers (``audit.processes.GpuWatch``: nvidia-smi's per-process figure, the CUDA
  context and the allocator's cache included); on a CPU the peak resident memory of its process
  tree (``audit.processes.peak_rss``). ``f_mem = min(1, allowance / (candidate / control))`` as
  ``audit replay``'s, but from figures no decoder reports about itself.
- GPUs: the candidate's processes may hold contexts only on the GPU the control uses, one GPU: a
  decoder spread over more GPUs than the control is measured on another machine.
- GPU work after the answer (``gpu_after_s``, ``audit.retime.quiet``): already added to the leg it
  followed; a side that left any is named.
- The control's allocator: its worker says how often a decode had to free the CUDA cache and
  retry an allocation; any such retry means the device ran short of memory under the control,
  which slows it for reasons not its own.
"""
from __future__ import annotations

from core.schema import ROLES

from audit import checks
from audit.processes import GpuWatch
from audit.stream import PromptRun

# GPU work left after an answer below this many seconds is the probe's own noise, not named
LINGER_NOTE_S = 0.05


def memory_figures(timed: list[PromptRun], gpu: GpuWatch | None, allowance: float) -> dict:
    """Each side's peak memory, their ratio and the memory factor; ``measured`` says from what
    (None, and ``f_mem`` 1, where neither the driver nor /proc told)."""
    if gpu is not None:
        peaks = {role: gpu.peak_bytes.get(role) for role in ROLES}
        measured = "GPU memory per process (nvidia-smi)"
        if gpu.unmeasured or any(role in gpu.memory_unknown for role in ROLES):
            peaks = {role: None for role in ROLES}
    else:
        peaks = {role: max((r.get("peak_rss_bytes") or 0 for p in timed for r in p.role_legs(role)), default=0)
                 or None for role in ROLES}
        measured = "peak resident memory of each process tree (/proc VmHWM)"
    f_mem, ratio = checks.memory_factor(peaks["control"], peaks["candidate"], allowance)
    known = peaks["control"] is not None and peaks["candidate"] is not None
    return {"control_peak_bytes": peaks["control"], "candidate_peak_bytes": peaks["candidate"], "ratio": ratio,
            "f_mem": f_mem, "allowance": allowance, "measured": measured if known else None}


def gpu_device_findings(gpu: GpuWatch | None) -> list[dict]:
    """``gpus-beyond-the-control`` (fail) when the candidate's processes held contexts on a GPU the
    control did not use, or on more than one."""
    if gpu is None or not gpu.gpus.get("candidate"):
        return []
    candidate, control = gpu.gpus["candidate"], gpu.gpus.get("control", set())
    if len(candidate) <= 1 and candidate <= control:
        return []
    return [checks.finding("gpus-beyond-the-control", "fail", None,
                           f"the candidate's processes held contexts on {len(candidate)} GPU(s) "
                           f"({', '.join(sorted(candidate))}), the control's on {len(control)} "
                           f"({', '.join(sorted(control)) or 'none'}): its speed is not one GPU's",
                           candidate_gpus=sorted(candidate), control_gpus=sorted(control))]


def lingering_findings(timed: list[PromptRun]) -> list[dict]:
    """``gpu-work-after-answer`` (warn) per side that left GPU work running after its answers: the
    time it took is already in that side's legs, and no other leg shared the GPU with it."""
    out = []
    for role in ROLES:
        left = [(p.id, r) for p in timed for r in p.role_legs(role) if (r.get("gpu_after_s") or 0) > LINGER_NOTE_S]
        if left:
            total = sum(r["gpu_after_s"] for _, r in left)
            out.append(checks.finding(
                "gpu-work-after-answer", "warn", None,
                f"the {role}'s worker left GPU work running after {len(left)} of its answers ({total:.2f} s in all, "
                f"first {left[0][0]} leg {left[0][1]['leg']}): it ran with both sides stopped and is counted in "
                "those legs' time", side=role, legs=[f"{pid} leg {r['leg']}" for pid, r in left], seconds=total))
    return out


def squeeze_findings(timed: list[PromptRun]) -> list[dict]:
    """``control-memory-squeezed`` (fail) when the control's allocator had to free its cache and
    retry during a timed leg: the device was short of memory, which slows the control alone."""
    squeezed = [f"{p.id} leg {r['leg']}" for p in timed for r in p.role_legs("control") if (r.get("alloc_retries") or 0) > 0]
    if not squeezed:
        return []
    return [checks.finding("control-memory-squeezed", "fail", None,
                           f"the control's CUDA allocator ran short of device memory and retried during {len(squeezed)} "
                           f"of its legs ({', '.join(squeezed[:4])}{', ...' if len(squeezed) > 4 else ''}): memory held "
                           "by other processes slowed it", legs=squeezed)]
