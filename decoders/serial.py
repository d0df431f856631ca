"""``serial``: the pristine control that defines "exact".

HF transformers' own forward and DynamicCache: prefill the prompt, then one token per forward,
``argmax`` (first index on ties), or under a seeded sampler (core/sampling.py) the sampler's pick
from the same logits at the token's absolute position. Nothing clever, ever: every other decoder
is judged against it. Greedy, it matches ``model.generate(do_sample=False)`` token for token
(tests/test_serial.py).
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from core.sampling import GREEDY, Sampler
from decoders.base import DecodeResult, DecodeStats


class SerialDecoder:
    name = "serial"
    sampling = True

    def __init__(self):
        self.model = None

    def prepare(self, model) -> None:
        self.model = model

    def config(self) -> dict:
        return {"cache": "DynamicCache", "attn_implementation": self.model.backbone.config._attn_implementation
                if self.model else None}

    @torch.inference_mode()
    def decode(self, prompt_ids: list[int], max_new_tokens: int, *, on_tokens=None,
               sampler: Sampler | None = None) -> DecodeResult:
        lm = self.model.backbone
        eos = set(self.model.eos_token_ids)
        stats = DecodeStats()
        cache = DynamicCache(config=lm.config)
        ids = torch.tensor([prompt_ids], device=self.model.device)
        out = lm(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        stats.forwards += 1
        sampler = sampler or GREEDY
        tokens: list[int] = []
        while True:
            nxt = sampler.pick_tensor(out.logits[0, -1], len(prompt_ids) + len(tokens))
            tok = int(nxt.item())
            tokens.append(tok)
            if on_tokens is not None:
                on_tokens([tok])
            if tok in eos or len(tokens) >= max_new_tokens:
                break
            out = lm(input_ids=nxt.view(1, 1), past_key_values=cache, use_cache=True, logits_to_keep=1)
            stats.forwards += 1
        return DecodeResult(tokens, stats)
