"""The sequence-level unlikelihood fine-tune against greedy loops (``Preset.unloop_*``).

Welleck et al. 2019, "Neural text generation with unlikelihood training". A model this small,
decoded greedily, falls into short cycles. Rounds of the model's own greedy continuations of
train-split windows mark each token that completes an ``unloop_ngram``-gram already in its sequence
(``repeat_mask``), and updates lower those tokens' probability by -log(1 - p) (``unlikelihood``)
beside ordinary next-token + MTP batches, so the language model itself is kept. It trades a little
dev loss and MTP acceptance (drafts of a loop are easy) for samples that read like code; the final
weights are the result.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from training.data import WindowSampler
from training.log import log, progress
from training.model import Preset, add_dropout, losses
from training.quality import loops
from training.train import evaluate_loss, param_groups


@torch.no_grad()
def greedy_continuations(backbone, prompts: torch.Tensor, n: int, amp: bool) -> torch.Tensor:
    """Batched greedy continuations with HF's cache: prompts [B, P] -> [B, P + n]. Training data
    only (rows share padding-free batches; not the exact decoders)."""
    was = backbone.training
    backbone.eval()
    seq = prompts
    with torch.autocast(prompts.device.type, dtype=torch.bfloat16, enabled=amp):
        out = backbone(input_ids=prompts, use_cache=True, logits_to_keep=1)
        for i in range(n):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            if i + 1 < n:
                out = backbone(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    backbone.train(was)
    return seq


def repeat_mask(seq: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """[B, T] bool: position t >= start whose token completes an n-gram that already ended at an
    earlier position of the same row (prompt included)."""
    B, T = seq.shape
    mask = torch.zeros(B, T, dtype=torch.bool)
    rows = seq.tolist()
    for b, row in enumerate(rows):
        seen = {tuple(row[j - n + 1: j + 1]) for j in range(n - 1, start)}
        for t in range(max(start, n - 1), T):
            g = tuple(row[t - n + 1: t + 1])
            if g in seen:
                mask[b, t] = True
            seen.add(g)
    return mask


def unlikelihood(backbone, seq: torch.Tensor, mask: torch.Tensor, start: int) -> torch.Tensor:
    """Mean over the continuation's tokens of -log(1 - p(token)) at masked positions."""
    hidden = backbone.model(input_ids=seq, use_cache=False).last_hidden_state
    logits = backbone.lm_head(hidden[:, start - 1: -1]).float()
    p = logits.softmax(-1).gather(-1, seq[:, start:, None]).squeeze(-1)
    ul = -torch.log((1.0 - p).clamp_min(1e-5))
    return (ul * mask[:, start:]).sum() / mask[:, start:].numel()


def unloop(backbone, head, train_stream, dev_windows, p: Preset, device, seed: int) -> dict:
    """The fine-tune; returns its record. Rounds of generation: each round continues
    ``unloop_prompts`` fresh train-split windows by ``new_tokens`` greedy tokens (the quality phase's
    length), marks ``repeat_mask``, then makes ``unloop_every`` AdamW updates of (next-token +
    mtp_lambda x MTP on train windows) + unloop_weight x unlikelihood on a random batch of the
    round's sequences. Dev loss is measured before and after (the record); the final weights are
    the result (no selection)."""
    amp = device.type == "cuda"
    backbone.to(device).train()
    head.to(device).train()
    hooks = add_dropout([backbone, head], p.dropout)
    params = list(backbone.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(param_groups([backbone, head], p.weight_decay), lr=p.unloop_lr, betas=(0.9, 0.95),
                            eps=1e-8, fused=amp)
    sampler = WindowSampler(train_stream, p.seq_len, p.unloop_mle_batch, seed + 10)
    gen = torch.Generator().manual_seed(seed + 11)
    P, G = p.prompt_len, p.new_tokens
    before = evaluate_loss(backbone, head, dev_windows, p.batch, device, amp)
    log(f"unloop: dev next-token {before['ntp_loss']:.4f} before; {p.unloop_steps} updates, lr {p.unloop_lr}, "
        f"{p.unloop_ngram}-gram repeats, {p.unloop_prompts} continuations x {G} tokens per round")
    rounds, done, t0 = [], 0, time.perf_counter()
    bar = progress(p.unloop_steps, "unloop", "update")
    while done < p.unloop_steps:
        starts = torch.randint(0, train_stream.numel() - P, (p.unloop_prompts,), generator=gen)
        prompts = train_stream[starts[:, None] + torch.arange(P)[None, :]].to(device)
        seq = greedy_continuations(backbone, prompts, G, amp)
        seq_cpu = seq.cpu()
        mask = repeat_mask(seq_cpu, P, p.unloop_ngram).to(device)
        looping = sum(loops(r[P:]) for r in seq_cpu.tolist()) / seq.shape[0]
        rec = {"update": done, "looping_fraction": round(looping, 4),
               "repeat_token_fraction": round(float(mask[:, P:].float().mean()), 4)}
        sums = torch.zeros(2, device=device)  # (unlikelihood, next-token): read once per round
        k = min(p.unloop_every, p.unloop_steps - done)
        for _ in range(k):
            pick = torch.randint(0, seq.shape[0], (p.unloop_batch,), generator=gen).to(device)
            ids = sampler.next().to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                ntp, mtp = losses(backbone, head, ids)
                ul = unlikelihood(backbone, seq[pick], mask[pick], P)
            loss = ntp + p.mtp_lambda * mtp + p.unloop_weight * ul
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, p.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sums += torch.stack([ul.detach().float(), ntp.detach().float()])
        done += k
        bar.update(k)
        ul_mean, ntp_mean = (sums / k).tolist()
        rec.update({"mean_unlikelihood": round(ul_mean, 5), "mean_train_ntp": round(ntp_mean, 5)})
        rounds.append(rec)
        log(f"unloop {done}/{p.unloop_steps}: generated loops {rec['looping_fraction']:.3f}, repeat tokens "
            f"{rec['repeat_token_fraction']:.3f}, unlikelihood {rec['mean_unlikelihood']:.4f}, "
            f"train ntp {rec['mean_train_ntp']:.4f}  {time.perf_counter() - t0:.0f}s")
    bar.close()
    for h in hooks:
        h.remove()
    after = evaluate_loss(backbone, head, dev_windows, p.batch, device, amp)
    log(f"unloop: dev next-token {after['ntp_loss']:.4f} after ({before['ntp_loss']:.4f} before)")
    return {"updates": done, "seconds": round(time.perf_counter() - t0, 1), "dev_before": before,
            "dev_after": after, "rounds": rounds,
            "settings": {k: v for k, v in dataclasses.asdict(p).items() if k.startswith("unloop_")}}
