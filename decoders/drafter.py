"""MTP drafting with a persistent head state and an optional draft shortlist.

The head keeps its own KV cache across rounds, one entry per position: the row at position p
holds (backbone hidden h_p, token t_{p+1}). After a verification, the rows for accepted tokens are
recomputed with the backbone's true hidden states (the draft steps had used the head's own
output) together with the next round's first draft step, in one call, so the head never drifts.
Rows past the accepted length are simply overwritten later. Drafts need not be exact (the verify
window decides), so every op here runs batched. On the GPU both the catch-up (one pair per row
count up to ``max_rows``, and for 16, 32 and 64 rows) and each chained step run as two CUDA graphs
around an eager attention call, whose KV length changes every round. A longer catch-up (after a
run of plain steps) runs as consecutive chunks of those sizes: an eager head forward costs ~4 ms of
host time on the H200 machine, which at zero acceptance was most of `spec`'s cost over
`fast-serial`.

Shortlist: the draft logits may be computed over a fixed, request-independent set of token ids
(built offline from token frequencies of generated text), which cuts the head's largest GEMM;
verification always uses the full vocabulary, so exactness is untouched.

Coupled drafting (``coupled=True``, bound per decode with ``couple(sampler)``): under a sampler
each draft at position q is the argmax, over the draft's DRAFT_CANDIDATES largest logits, of
``logits / T + G(seed, q, v)`` with the target's own noise (decoders/sampled.py), not the plain
argmax. On the GPU it has its own
graph pairs, captured at construction (nothing is live yet), reading T and the seed from device
tensors; greedy drafting runs the plain graphs, unchanged.

Confidence (``confidence=True``): each draft step also leaves the head's probability of its draft
(softmax over the draft logits, in float32) in ``in_conf``, for a policy that ends a round's
drafts where the head hesitates (``draft_until``; decoders/policy.py). Without it the graphs hold
no such ops.
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from core.errors import UserError
from core.sampling import candidates, noise_from_keys, position_keys, seed_key
from decoders.runtime import layers as L
from decoders.runtime.graphs import capture_segments, run_segments
from decoders.runtime.sizing import note_build


class Unchecked:
    """A calibration stand-in for drafting: batch everything (drafts are verified, not trusted)."""

    max_rows = 1 << 30
    hidden_mean = head_norm = gated_norm = l2norm = 1 << 30
    conv_window = kv_view_ok = elementwise = True

    def gemm_rows(self, linear) -> int:
        return 1 << 30


class MTPDrafter:
    def __init__(self, model, capacity: int, shortlist: list[int] | None = None, head=None, max_rows: int = 8,
                 use_graphs: bool | None = None, coupled: bool = False, confidence: bool = False):
        """``head``: a trained draft head (``load_head``) in place of the checkpoint's own.
        ``max_rows``: every catch-up of up to this many rows (a round's accepted rows + 1) runs as
        one CUDA graph pair; longer ones (after plain steps) run in chunks of LONG_CHUNKS rows or
        fewer. ``use_graphs``: default on a GPU; False runs the same functions eagerly.
        ``coupled``: able to draft with the target's noise (``couple``). ``confidence``: every
        draft step leaves the head's probability of its draft in ``in_conf``."""
        note_build()
        self.model = model
        lm, head = model.backbone, (head if head is not None else model.mtp)
        self.head, self.lm = head, lm
        dev, dtype = model.device, lm.lm_head.weight.dtype
        attn = head.layers[0].self_attn
        cfg = lm.config
        shape = (1, cfg.num_key_value_heads, capacity, attn.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=dev)
        self.values = torch.zeros(shape, dtype=dtype, device=dev)
        self.capacity = capacity
        self.cal = Unchecked()
        self.filled = 0  # head rows [0, filled) hold true-hidden entries
        self.shortlist = None
        self.head_weight = lm.lm_head.weight
        if shortlist:
            self.shortlist = torch.tensor(sorted(set(shortlist)), dtype=torch.long, device=dev)
            self.head_weight = lm.lm_head.weight.index_select(0, self.shortlist).contiguous()
        self._arange = torch.arange(capacity, device=dev)
        self.constants = L.Constants()  # the head's weight-only tensors, made once
        # one pool for all the drafter's graphs: sharing is safe because each pre graph's outputs
        # are read only by its own post graph, and no other graph replays between the two
        use_graphs = dev.type == "cuda" if use_graphs is None else use_graphs
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None
        hidden_size, width = cfg.hidden_size, cfg.num_attention_heads * attn.head_dim
        # the chained step's static buffers: its output row and draft feed the next step in place
        self.in_hidden = torch.zeros(1, 1, hidden_size, dtype=dtype, device=dev)
        self.in_token = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.step_pos = torch.zeros(1, dtype=torch.long, device=dev)  # warm-up writes row 0: nothing is live yet
        self.step_attn = torch.zeros(1, 1, width, dtype=dtype, device=dev)
        self.confidence = confidence
        self.in_conf = torch.zeros(1, dtype=torch.float32, device=dev)  # the last draft's confidence
        # the catch-ups' static buffers, m-row views of one max-size set; warm-up writes K/V at
        # rows_pos (and attends from start 0): at construction no head row is live, so rows
        # 0..m-1 are free to scribble on
        sizes = catch_up_sizes(int(max_rows), capacity)
        self.rows_hidden = torch.zeros(1, max(sizes), hidden_size, dtype=dtype, device=dev)
        self.rows_token = torch.zeros(1, max(sizes), dtype=torch.long, device=dev)
        self.rows_pos = self._arange[:max(sizes)].clone()
        self.rows_attn = torch.zeros(1, max(sizes), width, dtype=dtype, device=dev)
        self.attend_at = 0  # first KV position of the next eager attention segment's new rows
        # the coupled draft's inputs: the draft vocabulary's full-vocabulary ids, T and the seed's
        # key (core.sampling.seed_key, computed on the host)
        self.ids = self.shortlist if self.shortlist is not None else torch.arange(lm.lm_head.weight.shape[0], device=dev)
        self.temperature = torch.ones((), dtype=torch.float64, device=dev)
        self.seed_key = torch.zeros((), dtype=torch.long, device=dev)
        self.coupled = False  # this decode drafts coupled (``couple``)
        self.filter = None  # the sampler whose filter the coupled draft applies (``couple(filtered=True)``)
        self._step = self._graphed(self._step_segments())
        self._rows = {m: self._graphed(self._catch_up_segments(m)) for m in sizes}
        self._step_coupled = self._rows_coupled = None
        if coupled:
            self._step_coupled = self._graphed(self._step_segments(coupled=True))
            self._rows_coupled = {m: self._graphed(self._catch_up_segments(m, coupled=True)) for m in sizes}

    def nbytes(self) -> int:
        """The K/V cache, a shortlisted head weight and the graphs' static buffers (not their pool)."""
        tensors = [self.keys, self.values, self.in_hidden, self.in_token, self.in_conf, self.step_pos, self.step_attn,
                   self.rows_hidden, self.rows_token, self.rows_pos, self.rows_attn]
        if self.shortlist is not None:
            tensors.append(self.head_weight)
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.inference_mode()
    def forward_rows(self, hidden: torch.Tensor, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Head rows at positions start..start+m-1 from hidden [1,m,H] and tokens [1,m]; writes
        their K/V and returns the head's normed output [1,m,H]."""
        m = tokens.shape[-1]
        if start + m > self.capacity:
            raise ValueError(f"drafter capacity {self.capacity} exceeded")
        positions = self._arange[start:start + m]
        x, query, gate, kv = self._pre(hidden, tokens.view(1, m), positions)
        return self._post(x, self._attend(query, kv, start, self._causal_mask(positions, start + m)), gate)

    def _causal_mask(self, positions, length: int):
        """Causal within the new rows, which are the last of ``length`` (row i sees every position
        up to its own); a single row sees every cached position (no mask). A lower-right causal
        bias rather than a boolean mask: on a GPU it runs the flash kernel, where a mask over the
        whole prefix sends long prompts to a kernel that materialises rows x length scores."""
        m = positions.shape[0]
        if m == 1:
            return None
        return causal_lower_right(m, length)

    def _pre(self, hidden, tokens, positions):
        """fc over [embedding, hidden], input norm, q/k/v with their norms and RoPE at ``positions``.
        Returns (residual x, query [1,nh,m,hd], gate, (key, value) for ``_attend`` to write)."""
        head, inner, cal = self.head, self.lm.model, self.cal
        layer = head.layers[0]
        attn = layer.self_attn
        m, hd = tokens.shape[-1], attn.head_dim
        x = head.fuse(inner.embed_tokens(tokens), hidden)
        cos, sin = inner.rotary_emb(x, positions.view(1, 1, -1).expand(3, 1, -1))
        consts = self.constants
        h = L.rms_norm(layer.input_layernorm, x, cal, consts)
        query, gate = torch.chunk(L.linear(attn.q_proj, h, cal).view(1, m, -1, hd * 2), 2, dim=-1)
        query = L.rms_norm(attn.q_norm, query, cal, consts, 1 << 30).transpose(1, 2)
        key = L.rms_norm(attn.k_norm, attn.k_proj(h).view(1, m, -1, hd), cal, consts, 1 << 30).transpose(1, 2)
        value = attn.v_proj(h).view(1, m, -1, hd).transpose(1, 2)
        query, key = L.rotary(query, cos, sin), L.rotary(key, cos, sin)
        return x, query, gate, (key, value)

    def _attend(self, query, kv, start: int, mask):
        """Writes the new rows' K/V at ``start`` (eager, as ``layers.write_kv`` says why), then
        attends over every row up to the last new one."""
        L.write_kv(self.keys, self.values, *kv, start)
        length = start + query.shape[2]
        attn = self.head.layers[0].self_attn
        out = F.scaled_dot_product_attention(query, self.keys[:, :, :length], self.values[:, :, :length],
                                             attn_mask=mask, scale=attn.scaling,
                                             enable_gqa=attn.num_key_value_groups > 1)
        return out.transpose(1, 2).reshape(1, query.shape[2], -1)

    def _post(self, x, attn_out, gate):
        layer, cal = self.head.layers[0], self.cal
        m = x.shape[1]
        x = x + layer.self_attn.o_proj(attn_out * torch.sigmoid(gate.reshape(1, m, -1)))
        x = x + L.mlp(layer.mlp, L.rms_norm(layer.post_attention_layernorm, x, cal, self.constants), cal)
        return L.rms_norm(self.head.norm, x, cal, self.constants)

    # ------------------------------------------------------------------ graphed forwards

    @torch.no_grad()
    def _graphed(self, segments):
        """(segments, graphs): pre and post captured as CUDA graphs in the drafter's pool on the
        GPU (graphs None elsewhere: the functions run eagerly); attention stays eager between
        them, its KV length and mask change every call."""
        return segments, (capture_segments(segments, self.pool)
                          if self.pool is not None else None)

    def _run(self, graphed, start: int) -> None:
        """pre, eager attention for new rows from position ``start``, post."""
        self.attend_at = start
        run_segments(*graphed)

    def _emit(self, out_row) -> None:
        """The head's last output row and its draft become the next chained step's inputs (with
        ``confidence``, the draft's probability goes to ``in_conf``)."""
        logits = F.linear(out_row, self.head_weight)
        self.in_token.copy_(self._argmax_token(logits))
        if self.confidence:
            self.in_conf.copy_(torch.softmax(logits.float(), -1).amax(-1).view(1))
        self.in_hidden.copy_(out_row)

    def _emit_coupled(self, out_row, position: torch.Tensor) -> None:
        """As ``_emit``, the draft being the coupled one for the token at ``position`` ([1])."""
        logits = F.linear(out_row, self.head_weight).reshape(-1)
        token, row = self._coupled(logits, position)
        self.in_token.copy_(token)
        if self.confidence:
            self.in_conf.copy_(torch.softmax(logits.float(), -1)[row])
        self.in_hidden.copy_(out_row)

    def couple(self, sampler, filtered: bool = False) -> None:
        """Draft coupled to ``sampler``'s noise from now on; None or a greedy sampler: plain argmax.
        ``filtered``: only among the tokens the sampler's filter keeps of the draft's own logits;
        a measurement (docs/decoders.md#sampling), eager only."""
        self.coupled = sampler is not None and not sampler.greedy
        self.filter = sampler if self.coupled and filtered else None
        if self.coupled:
            if self._step_coupled is None:
                raise ValueError("this drafter was built without coupled graphs (coupled=False)")
            if filtered and self.pool is not None:
                raise ValueError("the filtered coupled draft runs eagerly only (use_graphs=False)")
            self.temperature.fill_(sampler.temperature)
            self.seed_key.fill_(seed_key(sampler.seed))

    def _step_segments(self, coupled: bool = False):
        """One chained draft step over the static buffers (in_hidden, in_token) at step_pos; the
        draft it emits is for position step_pos + 2 (a head row at p holds h_p and t_{p+1})."""
        ws = {}

        def pre():
            ws["pre"] = self._pre(self.in_hidden, self.in_token, self.step_pos)

        def attend():
            _, query, _, kv = ws["pre"]
            self.step_attn.copy_(self._attend(query, kv, self.attend_at, None))

        def post():
            x, _, gate, _ = ws["pre"]
            out = self._post(x, self.step_attn, gate)
            if coupled:
                self._emit_coupled(out, self.step_pos + 2)
            else:
                self._emit(out)

        return [("graph", pre), ("eager", attend), ("graph", post)]

    def _catch_up_segments(self, m: int, coupled: bool = False):
        """A catch-up of m rows; beyond the weights, every tensor it reads or writes that outlives
        a call is a static buffer (the graphs' addresses) or the head's K/V cache. Its post leaves
        the last row's output and draft in (in_hidden, in_token), so chaining continues without a
        copy."""
        hidden, tokens = self.rows_hidden[:, :m], self.rows_token[:, :m]
        positions, attn_out = self.rows_pos[:m], self.rows_attn[:, :m]
        ws = {}

        def pre():
            ws["pre"] = self._pre(hidden, tokens, positions)

        def attend():
            _, query, _, kv = ws["pre"]
            attn_out.copy_(self._attend(query, kv, self.attend_at, self._causal_mask(positions, self.attend_at + m)))

        def post():
            x, _, gate, _ = ws["pre"]
            out = self._post(x, attn_out, gate)[:, -1:]
            if coupled:
                self._emit_coupled(out, positions[m - 1:m] + 2)
            else:
                self._emit(out)

        return [("graph", pre), ("eager", attend), ("graph", post)]

    # ------------------------------------------------------------------ drafting

    def chained_step(self, position: int) -> torch.Tensor:
        """Consume (in_hidden, in_token) at ``position``; leaves the next draft in in_token and
        returns a copy of it [1,1]."""
        if position + 1 > self.capacity:
            raise ValueError(f"drafter capacity {self.capacity} exceeded")
        self.step_pos.fill_(position)
        self._run(self._step_coupled if self.coupled else self._step, position)
        return self.in_token.clone()

    def catch_up_chunks(self, m: int) -> list[int]:
        """How a catch-up of m rows is split: m itself where it has a graph, else the largest
        graphed size that fits, repeatedly (so 65 rows -> 64 + 1)."""
        return split_rows(m, self._rows)

    def _catch_up(self, hidden: torch.Tensor, tokens: torch.Tensor, start: int) -> None:
        """Head rows at positions start..start+m-1 (as ``forward_rows``, chunk by chunk), leaving
        the last row's output and draft in (in_hidden, in_token)."""
        m = tokens.shape[-1]
        if start + m > self.capacity:
            raise ValueError(f"drafter capacity {self.capacity} exceeded")
        tokens = tokens.view(1, m)
        done = 0
        for rows in self.catch_up_chunks(m):
            self._catch_up_chunk(hidden[:, done:done + rows], tokens[:, done:done + rows], start + done)
            done += rows

    def _catch_up_chunk(self, hidden: torch.Tensor, tokens: torch.Tensor, start: int) -> None:
        m = tokens.shape[-1]
        self.rows_hidden[:, :m].copy_(hidden)
        self.rows_token[:, :m].copy_(tokens.view(1, m))
        self.rows_pos[:m].copy_(self._arange[start:start + m])
        self._run(self._rows_coupled[m] if self.coupled else self._rows[m], start)

    def draft_token(self, out_row: torch.Tensor) -> torch.Tensor:
        """Argmax of the draft logits for one head output row [1,1,H] -> [1,1] token id."""
        return self._argmax_token(F.linear(out_row, self.head_weight))

    def _argmax_token(self, logits: torch.Tensor) -> torch.Tensor:
        idx = logits.argmax(-1)
        return self.shortlist[idx] if self.shortlist is not None else idx

    def coupled_token(self, out_row: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The coupled draft for one head output row [1,1,H] at ``position`` ([1] int64): among
        the draft's DRAFT_CANDIDATES largest logits, the argmax of logits / T + G(seed, position,
        v) -> [1,1] token id. The target picks among its own top-k (20 in Qwen's presets), so a
        draft outside the head's best few would rarely be kept; the noise is hashed at those few ids."""
        return self._coupled(F.linear(out_row, self.head_weight).reshape(-1), position)[0]

    def _coupled(self, logits: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``coupled_token`` from the draft logits [V']: (token id [1,1], its row in the logits [1])."""
        top = torch.topk(logits, min(DRAFT_CANDIDATES, logits.numel()))
        ids = self.ids[top.indices]
        noise = noise_from_keys(*position_keys(self.seed_key, position), ids)
        score = top.values.to(torch.float64) / self.temperature + noise
        if self.filter is not None:  # the filter over the candidates alone: a proposal, not a pick
            ranks, _, kept = candidates(top.values, self.filter)
            score = torch.where(torch.zeros_like(kept).index_put_((ranks,), kept), score, -math.inf)
        best = score.argmax(-1, keepdim=True)
        return ids[best].view(1, 1), top.indices[best]

    def head_candidates(self, k: int) -> torch.Tensor:
        """The head's ``k`` best full-vocabulary ids by draft logit, best first ([k]), for the head
        output row the last catch-up or chained step left in ``in_hidden``: the draft in
        ``in_token`` and the runners-up a tree of drafts would branch on."""
        logits = F.linear(self.in_hidden, self.head_weight).reshape(-1)
        return self.ids[torch.topk(logits, min(k, logits.numel())).indices]

    @torch.inference_mode()
    def prefill(self, hidden: torch.Tensor, prompt_ids: list[int]) -> None:
        """Head rows for the prompt: (h_p, t_{p+1}) at p = 0..P-2. Without graphs (the CPU) the
        rows are padded to a multiple of PREFILL_ROWS where that fits, so prompts of many lengths
        share a few GEMM shapes: a CPU's first GEMM of a shape sets up its kernels (~1.6 ms on
        tiny, more than the forward). Padded rows are scratch: the next catch-up writes over them
        before anything attends to them. A long prompt runs in chunks of PREFILL_CHUNK rows, each
        attending to every row before it: where the attention kernel materialises its scores (the
        CPU), they grow with rows x length."""
        self.filled = 0
        m = len(prompt_ids) - 1
        if m > 0:
            rows, tokens = hidden[:, :-1], torch.tensor([prompt_ids[1:]], device=hidden.device)
            padded = -(-m // PREFILL_ROWS) * PREFILL_ROWS
            if self.pool is None and padded <= self.capacity:
                rows = torch.cat([rows, rows.new_zeros(1, padded - m, rows.shape[-1])], dim=1)
                tokens = torch.cat([tokens, tokens.new_zeros(1, padded - m)], dim=1)
            for start in range(0, tokens.shape[-1], PREFILL_CHUNK):
                self.forward_rows(rows[:, start:start + PREFILL_CHUNK], tokens[:, start:start + PREFILL_CHUNK], start)
        self.filled = m

    @torch.inference_mode()
    def draft(self, pending_hidden: torch.Tensor, pending_tokens: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Catch up the head on rows [filled, filled+k) given as true hidden states and their next
        tokens (the last of which is the round's first draft input), then chain ``depth`` drafts.
        Returns the draft tokens as [1,1] device tensors."""
        pos = self._catch_up_pending(pending_hidden, pending_tokens)
        drafts = [self.in_token.clone()]
        for _ in range(depth - 1):
            drafts.append(self.chained_step(pos))
            pos += 1
        return drafts

    @torch.inference_mode()
    def draft_until(self, pending_hidden: torch.Tensor, pending_tokens: torch.Tensor,
                    more: Callable[[list[float]], bool]) -> tuple[list[torch.Tensor], list[float]]:
        """As ``draft``, the depth decided on the way: after each draft (the first is the
        catch-up's) its confidence is read, a wait for the device, and another is chained while
        ``more(confidences so far)`` is true. Needs ``confidence=True``. Returns (drafts as [1,1]
        device tensors, their confidences)."""
        if not self.confidence:
            raise ValueError("draft_until needs a drafter built with confidence=True")
        pos = self._catch_up_pending(pending_hidden, pending_tokens)
        drafts, confidences = [self.in_token.clone()], [float(self.in_conf)]
        while more(confidences):
            drafts.append(self.chained_step(pos))
            confidences.append(float(self.in_conf))
            pos += 1
        return drafts, confidences

    def _catch_up_pending(self, pending_hidden: torch.Tensor, pending_tokens: torch.Tensor) -> int:
        """The catch-up of ``draft``; returns the position of the first chained step."""
        start = self.filled
        self._catch_up(pending_hidden, pending_tokens, start)
        self.filled = start + pending_tokens.shape[-1]  # every pending row had true inputs; chained rows do not
        return self.filled


DRAFT_CANDIDATES = 64  # a coupled draft chooses among the head's this many largest logits
PREFILL_ROWS = 64  # an eager prompt prefill's row count is a multiple of this (see MTPDrafter.prefill)
# a prompt's head rows are made this many at a time: one call's mask and, where the attention kernel
# materialises them, its scores grow with rows x length (16 heads x 32k x 32k in bf16 is 32 GB)
PREFILL_CHUNK = 1024

# graphed catch-up sizes beyond a round's own (max_rows): after a run of plain steps, a gap of up
# to explore_every (64 by default) plus a round's rows is caught up in a few chunks, a longer one
# (where probes are dear) in 64-row chunks
LONG_CHUNKS = (16, 32, 64)


def catch_up_sizes(max_rows: int, capacity: int) -> list[int]:
    """Row counts with a catch-up graph: 1..max_rows and the LONG_CHUNKS above it, within capacity."""
    top = max(1, min(max_rows, capacity))
    return list(range(1, top + 1)) + [m for m in LONG_CHUNKS if top < m <= capacity]


def split_rows(m: int, sizes) -> list[int]:
    """m rows as consecutive chunks of the given sizes (which include 1): m itself if it is one,
    else greedily the largest that fits."""
    if m in sizes:
        return [m]
    ordered, out = sorted(sizes, reverse=True), []
    while m > 0:
        rows = next(s for s in ordered if s <= m)
        out.append(rows)
        m -= rows
    return out


SHORTLIST_FILE = "draft_shortlist.json"
HEAD_FILE = "mtp.safetensors"  # a trained draft head, as `heads train` saves it


def default_shortlist(model) -> str | None:
    """The shortlist stored beside a checkpoint's head (also a committed built-in's), if any."""
    where = model.extra.get("checkpoint_dir")
    if where is None:
        return None
    path = Path(where) / SHORTLIST_FILE
    return str(path) if path.is_file() else None


def shortlist_source(model, shortlist: str | None, head_dir: str | None) -> str | None:
    """The shortlist a drafter uses: the one given, else a trained head's (``HEAD_DIR/
    draft_shortlist.json``), else the checkpoint's, else none (the full vocabulary)."""
    if shortlist:
        return shortlist
    if head_dir is not None and (Path(head_dir) / SHORTLIST_FILE).is_file():
        return str(Path(head_dir) / SHORTLIST_FILE)
    return default_shortlist(model) if model is not None else None


def load_shortlist(path: Path, vocab: int | None = None) -> list[int]:
    """Token ids from a shortlist file: a JSON list, or an object with an ``ids`` list; with
    ``vocab``, every id must lie inside it."""
    if not Path(path).is_file():
        raise UserError(f"shortlist file {str(path)!r} not found")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: shortlist is not JSON ({exc})") from None
    ids = data.get("ids") if isinstance(data, dict) else data
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise UserError(f"{path}: shortlist must be a non-empty JSON list of token ids or {{'ids': [...]}}")
    bad = [i for i in ids if vocab is not None and not 0 <= i < vocab]
    if bad:
        raise UserError(f"{path}: shortlist id {bad[0]} outside the vocabulary (0..{vocab - 1})")
    return ids


def load_head(model, directory):
    """A copy of ``model``'s MTP head with ``DIR/mtp.safetensors`` loaded (strict: exactly the
    head's tensor names under ``mtp.``, matching shapes), in the model's dtype and device. The
    model itself (backbone and its own head) is unchanged."""
    from safetensors.torch import load_file  # only a trained head needs it

    if model.mtp is None:
        raise UserError(f"model {model.name} has no MTP head to load a trained one into: {model.mtp_missing}")
    path = Path(directory) / HEAD_FILE
    if not path.is_file():
        raise UserError(f"{path}: no such head file")
    raw = load_file(str(path), device=str(model.device))
    bad = [k for k in raw if not k.startswith("mtp.")]
    if bad:
        raise UserError(f"{path}: unexpected tensor {bad[0]} (a head file holds only mtp.*)")
    head = copy.deepcopy(model.mtp)
    own = head.state_dict()
    sd = {k[4:]: v for k, v in raw.items()}
    for k, v in sd.items():
        if k in own and tuple(own[k].shape) != tuple(v.shape):
            raise UserError(f"{path}: mtp.{k} has shape {tuple(v.shape)}, the model's head has {tuple(own[k].shape)}")
    try:
        head.load_state_dict({k: v.to(own[k].dtype) if k in own else v for k, v in sd.items()}, strict=True)
    except RuntimeError as exc:
        raise UserError(f"{path}: does not match the model's head ({str(exc).splitlines()[0]})") from None
    return head.eval()
