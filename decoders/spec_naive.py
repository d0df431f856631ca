"""``spec-naive``: MTP speculation as the field usually ships it, kept as a baseline.

Each round drafts a fixed ``k`` tokens with the MTP head from a fresh head state (no KV cache
kept between rounds), verifies them in one batched HF forward, keeps the agreeing prefix plus the
model's own next token, and, after any rejection, restores the cache from a copy and re-runs the
accepted block to repair it (HF cannot crop recurrent state). The batched forward uses HF's
chunked Gated-DeltaNet rule, a different computation from serial decoding's recurrent rule, so
this decoder is not guaranteed exact; the audit says whether it was. Nothing here special-cases it.
"""
from __future__ import annotations

import copy

import torch
from transformers import DynamicCache

from core.mtp import new_mtp_cache
from decoders.base import DecodeResult, DecodeStats


class SpecNaiveDecoder:
    name = "spec-naive"
    sampling = False  # a greedy baseline: the harness and the API refuse a sampler for it

    def __init__(self, k: int = 3):
        if k < 1:
            raise ValueError("spec-naive needs k >= 1 draft tokens per round")
        self.k = k
        self.model = None

    def prepare(self, model) -> None:
        model.require_mtp(self.name)
        self.model = model

    def config(self) -> dict:
        return {"k": self.k, "head_state": "fresh each round", "repair": "re-run accepted block"}

    @torch.inference_mode()
    def decode(self, prompt_ids: list[int], max_new_tokens: int, *, on_tokens=None) -> DecodeResult:
        lm, head, dev = self.model.backbone, self.model.mtp, self.model.device
        eos = set(self.model.eos_token_ids)
        stats = DecodeStats(extra={"repairs": 0})
        cache = DynamicCache(config=lm.config)
        out = lm.model(input_ids=torch.tensor([prompt_ids], device=dev), past_key_values=cache, use_cache=True)
        stats.forwards += 1
        hidden = out.last_hidden_state[:, -1:]
        nxt = lm.lm_head(hidden).argmax(-1).view(1, 1)  # token at absolute position `pos`
        pos = len(prompt_ids)
        tokens = [int(nxt.item())]
        if on_tokens is not None:
            on_tokens(tokens[:])
        if tokens[-1] in eos or max_new_tokens <= 1:
            return DecodeResult(tokens, stats)
        while True:
            drafts = self.draft(head, lm, hidden, nxt, pos - 1)
            block = torch.cat([nxt] + drafts, dim=1)  # [1, k+1] at positions pos..pos+k
            snapshot = copy.deepcopy(cache)
            ver = lm.model(input_ids=block, past_key_values=cache, use_cache=True)
            stats.forwards += 1
            pred = lm.lm_head(ver.last_hidden_state).argmax(-1)[0]
            j = 0
            while j < self.k and int(pred[j]) == int(drafts[j]):
                j += 1
            stats.record_round(self.k, j)
            new = [int(d) for d in drafts[:j]] + [int(pred[j])]
            done = False
            start = len(tokens)
            for t in new:
                tokens.append(t)
                if t in eos or len(tokens) >= max_new_tokens:
                    done = True
                    break
            if on_tokens is not None:
                on_tokens(tokens[start:])
            if done:
                break
            if j < self.k:  # rejected: roll back by copy and re-run the accepted block
                cache = snapshot
                rep = lm.model(input_ids=block[:, : j + 1], past_key_values=cache, use_cache=True)
                stats.forwards += 1
                stats.extra["repairs"] += 1
                hidden = rep.last_hidden_state[:, -1:]
            else:
                hidden = ver.last_hidden_state[:, j:j + 1]
            nxt = pred[j].view(1, 1)
            pos += j + 1
        return DecodeResult(tokens, stats)

    def draft(self, head, lm, hidden, token, position: int) -> list[torch.Tensor]:
        """k chained MTP steps from a fresh head cache; step i sits at RoPE position ``position + i``."""
        mcache = new_mtp_cache(head)
        drafts = []
        for i in range(self.k):
            pos = torch.tensor([position + i], device=hidden.device)
            hidden = head(hidden, token, pos, lm, cache=mcache)
            token = lm.lm_head(hidden).argmax(-1).view(1, 1)
            drafts.append(token)
        return drafts
