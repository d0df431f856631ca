"""``fast-serial``: serial decoding on the exact runtime (graphed single-token steps).

The same tokens and bit-identical logits as ``serial``, with the per-step work captured in CUDA
graphs over static state. It is the honest serial baseline a speculative decoder must beat.
Greedy, a step's token is the argmax inside the step's graph; under a sampler, the sampler's pick
from the step's logits row at the token's absolute position (decoders/sampled.py), after the graph.
Each step is queued before the host reads the token before it (decoders/stepping.py); decoder
argument ``read_ahead=false`` reads every token before queuing the next step (to measure the one).
"""
from __future__ import annotations

import gc

import torch

from core.sampling import Sampler
from decoders.base import DecodeResult, DecodeStats
from decoders.runtime.runtime import ExactRuntime
from decoders.runtime.sizing import DEFAULT_CAPACITY, capacity_for
from decoders.sampled import TargetPicks
from decoders.stepping import TokenReader, steps_read_ahead


class FastSerialDecoder:
    name = "fast-serial"
    margin = 1  # positions a decode needs beyond its prompt and new tokens
    sampling = True

    def __init__(self, capacity: int | None = None, stack_gate_up: bool = True, read_ahead: bool = True):
        if capacity is not None and (isinstance(capacity, bool) or int(capacity) < 1):
            raise ValueError(f"capacity must be >= 1 (positions the runtime is sized for), not {capacity}")
        if not isinstance(stack_gate_up, bool):
            raise ValueError("stack_gate_up must be true or false")
        if not isinstance(read_ahead, bool):
            raise ValueError("read_ahead must be true or false")
        self.capacity = None if capacity is None else int(capacity)
        self.stack_gate_up = stack_gate_up  # False: the MLP's gate and up as two GEMMs (to measure the one)
        self.read_ahead = read_ahead
        self.model = None
        self.runtime = None
        self.picks: TargetPicks | None = None  # the sampled path's picks, made at its first use

    def prepare(self, model, capacity: int | None = None) -> None:
        self.model = model
        cap = capacity or self.capacity or DEFAULT_CAPACITY
        self.runtime = ExactRuntime(model, capacity=cap, windows=(1,), stack_gate_up=self.stack_gate_up)
        self.reader = TokenReader(self.runtime.device)

    def config(self) -> dict:
        rt = self.runtime
        sizing = {"capacity": rt.capacity, "static_bytes": rt.nbytes()} if rt else {"capacity": self.capacity}
        return {"sizing": sizing, "graphs": bool(rt and rt.use_graphs),
                "prefill": rt.prefill_how if rt else None, "stack_gate_up": self.stack_gate_up,
                "read_ahead": self.read_ahead,
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
        return self._steps(nxt, lambda y: rt.step(y).ws["argmax"].view(1), max_new_tokens, eos, on_tokens, stats)

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
        # each pick at position rt.length after its step: len(prompt_ids) + the tokens before it
        return self._steps(nxt, lambda y: picks.row(rt.step(y), 0).view(1), max_new_tokens, eos, on_tokens, stats)

    def _steps(self, nxt: torch.Tensor, step, max_new_tokens: int, eos: set[int], on_tokens,
               stats: DecodeStats) -> DecodeResult:
        """The prefill's token ``nxt``, then plain steps (``step(y)``: queue one, return its
        device token) until EOS or ``max_new_tokens``."""
        tokens = [int(nxt.item())]
        emit = None if on_tokens is None else (lambda tok: on_tokens([tok]))
        if emit is not None:
            emit(tokens[0])
        if tokens[0] in eos:
            return DecodeResult(tokens, stats)
        if self.read_ahead:
            new, _, ran = steps_read_ahead(step, nxt, max_new_tokens - 1, eos, self.reader, emit)
            stats.forwards += ran
            return DecodeResult(tokens + new, stats)
        while tokens[-1] not in eos and len(tokens) < max_new_tokens:
            nxt = step(nxt)
            stats.forwards += 1
            tokens.append(int(nxt.item()))
            if emit is not None:
                emit(tokens[-1])
        return DecodeResult(tokens, stats)
