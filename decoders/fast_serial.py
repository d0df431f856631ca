"""``fast-serial``: serial decoding on the exact runtime (graphed single-token steps).

The same tokens and bit-identical logits as ``serial``, with the per-step work captured in CUDA
graphs over static state. It is the honest serial baseline a speculative decoder must beat.
Greedy, a step's token is the argmax inside the step's graph; under a sampler, the sampler's pick
from the step's logits row at the token's absolute position (decoders/sampled.py), after the graph.
"""
from __future__ import annotations

import gc

import torch

from core.sampling import Sampler
from decoders.base import DecodeResult, DecodeStats
from decoders.runtime.runtime import ExactRuntime
from decoders.runtime.sizing import DEFAULT_CAPACITY, capacity_for
from decoders.sampled import TargetPicks


class FastSerialDecoder:
    name = "fast-serial"
    margin = 1  # positions a decode needs beyond its prompt and new tokens
    sampling = True

    def __init__(self, capacity: int | None = None, stack_gate_up: bool = True):
        if capacity is not None and (isinstance(capacity, bool) or int(capacity) < 1):
            raise ValueError(f"capacity must be >= 1 (positions the runtime is sized for), not {capacity}")
        if not isinstance(stack_gate_up, bool):
            raise ValueError("stack_gate_up must be true or false")
        self.capacity = None if capacity is None else int(capacity)
        self.stack_gate_up = stack_gate_up  # False: the MLP's gate and up as two GEMMs (to measure the one)
        self.model = None
        self.runtime = None
        self.picks: TargetPicks | None = None  # the sampled path's picks, made at its first use

    def prepare(self, model, capacity: int | None = None) -> None:
        self.model = model
        cap = capacity or self.capacity or DEFAULT_CAPACITY
        self.runtime = ExactRuntime(model, capacity=cap, windows=(1,), stack_gate_up=self.stack_gate_up)

    def config(self) -> dict:
        rt = self.runtime
        sizing = {"capacity": rt.capacity, "static_bytes": rt.nbytes()} if rt else {"capacity": self.capacity}
        return {"sizing": sizing, "graphs": bool(rt and rt.use_graphs),
                "prefill": rt.prefill_how if rt else None, "stack_gate_up": self.stack_gate_up,
                "gate_up_rows": rt.gate_up_rows if rt else None, "calibration": rt.cal.to_json() if rt else None}

    def reserve(self, positions: int) -> None:
        """Room for every decode of ``len(prompt) + max_new_tokens <= positions`` (the protocol's)."""
        self.ensure_capacity(positions + self.margin)

    def ensure_capacity(self, needed: int) -> ExactRuntime:
        """Static buffers are sized up front; a longer request gets a larger runtime (rounded up
        to ``sizing.STEP`` positions), never a silent overflow. The old runtime's buffers and
        graphs are released first, so that growing never holds both."""
        if needed > self.runtime.capacity:
            cal = self.runtime.cal
            self.runtime = None
            self.picks = None
            gc.collect()  # graphs and closures may hold the old buffers in reference cycles
            self.runtime = ExactRuntime(self.model, capacity=capacity_for(needed), windows=(1,), cal=cal,
                                        stack_gate_up=self.stack_gate_up)
        return self.runtime

    @torch.inference_mode()
    def decode(self, prompt_ids: list[int], max_new_tokens: int, *, on_tokens=None,
               sampler: Sampler | None = None) -> DecodeResult:
        if sampler is not None and not sampler.greedy:
            return self._decode_sampled(prompt_ids, max_new_tokens, on_tokens, sampler)
        rt = self.ensure_capacity(len(prompt_ids) + max_new_tokens + self.margin)
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

    def _decode_sampled(self, prompt_ids, max_new_tokens, on_tokens, sampler: Sampler) -> DecodeResult:
        """As the greedy loop, each token the sampler's pick at its position (prompt + index)."""
        rt = self.ensure_capacity(len(prompt_ids) + max_new_tokens + self.margin)
        if self.picks is None:
            self.picks = TargetPicks(rt.device, rt.use_graphs)
        picks = self.picks
        picks.bind(sampler, rt.programs.values())
        eos = set(self.model.eos_token_ids)
        stats = DecodeStats()
        logits, _ = rt.prefill(prompt_ids)
        stats.forwards += 1
        nxt = picks.first(logits, len(prompt_ids)).view(1)
        tokens = [int(nxt.item())]
        if on_tokens is not None:
            on_tokens(tokens[-1:])
        while tokens[-1] not in eos and len(tokens) < max_new_tokens:
            prog = rt.step(nxt)
            stats.forwards += 1
            nxt = picks.row(prog, 0).view(1)  # position rt.length: len(prompt_ids) + len(tokens)
            tokens.append(int(nxt.item()))
            if on_tokens is not None:
                on_tokens(tokens[-1:])
        return DecodeResult(tokens, stats)
