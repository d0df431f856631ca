"""Recording a trace: the exact runtime decodes each prompt's stream and the drafter ``spec``
builds chains its drafts along it (the format: ``decoders.trace``)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from core.errors import UserError
from core.sampling import Sampler
from decoders.drafter import HEAD_FILE, MTPDrafter, load_head, load_shortlist, shortlist_source
from decoders.policy import confidence_bin
from decoders.runtime.runtime import ExactRuntime
from decoders.runtime.sizing import capacity_for
from decoders.sampled import TargetPicks
from decoders.trace import FORMAT, MAX_HEAD_TOP_K, MAX_TRACE_DEPTH, prompt_sha256, summarize


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
