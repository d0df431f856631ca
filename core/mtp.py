"""Qwen3.5's native multi-token-prediction (MTP) head.

Checkpoint weights (prefix ``mtp.``):
  pre_fc_norm_embedding, pre_fc_norm_hidden   zero-centred RMSNorms over hidden_size
  fc                                          Linear(2h -> h), no bias
  layers.0                                    one full-attention decoder layer (gated attention + MLP)
  norm                                        final zero-centred RMSNorm
``embed_tokens`` and ``lm_head`` are the backbone's.

Wiring, as vLLM's and SGLang's Qwen3.5/Qwen3-Next MTP modules do it (checked against their source):
  * the hidden state is the backbone's *last* hidden state after its final norm (the tensor that
    feeds ``lm_head``) at position t;
  * the token is t+1 (the token the backbone just predicted at t);
  * ``fc`` sees ``cat([pre_fc_norm_embedding(embed(t+1)), pre_fc_norm_hidden(h_t)], -1)``:
    embedding half first, hidden half second;
  * the decoder layer runs at RoPE position t and keeps its own KV cache, one entry per position;
  * the result goes through ``norm`` and the shared ``lm_head`` and predicts token t+2.
Chained drafting feeds the head its own output (after ``norm``) as the next step's hidden state.
``tests/test_mtp_wiring.py`` pins all of this on named weights.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import DynamicCache
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm


def mtp_layer_config(text_config):
    """A copy of the text config whose single layer is full attention (the MTP layer's type)."""
    cfg = copy.deepcopy(text_config)
    n = int(getattr(text_config, "mtp_num_hidden_layers", 1) or 1)
    cfg.num_hidden_layers = n
    cfg.layer_types = ["full_attention"] * n
    return cfg


class MTPHead(nn.Module):
    def __init__(self, text_config):
        super().__init__()
        h, eps = text_config.hidden_size, text_config.rms_norm_eps
        self.config = mtp_layer_config(text_config)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList(
            [Qwen3_5DecoderLayer(self.config, i) for i in range(self.config.num_hidden_layers)]
        )
        self.norm = Qwen3_5RMSNorm(h, eps=eps)

    def fuse(self, token_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """fc over [normalized embedding of token t+1, normalized hidden state at t]."""
        e = self.pre_fc_norm_embedding(token_embeds)
        h = self.pre_fc_norm_hidden(hidden)
        return self.fc(torch.cat([e, h], dim=-1))

    def forward(self, hidden, token_ids, positions, backbone, cache=None):
        """hidden [1,T,H] (backbone post-norm, or this head's previous output), token_ids [1,T],
        positions [T] absolute RoPE positions. Returns the head's normed output [1,T,H];
        ``backbone.lm_head`` of it gives the draft logits."""
        inner = backbone.model
        x = self.fuse(inner.embed_tokens(token_ids), hidden)
        pos = positions.view(1, 1, -1).expand(3, 1, -1)
        pos_emb = inner.rotary_emb(x, pos)
        mask = causal_mask(cache, positions.numel(), x.device)
        for layer in self.layers:
            x = layer(x, position_embeddings=pos_emb, attention_mask=mask, past_key_values=cache)
        return self.norm(x)


def causal_mask(cache, q_len: int, device) -> torch.Tensor | None:
    """Boolean [1,1,q,past+q] mask for q new rows after ``past`` cached ones (None for one row,
    which attends to everything)."""
    if q_len == 1:
        return None
    past = cache.get_seq_length() if cache is not None else 0
    q = torch.arange(q_len, device=device).view(-1, 1) + past
    k = torch.arange(past + q_len, device=device).view(1, -1)
    return (k <= q).view(1, 1, q_len, past + q_len)


def new_mtp_cache(head: MTPHead):
    return DynamicCache(config=head.config)
