"""Sampling on the exact runtime: the target's picks, row by row, and the coupled draft.

Target. Every emitted token is ``core.sampling``'s pick at its absolute position from a logits row
bit-identical to the control's, each row in its own call. On a CPU a row's pick IS
``sampler.pick_tensor``. On a GPU it is the same function (``pick_at``: ``core.sampling.pick_from_keys``)
captured in a CUDA graph per (window program, row, sampler settings), which reads the row's two
position keys (``core.sampling.position_key`` of the seed and the row's position) from a device
tensor: the host computes them in exact integers and copies them in before the replay. The hash is
integer arithmetic, exact whether an operand is a Python int or a tensor, so the noise has the
same bits, and a pick costs one launch and no device work on the keys.
tests/test_sampled.py and tests/test_cuda.py check both against ``pick_tensor``.

Coupled draft. The MTP head proposes the token at position q as the argmax, over its
DRAFT_CANDIDATES largest logits (of the shortlist where one is used; ``v`` the full-vocabulary
id), of ``draft_logits[v] / T + G(seed, q, v)``, the target's own noise at that position: where the
head's distribution is close to the target's, the two argmaxes agree far more often than the
head's plain argmax agrees with a sample. No filter is applied to the draft: a draft is only a
proposal, kept only when it equals the target's pick, and on ``small`` the draft's own filter added
0-5% tokens per round (docs/decoders.md). ``coupled=False`` drafts by plain argmax.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from core.sampling import Sampler, pick_from_keys, pick_rows_from_keys, position_keys, seed_key
from decoders.runtime.graphs import capture_segments


def device_seed(seed: int) -> int:
    """A seed in [0, 2**64) as the int64 that holds its bits (two's complement above 2**63-1):
    ``seed & 0xFFFFFFFF`` and ``(seed >> 32) & 0xFFFFFFFF`` read the same halves from either."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def pick_at(sampler: Sampler, row: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``sampler.pick_tensor(row, position)`` for a non-greedy sampler, with the position's two
    keys (``core.sampling.position_key``) in an int64 device tensor ``[2]``, so a CUDA graph can
    replay it for any seed and position: ``core.sampling.pick_from_keys``, the same ops on the
    same shapes."""
    return pick_from_keys(row.reshape(-1), sampler, keys[0], keys[1])


class RowKeys:
    """Position keys on their way to the device (a row's two, or a window's: every row's k1, then
    every row's k2): a pinned host buffer, copied without a host wait into the device tensor its
    graph reads. Before the buffer is written again, the event of its last copy is waited on (done
    by then in every decode: each round reads its tokens), so a copy never reads a half-written
    buffer."""

    def __init__(self, device, n: int = 2):
        self.device_keys = torch.zeros(n, dtype=torch.long, device=device)
        self.host = torch.zeros(n, dtype=torch.long, pin_memory=True)
        self.host_view = self.host.numpy()
        self.copied = torch.cuda.Event()

    def load(self, *keys: int) -> None:
        self.copied.synchronize()
        self.host_view[:] = keys
        self.device_keys.copy_(self.host, non_blocking=True)
        self.copied.record()


def window_keys(skey: int, first_position: int, rows: int) -> list[int]:
    """A window's keys as ``RowKeys`` holds them: each row's k1, then each row's k2."""
    keys = [position_keys(skey, first_position + r) for r in range(rows)]
    return [k[0] for k in keys] + [k[1] for k in keys]


def settings(sampler: Sampler) -> tuple:
    """What a captured pick bakes in: everything but the seed (read from a tensor)."""
    return sampler.temperature, sampler.top_k, sampler.top_p, sampler.min_p


WINDOW = -1  # in place of a row index: a program's rows picked in one call (TargetPicks.rows)


class TargetPicks:
    """The target's token at each row of a runtime's windows under one bound sampler.

    ``row(prog, r)`` picks row r of the program's last run (its logits ``prog.ws["logits"][0, r]``
    at position ``prog.start + r + 1``) into ``out(prog)[r]`` and returns that 0-d view;
    ``rows(prog)`` picks all of them in one call (``core.sampling.pick_rows_from_keys``, the same
    tokens) and returns ``out(prog)``. No host sync. Graphs (GPU) are kept for the
    ``max_settings`` most recent sampler settings."""

    def __init__(self, device, use_graphs: bool, max_settings: int = 4):
        self.device = device
        self.use_graphs = use_graphs
        self.max_settings = max_settings
        self.sampler: Sampler | None = None
        self.seed_key = 0  # core.sampling.seed_key of the bound sampler's seed
        self._keys: dict[tuple[int, int], RowKeys] = {}  # (id(prog), r) -> the row's keys (programs held by _out)
        self._out: dict[int, tuple] = {}  # id(prog) -> (prog, [w] int64): the program held, so its id stays its own
        self._graphs: OrderedDict = OrderedDict()  # settings -> {(id(prog), r): (graph, logits ptr)}
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.picked = 0  # rows picked since the last bind

    def bind(self, sampler: Sampler, programs=(), windows: bool = False) -> None:
        """Pick with ``sampler`` (non-greedy) from now on. On the GPU every row of ``programs``
        gets its graph now, and with ``windows`` every program of several rows its ``rows`` graph,
        so that no capture falls inside a later decode's rounds."""
        if sampler.greedy:
            raise ValueError("TargetPicks is for sampled decoding; greedy decoding takes the runtime's argmax")
        self.sampler = sampler
        self.seed_key = seed_key(sampler.seed)
        self.picked = 0
        if self.use_graphs:
            for prog in programs:
                for r in range(prog.w):
                    self._graph(prog, r)
                if windows and prog.w > 1:
                    self._graph(prog, WINDOW)

    def first(self, logits: torch.Tensor, position: int) -> torch.Tensor:
        """The prefill's token (``sampler.pick_tensor`` itself, eager: once per decode), [1,1]."""
        return self.sampler.pick_tensor(logits, position).view(1, 1)

    def out(self, prog) -> torch.Tensor:
        key = id(prog)
        if key not in self._out:
            self._out[key] = (prog, torch.zeros(prog.w, dtype=torch.long, device=self.device))
        return self._out[key][1]

    def row(self, prog, r: int) -> torch.Tensor:
        out = self.out(prog)
        self.picked += 1
        if not self.use_graphs:
            out[r] = self.sampler.pick_tensor(prog.ws["logits"][0, r], prog.start + r + 1)
            return out[r]
        graph = self._graph(prog, r)
        self._row_keys(prog, r).load(*position_keys(self.seed_key, prog.start + r + 1))
        graph.replay()
        return out[r]

    def rows(self, prog) -> torch.Tensor:
        out = self.out(prog)
        self.picked += prog.w
        keys = window_keys(self.seed_key, prog.start + 1, prog.w)
        if not self.use_graphs:
            k = torch.tensor(keys, dtype=torch.long, device=self.device)
            out.copy_(pick_rows_from_keys(prog.ws["logits"][0], self.sampler, k[:prog.w], k[prog.w:]))
            return out
        graph = self._graph(prog, WINDOW)
        self._row_keys(prog, WINDOW).load(*keys)
        graph.replay()
        return out

    def _row_keys(self, prog, r: int) -> RowKeys:
        """Row r's keys, or with r = WINDOW the whole window's."""
        key = (id(prog), r)
        if key not in self._keys:
            self.out(prog)  # holds the program, so its id stays its own
            self._keys[key] = RowKeys(self.device, 2 * prog.w if r == WINDOW else 2)
        return self._keys[key]

    def _graph(self, prog, r: int) -> torch.cuda.CUDAGraph:
        """Row r's pick graph under the bound sampler's settings (r = WINDOW: the window's)."""
        key = settings(self.sampler)
        graphs = self._graphs.get(key)
        if graphs is None:
            while len(self._graphs) >= self.max_settings:
                self._graphs.popitem(last=False)
            graphs = self._graphs[key] = {}
        self._graphs.move_to_end(key)
        logits = prog.ws["logits"]
        held = graphs.get((id(prog), r))
        if held is None or held[1] != logits.data_ptr():
            sampler, out, keys, w = self.sampler, self.out(prog), self._row_keys(prog, r).device_keys, prog.w

            def pick():
                if r == WINDOW:
                    out.copy_(pick_rows_from_keys(logits[0], sampler, keys[:w], keys[w:]))
                else:
                    out[r].copy_(pick_at(sampler, logits[0, r], keys))

            graph = capture_segments([("graph", pick)], self.pool)[0]
            held = graphs[(id(prog), r)] = (graph, logits.data_ptr(), prog)
        return held[0]
