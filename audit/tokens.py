"""``audit tokens FILE --model M [--sampling SPEC]``: any engine's output against the pristine
serial control, greedy or under the seeded sampler it claims (``core.sampling``).

FILE is a jsonl of generations in one of three shapes, read as they are (``read_generations``):

  (a) {"id"?, "prompt_token_ids": [...] | "prompt": "text", "output_token_ids": [...]}
  (b) a serving engine's request output: {"prompt_token_ids": [...], "outputs": [{"token_ids": [...]}, ...]}
  (c) what ``generate`` returns: {"sequences": [[prompt + output ids], ...], "prompt_token_ids" | "prompt_length"}

Every output is checked by ``audit.replay.replay_prompt``, the function ``audit replay`` judges
streams with: each emitted token must be the argmax of the pristine serial path's logits (under
``--sampling``, the sampler's pick from them at the token's absolute position), and the output must
stop where serial decoding stops (right after the first EOS, or at N tokens). N is the longest
output unless given. A divergence is a near-tie when the pristine logit of the greedy token exceeds
the emitted token's by at most the tolerance (default: ``TIE_ULPS`` ulps of the logits' dtype at
the top-1 logit), so it can come from the order of the arithmetic alone; above it, or at a stop,
it is real. Under a sampler the same holds of the sampler's scores (``audit.replay.sampler_scores``:
logit + T * Gumbel noise, for the tokens its filter keeps); an emitted token the filter drops is
real. Each line is judged under the sampler it records (``harness generate --record`` and
``harness serve --record`` record theirs, greedy included), a line that records none under
``--sampling`` (default greedy); a line that records another sampler than an explicit
``--sampling`` is refused: an output is judged against the sampler it claims.

With a reference file (the same engine without speculation) each pair of outputs is compared
where they first part, and the pristine path says there which of them is greedy and by what margin:
speculation changed the output, or the engine was not greedy-exact before speculation.

The document written is ``"kind": "tokens-audit"`` (``build_document``); ``reports render`` draws it.
"""
from __future__ import annotations

import hashlib
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core import determinism, dist
from core.devices import check_device
from core.errors import UserError
from core.models import device_name, load_model
from core.prompts import is_unicode
from core.sampling import GREEDY, Sampler, SamplerError
from core.schema import jsonl_values, read_regular

from audit.checks import first_difference
from audit.replay import (AFTER_EOS, ENDS_EARLY, TOKEN_REASONS, TOO_LONG, PristineSerial, expected_positions,
                          pick_and_top, replay_prompt, score_of, teacher_forced_logits)
from audit.progress import Progress
from audit.report import write_document

KIND = "tokens-audit"
SCHEMA = "qwen35-exact/tokens-audit/1"
DEFAULT_NAME = "audit_tokens.json"
EXIT_EXACT, EXIT_DIVERGED, EXIT_BAD_INPUT = 0, 1, 2

# Default near-tie tolerance, in ulps of the logits' dtype (bf16) at the top-1 logit's magnitude.
# The logits are rounded to bf16 once at the output, which alone moves each of two logits by up to
# half an ulp (1 ulp on their difference). A legitimate kernel that sums in another order (a batched
# verify GEMM, a split reduction) rounds the bf16 hidden state feeding lm_head differently, which
# moves a logit by about one more ulp of its own size (bf16 keeps 8 significant bits), in either
# direction for each of the two logits: 1 + 2 * 1 = 3 ulps, rounded up to 4. A larger gap needs a
# difference beyond summation order: a different token history, a wrong cache, a skipped op.
TIE_ULPS = 4

NEAR_TIE, REAL, STOP = "near-tie", "real", "stop"
VERDICT_EXACT, VERDICT_TIES, VERDICT_REAL = "exact", "near-ties only", "real divergences"
STOP_TEXT = {AFTER_EOS: "ran past an EOS", ENDS_EARLY: "stopped early (before N, no EOS)",
             TOO_LONG: "longer than N"}


@dataclass
class Generation:
    """One output to audit, with where it came from in the file."""

    id: str
    line: int
    output: list[int]
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None
    explicit_id: bool = False
    padded: bool = False  # shape (c): ``generate`` pads finished rows after their EOS
    max_new_tokens: int | None = None  # the line's own N, where it gives one
    sampler: Sampler | None = None  # the line's own sampler, where it records one
    judged: Sampler = GREEDY  # what it is judged under (``judge_samplers``)


@dataclass
class TokensOptions:
    """Every `audit tokens` option, named once."""

    file: Path
    model: str
    device: str | None = None
    out: Path | None = None  # None: audit_tokens.json beside the file; "-": stdout
    tie_margin: float | None = None  # None: TIE_ULPS ulps at the top-1 logit
    reference: Path | None = None
    limit: int | None = None
    max_new_tokens: int | None = None  # None: the longest output
    sampler: Sampler | None = None  # --sampling: what lines that record no sampler claim; None: greedy


@dataclass
class Inputs:
    """What was read: the generations, the reference's and their pairing, and the sha256 of the
    bytes each file held when read (hashed once, from what was parsed)."""

    gens: list[Generation]
    sha256: str
    refs: list[Generation] | None = None
    ref_sha256: str | None = None
    pairs: dict | None = None
    matched_by: str | None = None


@dataclass
class Walked:
    """What the pristine walk of one prompt left for the outputs that share it."""

    results: dict
    logits_at: dict = field(default_factory=dict)  # position -> logits, where a reference pair parts


# --------------------------------------------------------------------------- reading


def read_file(path: Path) -> bytes:
    """A generations file's bytes: a regular file of at most ``core.schema.MAX_JSONL_BYTES``."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise UserError(f"{path}: no such file")
    return read_regular(path)


def read_generations(path: Path, limit: int | None = None, raw: bytes | None = None) -> list[Generation]:
    """Every generation in ``path`` (the first ``limit`` records), or UserError naming the line.
    ``raw``: the file's bytes when already read (``read_file``), so what is hashed is what is read."""
    path = Path(path)
    raw = read_file(path) if raw is None else raw
    gens: list[Generation] = []
    for records, (lineno, rec) in enumerate(jsonl_values(path, raw=raw), start=1):
        if limit is not None and records > limit:
            break
        if not isinstance(rec, dict):
            raise UserError(f"{path} line {lineno}: not a JSON object")
        gens += generations_of(rec, f"{path} line {lineno}", lineno)
    if not gens:
        raise UserError(f"{path}: no generations")
    seen: dict[str, int] = {}
    for g in gens:
        if g.id in seen:
            raise UserError(f"{path} line {g.line}: id {g.id!r} already used on line {seen[g.id]}")
        seen[g.id] = g.line
    return gens


def generations_of(rec: dict, where: str, lineno: int) -> list[Generation]:
    """One record's generations: one for shape (a), one per output or sequence for (b) and (c)."""
    raw_id = rec.get("id", rec.get("request_id"))
    if raw_id is not None and (isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or raw_id == ""):
        raise UserError(f"{where}: 'id' must be a non-empty string or an integer")
    base = str(raw_id) if raw_id is not None else f"line-{lineno}"
    if "sequences" in rec:
        outputs, prompt_ids = split_sequences(rec, where)
        text, padded = None, True
    elif "outputs" in rec:
        outs = rec["outputs"]
        if not isinstance(outs, list) or not outs:
            raise UserError(f"{where}: 'outputs' must be a non-empty list of {{\"token_ids\": [...]}}")
        outputs = []
        for k, o in enumerate(outs):
            if not isinstance(o, dict) or "token_ids" not in o:
                raise UserError(f"{where}: outputs[{k}] lacks 'token_ids'")
            outputs.append(token_list(o["token_ids"], f"{where}: outputs[{k}].token_ids", allow_empty=True))
        prompt_ids, text = prompt_of(rec, where)
        padded = False
    elif "output_token_ids" in rec:
        outputs = [token_list(rec["output_token_ids"], f"{where}: 'output_token_ids'", allow_empty=True)]
        prompt_ids, text = prompt_of(rec, where)
        padded = False
    else:
        raise UserError(f"{where}: lacks 'output_token_ids' (or 'outputs', or 'sequences'): no output to audit")
    own_n = rec.get("max_new_tokens")
    if own_n is not None and (isinstance(own_n, bool) or not isinstance(own_n, int) or own_n < 1):
        raise UserError(f"{where}: 'max_new_tokens' must be a positive integer")
    try:
        sampler = Sampler.from_json(rec["sampler"]) if "sampler" in rec else None
    except (SamplerError, TypeError) as exc:
        raise UserError(f"{where}: 'sampler': {exc}") from None
    many = len(outputs) > 1
    return [Generation(f"{base}/{k}" if many else base, lineno, out, prompt_ids, text, raw_id is not None, padded,
                       own_n, sampler) for k, out in enumerate(outputs)]


def same_sampler(a: Sampler, b: Sampler) -> bool:
    """Whether two samplers pick the same tokens (every greedy one does, whatever its seed)."""
    return a == b or (a.greedy and b.greedy)


def judge_samplers(gens: list[Generation], given: Sampler | None, path: Path) -> None:
    """Set what each line is judged under: the sampler it records, else ``given`` (--sampling;
    None: greedy). A line that records another sampler than an explicit --sampling is bad input:
    the check would judge a claim the line does not make."""
    for g in gens:
        if g.sampler is not None and given is not None and not same_sampler(g.sampler, given):
            raise UserError(f"{path} line {g.line}: the output records the sampler {g.sampler.describe()}, "
                            f"but --sampling says {given.describe()}; leave --sampling out to judge every "
                            "line under the sampler it records")
        g.judged = (g.sampler if g.sampler is not None else given) or GREEDY


def n_of(g: Generation, n: int) -> int:
    """The N an output is judged against: its line's own ``max_new_tokens``, else the run's."""
    return g.max_new_tokens or n


def n_line(doc: dict) -> str:
    if doc["n_from"].startswith("unused"):
        return "N = each line's own"
    return f"N = {doc['max_new_tokens']} ({doc['n_from']})"


def n_source(gens, given: bool) -> str:
    """Where the N of the run's document comes from, as its table says: every line recording its
    own N (which is what judges it) leaves the run's N unused."""
    own = sum(g.max_new_tokens is not None for g in gens)
    run = "-n" if given else "longest output"
    if own == len(gens):
        return "unused: each line records its own"
    return f"{run}; {own} line(s) record their own" if own else run


def prompt_of(rec: dict, where: str) -> tuple[list[int] | None, str | None]:
    """Token ids when given (a serving engine records both), else the text, encoded later."""
    if "prompt_token_ids" in rec:
        return token_list(rec["prompt_token_ids"], f"{where}: 'prompt_token_ids'"), None
    if "prompt" in rec:
        text = rec["prompt"]
        if not isinstance(text, str) or not text:
            raise UserError(f"{where}: 'prompt' must be a non-empty string")
        if not is_unicode(text):
            raise UserError(f"{where}: 'prompt' holds a lone surrogate (an escape such as \\ud800 that is no "
                            "character): it cannot be tokenized")
        return None, text
    raise UserError(f"{where}: lacks 'prompt_token_ids' (or 'prompt' text)")


def split_sequences(rec: dict, where: str) -> tuple[list[list[int]], list[int]]:
    """Shape (c): each sequence split after its prompt (given as ids, or as a length)."""
    seqs = rec["sequences"]
    if isinstance(seqs, list) and seqs and all(isinstance(t, int) and not isinstance(t, bool) for t in seqs):
        seqs = [seqs]  # one sequence, not nested
    if not isinstance(seqs, list) or not seqs:
        raise UserError(f"{where}: 'sequences' must be a non-empty list of token-id lists")
    seqs = [token_list(s, f"{where}: sequences[{k}]") for k, s in enumerate(seqs)]
    if "prompt_token_ids" in rec:
        prompt = token_list(rec["prompt_token_ids"], f"{where}: 'prompt_token_ids'")
        for k, s in enumerate(seqs):
            if s[:len(prompt)] != prompt:
                raise UserError(f"{where}: sequences[{k}] does not start with 'prompt_token_ids'")
    elif "prompt_length" in rec:
        length = rec["prompt_length"]
        if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= min(map(len, seqs)):
            raise UserError(f"{where}: 'prompt_length' must be an integer from 1 to the shortest sequence's length")
        prompt = seqs[0][:length]
        for k, s in enumerate(seqs):
            if s[:length] != prompt:
                raise UserError(f"{where}: sequences[{k}] has another prompt than sequences[0]")
    else:
        raise UserError(f"{where}: lacks 'prompt_token_ids' (or 'prompt_length') to split 'sequences'")
    return [s[len(prompt):] for s in seqs], prompt


def token_list(value, where: str, allow_empty: bool = False) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                              for t in value):
        raise UserError(f"{where} must be a list of non-negative integer token ids")
    if not value and not allow_empty:
        raise UserError(f"{where} is empty")
    return list(value)


def resolve(gens: list[Generation], model, path: Path) -> None:
    """Encode text prompts (no chat template), check every id against the vocabulary, and drop
    ``generate``'s padding after an EOS (its pad is an EOS id in Qwen's configs)."""
    eos = set(model.eos_token_ids)
    for g in gens:
        where = f"{path} line {g.line}"
        if g.prompt_ids is None:
            if model.tokenizer is None:
                raise UserError(f"{where}: the prompt is text, but model {model.name} has no tokenizer; "
                                "give 'prompt_token_ids'")
            g.prompt_ids = list(model.tokenizer.get().encode(g.prompt_text))
            if not g.prompt_ids:
                raise UserError(f"{where}: 'prompt' tokenizes to nothing")
        bad = [t for t in g.prompt_ids + g.output if t >= model.vocab_size]
        if bad:
            raise UserError(f"{where}: token id {bad[0]} outside the model's vocabulary (0..{model.vocab_size - 1})")
        context = getattr(model.text_config, "max_position_embeddings", None)
        if context is not None and len(g.prompt_ids) + len(g.output) > context:
            raise UserError(f"{where}: {len(g.prompt_ids)} prompt and {len(g.output)} output tokens, beyond the "
                            f"model's context of {context}")
        if g.padded:
            first = next((i for i, t in enumerate(g.output) if t in eos), None)
            if first is not None and all(t in eos for t in g.output[first:]):
                g.output = g.output[:first + 1]


def pair_with_reference(gens: list[Generation], refs: list[Generation], path: Path,
                        ref_path: Path) -> tuple[dict[str, Generation], str]:
    """Each generation's counterpart: by id when both files name every record, else by position.
    A generation without one is bad input: a reference is the same requests, and a comparison
    that matched nothing (or only some) would pass without having compared what was asked."""
    if all(g.explicit_id for g in gens + refs):
        by_id = {r.id: r for r in refs}
        pairs, matched_by = {g.id: by_id.get(g.id) for g in gens}, "id"
    else:
        pairs, matched_by = {g.id: refs[i] if i < len(refs) else None for i, g in enumerate(gens)}, "line"
    lacking = [g for g in gens if pairs[g.id] is None]
    if lacking:
        how = "no record of that id" if matched_by == "id" else f"only {len(refs)} generation(s)"
        raise UserError(f"{ref_path}: {len(lacking)} of {len(gens)} generations of {path} have no counterpart "
                        f"(matched by {matched_by}; e.g. {lacking[0].id!r} of line {lacking[0].line}: {how}); "
                        "the reference must hold the same requests")
    return pairs, matched_by


def check_same_prompts(gens: list[Generation], pairs: dict, ref_path: Path, path: Path) -> None:
    for g in gens:
        r = pairs[g.id]
        if r is not None and r.prompt_ids != g.prompt_ids:
            raise UserError(f"{ref_path} line {r.line}: its prompt differs from {path} line {g.line}'s "
                            f"(id {g.id!r}); the two files must hold the same requests")


# --------------------------------------------------------------------------- classifying


def ulp(x: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s values at magnitude |x| (an ulp)."""
    info = torch.finfo(dtype)
    return info.eps * 2.0 ** math.floor(math.log2(max(abs(x), info.tiny)))


def tolerance(top1: float, dtype: torch.dtype, fixed: float | None) -> float:
    return fixed if fixed is not None else TIE_ULPS * ulp(top1, dtype)


def classify(gap: float | None, tol: float) -> str:
    return NEAR_TIE if gap is not None and gap <= tol else REAL


def divergence_json(d, dtype: torch.dtype, fixed: float | None) -> dict:
    """A first divergence as the document records it, with its class."""
    out = {"position": d.position, "emitted": d.emitted, "greedy": d.greedy, "top5": d.top5, "margin": d.margin,
           "reason": d.reason}
    if d.reason not in TOKEN_REASONS:
        out.update({"gap": None, "tolerance": None, "class": STOP, "stop": STOP_TEXT[d.reason]})
        return out
    # the greedy token's logit (or the pick's score) over the emitted one's: the margin itself
    # when the emitted token is the runner-up, larger when the engine took a token further down
    gap = d.top5[0][1] - d.emitted_logit if d.emitted_logit is not None else None
    tol = tolerance(d.top5[0][1], dtype, fixed)
    out.update({"gap": gap, "tolerance": tol, "class": classify(gap, tol), "stop": None})
    return out


def verdict(counts: dict) -> str:
    """Real divergences (stops included) dominate near-ties."""
    if counts[REAL] or counts[STOP]:
        return VERDICT_REAL
    return VERDICT_TIES if counts[NEAR_TIE] else VERDICT_EXACT


# --------------------------------------------------------------------------- the walk


def walk_prompts(model, gens: list[Generation], n: int, partings: dict[str, int],
                 log) -> tuple[dict, int, float]:
    """One pristine walk per distinct (prompt, N, sampler) for all its outputs (``replay_prompt``),
    with a progress bar (``audit.progress``). Keeps the logits at the positions where a generation
    parts from its reference. Returns ({(prompt ids, N, sampler): Walked}, positions computed,
    seconds)."""
    stepper = PristineSerial(model)
    eos = set(model.eos_token_ids)
    groups: dict[tuple, list[Generation]] = {}
    for g in gens:
        groups.setdefault((tuple(g.prompt_ids), n_of(g, n), g.judged), []).append(g)
    planned = sum(expected_positions([g.output for g in members], own_n) for (_, own_n, _), members in groups.items())
    walked, positions, t0 = {}, 0, time.perf_counter()
    with Progress(planned, "tokens", log) as bar:
        for k, (key, members) in enumerate(groups.items(), start=1):
            prompt, own_n, sampler = key
            walked[key], walk_len = walk_group(stepper, prompt, members, own_n, eos, partings, bar, sampler)
            positions += walk_len
            diverged = sum(walked[key].results[tuple(g.output)] is not None for g in members)
            bar.log(f"tokens [{k}/{len(groups)}] {members[0].id}: {walk_len} positions, {len(members)} output(s), "
                    f"{'exact' if not diverged else f'{diverged} diverge'}")
    return walked, positions, time.perf_counter() - t0


def walk_group(stepper, prompt: tuple, members: list[Generation], n: int, eos: set[int], partings: dict[str, int],
               bar, sampler: Sampler = GREEDY) -> tuple[Walked, int]:
    """One prompt's walk for the outputs that share it; (Walked, positions computed)."""
    wanted = {partings[g.id] for g in members if g.id in partings}
    kept: dict[int, torch.Tensor] = {}
    ticked = 0

    def observe(i, logits):
        if i in wanted:
            kept[i] = logits.float().clone()

    def progress(i):
        nonlocal ticked
        bar.tick()
        ticked += 1

    streams = [tuple(g.output) for g in members]
    results, greedy = replay_prompt(stepper, list(prompt), streams, n, eos, progress, observe=observe,
                                    sampler=sampler)
    bar.settle(expected_positions(streams, n), len(greedy), ticked)
    return Walked(results, kept), len(greedy)


def parting_json(model, g: Generation, ref: Generation, div, walked: Walked, dtype, fixed, n: int,
                 sampler: Sampler = GREEDY) -> dict:
    """Where ``g`` and its reference first part, and what the pristine path says there."""
    k = first_difference(g.output, ref.output)
    base = {"reference_line": ref.line, "reference_id": ref.id}
    if k is None:
        return {**base, "parts": False}
    prefix = g.output[:k]
    ours = g.output[k] if k < len(g.output) else None
    theirs = ref.output[k] if k < len(ref.output) else None
    out = {**base, "parts": True, "position": k, "emitted": ours, "reference": theirs}
    # the shared prefix is greedy up to the parting unless our own divergence comes before it
    greedy_prefix = div is None or div.position >= k
    if greedy_prefix:
        out["prefix"] = "greedy"
    else:
        out["prefix"] = f"departs from greedy at position {div.position}"
    eos = set(model.eos_token_ids)
    if (prefix and prefix[-1] in eos) or k >= n:
        out.update({"greedy": None, "top5": [], "margin": None, "gap": None, "tolerance": None, "class": STOP,
                    "cause": cause(greedy_prefix, None, ours, theirs)})
        return out
    logits = walked.logits_at.get(k) if greedy_prefix else None
    if logits is None:  # the walk went elsewhere: teacher-force the shared prefix
        logits = teacher_forced_logits(PristineSerial(model), g.prompt_ids, prefix).float()
    position = len(g.prompt_ids) + k
    greedy, top, margin = pick_and_top(logits, sampler, position)
    off = off_tokens(greedy, ours, theirs)
    scores = [score_of(logits, t, sampler, position) for t in off]
    gap = (None if None in scores else top[0][1] - min(scores)) if off else None
    tol = tolerance(top[0][1], dtype, fixed)
    out.update({"greedy": greedy, "top5": top, "margin": margin, "gap": gap, "tolerance": tol,
                "class": classify(gap, tol) if off and all(t is not None for t in (ours, theirs)) else STOP,
                "cause": cause(greedy_prefix, greedy, ours, theirs)})
    return out


def off_tokens(control: int, ours: int | None, theirs: int | None) -> list[int]:
    """Of the two outputs' tokens at their parting, those that are not the control's."""
    return [t for t in (ours, theirs) if t is not None and t != control]


def cause(greedy_prefix: bool, greedy: int | None, ours: int | None, theirs: int | None) -> str:
    if not greedy_prefix:
        return "engine not greedy-exact: both outputs left the greedy path before they part"
    if theirs == greedy:
        return "speculation changed the output: the reference is greedy here, this output is not"
    if ours == greedy:
        return "engine not greedy-exact: the reference leaves the greedy path here, this output does not"
    return "both leave the greedy path here"


# --------------------------------------------------------------------------- the document


def build_document(opts: TokensOptions, inputs: Inputs, walked: dict, model, dev: str, n: int, replay: dict) -> dict:
    gens, pairs = inputs.gens, inputs.pairs
    dtype = model.backbone.get_output_embeddings().weight.dtype
    entries = []
    counts = {"exact": 0, NEAR_TIE: 0, REAL: 0, STOP: 0}
    for g in gens:
        walk = walked[tuple(g.prompt_ids), n_of(g, n), g.judged]
        div = walk.results[tuple(g.output)]
        first = divergence_json(div, dtype, opts.tie_margin) if div else None
        counts["exact" if first is None else first["class"]] += 1
        entry = {"id": g.id, "line": g.line, "prompt_tokens": len(g.prompt_ids), "output_tokens": len(g.output),
                 "exact": first is None, "ends_with_eos": bool(g.output) and g.output[-1] in model.eos_token_ids,
                 "max_new_tokens": n_of(g, n), "first_divergence": first, "sampler": g.judged.to_json()}
        if pairs is not None:
            ref = pairs[g.id]
            entry["reference"] = (parting_json(model, g, ref, div, walk, dtype, opts.tie_margin, n_of(g, n),
                                               g.judged)
                                  if ref is not None else None)
        entries.append(entry)
    doc = {
        "kind": KIND,
        "schema": SCHEMA,
        "file": str(opts.file),
        "file_sha256": inputs.sha256,
        "model": model.identity,
        "replay": {**replay, "path": "pristine-serial", "device": device_name(torch.device(dev))},
        "determinism": determinism.current(),
        "max_new_tokens": n,
        "n_from": n_source(gens, bool(opts.max_new_tokens)),
        # --sampling: the sampler lines that record none were judged under (greedy: temperature 0);
        # each generation's own is in its entry
        "sampler": (opts.sampler or GREEDY).to_json(),
        "eos_token_ids": list(model.eos_token_ids),
        "tie_margin": ({"mode": "fixed", "value": opts.tie_margin} if opts.tie_margin is not None
                       else {"mode": "ulps", "ulps": TIE_ULPS, "dtype": str(dtype).removeprefix("torch.")}),
        "generations": entries,
        "counts": {"generations": len(entries), **counts},
        "verdict": verdict(counts),
    }
    if pairs is not None:
        parted = [e["reference"] for e in entries if e["reference"] and e["reference"]["parts"]]
        doc["reference"] = {"file": str(opts.reference), "file_sha256": inputs.ref_sha256,
                            "matched_by": inputs.matched_by,
                            "unmatched": sum(e["reference"] is None for e in entries),
                            "parted": len(parted),
                            "speculation_changed": sum(p["cause"].startswith("speculation") for p in parted)}
    return doc


# --------------------------------------------------------------------------- table


def fmt(x, spec: str = ".4g") -> str:
    return "-" if x is None else format(x, spec)


def divergence_text(d: dict | None, sampled: bool = False) -> str:
    """A first divergence in a line: the emitted token against the control's (the argmax, or under
    a sampler its pick)."""
    if d is None:
        return "-"
    if d["class"] == STOP:
        return f"@{d['position']}: {d['stop']}"
    return f"@{d['position']}: {d['emitted']} vs {'pick' if sampled else 'greedy'} {d['greedy']}"


def parting_text(p: dict | None) -> str:
    if p is None:
        return "no counterpart"
    if not p["parts"]:
        return "same output"
    greedy = "serial stops" if p["greedy"] is None else f"greedy {p['greedy']}"
    return f"@{p['position']}: {p['emitted']} vs ref {p['reference']}, {greedy} ({p['class']}); {p['cause']}"


def render_table(doc: dict) -> str:
    judged = [Sampler.from_json(e.get("sampler", doc.get("sampler"))) for e in doc["generations"]]
    mixed = len({s.describe() for s in judged}) > 1  # then each line names its sampler
    rows = [("id", "tokens", "exact", "first divergence", "margin", "gap", "tolerance", "class")
            + (("sampler",) if mixed else ())]
    for e, sampler in zip(doc["generations"], judged):
        d = e["first_divergence"]
        rows.append((e["id"], str(e["output_tokens"]), "yes" if e["exact"] else "NO",
                     divergence_text(d, not sampler.greedy), fmt(d and d["margin"]), fmt(d and d["gap"]),
                     fmt(d and d["tolerance"]), d["class"] if d else "-") + ((sampler.describe(),) if mixed else ()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i in (1, 4, 5, 6) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
                       ).rstrip() for r in rows]
    lines.insert(1, "-" * max(len(x) for x in lines))
    if "reference" in doc:
        lines += ["", "against the reference:"]
        lines += [f"  {e['id']}: {parting_text(e['reference'])}" for e in doc["generations"]]
    c, tm, rp = doc["counts"], doc["tie_margin"], doc["replay"]
    tol = f"{tm['ulps']} ulps of {tm['dtype']} at the top-1 logit" if tm["mode"] == "ulps" else f"{tm['value']:g}"
    sampled = "" if mixed or all(s.greedy for s in judged) else f"; sampler: {judged[0].describe()}"
    lines += ["", f"{n_line(doc)}{sampled}; near-tie tolerance: {tol}",
              f"replay: {rp['tokens_replayed']} positions in {rp['seconds']:.2f} s on {rp['device']} via {rp['path']}",
              f"{c['generations']} generations: {c['exact']} exact, {c[NEAR_TIE]} near-tie, {c[REAL]} real, "
              f"{c[STOP]} stop"]
    if "reference" in doc:
        r = doc["reference"]
        lines.append(f"reference {r['file']} (matched by {r['matched_by']}): {r['parted']} part, "
                     f"{r['speculation_changed']} where speculation changed a greedy output"
                     + (f", {r['unmatched']} without a counterpart" if r["unmatched"] else ""))
    lines.append(f"verdict: {doc['verdict'].upper()}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the command


def out_destination(opts: TokensOptions) -> Path | None:
    """Where the document goes (None: stdout, for ``--out -``), refused before any work when it
    names a directory or one of the input files."""
    if opts.out is not None and str(opts.out) == "-":
        if sys.stdout is None:
            raise UserError("--out -: stdout is closed; the document would go nowhere")
        return None
    out = Path(opts.out) if opts.out else Path(opts.file).parent / DEFAULT_NAME
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; name the file to write (e.g. {out / DEFAULT_NAME})")
    for given in filter(None, (opts.file, opts.reference)):
        if Path(given).exists() and out.resolve() == Path(given).resolve():
            raise UserError(f"--out {out} is an input file")
    return out


def read_inputs(opts: TokensOptions) -> Inputs:
    """Both files read, checked and paired: every problem with them before the model loads."""
    path = Path(opts.file)
    raw = read_file(path)
    inputs = Inputs(read_generations(path, opts.limit, raw), hashlib.sha256(raw).hexdigest())
    if opts.reference:
        ref_raw = read_file(opts.reference)
        inputs.refs = read_generations(opts.reference, opts.limit, ref_raw)
        inputs.ref_sha256 = hashlib.sha256(ref_raw).hexdigest()
        inputs.pairs, inputs.matched_by = pair_with_reference(inputs.gens, inputs.refs, path, Path(opts.reference))
    return inputs


def run_tokens_audit(opts: TokensOptions, log=None) -> int:
    """The whole `audit tokens`; returns the exit code. Bad input raises UserError before anything
    is written."""
    from audit.pipeline import check_replaceable, check_writable, pin_replay_environment  # pin() before CUDA

    pin_replay_environment()
    if dist.topology().active:
        raise UserError("audit tokens runs in one process; launch it without torchrun")
    path = Path(opts.file)
    out_path = out_destination(opts)
    inputs = read_inputs(opts)
    gens, pairs = inputs.gens, inputs.pairs
    dev = check_device(opts.device)  # None: cuda when present, else cpu
    try:
        model = load_model(opts.model, dev)
    except UserError as exc:
        raise UserError(f"cannot load model {opts.model!r} to replay with: {exc}") from None
    resolve(gens, model, path)
    judge_samplers(gens, opts.sampler, path)
    if pairs is not None:
        resolve(inputs.refs, model, opts.reference)
        check_same_prompts(gens, pairs, opts.reference, path)
    n = opts.max_new_tokens or max(len(g.output) for g in gens)
    if n < 1:
        raise UserError(f"{path}: every output is empty; give -n to audit them against N tokens")
    if out_path is not None:
        check_replaceable(out_path)
        check_writable(out_path)
    partings = {}
    for g in gens:
        k = first_difference(g.output, pairs[g.id].output) if pairs else None
        if k is not None:
            partings[g.id] = k
    if log:
        samplers = sorted({g.judged.describe() for g in gens})
        sampled = "" if samplers == ["greedy"] else f", {' / '.join(samplers)}"
        log(f"auditing {len(gens)} generation(s) of {path} with {model.name} on {dev}, N = {n}{sampled} ...")
    walked, positions, seconds = walk_prompts(model, gens, n, partings, log)
    replay = {"tokens_replayed": positions, "seconds": seconds,
              "ms_per_token": 1000 * seconds / positions if positions else None}
    doc = build_document(opts, inputs, walked, model, dev, n, replay)
    write_document(out_path, doc, render_table(doc))
    return EXIT_EXACT if doc["verdict"] == VERDICT_EXACT else EXIT_DIVERGED
