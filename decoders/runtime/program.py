"""A forward of w rows as a fixed program of segments over static buffers, CUDA-graphed on the GPU.

Everything with fixed shapes (embedding, projections, norms, conv, recurrence, MLP, lm_head) runs
in captured CUDA graphs. Attention's q_len=1 calls do not: the KV length grows every token, and
the control's attention kernel must see exactly that length to produce the same bits, so the
program is cut into graph segments around them and those calls run eagerly in between
(``capture around it``), each after a plain copy of the window's keys and values into the cache at
the window's start. A window's rows kept for the MTP head are copied the same way after the last
graph; a plain step's hidden row goes, inside its last graph, to the state's ring slot of its
position (a select over the ring, no host-side offset), so a plain step launches nothing eagerly
beyond attention. One program per window size; on a CPU the same segments run eagerly.
"""
from __future__ import annotations

from functools import partial

import torch

from decoders.runtime import layers as L
from decoders.runtime.graphs import capture_segments, run_segments
from decoders.runtime.lanes import Lanes


class WindowProgram:
    def __init__(self, model, state, rope, cal, consts: L.Constants, w: int, capture_states: bool, lanes: Lanes,
                 gate_up: dict | None = None):
        self.model, self.state, self.rope, self.cal, self.consts, self.w = model, state, rope, cal, consts, w
        # layer index -> its stacked gate/up weight, for layers whose MLP runs them as one GEMM
        self.gate_up = gate_up or {}
        self.lanes = lanes  # the streams independent branches run on (lanes.py)
        self.eager_lanes = lanes  # those a window's eager attention rows run on (ExactRuntime.spread_eager_rows)
        self.capture_states = capture_states
        lm = model.backbone
        dev = model.device
        self.tokens = torch.zeros(1, w, dtype=torch.long, device=dev)
        self.positions = torch.zeros(w, dtype=torch.long, device=dev)
        if state.ring_hidden is not None:
            self.ring_slots = torch.arange(state.ring_hidden.shape[0], device=dev)
        self.attn_out = {idx: torch.zeros(1, w, lm.config.num_attention_heads * lm.model.layers[idx].self_attn.head_dim,
                                          dtype=lm.lm_head.weight.dtype, device=dev)
                         for idx in state.attn_layers}
        # [state ++ window] conv inputs of every Gated-DeltaNet layer: rollback gathers from here
        conv_all = state.conv_all
        self.conv_cat = torch.zeros((*conv_all.shape[:-1], conv_all.shape[-1] + w), dtype=conv_all.dtype, device=dev)
        self.ws: dict = {}  # tensors passed between steps; on the GPU their addresses are the graphs'
        self.start = 0  # the window's first position, read by the eager attention segments
        self.segments = self._build()
        self.graphs: list | None = None  # one per segment once captured (None for eager ones)

    # ------------------------------------------------------------------ the forward, as steps

    def _build(self):
        """The forward as ("graph", fn) / ("eager", fn) segments (graphs.py), cut at attention."""
        segments, current = [], [self._embed]
        for idx, layer in enumerate(self.model.backbone.model.layers):
            if idx in self.state.attn_layers:
                current.append(partial(self._attn_pre, idx))
                segments.append(("graph", partial(run_all, current)))
                segments.append(("eager", partial(self._attn_core, idx)))
                current = [partial(self._attn_post, idx)]
            else:
                current.append(partial(self._gdn, idx))
        current.append(self._commit_states)
        current.append(self._head)
        # the kept rows: a plain step's (one row, no states captured for rollback) through the
        # ring inside its graph, a window's copied eagerly after it
        keeps = self.state.row_hidden is not None
        plain_step = self.w == 1 and not self.capture_states
        if keeps and plain_step:
            current.append(self._ring_row)
        segments.append(("graph", partial(run_all, current)))
        if keeps and not plain_step:
            segments.append(("eager", self._keep_rows))
        return segments

    def _embed(self):
        lm = self.model.backbone
        self.ws["x"] = lm.model.embed_tokens(self.tokens)
        cos, sin = self.rope
        self.ws["cos"] = cos.index_select(0, self.positions).unsqueeze(0)
        self.ws["sin"] = sin.index_select(0, self.positions).unsqueeze(0)

    def _gdn(self, idx):
        layer = self.model.backbone.model.layers[idx]
        x = self.ws["x"]
        h = L.rms_norm(layer.input_layernorm, x, self.cal, self.consts, lanes=self.lanes)
        cap = self.state.rec_capture[idx] if self.capture_states else None
        h = L.gdn_window(layer.linear_attn, h, self.state.conv[idx], self.state.rec[idx], self.cal, self.consts,
                         self.conv_cat[self.state.slot[idx]], cap, deferred=True, lanes=self.lanes)
        self._mlp(idx, x + h)

    def _attn_pre(self, idx):
        layer = self.model.backbone.model.layers[idx]
        x = self.ws["x"]
        h = L.rms_norm(layer.input_layernorm, x, self.cal, self.consts, lanes=self.lanes)
        q_rows, gate, key, value = L.attention_pre(layer.self_attn, h, self.ws["cos"], self.ws["sin"], self.cal,
                                                   self.consts, self.lanes)
        self.ws[("q", idx)], self.ws[("gate", idx)], self.ws[("kv", idx)] = q_rows, gate, (key, value)

    def _attn_core(self, idx):
        layer = self.model.backbone.model.layers[idx]
        L.write_kv(self.state.keys[idx], self.state.values[idx], *self.ws[("kv", idx)], self.start)
        L.attention_core(layer.self_attn, self.ws[("q", idx)], self.state.keys[idx], self.state.values[idx],
                         self.start, self.attn_out[idx], contiguous_kv=not self.cal.kv_view_ok, lanes=self.eager_lanes)

    def _attn_post(self, idx):
        layer = self.model.backbone.model.layers[idx]
        h = L.attention_post(layer.self_attn, self.attn_out[idx], self.ws[("gate", idx)], self.cal)
        self._mlp(idx, self.ws["x"] + h)

    def _mlp(self, idx, x):
        layer = self.model.backbone.model.layers[idx]
        h = L.rms_norm(layer.post_attention_layernorm, x, self.cal, self.consts, lanes=self.lanes)
        self.ws["x"] = x + L.mlp(layer.mlp, h, self.cal, self.lanes, gate_up=self.gate_up.get(idx))

    def _commit_states(self):
        """The final Gated-DeltaNet states of every layer, each written in one copy rather than one
        per layer (gdn_window defers them): nothing later in the forward reads them."""
        st, w = self.state, self.w
        if not st.gdn_layers:
            return
        st.conv_all.copy_(self.conv_cat[..., w:])
        if L.uses_batched_readout(w, self.capture_states, self.cal):
            st.rec_all.copy_(st.rec_capture_all[:, w - 1])

    def _head(self):
        lm = self.model.backbone
        hidden = L.rms_norm(lm.model.norm, self.ws["x"], self.cal, self.consts, lanes=self.lanes)
        self.ws["hidden"] = hidden
        self.ws["logits"] = L.linear(lm.lm_head, hidden, self.cal)
        self.ws["argmax"] = self.ws["logits"].argmax(-1)

    def _ring_row(self):
        """A step's hidden row into ring slot position % RING_ROWS, selected on the device (a
        graph replays it at any position; ``ExactRuntime.flush_rows`` moves it on)."""
        ring = self.state.ring_hidden
        here = (self.ring_slots == self.positions.remainder(ring.shape[0])).view(-1, 1)
        torch.where(here, self.ws["hidden"][0], ring, out=ring)

    def _keep_rows(self):
        """Each position's final hidden state and argmax, kept for the MTP head (state.py); eager,
        for the reason ``layers.write_kv`` gives."""
        st, a, b = self.state, self.start, self.start + self.w
        st.row_hidden[:, a:b].copy_(self.ws["hidden"])
        st.row_next[:, a:b].copy_(self.ws["argmax"])

    # ------------------------------------------------------------------ running

    def run_eager(self) -> None:
        """Every segment called eagerly (what the graphs replay; profiling reads these kernels)."""
        run_segments(self.segments, None)

    def capture(self, pool, start: int) -> None:
        """Capture the graph segments at positions start..start+w-1 (GPU only; graphs.py)."""
        self.start = start
        self.positions.copy_(torch.arange(start, start + self.w, device=self.positions.device))
        self.graphs = capture_segments(self.segments, pool, stream=self.lanes.main)

    def run(self, start: int) -> None:
        """Forward the rows already in ``self.tokens`` at positions start..start+w-1."""
        self.start = start
        run_segments(self.segments, self.graphs)


def run_all(fns) -> None:
    for fn in fns:
        fn()
