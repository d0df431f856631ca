"""Plain exact steps with the host one step behind the GPU.

A serial loop that reads each token before it queues the next step leaves the GPU idle while the
host wakes from the read and launches the step (a third of a millisecond on an H100). The next
step does not need the token on the host: its input is the device tensor the last step wrote. So
step t+1 is queued first, and token t is read from a pinned copy made right after step t, waited
on by its own event. The steps, their inputs and their order are those of the plain loop: only
when the host learns each token moves. A token that ends the decode (EOS) is learnt after one
more step was queued; that step is waited for before returning, so no GPU work outlives the call,
and its state is never kept (the next decode starts with a prefill).
"""
from __future__ import annotations

from typing import Callable

import torch


class TokenReader:
    """Reads a device token on the host without waiting for work queued after it: two pinned
    slots and their events. On the CPU a copy completes when issued, so it reads directly."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.host = torch.zeros(2, dtype=torch.long, pin_memory=self.cuda)
        self.events = [torch.cuda.Event() for _ in range(2)] if self.cuda else None
        self.slot = 0

    def post(self, token: torch.Tensor) -> int:
        """Queue the copy of ``token`` (one element) to the host; returns its slot, whose previous
        value must already have been read (``read``): a slot is reused every second post."""
        s, self.slot = self.slot, self.slot ^ 1
        self.host[s:s + 1].copy_(token.view(1), non_blocking=self.cuda)
        if self.cuda:
            self.events[s].record()
        return s

    def read(self, slot: int) -> int:
        if self.cuda:
            self.events[slot].synchronize()
        return int(self.host[slot])


def steps_read_ahead(step: Callable[[torch.Tensor], torch.Tensor], y: torch.Tensor, count: int,
                     eos: set[int], reader: TokenReader,
                     on_token: Callable[[int], None] | None = None) -> tuple[list[int], torch.Tensor, int]:
    """Up to ``count`` plain steps from the device token ``y``, stopping after an EOS.

    ``step(y)`` queues one step consuming ``y`` and returns its token as a device tensor that stays
    valid until the next ``step`` call consumes it. Returns (tokens read, the last step's device
    token, steps run). When an EOS came before ``count``, one more step ran than tokens were read,
    and the device token is that step's: a decode ends there and uses neither."""
    out: list[int] = []
    if count <= 0:
        return out, y, 0
    y = step(y)
    slot, ran = reader.post(y), 1
    while True:
        ahead = len(out) + 1 < count
        if ahead:  # queue the next step before the host waits for this one's token
            y_next = step(y)
            slot_next, ran = reader.post(y_next), ran + 1
        tok = reader.read(slot)
        out.append(tok)
        if on_token is not None:
            on_token(tok)
        if tok in eos:
            if ahead:
                reader.read(slot_next)  # the queued step ends inside this call
            return out, y, ran
        if not ahead:
            return out, y, ran
        y, slot = y_next, slot_next
