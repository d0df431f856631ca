"""The exact fast runtime: prefill, graphed single-token steps, verify windows, rollback.

Bit-exactness contract: every logit this runtime computes for a position equals, bit for bit,
the logit the pristine ``serial`` control computes for that position after the same tokens.
  * prefill is the control's own HF forward, copied into static state; ``prefill.py`` runs it with
    the Gated-DeltaNet chunk scans replayed from graphs, where that is proven bit-equal to the
    control's forward on this device at start-up;
  * a step or a window runs ``layers.py``'s ops, which mirror HF's serial step and batch over rows
    only where ``calibration.py`` proved it bit-equal on this device;
  * RoPE rows are the control's own rotary computation, one position at a time, done once up front;
  * each MLP's gate and up weights live in one buffer (``gate_up.py``: same values, new storage,
    before any capture); a window of at most ``cal.gate_up`` rows runs them as one GEMM;
  * rollback restores the Gated-DeltaNet state captured at the accepted row; KV entries past the
    accepted length are simply overwritten later. No forward is ever re-run to repair state.
"""
from __future__ import annotations

import torch
from decoders.runtime.calibration import Calibration, calibrate
from decoders.runtime.gate_up import stack_gate_up as stack_gate_up_weights
from decoders.runtime.graphs import capture_segments
from decoders.runtime.lanes import SERIAL, Lanes
from decoders.runtime.layers import Constants
from decoders.runtime.prefill import choose_prefill, control_forward, prefill_forward
from decoders.runtime.program import WindowProgram
from decoders.runtime.sizing import note_build
from decoders.runtime.state import StaticState


class ExactRuntime:
    def __init__(self, model, capacity: int, windows=(1,), cal: Calibration | None = None,
                 use_graphs: bool | None = None, lanes: int | None = None, lane_priority: bool = True,
                 keep_rows: bool = False, stack_gate_up: bool = True):
        note_build()
        self.model = model
        lm = model.backbone
        self.device = model.device
        self.capacity = capacity
        self.max_window = max(windows)
        # the model's layout, made (or found) whatever this runtime decides: before any capture
        self.gate_up_weights = stack_gate_up_weights(lm)  # layer index -> [2I, H]
        self.cal = cal or calibrate(model, max_rows=max(8, self.max_window))
        # windows of up to this many rows run each MLP's gate and up as one GEMM (0: none);
        # ``stack_gate_up=False`` runs two everywhere (to measure what the one GEMM saves)
        self.gate_up_rows = self.cal.gate_up if stack_gate_up and self.gate_up_weights else 0
        self.constants = Constants()  # weight-only tensors of this model's forward, made once
        self.state = StaticState(lm, capacity, self.max_window, self.device, keep_rows=keep_rows)
        self.rope = self._rope_table(capacity)
        self._arange = torch.arange(capacity, device=self.device)
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        # streams for a layer's independent branches: three in a Gated-DeltaNet layer, one per
        # row of a window's per-row reductions; ``lanes=1`` runs every branch in order;
        # ``lane_priority``: the first branch of each fork (the critical path) on a higher priority
        self.lanes = Lanes.on(self.device, max(3, self.max_window) if lanes is None else lanes, lane_priority)
        self.eager_rows_on_lanes = True
        self.programs: dict[tuple[int, bool], WindowProgram] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self._rec_live = [self.state.rec[i] for i in self.state.gdn_layers]
        self._rec_caps = [self.state.rec_capture[i] for i in self.state.gdn_layers]
        self._rollback_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.length = 0  # tokens whose state is committed
        self.ring_from = 0  # steps' hidden rows from here to ``length`` are in the ring only (flush_rows)
        self.prefilled = False  # whether a prefill has set the state a step or window continues
        self.last_verify: WindowProgram | None = None  # the window ``accept`` commits rows of
        # the prefill's chunk rule (graphed where proven, prefill.py); None: the control's forward
        self.prefill_rule, self.prefill_how = choose_prefill(model, capacity, self.use_graphs)
        for w in windows:
            self.program(w, capture=w > 1)

    # ------------------------------------------------------------------ setup

    @torch.inference_mode()
    def _rope_table(self, capacity: int):
        """cos/sin for every position, each computed exactly as the control computes it (one
        position per call), so gathering a row reproduces the control's bits."""
        inner = self.model.backbone.model
        dummy = torch.zeros(1, 1, 1, dtype=self.model.backbone.lm_head.weight.dtype, device=self.device)
        cos_rows, sin_rows = [], []
        for p in range(capacity):
            pos = torch.full((3, 1, 1), p, dtype=torch.long, device=self.device)
            cos, sin = inner.rotary_emb(dummy, pos)
            cos_rows.append(cos.reshape(-1))
            sin_rows.append(sin.reshape(-1))
        return torch.stack(cos_rows), torch.stack(sin_rows)

    def nbytes(self) -> int:
        """Bytes of the state sized by the capacity: ``StaticState`` and the RoPE table (not the
        window programs' workspaces, which live in the graph pool and do not grow with it)."""
        rope = (*self.rope, self._arange)
        return self.state.nbytes() + sum(t.numel() * t.element_size() for t in rope)

    @torch.inference_mode()
    def program(self, w: int, capture: bool) -> WindowProgram:
        key = (w, capture)
        if key not in self.programs:
            prog = WindowProgram(self.model, self.state, self.rope, self.cal, self.constants, w,
                                 capture_states=capture, lanes=self.lanes,
                                 gate_up=self.gate_up_weights if w <= self.gate_up_rows else {})
            prog.eager_lanes = self.lanes if self.eager_rows_on_lanes else SERIAL
            if self.use_graphs:
                # capturing runs the forward eagerly to warm up, which writes state: keep the live
                # state intact for a program built mid-decode
                saved = self.state.snapshot()
                prog.capture(self.pool, start=0)
                self.state.restore(saved)
            self.programs[key] = prog
        return self.programs[key]

    def spread_eager_rows(self, on: bool) -> None:
        """Whether a window's eager attention rows run on the lanes (GPU time saved) or in order
        (host time saved: a fork costs the host a few calls per lane, which a launch-bound model
        pays in full). The bits are the same either way; a decoder picks by measuring both."""
        self.eager_rows_on_lanes = on
        for prog in self.programs.values():
            prog.eager_lanes = self.lanes if on else SERIAL

    # ------------------------------------------------------------------ decoding

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]):
        """The control's prefill (HF forward as ``prefill_rule`` runs it, last-row logits), into static state.
        Returns the last position's logits [1,V] and the hidden states of every prompt position
        [1,P,H] (after the final norm: what the MTP head consumes)."""
        lm = self.model.backbone
        if len(prompt_ids) + 1 > self.capacity:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit capacity {self.capacity}")
        ids = torch.tensor([prompt_ids], device=self.device)
        hidden, cache = (prefill_forward(lm.model, ids, self.prefill_rule) if self.prefill_rule is not None
                         else control_forward(lm.model, ids))
        logits = lm.lm_head(hidden[:, -1:, :])
        self.state.load_from_cache(cache, len(prompt_ids))
        if self.state.row_hidden is not None:  # the last prompt position's rows, as a step leaves them
            self.state.row_hidden[:, len(prompt_ids) - 1].copy_(hidden[:, -1])
            self.state.row_next[:, len(prompt_ids) - 1].copy_(logits[:, -1].argmax(-1))
        self.length = self.ring_from = len(prompt_ids)
        self.prefilled = True
        self.last_verify = None
        return logits[:, -1], hidden

    def reset(self) -> None:
        """Forget the committed length and any pending window: the next call must be ``prefill``
        (e.g. after timing steps and windows whose results nobody keeps)."""
        self.length = self.ring_from = 0
        self.prefilled = False
        self.last_verify = None

    def _check_room(self, w: int) -> None:
        if not self.prefilled:
            raise ValueError("the runtime holds no prompt: call prefill first")
        if self.length + w > self.capacity:
            raise ValueError(f"runtime capacity {self.capacity} exceeded at length {self.length} + {w}")

    @torch.inference_mode()
    def step(self, token: torch.Tensor) -> WindowProgram:
        """Consume one token (device tensor, [1,1] or [1]) at position ``length`` and commit it.
        Returns the program, whose ws holds logits [1,1,V], argmax [1,1] and hidden [1,1,H]."""
        self._check_room(1)
        ring = self.state.ring_hidden
        if ring is not None and self.length - self.ring_from >= ring.shape[0]:
            self.flush_rows()  # the slot this step writes still holds an unflushed row
        prog = self.program(1, capture=False)
        prog.tokens.copy_(token.view(1, 1))
        prog.positions.copy_(self._positions(self.length, 1))
        prog.run(self.length)
        self.length += 1
        return prog

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor) -> WindowProgram:
        """Run a window over ``tokens`` [1,w] at positions length..length+w-1, capturing the state
        after every row; nothing is committed until ``accept``."""
        w = tokens.shape[-1]
        if not 1 <= w <= self.max_window:
            raise ValueError(f"window of {w} tokens outside 1..{self.max_window}")
        self._check_room(w)
        self.flush_rows()  # the window's rows go straight to row_hidden: the ring must not hold older ones
        prog = self.program(w, capture=True)
        prog.tokens.copy_(tokens.view(1, w))
        prog.positions.copy_(self._positions(self.length, w))
        prog.run(self.length)
        self.last_verify = prog
        return prog

    @torch.inference_mode()
    def accept(self, rows: int) -> None:
        """Commit the first ``rows`` rows (1..w) of the last verify window; roll the recurrent and
        conv state back to the one captured after row rows-1."""
        prog = self.last_verify
        if prog is None:
            raise ValueError("accept without a pending verify window")
        w = prog.w
        if not 1 <= rows <= w:
            raise ValueError(f"accept({rows}) outside 1..{w}")
        if rows < w:
            self._rollback(prog, rows)
        self.length += rows
        self.ring_from = self.length
        self.last_verify = None

    def flush_rows(self) -> None:
        """Copy the steps' hidden rows still only in the ring (positions ring_from..length-1) to
        ``state.row_hidden``: one copy, two where the ring wraps. Whoever reads row_hidden calls it."""
        a, b, ring = self.ring_from, self.length, self.state.ring_hidden
        if ring is None or a >= b:
            self.ring_from = b
            return
        n, s = ring.shape[0], a % ring.shape[0]
        head = min(b - a, n - s)
        self.state.row_hidden[0, a:a + head].copy_(ring[s:s + head])
        if a + head < b:
            self.state.row_hidden[0, a + head:b].copy_(ring[:b - a - head])
        self.ring_from = b

    def _rollback(self, prog: WindowProgram, rows: int) -> None:
        """Restore the states captured after row rows-1: 2 MB contiguous copies of the recurrent
        states and one strided copy of the conv windows. On the GPU each (w, rows) pair is a
        captured graph (one launch); its copies only move data between static buffers."""
        def copies():
            k = self.state.conv_all.shape[-1]
            torch._foreach_copy_(self._rec_live, [cap[rows - 1] for cap in self._rec_caps])
            self.state.conv_all.copy_(prog.conv_cat[..., rows:rows + k])

        if not self.use_graphs:
            copies()
            return
        key = (prog.w, rows)
        if key not in self._rollback_graphs:
            # its copies only move data between static buffers, so the warm-up run is a rollback too
            self._rollback_graphs[key] = capture_segments([("graph", copies)], self.pool, warmups=1)[0]
        self._rollback_graphs[key].replay()

    def _positions(self, start: int, w: int) -> torch.Tensor:
        return self._arange[start:start + w]
