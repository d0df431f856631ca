"""MTP acceptance: how many chained head drafts match a greedy stream, at every position.

A library for ``training`` (the quality phase) and ``heads`` (its evaluation): both measure a head
against the serial greedy streams of a frozen backbone, as ``spec``'s head cache drafts. Needs only
torch and ``core.mtp``.

    A, lens = acceptance_runs(backbone, head, prompts, streams, depth)
    summary = summarize_acceptance(A, lens, P, depth)   # per-depth rates, tokens per round at depth d
"""
from __future__ import annotations

import torch

from core.mtp import new_mtp_cache


@torch.inference_mode()
def acceptance_runs(backbone, head, prompts: list[list[int]], streams: list[list[int]], depth: int) -> tuple:
    """Chained MTP drafts of ``head`` against the serial greedy stream, at every position of every stream.

    For each position t from the last prompt row on, the head's persistent cache holds teacher rows
    0..t-1 (backbone hidden h_i, token i+1, at position i); row t gives draft d1 for token t+2,
    then the head chains on its own output and draft (the row at position t+k-1 gives d_k for
    token t+k+1), and the chained rows are cropped away again: what ``spec`` does with its head
    cache. The hidden states come from one batched backbone forward over prompt+stream (the
    chunked rule; serial decoding uses the recurrent one, so a near-tie may rarely differ).
    Runs on the backbone's device. Prompts must have equal lengths P. Returns (A, lens): A[i, j]
    is the number of leading drafts (0..depth) that match stream i at position t = P-1+j, -1 where
    token t+2 does not exist; lens[i] = P + len(stream i)."""
    lm, dev = backbone, backbone.lm_head.weight.device
    P = len(prompts[0])
    if any(len(p) != P for p in prompts):
        raise ValueError("acceptance needs prompts of one length")
    seqs = [p + s for p, s in zip(prompts, streams)]
    lens = torch.tensor([len(s) for s in seqs], device=dev)
    L = int(lens.max())
    S = torch.zeros(len(seqs), L + depth + 1, dtype=torch.int64, device=dev)
    for i, s in enumerate(seqs):
        S[i, : len(s)] = torch.tensor(s, device=dev)
    H = lm.model(input_ids=S[:, :L], use_cache=False).last_hidden_state
    cache = new_mtp_cache(head)
    if P > 1:
        head(H[:, : P - 1], S[:, 1:P], torch.arange(P - 1, device=dev), lm, cache=cache)  # teacher rows 0..P-2
    runs = []
    steps = torch.arange(1, depth + 1, device=dev)
    for t in range(P - 1, L - 2):
        out = head(H[:, t: t + 1], S[:, t + 1: t + 2], torch.tensor([t], device=dev), lm, cache=cache)
        keep = cache.get_seq_length()
        tok = lm.lm_head(out).argmax(-1)
        drafts = [tok]
        for k in range(2, depth + 1):
            out = head(out, tok, torch.tensor([t + k - 1], device=dev), lm, cache=cache)
            tok = lm.lm_head(out).argmax(-1)
            drafts.append(tok)
        cache.crop(keep)
        D = torch.cat(drafts, dim=1)                                  # [K, depth]: d_k predicts t+k+1
        valid = (t + 1 + steps)[None, :] < lens[:, None]
        ok = (D == S[:, t + 2: t + 2 + depth]) & valid
        run = ok.int().cumprod(dim=1).sum(dim=1)
        runs.append(torch.where(valid[:, 0], run, torch.full_like(run, -1)))
    A = torch.stack(runs, dim=1).cpu() if runs else torch.empty(len(seqs), 0, dtype=torch.int64)
    return A, lens.cpu()


def summarize_acceptance(A: torch.Tensor, lens: torch.Tensor, P: int, depth: int) -> dict:
    """Per-depth rates from ``acceptance_runs``, and the tokens per verification round that a fixed
    depth d would give along the stream (rounds of min(run, d) accepted drafts + 1 own token)."""
    t_idx = torch.arange(P - 1, P - 1 + A.shape[1])
    per_depth = []
    for k in range(1, depth + 1):
        exists = (t_idx[None, :] + 1 + k) < lens[:, None]       # token t+k+1 is in the stream
        reached = exists & (A >= k - 1)
        hit = exists & (A >= k)
        per_depth.append({
            "depth": k,
            "opportunities": int(reached.sum()),
            "accepted": int(hit.sum()),
            "conditional": float(hit.sum()) / max(int(reached.sum()), 1),   # P(d_k ok | d_1..d_{k-1} ok)
            "cumulative": float(hit.sum()) / max(int(exists.sum()), 1),     # P(d_1..d_k all ok)
        })
    per_round = {}
    for d in range(1, depth + 1):
        emitted = rounds = 0
        for i in range(A.shape[0]):
            j = 0
            while j < A.shape[1] and A[i, j] >= 0:
                run = min(int(A[i, j]), d)
                emitted += run + 1
                rounds += 1
                j += run + 1
        per_round[str(d)] = emitted / rounds if rounds else None
    valid = A[A >= 0]
    return {
        "positions": int(valid.numel()),
        "per_depth": per_depth,
        "tokens_per_round_at_fixed_depth": per_round,
        "mean_leading_accepted_at_max_depth": float(valid.float().mean()) if valid.numel() else None,
    }


def mtp_acceptance(backbone, head, prompts: list[list[int]], streams: list[list[int]], depth: int) -> dict:
    """``summarize_acceptance`` of ``acceptance_runs`` on prompts of one length."""
    A, lens = acceptance_runs(backbone, head, prompts, streams, depth)
    return summarize_acceptance(A, lens, len(prompts[0]), depth)
