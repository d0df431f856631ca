"""Acceptance traces: which of the MTP head's chained drafts a model's own stream accepts.

    python -m decoders.trace --model small --prompts stdlib-heldout -n 256 --out FILE
                             [--max-depth 6] [--limit K] [--device DEV] [--head DIR] [--shortlist FILE]
                             [--sampling SAMPLER [--uncoupled]] [--head-top-k K]

For every prompt the exact runtime decodes the greedy stream s_0..s_{m-1} (m <= n, ending early at
EOS, as every decoder does). Teacher-forced along it, the drafter ``spec`` builds for the same
arguments (its head, its shortlist) catches up on the true row of each position t (the backbone's
hidden state there and s_t) and chains ``max_depth`` drafts from it; bit (t, k) records whether
the k-th chained draft equals s_{t+k}, the token a round starting at s_t must match at depth k
(1 <= k <= max_depth, t + k < m). With ``--sampling`` (``core.sampling.Sampler.parse``: a preset
such as ``qwen-thinking,seed=7``, or ``temperature=0.6,top_p=0.95,seed=1``) the stream is the
sampled control's and the drafts are ``spec``'s coupled drafts (the target's noise at each draft's
position; ``--uncoupled``: plain argmax), so the trace is the head's acceptance under sampling.
With ``--head-top-k K`` (default 4; 0: none) each position also records where s_{t+1} ranks among
the K branches a tree of drafts would verify at depth 1: the draft itself (rank 0), then the head's
best other ids by draft logit (-1: none of them). Every draft's confidence (the head's probability
of it) is recorded too, as its tenth: one digit per bit, 0-9.
A row's catch-up here is always one row, where ``spec`` catches up
on a round's accepted rows at once; a batched head forward may round differently, so a trace is
the head's acceptance along the stream, not a record of any one ``spec`` run.

The JSON file holds the source model (name and identity), the drafter's settings (the sampler
and the coupling among them), the prompt set
(source, sha256, count), n, and per prompt its id, the sha256 of its token ids, the stream, one
bit string per position ("1" accepted, "0" not), one digit string of the drafts' confidences
(``"confidence": true``; files without it have none) and, with ``head_top_k``, the ranks; plus,
per depth, the conditional acceptance P(draft k accepted | drafts 1..k-1 accepted) and the tokens
per round a fixed depth gives, per tenth of confidence the acceptance of the drafts observed, and
with the ranks what a second branch at depth 1 would add (``summarize``).

``spec-instrument --decoder-arg trace=FILE`` replays a trace on any model (``Trace.accepts``, and
for ``stop=confidence`` ``Trace.confidence``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from core import determinism
from core.devices import check_device
from core.errors import UserError
from core.models import load_model
from core.paths import check_new_output
from core.prompts import load_prompts
from core.sampling import Sampler, SamplerError
from core.schema import write_json_atomic
from decoders.drafter import HEAD_FILE, MTPDrafter, load_head, load_shortlist, shortlist_source
from decoders.policy import CONFIDENCE_BINS, confidence_bin
from decoders.runtime.runtime import ExactRuntime
from decoders.runtime.sizing import capacity_for
from decoders.sampled import TargetPicks

FORMAT = "qwen35-exact/acceptance-trace/1"
MAX_TRACE_DEPTH = 15  # as SpecDecoder's max_depth
MAX_HEAD_TOP_K = 16
DIGITS = set("0123456789")


def prompt_sha256(token_ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(list(token_ids)).encode()).hexdigest()


@dataclass(frozen=True)
class TraceRow:
    prompt_id: str
    prompt_sha256: str
    tokens: list[int]  # the stream s_0..s_{m-1} (greedy, or the recorded sampler's)
    bits: list[str]  # bits[t][k-1] == "1": the k-th draft chained from s_t equals s_{t+k}
    ranks: list[int] | None = None  # ranks[t]: s_{t+1}'s rank among the depth-1 branches (0: the draft; -1: none)
    conf: list[str] | None = None  # conf[t][k-1]: the tenth (0-9) of the k-th chained draft's confidence


@dataclass(frozen=True)
class Trace:
    max_depth: int
    max_new_tokens: int
    rows: list[TraceRow]
    meta: dict  # model, drafter, prompts: as recorded

    def row_for(self, prompt_ids: list[int]) -> TraceRow:
        """The prompt's own row when it was traced, else a row picked by the prompt's hash: the
        same one on every run, rank and prompt order."""
        sha = prompt_sha256(prompt_ids)
        for row in self.rows:
            if row.prompt_sha256 == sha:
                return row
        return self.rows[int(sha, 16) % len(self.rows)]

    @staticmethod
    def accepts(row: TraceRow, t: int, k: int) -> bool:
        """Whether depth k's draft from position t is accepted. Past the row (a longer run, or a
        depth it cannot have near its end) positions cycle through the row's complete ones (those
        with a bit for every depth); a row without any accepts nothing there."""
        bits = cycled(row.bits, t, k)
        return bits is not None and bits[k - 1] == "1"

    @staticmethod
    def confidence(row: TraceRow, t: int, k: int) -> float:
        """Depth k's draft's confidence from position t, as its tenth's midpoint; past the row the
        positions cycle as in ``accepts``. A row without confidences (or none at depth k): 0.5."""
        digits = cycled(row.conf, t, k) if row.conf is not None else None
        return 0.5 if digits is None else (int(digits[k - 1]) + 0.5) / CONFIDENCE_BINS


def cycled(strings: list[str], t: int, k: int) -> str | None:
    """Position t's string when it reaches depth k; past that, position t modulo the count of
    strings that do (the complete ones lead a row: only its last positions are shorter); None when
    none does."""
    if t < len(strings) and k <= len(strings[t]):
        return strings[t]
    full = sum(1 for x in strings if len(x) >= k)
    return strings[t % full] if full else None


def leading_ones(bits: str, depth: int) -> int:
    """Drafts a round of ``depth`` keeps: the accepted run from the first draft on."""
    j = 0
    while j < min(depth, len(bits)) and bits[j] == "1":
        j += 1
    return j


def summarize(rows: list[list[str]], max_depth: int, ranks: list[list[int]] | None = None,
              top_k: int = 0, conf: list[list[str]] | None = None) -> dict:
    """Per-depth conditional acceptance, and the tokens per round (accepted + 1) that a fixed
    depth d gives when its rounds walk the stream (each round starting where the last one left).
    With each row's ``ranks`` (``top_k`` of them recorded), also ``second_branch``; with its
    confidences, ``by_confidence``."""
    per_depth = []
    for k in range(1, max_depth + 1):
        reached = [b for bits in rows for b in bits if len(b) >= k and leading_ones(b, k - 1) == k - 1]
        hit = sum(1 for b in reached if b[k - 1] == "1")
        per_depth.append({"depth": k, "opportunities": len(reached), "accepted": hit,
                          "conditional": hit / len(reached) if reached else None})
    per_round = {str(d): tokens_per_round(rows, d) for d in range(1, max_depth + 1)}
    out = {"per_depth": per_depth, "tokens_per_round_at_fixed_depth": per_round}
    if ranks is not None and top_k > 0:
        out["second_branch"] = second_branch(rows, ranks, max_depth, top_k)
    if conf is not None:
        out["by_confidence"] = by_confidence(rows, conf)
    return out


def by_confidence(rows: list[list[str]], conf: list[list[str]]) -> list[dict]:
    """Per tenth of confidence, the drafts observed (each up to and including a round's first
    rejection, at every depth) and the share accepted: how well the head's confidence predicts."""
    seen, hit = [0] * CONFIDENCE_BINS, [0] * CONFIDENCE_BINS
    for bits_row, conf_row in zip(rows, conf):
        for bits, digits in zip(bits_row, conf_row):
            for b, d in zip(bits, digits):
                seen[int(d)] += 1
                hit[int(d)] += b == "1"
                if b == "0":
                    break
    return [{"tenth": i, "drafts": seen[i], "accepted": hit[i] / seen[i] if seen[i] else None}
            for i in range(CONFIDENCE_BINS)]


def tokens_per_round(rows: list[list[str]], depth: int, ranks: list[list[int]] | None = None) -> float | None:
    """Tokens per round (accepted + 1) of rounds at a fixed ``depth`` walking each row, each round
    starting where the last one left; with ``ranks``, a round whose first draft misses but whose
    token is the second branch (rank 1) keeps it and the target's next: 2 tokens."""
    emitted = rounds = 0
    for i, bits in enumerate(rows):
        t = 0
        while t < len(bits) and bits[t]:
            run = leading_ones(bits[t], depth)
            gain = 2 if ranks is not None and ranks[i][t] == 1 else run + 1  # rank 1: the first draft missed
            emitted, rounds, t = emitted + gain, rounds + 1, t + gain
    return emitted / rounds if rounds else None


def second_branch(rows: list[list[str]], ranks: list[list[int]], max_depth: int, top_k: int) -> dict:
    """What the head's runners-up at depth 1 are worth, from the recorded ranks:

    - ``in_top``: per j, the share of depth-1 opportunities whose token is among the first j
      branches (the draft, then the head's best others);
    - ``misses_in_top``: per j, the share of depth-1 misses whose token is among them (a tree
      with those j branches keeps that round's first token);
    - ``tokens_per_round_at_fixed_depth``: the rounds of ``summarize`` with a second branch at
      depth 1 (the head's best other id as one more verify row): a round whose first draft misses
      but whose token is that id emits 2 (the branch's token and the target's next). The
      branch's own chain is not traced, so this is a lower bound."""
    firsts = [(bits[t][0], r[t]) for bits, r in zip(rows, ranks) for t in range(len(r)) if bits[t]]
    misses = [rank for bit, rank in firsts if bit == "0"]
    in_top = {str(j): sum(1 for _, rank in firsts if 0 <= rank < j) / len(firsts) if firsts else None
              for j in range(1, top_k + 1)}
    misses_in_top = {str(j): sum(1 for rank in misses if 0 <= rank < j) / len(misses) if misses else None
                     for j in range(1, top_k + 1)}
    per_round = {str(d): tokens_per_round(rows, d, ranks) for d in range(1, max_depth + 1)} if top_k >= 2 else {}
    return {"top_k": top_k, "opportunities": len(firsts), "in_top": in_top, "misses_in_top": misses_in_top,
            "tokens_per_round_at_fixed_depth": per_round}


@torch.inference_mode()
def record_prompt(runtime, drafter, prompt_ids: list[int], max_new_tokens: int, max_depth: int,
                  eos: set[int], picks: TargetPicks | None = None,
                  top_k: int = 0) -> tuple[list[int], list[str], list[int] | None, list[str]]:
    """The stream of one prompt, its bit strings, (``top_k`` > 0) its ranks and its confidence
    digits (see the module docstring): greedy, or with ``picks`` (bound to a sampler) the sampled
    stream. The drafter must be built with ``confidence=True``."""
    logits, hidden = runtime.prefill(prompt_ids)
    drafter.prefill(hidden, prompt_ids)
    y = logits.argmax(-1).view(1, 1) if picks is None else picks.first(logits, len(prompt_ids))
    row_hidden = hidden[:, -1:]
    tokens, chains, heads, confs = [int(y.item())], [], [], []
    while True:
        # the true row (hidden state at s_t's position, s_t), then max_depth chained drafts; the
        # chained rows lie past the true ones, so the next position's catch-up overwrites them.
        # One draft, then the chained steps: the same calls as draft(..., max_depth), with the
        # head's first output row read in between
        drafts = drafter.draft(row_hidden, y, 1)
        conf = [drafter.in_conf.clone()]
        if top_k:  # one more than kept: the draft itself may be any of them under coupling or a tie
            heads.append(drafter.head_candidates(top_k + 1))
        for i in range(max_depth - 1):
            drafts.append(drafter.chained_step(drafter.filled + i))
            conf.append(drafter.in_conf.clone())
        chains.append(torch.cat(drafts, dim=1))
        confs.append(torch.cat(conf))
        if tokens[-1] in eos or len(tokens) >= max_new_tokens:
            break
        prog = runtime.step(y)
        y = (prog.ws["argmax"] if picks is None else picks.row(prog, 0)).view(1, 1).clone()
        row_hidden = prog.ws["hidden"].clone()
        tokens.append(int(y.item()))
    drafts = torch.cat(chains, dim=0).tolist()  # [m, max_depth]
    m = len(tokens)
    bits = ["".join("1" if drafts[t][k - 1] == tokens[t + k] else "0" for k in range(1, min(max_depth, m - 1 - t) + 1))
            for t in range(m)]
    ranks = None
    if top_k:
        # the draft first, then the head's best others: the branches a tree would verify
        best = [[drafts[t][0]] + [v for v in top if v != drafts[t][0]][:top_k - 1]
                for t, top in enumerate(torch.stack(heads[:m - 1]).tolist())] if m > 1 else []
        ranks = [best[t].index(tokens[t + 1]) if tokens[t + 1] in best[t] else -1 for t in range(m - 1)]
    tenths = torch.stack(confs).tolist()
    digits = ["".join(str(confidence_bin(c)) for c in tenths[t][:len(bits[t])]) for t in range(m)]
    return tokens, bits, ranks, digits


def record(model, prompts, max_new_tokens: int, max_depth: int = 6, head: str | None = None,
           shortlist: str | None = None, progress=None, sampler: Sampler | None = None,
           coupled: bool = True, head_top_k: int = 0) -> dict:
    """Trace every prompt (``core.prompts.Prompt``) with the drafter ``spec`` builds for the same
    ``head``, ``shortlist`` and ``coupled`` arguments, greedily or under ``sampler``; with
    ``head_top_k`` > 0 each position's rank among the head's best at depth 1 too."""
    if not 1 <= max_depth <= MAX_TRACE_DEPTH:
        raise UserError(f"--max-depth must be within 1..{MAX_TRACE_DEPTH}")
    if not 0 <= head_top_k <= MAX_HEAD_TOP_K:
        raise UserError(f"--head-top-k must be within 0..{MAX_HEAD_TOP_K}")
    if max_new_tokens < 1:
        raise UserError("-n must be >= 1")
    trained = load_head(model, head) if head is not None else None
    source = shortlist_source(model, shortlist, head)
    ids = load_shortlist(source, model.vocab_size) if source else None
    longest = max(len(p.token_ids) for p in prompts) + max_new_tokens + max_depth + 2
    capacity = capacity_for(longest)
    runtime = ExactRuntime(model, capacity=capacity, windows=(1,))
    sampled = sampler is not None and not sampler.greedy
    drafter = MTPDrafter(model, capacity, shortlist=ids, head=trained, max_rows=max_depth + 1,
                         coupled=sampled and coupled, confidence=True)
    picks = None
    if sampled:
        drafter.couple(sampler if coupled else None)
        picks = TargetPicks(runtime.device, runtime.use_graphs)
        picks.bind(sampler, runtime.programs.values())
    eos = set(model.eos_token_ids)
    rows = []
    for i, p in enumerate(prompts):
        tokens, bits, ranks, conf = record_prompt(runtime, drafter, p.token_ids, max_new_tokens, max_depth, eos,
                                                  picks, head_top_k)
        rows.append({"id": p.id, "prompt_sha256": prompt_sha256(p.token_ids), "tokens": tokens, "bits": bits,
                     "conf": conf, **({"ranks": ranks} if head_top_k else {})})
        if progress:
            progress(i + 1, len(prompts), len(tokens))
    head_file = Path(head) / HEAD_FILE if head is not None else None
    return {
        "format": FORMAT,
        "model": {"name": model.name, "identity": model.identity},
        "drafter": {"head": head, "head_sha256": hashlib.sha256(head_file.read_bytes()).hexdigest() if head_file else None,
                    "shortlist": source, "shortlist_size": None if ids is None else len(set(ids)),
                    "sampler": sampler.to_json() if sampled else None, "coupled": sampled and coupled},
        "max_new_tokens": max_new_tokens,
        "max_depth": max_depth,
        "head_top_k": head_top_k,
        "confidence": True,
        "rows": rows,
        "acceptance": summarize([r["bits"] for r in rows], max_depth,
                                [r["ranks"] for r in rows] if head_top_k else None, head_top_k,
                                [r["conf"] for r in rows]),
    }


def load(path) -> Trace:
    """A trace file, checked: every malformation is a UserError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"trace file {str(path)!r} not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not a JSON trace file ({exc})") from None

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise UserError(f"{path}: not a valid trace file: {what}")

    need(isinstance(data, dict) and data.get("format") == FORMAT, f"format must be {FORMAT!r}")
    depth, n, rows = data.get("max_depth"), data.get("max_new_tokens"), data.get("rows")
    need(isinstance(depth, int) and 1 <= depth <= MAX_TRACE_DEPTH, "max_depth")
    need(isinstance(n, int) and n >= 1, "max_new_tokens")
    need(isinstance(rows, list) and rows, "rows must be a non-empty list")
    top_k = data.get("head_top_k", 0)
    need(isinstance(top_k, int) and not isinstance(top_k, bool) and 0 <= top_k <= MAX_HEAD_TOP_K, "head_top_k")
    with_conf = data.get("confidence", False)
    need(isinstance(with_conf, bool), "confidence must be true or false")
    out = []
    for i, r in enumerate(rows):
        need(isinstance(r, dict) and isinstance(r.get("id"), str) and isinstance(r.get("prompt_sha256"), str),
             f"row {i}: id and prompt_sha256")
        tokens, bits = r.get("tokens"), r.get("bits")
        need(isinstance(tokens, list) and 1 <= len(tokens) <= n
             and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens), f"row {i}: tokens")
        need(isinstance(bits, list) and len(bits) == len(tokens), f"row {i}: one bit string per token")
        need(all(isinstance(b, str) and set(b) <= {"0", "1"} and len(b) == min(depth, len(tokens) - 1 - t)
                 for t, b in enumerate(bits)), f"row {i}: bit strings of 0/1, max_depth long (shorter at the end)")
        ranks = r.get("ranks")
        need((ranks is None) == (top_k == 0), f"row {i}: ranks recorded exactly when head_top_k > 0")
        need(ranks is None or (isinstance(ranks, list) and len(ranks) == len(tokens) - 1
                               and all(isinstance(k, int) and not isinstance(k, bool) and -1 <= k < top_k
                                       for k in ranks)), f"row {i}: ranks, one per position with a next token")
        conf = r.get("conf")
        need((conf is None) == (not with_conf), f"row {i}: conf recorded exactly when confidence is true")
        need(conf is None or (isinstance(conf, list) and len(conf) == len(bits)
                              and all(isinstance(c, str) and set(c) <= DIGITS and len(c) == len(b)
                                      for c, b in zip(conf, bits))),
             f"row {i}: conf, one digit string per bit string, as long")
        out.append(TraceRow(r["id"], r["prompt_sha256"], list(tokens), list(bits),
                            None if ranks is None else list(ranks), None if conf is None else list(conf)))
    meta = {k: data.get(k) for k in ("model", "drafter", "prompts")}
    return Trace(max_depth=depth, max_new_tokens=n, rows=out, meta=meta)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m decoders.trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--prompts", default=None, help="prompt set (default: the model's default set)")
    ap.add_argument("--limit", type=int, default=None, help="keep the first K prompts")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-depth", type=int, default=6)
    ap.add_argument("--head", default=None, help="a directory written by `heads train` (as spec's head=)")
    ap.add_argument("--shortlist", default=None, help="draft shortlist JSON (as spec's shortlist=)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--sampling", default=None, metavar="SAMPLER",
                    help="trace the sampled stream (core.sampling: e.g. qwen-thinking,seed=7) with coupled drafts")
    ap.add_argument("--uncoupled", action="store_true", help="with --sampling: drafts by plain argmax")
    ap.add_argument("--head-top-k", type=int, default=4, metavar="K",
                    help="record each position's rank among the head's K best at depth 1 (0: none)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = ap.parse_args(argv)

    determinism.pin()  # before anything starts CUDA
    transformers.logging.set_verbosity_error()
    try:
        if args.limit is not None and args.limit < 1:
            raise UserError("--limit must be >= 1")
        check_new_output(args.out, args.force)
        device = check_device(args.device)
        if args.uncoupled and args.sampling is None:
            raise UserError("--uncoupled needs --sampling")
        try:
            sampler = Sampler.parse(args.sampling) if args.sampling is not None else None
        except SamplerError as exc:
            raise UserError(f"--sampling: {exc}") from None
        model = load_model(args.model, device)
        model.require_mtp("trace")
        prompts, info = load_prompts(args.prompts, model, args.limit)
        data = record(model, prompts, args.max_new_tokens, args.max_depth, args.head, args.shortlist,
                      lambda i, k, m: print(f"traced {i}/{k} ({m} tokens)", file=sys.stderr, flush=True),
                      sampler=sampler, coupled=not args.uncoupled, head_top_k=args.head_top_k)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    data["prompts"] = info
    write_json_atomic(args.out, data, indent=None)  # a data file: 2-3 KB per 100 positions
    acc = ", ".join(f"{d['conditional']:.3f}" if d["conditional"] is not None else "-"
                    for d in data["acceptance"]["per_depth"])
    print(f"wrote {args.out}: {len(data['rows'])} prompts, conditional acceptance by depth {acc}")
    branch = data["acceptance"].get("second_branch")
    if branch and branch["misses_in_top"].get("2") is not None:
        per_round = ", ".join(f"{v:.3f}" for v in branch["tokens_per_round_at_fixed_depth"].values() if v is not None)
        print(f"depth-1 misses whose token is the second branch: {branch['misses_in_top']['2']:.3f}; "
              f"tokens per round by depth with a second branch at depth 1: {per_round}")
    tenths = ", ".join("-" if b["accepted"] is None else f"{b['accepted']:.2f}" for b in data["acceptance"]["by_confidence"])
    print(f"acceptance by tenth of the head's confidence (0.0-0.1 ... 0.9-1.0): {tenths}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
