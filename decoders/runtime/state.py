"""Static, preallocated decoding state for the whole model.

Attention layers: K and V buffers of ``capacity`` positions (prompt + N + window). Gated-DeltaNet
layers: the conv state (last K inputs) and the fp32 recurrent state, plus ``max_window`` capture
slots per layer holding the recurrent state after each row of a verify window, so a rejection is
repaired by copying the captured state back, never by re-running a forward. All tensors keep
their addresses for the life of the runtime, as CUDA graphs require.
"""
from __future__ import annotations

import torch

# the steps whose hidden rows a step's graph holds before they must be copied to ``row_hidden``
RING_ROWS = 64


class StaticState:
    def __init__(self, backbone, capacity: int, max_window: int, device, keep_rows: bool = False):
        cfg = backbone.config
        self.capacity = capacity
        self.attn_layers, self.gdn_layers = [], []
        self.keys, self.values = {}, {}
        self.conv, self.rec, self.rec_capture, self.slot = {}, {}, {}, {}
        dtype = backbone.lm_head.weight.dtype
        gdn = []
        for idx, layer in enumerate(backbone.model.layers):
            if hasattr(layer, "self_attn"):
                a = layer.self_attn
                shape = (1, cfg.num_key_value_heads, capacity, a.head_dim)
                self.keys[idx] = torch.zeros(shape, dtype=dtype, device=device)
                self.values[idx] = torch.zeros(shape, dtype=dtype, device=device)
                self.attn_layers.append(idx)
            else:
                gdn.append((idx, layer.linear_attn))
        # Gated-DeltaNet states of all layers live in one tensor each (per-layer views), so that
        # a rollback is one gather per kind of state instead of one copy per layer.
        n = len(gdn)
        g = gdn[0][1] if gdn else None
        conv_shape = (1, g.conv_dim, g.conv_kernel_size) if g else (1, 1, 1)
        rec_shape = (1, g.num_v_heads, g.head_k_dim, g.head_v_dim) if g else (1, 1, 1, 1)
        self.conv_all = torch.zeros((n, *conv_shape), dtype=dtype, device=device)
        self.rec_all = torch.zeros((n, *rec_shape), dtype=torch.float32, device=device)
        self.rec_capture_all = torch.zeros((n, max_window, *rec_shape), dtype=torch.float32, device=device)
        for slot, (idx, _) in enumerate(gdn):
            self.slot[idx] = slot
            self.conv[idx] = self.conv_all[slot]
            self.rec[idx] = self.rec_all[slot]
            self.rec_capture[idx] = self.rec_capture_all[slot]
            self.gdn_layers.append(idx)
        # with keep_rows, each position's final hidden state and the token after it (what the MTP
        # head consumes) end up here: a window's program copies its rows in right after its graphs;
        # a step's graph writes its hidden row into ``ring_hidden`` (slot position % RING_ROWS),
        # which ``ExactRuntime.flush_rows`` copies over, RING_ROWS steps at a time or when asked;
        # a step's token is the decoder's to write (it reads it on the host anyway)
        self.row_hidden = self.row_next = self.ring_hidden = None
        if keep_rows:
            self.row_hidden = torch.zeros(1, capacity, cfg.hidden_size, dtype=dtype, device=device)
            self.row_next = torch.zeros(1, capacity, dtype=torch.long, device=device)
            self.ring_hidden = torch.zeros(RING_ROWS, cfg.hidden_size, dtype=dtype, device=device)

    @torch.no_grad()
    def load_from_cache(self, cache, length: int) -> None:
        """Copy an HF DynamicCache (after the prompt's prefill) into the static buffers."""
        if length > self.capacity:
            raise ValueError(f"prompt of {length} tokens exceeds the runtime's capacity {self.capacity}")
        for idx in self.attn_layers:
            layer = cache.layers[idx]
            self.keys[idx][:, :, :length].copy_(layer.keys)
            self.values[idx][:, :, :length].copy_(layer.values)
        for idx in self.gdn_layers:
            layer = cache.layers[idx]
            self.conv[idx].copy_(layer.conv_states[0])
            self.rec[idx].copy_(layer.recurrent_states[0])

    def tensors(self) -> list[torch.Tensor]:
        """Everything a decode carries from one forward to the next (not the capture slots)."""
        kept = [t for t in (self.row_hidden, self.row_next, self.ring_hidden) if t is not None]
        return [*self.keys.values(), *self.values.values(), self.conv_all, self.rec_all, *kept]

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.tensors()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        torch._foreach_copy_(self.tensors(), saved)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.tensors(), self.rec_capture_all))
