"""Pure checks over a parsed run: no model, no torch, so most tests need neither.

Each ``check_*`` returns a list of findings (dicts with check, severity, prompt_id, message and
details). Every number is recomputed here from the raw leg records; the harness's own summaries
are only compared against, never used.
"""
from __future__ import annotations

import json
import math
import statistics

from core.schema import LEG_SPREAD_LIMIT, ROLES, UNSTABLE_RUN_SHARE, leg_spread, prompt_ratio

from audit.stream import BadInput, PromptRun, Run, is_int

REL_TOL = 1e-9  # "beyond rounding": JSON round-trips floats exactly, so this is generous
ABS_TOL = 1e-12
# warm-leg heuristic: candidate's later legs much faster than its first while the control's are not
WARM_CANDIDATE_MAX = 0.6
WARM_CONTROL_MIN = 0.8
# ... or a candidate speed-up over 10x the control's: no shared warm-up effect (or a noisy first
# control leg, which would otherwise excuse it) explains that, a lookup does
WARM_RELATIVE_MAX = 0.1
# A flag is a warning: the ratio takes the candidate's first leg only, so a cache gains nothing,
# and a loaded machine can slow an honest first leg by tens of percent. It fails the run only
# where later legs take under a tenth of the first while the control's take half or more: noise
# does not make one leg ten times slower, a lookup makes it a thousand times faster.
WARM_FAIL_MAX = 0.1
WARM_FAIL_CONTROL_MIN = 0.5

# checks whose failure means the run's timing record cannot be trusted
CONSISTENCY_CHECKS = ("control-consistency", "tamper", "integrity", "missing-leg", "in-process-integrity",
                      "warmup-prompt", "prompts")
# how many missing or misplaced legs a finding names (the count is always given)
LISTED_LEGS = 10
EXACTNESS_CHECKS = ("exactness", "stop")


def finding(check: str, severity: str, prompt_id: str | None, message: str, **details) -> dict:
    return {"check": check, "severity": severity, "prompt_id": prompt_id, "message": message, **details}


def close(a: float, b: float, rel: float = REL_TOL, abs_tol: float = 0.0) -> bool:
    return abs(a - b) <= max(abs_tol, rel * max(abs(a), abs(b)))


def leg_label(rec: dict) -> str:
    return f"{rec['role']}#{rec['leg']}"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """First position where two token lists differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# --------------------------------------------------------------------------- file integrity


def check_integrity(integrity: dict) -> list[dict]:
    """The end record's count and sha256 cover every byte before it: a mismatch means the
    file was edited or cut after the harness wrote it; no end record means it was cut."""
    if not integrity.get("present"):
        return [finding("integrity", "fail", None,
                        "no end record: the stream is truncated (the harness always writes one last)")]
    out = []
    if not integrity.get("count_ok"):
        out.append(finding("integrity", "fail", None,
                           "end record's count does not match the records before it (lines added or removed)"))
    if not integrity.get("sha256_ok"):
        out.append(finding("integrity", "fail", None,
                           "end record's sha256 does not match the file (the stream was edited after it was written)"))
    return out


# --------------------------------------------------------------------------- header


def check_header(header: dict, versions_now: dict) -> list[dict]:
    out = []
    if header.get("dtype") != "bfloat16":
        out.append(finding("header", "fail", None,
                           f"run dtype {header.get('dtype')!r}; the audit replays in bfloat16, the harness's only dtype"))
    recorded = header.get("versions") if isinstance(header.get("versions"), dict) else {}
    for lib in ("torch", "transformers"):
        if lib in versions_now and recorded.get(lib) != versions_now[lib]:
            # a different build can legitimately compute different bits: say so, don't fail for it
            out.append(finding("header", "warn", None,
                               f"recorded with {lib} {recorded.get(lib)!r}, replayed with {versions_now[lib]!r}; "
                               "a divergence may be the library's, not the decoder's",
                               library=lib, recorded=recorded.get(lib), replayed=versions_now[lib]))
    warm = header.get("warmup_tokens")
    if is_int(warm) and warm >= header["max_new_tokens"]:
        out.append(finding("warm-leg", "warn", None,
                           f"warm-up decodes {warm} >= N={header['max_new_tokens']} tokens: a cache filled during "
                           "the warm-up would make every timed leg warm, invisible to the warm-leg check"))
    return out


def check_device(recorded: dict, replay_type: str, replay_name: str, allow_mismatch: bool) -> list[dict]:
    """A different device can legitimately produce a different greedy stream, so replaying on
    one is refused (BadInput) unless explicitly allowed, and then it is a warning."""
    if recorded.get("type") == replay_type and recorded.get("name") == replay_name:
        return []
    msg = (f"stream was recorded on {recorded.get('name')!r} ({recorded.get('type')}), replay runs on "
           f"{replay_name!r} ({replay_type}); a different device can legitimately emit a different greedy stream")
    if not allow_mismatch:
        raise BadInput(msg + "; replay on the recording device or pass --allow-device-mismatch")
    return [finding("device", "warn", None, msg + " (--allow-device-mismatch)",
                    recorded=recorded, replayed={"type": replay_type, "name": replay_name})]


def recorded_devices(header: dict) -> list[dict]:
    """Every device the run was recorded on: the header's, and under torchrun each rank's."""
    ranks = header.get("ranks") if isinstance(header.get("ranks"), list) else []
    out = []
    for dev in [header["device"], *(r["device"] for r in ranks if isinstance(r, dict) and "device" in r)]:
        if dev not in out:
            out.append(dev)
    return out


def check_devices(header: dict, replay_devices: list[dict], allow_mismatch: bool) -> list[dict]:
    """``check_device`` for every pair of a recording device and a replay device (one of each for
    a single process; under torchrun every replay rank must match every recording rank)."""
    out = []
    for replayed in [d for i, d in enumerate(replay_devices) if d not in replay_devices[:i]]:
        for recorded in recorded_devices(header):
            out += check_device(recorded, replayed["type"], replayed["name"], allow_mismatch)
    return out


def check_determinism(recorded, differences) -> list[dict]:
    """``differences`` is core.determinism.differences, called after the audit pinned."""
    if not isinstance(recorded, dict) or not recorded:
        return [finding("determinism", "fail", None,
                        "header has no determinism settings; exactness is undefined without them")]
    diffs = differences(recorded)
    if diffs:
        return [finding("determinism", "fail", None,
                        "stream was recorded in another configuration than the pinned one: " + "; ".join(diffs),
                        differences=diffs)]
    return []


def check_model_identity(recorded: dict, replayed: dict) -> list[dict]:
    """The replayed model must be the one that recorded the stream: the same config and weights
    (config_sha256 and weights_fingerprint; one missing from the stream is a mismatch, since a
    name alone does not say which weights ran). Two built-ins must also share name and seed.
    Paths may differ between machines, and a built-in given by its checkpoint directory
    (``--model fixtures/small``) is the same weights under another name: accepted, with a
    warning naming both."""
    both_builtin = recorded.get("kind") == "builtin" and replayed.get("kind") == "builtin"
    keys = (["name", "seed"] if both_builtin else []) + ["config_sha256", "weights_fingerprint"]
    bad = [k for k in keys if recorded.get(k) != replayed.get(k) or (k != "seed" and k not in recorded)]
    if not bad:
        if recorded.get("kind") == "builtin" and not both_builtin:
            return [finding("model", "warn", None,
                            f"replayed with {replayed.get('name')!r}, the same config and weights as the built-in "
                            f"{recorded.get('name')!r} the stream names (config_sha256 and weights_fingerprint agree)")]
        return []
    detail = "; ".join(f"{k}: stream {recorded[k]!r}, replayed {replayed.get(k)!r}" if k in recorded
                       else f"{k}: missing from the stream, replayed {replayed.get(k)!r}" for k in bad)
    return [finding("model", "fail", None,
                    f"the replayed model is not the one that recorded the stream ({detail}); tokens not replayed",
                    mismatched=bad)]


def is_serial_control(entry: dict) -> bool:
    """The header's control is the built-in serial decoder: named so, and built from the registry's
    ``serial`` with no arguments (a plug-in spec or arguments could build anything under that name)."""
    return (entry.get("name") == "serial" and entry.get("spec") in (None, "serial")
            and entry.get("args") in (None, {}))


def check_reference(header: dict) -> list[dict]:
    """A run timed against another reference than serial (``harness time --control``): its
    exactness is still replayed against serial greedy decoding, but its ratio is not one against
    the control, so it is never scored."""
    control = header["control"]
    if not is_serial_control(control):
        name = control.get("name")
        built = f" built from {control.get('spec')!r} {json.dumps(control.get('args') or {})}" if name == "serial" else ""
        return [finding("reference", "warn", None,
                        f"the reference decoder is {name!r}{built}, not the built-in serial control: ratios are "
                        f"against it; audited for exactness, never scored")]
    return []


def check_control_code(header: dict) -> list[dict]:
    """The harness's check of the control's code before it timed (``control_code`` in the header):
    a file it found changed fails the run; a stream that records no check is only said to lack it
    (``audit retime`` checks the code again before its own workers start)."""
    code = header.get("control_code")
    if not isinstance(code, dict):
        return [finding("control-code-unchecked", "warn", None,
                        "the header records no check of the control's code; `audit retime` checks it")]
    modified = code.get("modified")
    if not isinstance(modified, list):
        return [finding("control-code-modified", "fail", None, "the header's control_code.modified is not a list")]
    paths = [m.get("path") if isinstance(m, dict) else m for m in modified]
    out = [finding("control-code-modified", "fail", None,
                   f"the harness found {path!r} changed from its reference before timing: the control did "
                   "not run the code it names", path=path) for path in paths]
    unproven = code.get("unproven")
    if isinstance(unproven, list) and unproven:
        out.append(finding("control-code-unverified", "warn", None,
                           f"{len(unproven)} file(s) of the control's own code are covered by no reference (git "
                           f"HEAD, RECORD), so the harness could not prove them unchanged, e.g. {unproven[0]!r}",
                           paths=unproven[:LISTED_LEGS]))
    return out


def check_instrument(header: dict) -> list[dict]:
    if header["candidate"].get("instrument") is True:
        return [finding("instrument", "warn", None,
                        f"candidate {header['candidate']['name']!r} is marked as an instrument: "
                        "audited for exactness, never scored")]
    return []


# --------------------------------------------------------------------------- legs


def first_missing(present: set[int], legs: int, limit: int = LISTED_LEGS) -> list[int]:
    """The first ``limit`` of 0..legs-1 absent from ``present``, in len(present) + limit steps."""
    out, i = [], 0
    while len(out) < limit and i < legs:
        if i not in present:
            out.append(i)
        i += 1
    return out


def check_leg_set(p: PromptRun, legs: int) -> list[dict]:
    """Each role needs legs 0..L-1 exactly once (linear in the prompt's legs, whatever L claims)."""
    out = []
    for role in ROLES:
        idx = [r["leg"] for r in p.role_legs(role)]
        seen, dups = set(), set()
        for i in idx:
            (dups if i in seen else seen).add(i)
        dups = sorted(dups)
        extra = sorted({i for i in idx if not 0 <= i < legs})
        present = seen - set(extra)
        n_missing = legs - len(present)
        missing = first_missing(present, legs)
        if dups:
            out.append(finding("tamper", "fail", p.id, f"{role} legs {dups} appear more than once",
                               role=role, legs=dups))
        if extra:
            out.append(finding("tamper", "fail", p.id, f"{role} legs {extra} lie outside 0..{legs - 1} (L={legs})",
                               role=role, legs=extra))
        if n_missing:
            more = f" and {n_missing - len(missing)} more" if n_missing > len(missing) else ""
            out.append(finding("missing-leg", "fail", p.id,
                               f"{role} has {legs - n_missing} of {legs} legs; missing "
                               + ", ".join(f"{role}#{i}" for i in missing) + more, role=role, legs=missing))
    return out


def abba_slot(order: int) -> tuple[str, int]:
    """(role, leg) that ABBA puts at ``order`` (``core.schema.abba_roles`` without the list): pair
    order // 2 runs control first when even, candidate first when odd, and holds each role's
    leg number order // 2."""
    pair, second = divmod(order, 2)
    first = "control" if pair % 2 == 0 else "candidate"
    return (other_role(first) if second else first), pair


def check_leg_order(p: PromptRun, legs: int) -> list[dict]:
    """``order`` must follow ABBA: order k is abba_roles(L)[k], and it is that role's n-th leg."""
    out, seen = [], set()
    for rec in p.legs:
        o, label = rec["order"], leg_label(rec)
        if not 0 <= o < 2 * legs:
            out.append(finding("tamper", "fail", p.id, f"{label} has order {o}, outside 0..{2 * legs - 1}",
                               leg=label, order=o))
        elif o in seen:
            out.append(finding("tamper", "fail", p.id, f"order {o} is used by more than one leg", leg=label, order=o))
        elif abba_slot(o) != (rec["role"], rec["leg"]):
            role, leg = abba_slot(o)
            out.append(finding("tamper", "fail", p.id,
                               f"{label} has order {o}, but ABBA order {o} is {role}#{leg}",
                               leg=label, order=o))
        seen.add(o)
    orders = [r["order"] for r in p.legs]
    if orders != sorted(orders):
        out.append(finding("tamper", "fail", p.id, f"legs are not in the file in the order they ran: {orders}",
                           orders=orders))
    return out


def check_leg_timing(p: PromptRun) -> list[dict]:
    """wall_s == t_end - t_start; legs, taken by ``order``, occupy disjoint increasing intervals."""
    out = []
    for rec in p.legs:
        label, span = leg_label(rec), rec["t_end"] - rec["t_start"]
        if rec["t_start"] < 0 or rec["t_end"] <= rec["t_start"]:
            out.append(finding("tamper", "fail", p.id,
                               f"{label}: interval [{rec['t_start']}, {rec['t_end']}] is not a forward interval "
                               "from the run's start", leg=label))
        if not close(rec["wall_s"], span, REL_TOL, ABS_TOL):
            out.append(finding("tamper", "fail", p.id,
                               f"{label}: wall_s {rec['wall_s']!r} != t_end - t_start = {span!r}",
                               leg=label, wall_s=rec["wall_s"], span=span))
    by_order = sorted(p.legs, key=lambda r: r["order"])
    for a, b in zip(by_order, by_order[1:]):
        if b["t_start"] < a["t_end"]:
            out.append(finding("tamper", "fail", p.id,
                               f"{leg_label(b)} (order {b['order']}) starts at {b['t_start']!r}, before "
                               f"{leg_label(a)} (order {a['order']}) ends at {a['t_end']!r}: leg times were moved",
                               legs=[leg_label(a), leg_label(b)]))
    return out


def check_prompt_sequence(prompts: list[PromptRun], world_size: int = 1) -> list[dict]:
    """Prompts ran one after another: each prompt's legs start after the previous prompt's end.
    Under torchrun each rank has its own clock: prompt i ran on rank i % world_size
    (``check_ranks`` holds the file to that), so the rule holds among each rank's prompts."""
    out = []
    for rank in range(world_size):
        out += check_one_clock(prompts[rank::world_size])
    return out


def check_one_clock(prompts: list[PromptRun]) -> list[dict]:
    """The prompts one process ran, in order, on its one monotonic clock."""
    out, prev = [], None
    for p in prompts:
        if not p.legs:
            continue
        start, end = min(r["t_start"] for r in p.legs), max(r["t_end"] for r in p.legs)
        if prev is not None and start < prev[1]:
            out.append(finding("tamper", "fail", p.id,
                               f"prompt {p.id!r} legs start at {start!r}, before prompt {prev[0]!r} ended at {prev[1]!r}"))
        prev = (p.id, max(end, prev[1]) if prev else end)
    return out


def check_ranks(run: Run) -> list[dict]:
    """Under torchrun the harness gives prompt i to rank i % world_size and times all its legs
    there; a prompt or leg recorded elsewhere would escape the per-rank clock checks."""
    world = run.world_size
    if world <= 1:
        return []
    out = []
    for i, p in enumerate(run.prompts):
        want = i % world
        if not (is_int(p.rank) and p.rank == want):
            out.append(finding("tamper", "fail", p.id,
                               f"prompt {p.id!r} is recorded on rank {p.rank!r}, but as prompt {i} of a "
                               f"{world}-rank run it ran on rank {want} (i % world_size)", rank=p.rank, expected=want))
        stray = [leg_label(r) for r in p.legs if not (is_int(r.get("rank")) and r["rank"] == want)]
        if stray:
            out.append(finding("tamper", "fail", p.id, f"legs {stray} are not recorded on rank {want}, "
                               "the rank that ran their prompt", legs=stray, expected=want))
    return out


def check_out_of_place(p: PromptRun) -> list[dict]:
    return [finding("tamper", "fail", p.id, f"record out of place for prompt {p.id!r}: {where}")
            for where in p.out_of_place]


def check_control_consistency(p: PromptRun) -> list[dict]:
    """Every control leg must have emitted the same stream, or the reference is ill-defined."""
    ctl = sorted(p.role_legs("control"), key=lambda r: r["leg"])
    for rec in ctl[1:]:
        pos = first_difference(ctl[0]["tokens"], rec["tokens"])
        if pos is not None:
            return [finding("control-consistency", "fail", p.id,
                            f"control legs disagree: {leg_label(ctl[0])} and {leg_label(rec)} first differ at "
                            f"position {pos}; the serial reference is ill-defined for this prompt",
                            legs=[leg_label(ctl[0]), leg_label(rec)], position=pos)]
    return []


# --------------------------------------------------------------------------- ratios


def prompt_medians(p: PromptRun) -> dict:
    """Median wall time per side, from the raw legs, and the prompt's ratio by the shared rule
    (``core.schema.prompt_ratio``: the control's median over the candidate's first leg)."""
    med = {}
    for role in ROLES:
        walls = [r["wall_s"] for r in p.role_legs(role)]
        med[role] = statistics.median(walls) if walls else None
    first = next((r["wall_s"] for r in p.role_legs("candidate") if r["leg"] == 0), None)
    ratio = prompt_ratio([r["wall_s"] for r in p.role_legs("control")], first)
    return {"control_median_s": med["control"], "candidate_median_s": med["candidate"], "ratio": ratio}


def median_ratio(ratios: list[float | None]) -> float | None:
    have = [r for r in ratios if r is not None]
    return statistics.median(have) if have else None


def recompute_ratios(prompts: list[PromptRun]) -> tuple[dict[str, dict], float | None]:
    per_prompt = {p.id: prompt_medians(p) for p in prompts}
    return per_prompt, median_ratio([m["ratio"] for m in per_prompt.values()])


def check_summary(p: PromptRun, medians: dict) -> list[dict]:
    """The harness's summary record must agree with the recomputation beyond rounding."""
    if not p.summaries:
        return [finding("tamper", "fail", p.id, "no summary record (the harness writes one per prompt)")]
    out = []
    if len(p.summaries) > 1:
        out.append(finding("tamper", "fail", p.id, f"{len(p.summaries)} summary records for one prompt"))
    s = p.summaries[0]
    ours = dict(medians)
    ctl, cand = p.role_legs("control"), p.role_legs("candidate")
    if ctl and ours["control_median_s"]:
        ours["control_tokens_per_s"] = len(ctl[0]["tokens"]) / ours["control_median_s"]
    if cand and ours["candidate_median_s"]:
        ours["candidate_tokens_per_s"] = len(cand[0]["tokens"]) / ours["candidate_median_s"]
    for key, value in ours.items():
        if value is None or key not in s:
            continue
        theirs = s[key]
        if not isinstance(theirs, (int, float)) or isinstance(theirs, bool) or not close(float(theirs), value):
            out.append(finding("tamper", "fail", p.id,
                               f"summary {key} is {theirs!r}, the raw legs give {value!r}",
                               field=key, harness=theirs, recomputed=value))
    if "same_tokens_as_control" in s and p.legs:
        same = all(r["tokens"] == p.legs[0]["tokens"] for r in p.legs)
        if s["same_tokens_as_control"] is not same:
            out.append(finding("tamper", "fail", p.id,
                               f"summary same_tokens_as_control is {s['same_tokens_as_control']!r}, the legs say {same}",
                               field="same_tokens_as_control"))
    return out


def check_end_median(end: dict | None, median: float | None) -> list[dict]:
    if end is None or median is None:
        return []
    theirs = end.get("median_ratio")
    if not isinstance(theirs, (int, float)) or isinstance(theirs, bool) or not math.isfinite(theirs):
        return [finding("tamper", "fail", None, f"end record's median_ratio is {theirs!r}, not a finite number")]
    if not close(float(theirs), median):
        return [finding("tamper", "fail", None,
                        f"end record's median_ratio is {theirs!r}, the raw legs give {median!r}",
                        field="median_ratio", harness=theirs, recomputed=median)]
    return []


def check_warmup_prompt(p: PromptRun) -> list[dict]:
    """The harness warms both sides up on another prompt of the same length (``warmup_ids``), so
    the candidate meets the timed prompt first on its leg 0; older files record none."""
    if p.warmup_ids is None:
        return []
    if len(p.warmup_ids) != len(p.token_ids):
        return [finding("warmup-prompt", "fail", p.id,
                        f"the warm-up prompt has {len(p.warmup_ids)} tokens, the prompt {len(p.token_ids)}: "
                        "the warm-up must cost what the prompt costs")]
    if p.warmup_ids == p.token_ids:
        return [finding("warmup-prompt", "fail", p.id,
                        "the warm-up prompt is the timed prompt itself: the candidate's first leg was warm")]
    return []


def check_violations(run: Run) -> list[dict]:
    """The harness re-checks its own process (determinism, its clock, the control) after prepare
    and after every leg, and writes a violation record for anything changed."""
    return [finding("in-process-integrity", "fail", None,
                    f"line {line}: the harness found its process changed {rec['at']}: {rec['problem']}",
                    at=rec["at"], problem=rec["problem"], line=line)
            for line, rec in run.violations]


def check_prompt_set(header: dict, prompts: list[PromptRun], reference) -> list[dict]:
    """The header's prompt set (source, sha256, count) against the prompt records. ``reference``
    is what the named set gives here ((id, token_ids) per prompt, and its own source / sha256 /
    count, from ``core.prompts.load_prompts``), or a string saying why it cannot be rebuilt."""
    info = header.get("prompts")
    if not isinstance(info, dict):
        return [finding("prompts", "fail", None, "the header names no prompt set (source, sha256, count)")]
    out = []
    if info.get("count") != len(prompts):
        out.append(finding("prompts", "fail", None,
                           f"the header counts {info.get('count')!r} prompts, the file holds {len(prompts)} "
                           "prompt records", header_count=info.get("count"), records=len(prompts)))
    if isinstance(reference, str):
        return out + [finding("prompts", "warn", None, reference)]
    ref_prompts, ref_info = reference
    if info.get("sha256") != ref_info["sha256"]:
        out.append(finding("prompts", "fail", None,
                           f"the header's prompt sha256 {info.get('sha256')!r} is not that of {info.get('source')!r} "
                           f"({ref_info['sha256']})", header_sha256=info.get("sha256"), sha256=ref_info["sha256"]))
    differ = [p.id for p, ref in zip(prompts, ref_prompts) if (p.id, p.token_ids) != ref]
    differ += [p.id for p in prompts[len(ref_prompts):]]
    if differ:
        out.append(finding("prompts", "fail", None,
                           f"{len(differ)} prompt records (e.g. {differ[0]!r}) are not the prompts of "
                           f"{info.get('source')!r} (id and token ids, in order)", prompts=differ[:LISTED_LEGS]))
    return out


# --------------------------------------------------------------------------- noise


def prompt_spreads(p: PromptRun) -> dict[str, float | None]:
    """Each role's leg spread on one prompt (``core.schema.leg_spread``; None under 2 legs)."""
    return {role: leg_spread([r["wall_s"] for r in p.role_legs(role)]) for role in ROLES}


def is_unstable(p: PromptRun) -> bool:
    return any(s is not None and s > LEG_SPREAD_LIMIT for s in prompt_spreads(p).values())


def check_leg_spread(p: PromptRun) -> list[dict]:
    """A warning, never a failure: this prompt's ratio is within the machine's noise."""
    return [finding("unstable", "warn", p.id,
                    f"{role} legs differ by {s:.0%} (limit {LEG_SPREAD_LIMIT:.0%}): this prompt's ratio is within noise",
                    role=role, spread=s)
            for role, s in prompt_spreads(p).items() if s is not None and s > LEG_SPREAD_LIMIT]


def run_unstable(prompts: list[PromptRun]) -> bool:
    """More than UNSTABLE_RUN_SHARE of the prompts unstable: the run's ratio may be noise."""
    return bool(prompts) and sum(map(is_unstable, prompts)) > UNSTABLE_RUN_SHARE * len(prompts)


# --------------------------------------------------------------------------- memory


def peak_bytes(legs: list[dict]) -> int | None:
    """The max peak over legs; None where not measured (every leg null)."""
    values = [r.get("peak_mem_bytes") for r in legs]
    measured = [v for v in values if v is not None]
    return max(measured) if measured else None


def resident_bytes(header: dict) -> dict | None:
    """Header ``memory.resident_bytes``: what each decoder keeps allocated between decodes
    (static caches, graph pools), measured by the harness on CUDA; None where absent or null."""
    mem = header.get("memory")
    res = mem.get("resident_bytes") if isinstance(mem, dict) else None
    if isinstance(res, dict) and all(is_int(res.get(r)) and res[r] >= 0 for r in ROLES):
        return {r: res[r] for r in ROLES}
    return None


def rank_resident_bytes(header: dict, rank) -> dict | None:
    """Under torchrun each rank prepared its own decoders, so its own resident bytes (header
    ``ranks[r].resident_bytes``) apply to its legs; otherwise, or where absent, the header's."""
    ranks = header.get("ranks")
    if header.get("world_size", 1) > 1 and isinstance(ranks, list) and is_int(rank) and 0 <= rank < len(ranks):
        own = resident_bytes({"memory": {"resident_bytes": ranks[rank].get("resident_bytes")}})
        if own is not None:
            return own
    return resident_bytes(header)


def leg_resident(header: dict, rec: dict) -> dict | None:
    return rank_resident_bytes(header, rec.get("rank"))


def other_role(role: str) -> str:
    return "candidate" if role == "control" else "control"


def own_peak_bytes(legs: list[dict], role: str, header: dict) -> int | None:
    """A side's peak over its legs, without the other decoder's resident bytes: both decoders
    live in one process, so each leg's raw allocator peak also holds the other's buffers (the
    resident bytes of the leg's own rank under torchrun)."""
    own = []
    for r in legs:
        raw, res = r.get("peak_mem_bytes"), leg_resident(header, r)
        if raw is not None:
            own.append(raw if res is None else raw - res[other_role(role)])
    return max(own) if own else None


def check_resident(run: Run) -> list[dict]:
    """Every raw peak holds the other decoder's resident bytes, so it cannot be smaller."""
    low, shown = [], None
    for p in run.prompts:
        for r in p.legs:
            res, peak = leg_resident(run.header, r), r.get("peak_mem_bytes")
            if res is not None and peak is not None and peak < res[other_role(r["role"])]:
                low.append(f"{p.id}/{leg_label(r)}")
                shown = shown or res
    if low:
        return [finding("tamper", "fail", None,
                        f"{len(low)} legs (e.g. {low[0]}) peak below the other decoder's resident bytes "
                        f"{shown}: the header's memory.resident_bytes or the peaks were edited", legs=low)]
    return []


def check_memory_recorded(prompts: list[PromptRun]) -> list[dict]:
    """Peak memory is measured for every leg of a run or for none: a null beside numbers would
    silently lift the memory penalty."""
    legs = [r for p in prompts for r in p.legs]
    nulls = [f"{p.id}/{leg_label(r)}" for p in prompts for r in p.legs if r.get("peak_mem_bytes") is None]
    if nulls and len(nulls) < len(legs):
        return [finding("tamper", "fail", None,
                        f"peak_mem_bytes is null on {len(nulls)} of {len(legs)} legs (e.g. {nulls[0]}) "
                        "but measured on the others", legs=nulls)]
    return []


def memory_factor(control_peak: int | None, candidate_peak: int | None, allowance: float) -> tuple[float, float | None]:
    """(f_mem, candidate/control peak ratio): f_mem = min(1, allowance / ratio); 1 when not measured."""
    if control_peak is None or candidate_peak is None:
        return 1.0, None
    if control_peak <= 0:
        return (1.0 if candidate_peak <= 0 else 0.0), None
    ratio = candidate_peak / control_peak
    return (min(1.0, allowance / ratio) if ratio > 0 else 1.0), ratio


# --------------------------------------------------------------------------- warm legs


def later_over_first(legs: list[dict]) -> float | None:
    """Median wall time of legs 1.. over leg 0's; None without leg 0 and a later leg."""
    by_leg = {r["leg"]: r["wall_s"] for r in legs}
    later = [w for k, w in by_leg.items() if k >= 1]
    if 0 not in by_leg or not later:
        return None
    return statistics.median(later) / by_leg[0]


def warm_leg_flag(p: PromptRun, legs: int) -> tuple[bool, dict]:
    """A candidate whose later legs are much faster than its first while the control's are not
    looks like a cache keyed on the request: the first leg computed, the others looked it up.
    Flagged when candidate later/first < 0.6 while the control's > 0.8, or when the candidate's
    later/first is under 0.1x the control's whatever the control did."""
    cand, ctl = later_over_first(p.role_legs("candidate")), later_over_first(p.role_legs("control"))
    stats = {"candidate_later_over_first": cand, "control_later_over_first": ctl}
    flagged = (legs >= 2 and cand is not None and ctl is not None and cand < WARM_CANDIDATE_MAX
               and (ctl > WARM_CONTROL_MIN or cand < WARM_RELATIVE_MAX * ctl))
    return flagged, stats


def check_warm_leg(p: PromptRun, legs: int) -> list[dict]:
    flagged, stats = warm_leg_flag(p, legs)
    if not flagged:
        return []
    lookup = (stats["candidate_later_over_first"] < WARM_FAIL_MAX
              and stats["control_later_over_first"] >= WARM_FAIL_CONTROL_MIN)
    return [finding("warm-leg", "fail" if lookup else "warn", p.id,
                    f"candidate's later legs take {stats['candidate_later_over_first']:.2f}x its first leg while the "
                    f"control's take {stats['control_later_over_first']:.2f}x: possible cache keyed on the request",
                    **stats)]


# --------------------------------------------------------------------------- score


def score(median: float | None, f_mem: float, s_max: float, kappa: float, disqualified: bool) -> float:
    """S_max * (1 - exp(-(m - 1) / kappa)) * f_mem; 0 when disqualified or not faster (m <= 1)."""
    if disqualified or median is None or median <= 1:
        return 0.0
    return s_max * (1.0 - math.exp(-(median - 1.0) / kappa)) * f_mem


def run_checks(run: Run) -> list[dict]:
    """Every model-free check of the file's structure, timing and the harness's arithmetic."""
    out = check_integrity(run.integrity)
    out += check_violations(run)
    for p in run.prompts:
        out += check_out_of_place(p)
        out += check_leg_set(p, run.legs)
        out += check_leg_order(p, run.legs)
        out += check_leg_timing(p)
        out += check_control_consistency(p)
        out += check_warm_leg(p, run.legs)
        out += check_warmup_prompt(p)
        out += check_leg_spread(p)
    out += check_ranks(run)
    out += check_prompt_sequence(run.prompts, max(1, run.world_size))
    out += check_memory_recorded(run.prompts)
    out += check_resident(run)
    per_prompt, median = recompute_ratios(run.prompts)
    for p in run.prompts:
        out += check_summary(p, per_prompt[p.id])
    out += check_end_median(run.end, median)
    return out
