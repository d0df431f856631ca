"""Known-bad decoders the audit must catch (test-only; plug in with ``--decoder bad_decoders:Name``).

  Unverified   emits MTP drafts without verifying them: fast, wrong    -> exactness finding
  SkipLayers   skips backbone layers to go fast: wrong logits          -> exactness finding
  PromptCache  serial the first time, then tokens cached on the request -> warm-leg finding

Each is built the way a real shortcut would be, not rigged to trip a particular check.
"""
from __future__ import annotations

import torch
from torch import nn

from decoders.base import DecodeResult, DecodeStats
from core.mtp import new_mtp_cache


def serial_tokens(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], int]:
    """Plain serial greedy (prefill, then one token per forward). Returns (tokens, forwards)."""
    from transformers import DynamicCache

    lm, eos = model.backbone, set(model.eos_token_ids)
    cache = DynamicCache(config=lm.config)
    out = lm(input_ids=torch.tensor([prompt_ids], device=model.device), past_key_values=cache,
             use_cache=True, logits_to_keep=1)
    tokens, forwards = [], 1
    while True:
        tok = int(out.logits[0, -1].argmax(-1).item())
        tokens.append(tok)
        if tok in eos or len(tokens) >= max_new_tokens:
            return tokens, forwards
        out = lm(input_ids=torch.tensor([[tok]], device=model.device), past_key_values=cache,
                 use_cache=True, logits_to_keep=1)
        forwards += 1


class Unverified:
    """MTP speculation that trusts its drafts: each round emits k drafts plus the backbone's
    token after them, and never checks a draft against the backbone."""

    name = "unverified"

    def __init__(self, k: int = 3):
        self.k = k
        self.model = None

    def prepare(self, model) -> None:
        model.require_mtp(self.name)
        self.model = model

    def config(self) -> dict:
        return {"k": self.k, "verify": False}

    @torch.inference_mode()
    def decode(self, prompt_ids: list[int], max_new_tokens: int) -> DecodeResult:
        from transformers import DynamicCache

        lm, head, dev = self.model.backbone, self.model.mtp, self.model.device
        eos = set(self.model.eos_token_ids)
        stats = DecodeStats()
        cache = DynamicCache(config=lm.config)
        out = lm.model(input_ids=torch.tensor([prompt_ids], device=dev), past_key_values=cache, use_cache=True)
        stats.forwards += 1
        hidden = out.last_hidden_state[:, -1:]
        nxt = lm.lm_head(hidden).argmax(-1).view(1, 1)
        pos = len(prompt_ids)
        tokens = [int(nxt.item())]
        while tokens[-1] not in eos and len(tokens) < max_new_tokens:
            mcache, h, tok, drafts = new_mtp_cache(head), hidden, nxt, []
            for i in range(self.k):
                h = head(h, tok, torch.tensor([pos - 1 + i], device=dev), lm, cache=mcache)
                tok = lm.lm_head(h).argmax(-1).view(1, 1)
                drafts.append(tok)
            block = torch.cat([nxt] + drafts, dim=1)
            ver = lm.model(input_ids=block, past_key_values=cache, use_cache=True)  # advance only
            stats.forwards += 1
            stats.record_round(self.k, self.k)
            hidden = ver.last_hidden_state[:, -1:]
            nxt = lm.lm_head(hidden).argmax(-1).view(1, 1)
            for t in [int(d) for d in drafts] + [int(nxt.item())]:
                tokens.append(t)
                if t in eos or len(tokens) >= max_new_tokens:
                    break
            pos += self.k + 1
        return DecodeResult(tokens, stats)


class _Skip(nn.Module):
    """Stands in for a decoder layer: passes the hidden state through untouched."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class SkipLayers:
    """Serial decoding with some backbone layers skipped (swapped for identities during decode
    and restored after, so the control sharing the model is unaffected)."""

    name = "skip-layers"

    def __init__(self, skip: tuple[int, ...] = (1,)):
        self.skip = skip
        self.model = None

    def prepare(self, model) -> None:
        self.model = model

    def config(self) -> dict:
        return {"skip": list(self.skip)}

    @torch.inference_mode()
    def decode(self, prompt_ids: list[int], max_new_tokens: int) -> DecodeResult:
        layers = self.model.backbone.model.layers
        saved = {i: layers[i] for i in self.skip}
        try:
            for i in self.skip:
                layers[i] = _Skip()
            tokens, forwards = serial_tokens(self.model, prompt_ids, max_new_tokens)
        finally:
            for i, layer in saved.items():
                layers[i] = layer
        return DecodeResult(tokens, DecodeStats(forwards=forwards))


class PromptCache:
    """Exact tokens, cheated time: decodes serially once per (prompt, N), then returns the
    cached tokens. (The harness's warm-up decodes fewer tokens than N, so leg 0 computes.)"""

    name = "prompt-cache"

    def __init__(self):
        self.model = None
        self.cache: dict[tuple, list[int]] = {}

    def prepare(self, model) -> None:
        self.model = model

    def config(self) -> dict:
        return {"cache": "keyed on (prompt tokens, max_new_tokens)"}

    @torch.inference_mode()
    def decode(self, prompt_ids: list[int], max_new_tokens: int) -> DecodeResult:
        key = (tuple(prompt_ids), max_new_tokens)
        if key in self.cache:
            return DecodeResult(list(self.cache[key]), DecodeStats(extra={"cache_hit": True}))
        tokens, forwards = serial_tokens(self.model, prompt_ids, max_new_tokens)
        self.cache[key] = tokens
        return DecodeResult(list(tokens), DecodeStats(forwards=forwards, extra={"cache_hit": False}))
