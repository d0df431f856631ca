"""MTP drafting with a persistent head state and an optional draft shortlist.

The head keeps its own KV cache across rounds, one entry per position: the row at position p
holds (backbone hidden h_p, token t_{p+1}). After a verification, the rows for accepted tokens are
recomputed with the backbone's true hidden states (the draft steps had used the head's own
output) together with the next round's first draft step, in one call, so the head never drifts.
Rows past the accepted length are simply overwritten later. Drafts need not be exact (the verify
window decides), so every op here runs batched.

Shortlist: the draft logits may be computed over a fixed, request-independent set of token ids
(built offline from token frequencies of generated text), which cuts the head's largest GEMM;
verification always uses the full vocabulary, so exactness is untouched.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from decoders.runtime import layers as L


class Unchecked:
    """A calibration stand-in for drafting: batch everything (drafts are verified, not trusted)."""

    max_rows = 1 << 30
    hidden_mean = head_norm = gated_norm = l2norm = 1 << 30
    conv_window = kv_view_ok = elementwise = True

    def gemm_rows(self, linear) -> int:
        return 1 << 30


class MTPDrafter:
    def __init__(self, model, capacity: int, shortlist: list[int] | None = None):
        self.model = model
        lm, head = model.backbone, model.mtp
        self.head, self.lm = head, lm
        dev, dtype = model.device, lm.lm_head.weight.dtype
        attn = head.layers[0].self_attn
        cfg = lm.config
        shape = (1, cfg.num_key_value_heads, capacity, attn.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=dev)
        self.values = torch.zeros(shape, dtype=dtype, device=dev)
        self.capacity = capacity
        self.cal = Unchecked()
        self.filled = 0  # head rows [0, filled) hold true-hidden entries
        self.shortlist = None
        self.head_weight = lm.lm_head.weight
        if shortlist:
            self.shortlist = torch.tensor(sorted(set(shortlist)), dtype=torch.long, device=dev)
            self.head_weight = lm.lm_head.weight.index_select(0, self.shortlist).contiguous()
        self._arange = torch.arange(capacity, device=dev)

    def nbytes(self) -> int:
        extra = self.head_weight.numel() * self.head_weight.element_size() if self.shortlist is not None else 0
        return 2 * self.keys.numel() * self.keys.element_size() + extra

    @torch.inference_mode()
    def forward_rows(self, hidden: torch.Tensor, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Head rows at positions start..start+m-1 from hidden [1,m,H] and tokens [1,m]; writes
        their K/V and returns the head's normed output [1,m,H]."""
        m = tokens.shape[-1]
        if start + m > self.capacity:
            raise ValueError(f"drafter capacity {self.capacity} exceeded")
        head, inner, cal = self.head, self.lm.model, self.cal
        layer = head.layers[0]
        attn = layer.self_attn
        positions = self._arange[start:start + m]
        x = head.fuse(inner.embed_tokens(tokens.view(1, m)), hidden)
        cos, sin = inner.rotary_emb(x, positions.view(1, 1, -1).expand(3, 1, -1))
        h = L.rms_norm(layer.input_layernorm, x, cal)
        hd = attn.head_dim
        query, gate = torch.chunk(L.linear(attn.q_proj, h, cal).view(1, m, -1, hd * 2), 2, dim=-1)
        query = L.rms_norm(attn.q_norm, query, cal, 1 << 30).transpose(1, 2)
        key = L.rms_norm(attn.k_norm, attn.k_proj(h).view(1, m, -1, hd), cal, 1 << 30).transpose(1, 2)
        value = attn.v_proj(h).view(1, m, -1, hd).transpose(1, 2)
        query, key = L.apply_rotary_pos_emb(query, key, cos, sin)
        self.keys.index_copy_(2, positions, key)
        self.values.index_copy_(2, positions, value)
        length = start + m
        mask = None
        if m > 1:
            mask = (self._arange[:length].view(1, -1) <= positions.view(-1, 1)).view(1, 1, m, length)
        out = F.scaled_dot_product_attention(query, self.keys[:, :, :length], self.values[:, :, :length],
                                             attn_mask=mask, scale=attn.scaling,
                                             enable_gqa=attn.num_key_value_groups > 1)
        out = out.transpose(1, 2).reshape(1, m, -1)
        x = x + attn.o_proj(out * torch.sigmoid(gate.reshape(1, m, -1)))
        x = x + L.mlp(layer.mlp, L.rms_norm(layer.post_attention_layernorm, x, cal), cal)
        return L.rms_norm(head.norm, x, cal)

    def draft_token(self, out_row: torch.Tensor) -> torch.Tensor:
        """Argmax of the draft logits for one head output row [1,1,H] -> [1,1] token id."""
        logits = F.linear(out_row, self.head_weight)
        idx = logits.argmax(-1)
        return self.shortlist[idx] if self.shortlist is not None else idx

    @torch.inference_mode()
    def prefill(self, hidden: torch.Tensor, prompt_ids: list[int]) -> None:
        """Head rows for the prompt: (h_p, t_{p+1}) at p = 0..P-2."""
        self.filled = 0
        if len(prompt_ids) > 1:
            tokens = torch.tensor([prompt_ids[1:]], device=hidden.device)
            self.forward_rows(hidden[:, :-1], tokens, 0)
        self.filled = len(prompt_ids) - 1

    @torch.inference_mode()
    def draft(self, pending_hidden: torch.Tensor, pending_tokens: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Catch up the head on rows [filled, filled+k) given as true hidden states and their next
        tokens (the last of which is the round's first draft input), then chain ``depth`` drafts.
        Returns the draft tokens as [1,1] device tensors."""
        start = self.filled
        out = self.forward_rows(pending_hidden, pending_tokens, start)
        pos = start + pending_tokens.shape[-1]
        self.filled = pos  # every pending row had true inputs; the chained rows after it do not
        drafts = [self.draft_token(out[:, -1:])]
        hidden = out[:, -1:]
        for _ in range(depth - 1):
            hidden = self.forward_rows(hidden, drafts[-1], pos)
            pos += 1
            drafts.append(self.draft_token(hidden))
        return drafts


def load_shortlist(path: Path) -> list[int]:
    data = json.loads(Path(path).read_text())
    ids = data["ids"] if isinstance(data, dict) else data
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{path}: shortlist must be a JSON list of token ids or {{'ids': [...]}}")
    return ids
