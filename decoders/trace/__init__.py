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

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from core.errors import UserError
from decoders.policy import CONFIDENCE_BINS

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
