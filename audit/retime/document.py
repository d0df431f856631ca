"""retime.json and the printed table. The verified figures are the retime's own; the stream's
claimed ratio stands beside them."""
from __future__ import annotations

from dataclasses import dataclass, field

from audit import checks
from audit.processes import GpuWatch
from audit.report import finding_lines, fmt_ratio
from audit.retime.fresh import FreshPrompt
from audit.retime.judge import verified_ratio
from audit.retime.load import leg_walls, others_load, waited
from audit.retime.provenance import control_code_line, sandbox_line
from audit.stream import PromptRun, Run

SCHEMA = "qwen35-exact/retime/2"


@dataclass(frozen=True)
class Outcome:
    """What a retime found, for its document."""

    run: Run
    sha256: str
    seed: int
    source: dict | None  # where the fresh prompts came from (None when nothing fit)
    verdict: str
    findings: list
    verified: dict | None
    claimed: dict  # {"ratio": the stream's median, "per_prompt": {id: ratio}}
    max_new_tokens: int
    legs: int
    seconds: float
    instrument: bool
    fresh: list[FreshPrompt] = field(default_factory=list)
    timed: list[PromptRun] = field(default_factory=list)
    exact: dict = field(default_factory=dict)
    remeasured: list = field(default_factory=list)
    second_look: dict | None = None
    gpu_processes: dict | None = None
    unverified_reason: str | None = None
    control_code: dict | None = None  # core.provenance's summary (None: not checked)
    sandbox: dict | None = None  # the candidate's sandbox (None: --no-sandbox, or no worker ran)
    isolation: dict | None = None  # role -> how that side was frozen while the other was timed
    memory: dict | None = None  # each side's peak memory, from outside (audit.retime.resources)
    quiet: dict | None = None  # the GPU's idle probe (audit.retime.quiet; None on a CPU)


def gpu_document(gpu: GpuWatch | None) -> dict | None:
    if gpu is None:
        return None
    return {"samples": gpu.samples, "foreign": [{"pid": pid, "name": name} for pid, name in sorted(gpu.foreign.items())],
            "unmeasured": gpu.unmeasured, "gpus": {role: sorted(ids) for role, ids in sorted(gpu.gpus.items())}}


def prompt_entry(fp: FreshPrompt, p: PromptRun, o: Outcome) -> dict:
    return {"id": fp.id, "mirrors": fp.mirrors, "tokens": len(fp.token_ids),
            "claimed_ratio": o.claimed["per_prompt"].get(fp.mirrors), "ratio": verified_ratio(p),
            "exact": o.exact.get(p.id, False), "leg_spread": checks.prompt_spreads(p), "waited": waited(p),
            "others_load": others_load(p), "walls": leg_walls(p), "token_ids": fp.token_ids}


def build_document(o: Outcome) -> dict:
    header = o.run.header
    return {
        "schema": SCHEMA,
        "kind": "retime",
        "stream": str(o.run.path),
        "stream_sha256": o.sha256,
        "seed": o.seed,
        # where the fresh prompts came from: kind random-ids | line-runs | file, and a sentence
        "fresh_source": o.source,
        "fresh_prompts": o.source["how"] if o.source else None,
        "candidate": {k: header["candidate"].get(k) for k in ("name", "spec", "args", "instrument")},
        "control": header["control"].get("name"),
        "model": header["model"].get("name"),
        "max_new_tokens": o.max_new_tokens,
        "legs": o.legs,
        # what decided the tokens: both workers decoded, and the replay checked, with the header's
        "sampler": o.run.sampler.to_json(),
        "verdict": o.verdict,
        "unverified_reason": o.unverified_reason,
        # the figures to quote: the retime's own legs, prompts, interval and score
        "verified": o.verified,
        # the stream's word: its median ratio recomputed from its raw legs (in-process timing)
        "claimed": {"ratio": o.claimed["ratio"], "prompts": len(o.claimed["per_prompt"])},
        "instrument": o.instrument,
        "seconds": o.seconds,
        "prompts": [prompt_entry(fp, p, o) for fp, p in zip(o.fresh, o.timed)],
        # prompts whose legs were unstable or loaded, each replaced by its spare (counting nowhere)
        "remeasured": list(o.remeasured),
        # None, or why the first look sent for a second look (all prompts judged together)
        "second_look": o.second_look,
        # on a GPU: how often the driver was asked which processes hold a context, and those out of
        # the audit's reach it named (None on a CPU)
        "gpu_processes": o.gpu_processes,
        # the control's import closure against git HEAD / RECORD; the candidate's sandbox
        "control_code": o.control_code,
        "sandbox": o.sandbox,
        # per side: frozen by its cgroup v2 (and pinned, where cpusets are delegated), or by signals
        "isolation": o.isolation,
        # each side's peak memory measured from outside its process, and the verified f_mem
        "memory": o.memory,
        # on a GPU: the probe that waits for it to be idle before each leg and after each answer
        "gpu_quiet": o.quiet,
        "findings": o.findings,
    }


def isolation_line(isolation: dict | None) -> str:
    """How the side not being timed was stopped: by its cgroup (and pinned or not), or by signals."""
    if not isolation:
        return "-"
    parts = []
    for role, how in sorted(isolation.items()):
        if how.get("cgroup"):
            pinned = how.get("pinned")
            parts.append(f"{role} frozen by cgroup v2" + (f", pinned to CPUs {pinned}"
                                                         if pinned and not pinned.startswith("not") else ""))
        else:
            parts.append(f"{role} stopped by signals ({how.get('why')})")
    return ", ".join(parts)


def widest_spread(spreads: dict[str, float | None]) -> float | None:
    return max((s for s in spreads.values() if s is not None), default=None)


def prompt_rows(doc: dict) -> list[str]:
    rows = [("fresh prompt", "like", "P", "claimed", "verified", "spread", "exact")]
    for e in doc["prompts"]:
        spread = widest_spread(e["leg_spread"])
        rows.append((e["id"], e["mirrors"], str(e["tokens"]), fmt_ratio(e["claimed_ratio"]), fmt_ratio(e["ratio"]),
                     "-" if spread is None else f"{spread:.0%}", "yes" if e["exact"] else "NO"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in rows]
    lines.insert(1, "-" * max(len(x) for x in lines))
    return lines


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 30):.2f} GiB"


def resource_lines(doc: dict) -> list[str]:
    """Each side's memory from outside, and the GPU's idle probe."""
    out = []
    mem = doc.get("memory")
    if mem:
        out.append(f"memory: control {gib(mem['control_peak_bytes'])}, candidate {gib(mem['candidate_peak_bytes'])}"
                   + (f" ({mem['ratio']:.2f}x, f_mem {mem['f_mem']:.3f}; {mem['measured']})" if mem["measured"]
                      else " (not measured)"))
    quiet = doc.get("gpu_quiet")
    if quiet:
        out.append(f"GPU idle before every leg and after every answer: {quiet['probes']} probes of "
                   f"{quiet['solo_ms']:.2f} ms alone (quiet at most {quiet['slack']}x that, {quiet['runs']} in a row)")
    return out


def summary_lines(doc: dict) -> list[str]:
    v, claimed = doc["verified"], doc["claimed"]["ratio"]
    if v is None:
        return [f"claimed median ratio {fmt_ratio(claimed)} (in-process, the stream's); verified: nothing "
                f"({doc['unverified_reason'] or 'the retime did not measure'})"]
    ci = ("no interval" if v["ci_low"] is None else
          f"{v['confidence']:.1%} interval [{v['ci_low']:.3f}, {v['ci_high']:.3f}]")
    withheld = [f"score withheld: {why}" for why in v.get("withheld") or ()]
    return [f"verified median ratio {fmt_ratio(v['ratio'])}  {ci}  "
            f"score {v['score']:.4f}  ({v['prompts']} fresh prompts, N={doc['max_new_tokens']}, "
            f"{doc['legs']} legs per side; interval: {v['interval']})", *withheld,
            f"claimed median ratio {fmt_ratio(claimed)} (in-process, the stream's {doc['claimed']['prompts']} "
            "prompts): quote the verified figure"]


def render_table(doc: dict) -> str:
    lines = prompt_rows(doc) if doc["prompts"] else []
    if doc["fresh_prompts"]:
        lines.append(f"fresh prompts: {doc['fresh_prompts']}; seed {doc['seed']} (--seed {doc['seed']} draws them "
                     "again)")
    for e in doc["remeasured"]:
        lines.append(f"measured again: {e['id']} ({e['reason']}; ratio {fmt_ratio(e['ratio'])}) "
                     f"replaced by {e['replaced_by']}")
    look = doc.get("second_look")
    if look:
        lines.append(f"second look: the first {look['first_prompts']} fresh prompts' median "
                     f"{fmt_ratio(look['first_median_ratio'])} fell short; {look['prompts']} more were measured and "
                     f"all {len(doc['prompts'])} judged together")
    gpu = doc.get("gpu_processes")
    if gpu:
        lines.append(f"GPU processes: asked {gpu['samples']} times, " + (
            f"not told: {gpu['unmeasured']}" if gpu["unmeasured"] and not gpu["foreign"] else
            f"{len(gpu['foreign'])} out of the audit's reach"))
    lines.append(f"candidate sandbox: {sandbox_line(doc.get('sandbox'))}; idle side: "
                 f"{isolation_line(doc.get('isolation'))}; control code: {control_code_line(doc.get('control_code'))}")
    lines += resource_lines(doc)
    lines += finding_lines(doc["findings"])
    lines.append("")
    lines += summary_lines(doc)
    lines.append(f"retime took {doc['seconds']:.1f} s  verdict: {doc['verdict'].upper()}  candidate: "
                 f"{doc['candidate']['name']}" + ("  (instrument: never scored)" if doc["instrument"] else ""))
    return "\n".join(lines)

