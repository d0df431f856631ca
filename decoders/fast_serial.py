"""``fast-serial``: serial greedy decoding on the exact runtime (graphed single-token steps).

The same tokens and bit-identical logits as ``serial``, with the per-step work captured in CUDA
graphs over static state. It is the honest serial baseline a speculative decoder must beat.
"""
from __future__ import annotations

import torch

from decoders.base import DecodeResult, DecodeStats
from decoders.runtime.runtime import ExactRuntime


class FastSerialDecoder:
    name = "fast-serial"

    def __init__(self, capacity: int | None = None, stack_gate_up: bool = True):
        self.capacity = capacity
        self.stack_gate_up = stack_gate_up  # False: the MLP's gate and up as two GEMMs (to measure the one)
        self.model = None
        self.runtime = None

    def prepare(self, model, capacity: int | None = None) -> None:
        self.model = model
        cap = capacity or self.capacity or 4096
        self.runtime = ExactRuntime(model, capacity=cap, windows=(1,), stack_gate_up=self.stack_gate_up)

    def config(self) -> dict:
        rt = self.runtime
        return {"capacity": rt.capacity if rt else self.capacity, "graphs": bool(rt and rt.use_graphs),
                "prefill": rt.prefill_how if rt else None, "stack_gate_up": self.stack_gate_up,
                "gate_up_rows": rt.gate_up_rows if rt else None, "calibration": rt.cal.to_json() if rt else None}

    def ensure_capacity(self, needed: int) -> ExactRuntime:
        """Static buffers are sized up front; a longer request gets a larger runtime (rounded up
        to 1024 positions), never a silent overflow."""
        if needed > self.runtime.capacity:
            self.runtime = ExactRuntime(self.model, capacity=-(-needed // 1024) * 1024, windows=(1,),
                                        cal=self.runtime.cal, stack_gate_up=self.stack_gate_up)
        return self.runtime

    @torch.inference_mode()
    def decode(self, prompt_ids: list[int], max_new_tokens: int, *, on_tokens=None) -> DecodeResult:
        rt = self.ensure_capacity(len(prompt_ids) + max_new_tokens + 1)
        eos = set(self.model.eos_token_ids)
        stats = DecodeStats()
        logits, _ = rt.prefill(prompt_ids)
        stats.forwards += 1
        nxt = logits.argmax(-1)
        tokens = [int(nxt.item())]
        if on_tokens is not None:
            on_tokens(tokens[-1:])
        while tokens[-1] not in eos and len(tokens) < max_new_tokens:
            prog = rt.step(nxt)
            stats.forwards += 1
            nxt = prog.ws["argmax"].view(1)
            tokens.append(int(nxt.item()))
            if on_tokens is not None:
                on_tokens(tokens[-1:])
        return DecodeResult(tokens, stats)
