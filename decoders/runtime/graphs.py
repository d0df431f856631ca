"""CUDA-graph capture of a forward cut into segments: the one warm-up + capture sequence that the
runtime's window programs, its rollback copies and the drafter's forwards all use.

A segment is ``("graph", fn)`` (captured, later replayed) or ``("eager", fn)`` (run as it is,
e.g. attention over a KV length that changes every call). Capture needs the segments' lazy
initialisation and first allocations done beforehand, outside any capture, and on a side stream
(PyTorch's documented requirement), so every segment is warmed up first, in order.

The side streams a process uses are made once per device (``side_stream``): PyTorch gives every
stream that runs a GEMM a cuBLAS workspace (32 MiB in the pinned configuration) and does not free
it with the stream, so a stream per runtime would keep one workspace for every runtime ever built.
"""
from __future__ import annotations

import gc
from typing import Callable, Sequence

import torch

Segment = tuple[str, Callable[[], None]]

_side_streams: dict[tuple, torch.cuda.Stream] = {}


def side_stream(device, name: str = "warmup", priority: int = 0) -> torch.cuda.Stream:
    """This process's stream ``name`` on ``device`` (made at its first use, then shared by every
    runtime, drafter and sampler: see the module docstring)."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, name, priority)
    if key not in _side_streams:
        _side_streams[key] = torch.cuda.Stream(torch.device("cuda", index), priority=priority)
    return _side_streams[key]


def capture_segments(segments: Sequence[Segment], pool, warmups: int = 2,
                     stream: torch.cuda.Stream | None = None) -> list[torch.cuda.CUDAGraph | None]:
    """Run the segments in order ``warmups`` times on a side stream, then capture each "graph"
    segment in ``pool`` and run each "eager" one in between (so a later graph captures the
    buffers its eager predecessor writes). Returns one graph per segment, None for eager ones.
    ``stream``: the stream to capture on (its priority is the captured kernels' priority on
    replay: PyTorch instantiates graphs with per-node priorities); default PyTorch's own.
    The warm-up runs on this process's side stream of the current device (``side_stream``), the
    device every capture runs on."""
    side = side_stream(torch.cuda.current_device())
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            for _, fn in segments:
                fn()
    torch.cuda.current_stream().wait_stream(side)
    graphs: list[torch.cuda.CUDAGraph | None] = []
    # no garbage collection while capturing: collecting a dead object that holds a CUDA graph
    # (runtimes hold theirs in reference cycles) destroys that graph, which CUDA refuses during a
    # capture, and the capture fails
    collecting = gc.isenabled()
    gc.disable()
    try:
        for kind, fn in segments:
            if kind == "graph":
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    fn()
                graphs.append(graph)
            else:
                fn()
                graphs.append(None)
    finally:
        if collecting:
            gc.enable()
    return graphs


def run_segments(segments: Sequence[Segment], graphs: Sequence[torch.cuda.CUDAGraph | None] | None) -> None:
    """Each segment once, in order: replayed where captured, else called."""
    if graphs is None:
        for _, fn in segments:
            fn()
        return
    for (_, fn), graph in zip(segments, graphs):
        if graph is not None:
            graph.replay()
        else:
            fn()
