"""Independent branches of a forward, each on its own CUDA stream.

A decode step is ~2,500 small kernels, and inside a CUDA graph each costs ~1 us whatever its size,
so a chain of dependent kernels takes as long as its length. Where a layer's work splits into
branches that meet later (the z gate, the decay and the q/k/v path of a Gated-DeltaNet layer;
q, k and v of attention; the rows of a window's per-row reductions), ``Lanes.fork`` runs each
branch on its own stream, forked from the current stream and joined back before it returns.
Captured in a graph, the branches become parallel paths of the graph.

The bits cannot change: every branch runs the same kernels on the same inputs as it would in
sequence; only when they run changes. Memory stays safe under the caching allocator because the
join comes before the caller continues: a tensor made on a lane and used afterwards is only
reused by that lane after its next fork, which waits for everything the current stream has
queued. On a CPU (and with ``SERIAL``) the branches simply run in order.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from decoders.runtime.graphs import side_stream  # one set of streams per process (graphs.py says why)


class Lanes:
    def __init__(self, streams: Sequence["torch.cuda.Stream"] = (), main: "torch.cuda.Stream | None" = None):
        self.streams = tuple(streams)
        # the stream to capture graphs on, of a higher priority than the side lanes, so that where
        # branches contend for the GPU the first one (each fork's critical path) goes first; None:
        # PyTorch's capture stream, all lanes of equal priority
        self.main = main

    @classmethod
    def on(cls, device: torch.device, width: int, prioritize: bool = True) -> "Lanes":
        """Up to ``width`` branches at once on a CUDA device; in order elsewhere."""
        if device.type != "cuda" or width < 2:
            return SERIAL
        main = side_stream(device, "lane-main", priority=-1) if prioritize else None
        return cls([side_stream(device, f"lane-{k}") for k in range(1, width)], main)

    @property
    def width(self) -> int:
        return len(self.streams) + 1

    def fork(self, *branches: Callable[[], object]) -> list:
        """Each branch's result, in order; branch 0 runs on the current stream, the others on the
        side streams in turn (one each while there are enough), and the current stream waits for
        all of them before this returns."""
        if not self.streams or len(branches) < 2:
            return [branch() for branch in branches]
        main = torch.cuda.current_stream()
        sides = self.streams[:len(branches) - 1]
        for side in sides:
            side.wait_stream(main)
        results = [branches[0]()]
        for i, branch in enumerate(branches[1:]):
            with torch.cuda.stream(sides[i % len(sides)]):
                results.append(branch())
        for side in sides:
            main.wait_stream(side)
        return results

    def each(self, fn: Callable[[int], object], count: int) -> list:
        """``fn(i)`` for i in range(count), spread over the lanes in turn (lane i % width)."""
        if not self.streams or count < 2:
            return [fn(i) for i in range(count)]
        groups = [range(j, count, self.width) for j in range(min(self.width, count))]
        by_group = self.fork(*[lambda g=g: [fn(i) for i in g] for g in groups])
        results = [None] * count
        for g, values in zip(groups, by_group):
            for i, value in zip(g, values):
                results[i] = value
        return results


SERIAL = Lanes()  # every branch in order, on the current stream
