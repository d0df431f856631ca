"""Qwen3.5 layer arithmetic over a window of w rows, bit-identical per row to HF's serial step.

Every function here mirrors, op for op and dtype for dtype, what transformers 5.17's Qwen3.5
modules do for a single token with a cache (q_len = 1), and batches an op over the window's rows
only where the calibration proved the batched kernel bit-equal to the 1-row kernel; elsewhere it
loops rows with the serial shapes. Elementwise ops compute each element alone and are batched
freely. The only genuinely sequential work, the Gated-DeltaNet recurrence, runs token by token.
With w = 1 each function performs exactly the serial step's ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.models.qwen3_5.modeling_qwen3_5 import rotate_half

from decoders.runtime.lanes import SERIAL, Lanes


def rows(fn, x: torch.Tensor, dim: int, batch: int) -> torch.Tensor:
    """fn over x in chunks of at most ``batch`` rows along ``dim`` (one chunk when proven)."""
    n = x.shape[dim]
    if n <= batch:
        return fn(x)
    return torch.cat([fn(x.narrow(dim, i, min(batch, n - i)).contiguous()) for i in range(0, n, batch)], dim=dim)


def ew(fn, x: torch.Tensor, dim: int, cal) -> torch.Tensor:
    """A transcendental elementwise op: over the whole window where proven layout-invariant,
    else one row at a time in the serial step's layout."""
    n = x.shape[dim]
    if cal.elementwise or n == 1:
        return fn(x)
    return torch.cat([fn(x.narrow(dim, i, 1)) for i in range(n)], dim=dim)


def linear(lin: torch.nn.Linear, x: torch.Tensor, cal) -> torch.Tensor:
    return rows(lin, x, 1, cal.gemm_rows(lin))


class Constants:
    """Weight-only tensors HF recomputes on every call (e.g. ``1.0 + weight.float()``), computed
    once with the same ops, so the same bits, and kept: fewer kernels per step. Owned by whoever
    runs the forwards (the runtime, the drafter), which holds the modules for as long as it lives;
    a runtime built after new weights are loaded computes them afresh."""

    def __init__(self):
        self._made: dict[tuple[int, str], torch.Tensor] = {}

    def get(self, module, name: str, make) -> torch.Tensor:
        key = (id(module), name)  # the owner keeps the module alive, so its id stays its own
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]


def rms_norm(norm, x: torch.Tensor, cal, consts: Constants, batch: int | None = None,
             lanes: Lanes = SERIAL) -> torch.Tensor:
    """Qwen3_5RMSNorm (zero-centred weight) over x's last dim, rows along dim 1; the statistic is
    computed in row chunks of ``batch`` (default: the hidden-size proof), the chunks on the lanes."""
    batch = cal.hidden_mean if batch is None else batch
    xf = x.float()
    sq = xf.pow(2)
    var = row_mean(sq, batch, lanes)
    out = xf * ew(torch.rsqrt, var + norm.eps, 1, cal)
    out = out * consts.get(norm, "scale", lambda: 1.0 + norm.weight.float())
    return out.type_as(x)


def row_mean(sq: torch.Tensor, batch: int, lanes: Lanes = SERIAL) -> torch.Tensor:
    """``sq.mean(-1, keepdim=True)`` with tokens along dim 1, in chunks of ``batch`` tokens, each
    chunk's mean written straight into its slice of the result (same kernel, no concatenation).
    The chunks are independent reductions: they run on the lanes."""
    n = sq.shape[1]
    if n <= batch:
        return sq.mean(-1, keepdim=True)
    var = sq.new_empty((*sq.shape[:-1], 1))

    def chunk(j: int) -> None:
        i = j * batch
        m = min(batch, n - i)
        torch.mean(sq.narrow(1, i, m).contiguous(), -1, keepdim=True, out=var.narrow(1, i, m))

    lanes.each(chunk, -(-n // batch))
    return var


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """transformers' l2norm (FLA-compatible), used on q and k in the recurrent rule."""
    inv_norm = torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)
    return x * inv_norm


def serial_sdpa(attn, query, key, value) -> torch.Tensor:
    """The control's q_len=1 attention call (transformers' sdpa_attention_forward with no mask)."""
    kwargs = {}
    if attn.num_key_value_groups > 1:
        if key.shape[-1] == value.shape[-1] <= 256:
            kwargs = {"enable_gqa": True}
        else:
            n = attn.num_key_value_groups
            b, h, s, d = key.shape
            key = key[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)
            value = value[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                         scale=attn.scaling, is_causal=False, **kwargs)
    return out.transpose(1, 2).contiguous()


# --------------------------------------------------------------------------- Gated-DeltaNet


def gdn_window(mod, x, conv_state, rec_state, cal, consts: Constants, conv_cat, rec_capture=None,
               deferred: bool = False, lanes: Lanes = SERIAL):
    """Gated-DeltaNet token mixer over w rows. Updates ``conv_state`` and ``rec_state`` in place to
    the state after the last row and returns the output [1,w,H]. ``conv_cat`` ([1,C,K+w]) receives
    [conv state ++ window inputs], so the conv state after row i is ``conv_cat[..., i+1:i+1+K]``;
    with ``rec_capture`` ([>=w,1,Hv,dk,dv]) the recurrent state after row i is left in
    ``rec_capture[i]``. Those two are what rollback restores. With ``deferred`` the two final-state
    copies (conv state from ``conv_cat``; the recurrent state from ``rec_capture[w-1]`` where the
    readout is batched) are left to the caller, who makes them for every layer in one copy.

    The layer's three branches meet only at the recurrence: q/k/v (projection, conv, norms), the
    output gate z, and beta with the decay. They run on three lanes."""
    w = x.shape[1]
    (query, key, value), gates, (beta, decay, decay_exp) = lanes.fork(
        lambda: gdn_qkv(mod, x, conv_state, cal, conv_cat, deferred),
        lambda: gdn_output_gate(mod, x, cal),
        lambda: gdn_decay(mod, x, cal, consts))
    core = recurrent_rule(query, key, value, beta, decay, decay_exp, rec_state, cal, rec_capture,
                          out_dtype=x.dtype, deferred=deferred)
    core = gated_norm(mod, core.reshape(-1, mod.head_v_dim), gates, w, cal.gated_norm).reshape(1, w, -1)
    return linear(mod.out_proj, core, cal)


def gdn_qkv(mod, x, conv_state, cal, conv_cat, deferred: bool):
    """Projection, causal conv and the recurrent rule's q/k L2 norms: query (normed and scaled),
    key (normed) [1,Hv,w,dk] and value [1,Hv,w,dv], all fp32."""
    w = x.shape[1]
    qkv = linear(mod.in_proj_qkv, x, cal)
    # transformers' causal_conv1d_update, over the whole window at once where proven
    k = conv_state.shape[-1]
    weight = mod.conv1d.weight.squeeze(1).unsqueeze(1)
    cat = torch.cat([conv_state, qkv.transpose(1, 2)], dim=-1, out=conv_cat).to(weight.dtype)
    if not deferred:
        conv_state.copy_(cat[:, :, -k:])
    act = ACT2FN[mod.activation]
    if w == 1 or cal.conv_window:
        conv = F.conv1d(cat, weight, mod.conv1d.bias, padding=0, groups=mod.conv_dim)[:, :, -w:]
        conv = ew(act, conv, 2, cal)
    else:  # the serial update rule, token by token, activation in the serial layout
        conv = torch.cat([act(F.conv1d(cat[:, :, i:i + k + 1].contiguous(), weight, mod.conv1d.bias, padding=0,
                                       groups=mod.conv_dim)[:, :, -1:]) for i in range(w)], dim=-1)
    # HF casts the conv output to bf16, splits it, repeats q/k heads, then converts q, k, v to fp32
    # one by one; casting once before the split gives the same values with fewer kernels
    mixed = conv.to(qkv.dtype).float().transpose(1, 2)
    value = mixed[..., 2 * mod.key_dim:].reshape(1, w, -1, mod.head_v_dim)
    value = value.transpose(1, 2).to(torch.float32)  # only ever read elementwise: layout is free
    rep = mod.num_v_heads // mod.num_k_heads
    fused = w <= cal.qk_l2norm
    if fused:
        # q and k are adjacent channels: repeat, lay out and L2-normalise them as one tensor of 2*Hv
        # heads, where the calibration proved its norm statistic equal to each one's per token; the
        # rest is data movement and exact casts.
        qk = mixed[..., :2 * mod.key_dim].reshape(1, w, -1, mod.head_k_dim)
        if rep > 1:
            qk = qk.repeat_interleave(rep, dim=2)
        qk = l2norm(qk.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format))
        query, key = qk[:, :mod.num_v_heads], qk[:, mod.num_v_heads:]
    else:
        query, key = [t.reshape(1, w, -1, mod.head_k_dim)
                      for t in torch.split(mixed[..., :2 * mod.key_dim], [mod.key_dim, mod.key_dim], dim=-1)]
        if rep > 1:
            query, key = query.repeat_interleave(rep, dim=2), key.repeat_interleave(rep, dim=2)
        # the recurrent rule's own L2 norms, in fp32 [1,Hv,w,dk]
        query, key = [t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                      for t in (query, key)]
        query = rows(l2norm, query, 2, cal.l2norm)
        key = rows(l2norm, key, 2, cal.l2norm)
    query = query / (query.shape[-1] ** 0.5)
    return query, key, value


def gdn_decay(mod, x, cal, consts: Constants):
    """beta = sigmoid(b) and the decay g = -exp(A_log) * softplus(a + dt_bias), as the recurrent
    rule reads them ([1,Hv,w] fp32, contiguous), and exp(g) where it may be taken over the window."""
    w = x.shape[1]
    b = linear(mod.in_proj_b, x, cal)
    a = linear(mod.in_proj_a, x, cal)
    beta = ew(torch.sigmoid, b, 1, cal)
    neg_a = consts.get(mod, "neg_A", lambda: -mod.A_log.float().exp())
    # HF: softplus(a.float() + dt_bias) in fp32; with dt_bias kept in fp32, bf16 a + fp32 promotes
    # a exactly inside the add: the same sum, one kernel fewer
    dt_bias = consts.get(mod, "dt_bias_f32", lambda: mod.dt_bias.float())
    g = neg_a * ew(F.softplus, a + dt_bias, 1, cal)
    beta, decay = [t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for t in (beta, g)]
    # exp of each token's decay over the window at once, unless the serial layout is required
    decay_exp = decay.exp() if cal.elementwise or w == 1 else None
    return beta, decay, decay_exp


def gdn_output_gate(mod, x, cal) -> list[torch.Tensor]:
    """The output norm's gate, act(z) in fp32 (HF: ``act(gate.to(float32))``), in the token chunks
    ``gated_norm`` normalises: [w*Hv, dv] rows."""
    w = x.shape[1]
    z = linear(mod.in_proj_z, x, cal).reshape(-1, mod.head_v_dim)
    act = ACT2FN[mod.norm.activation]
    return [act(chunk.to(torch.float32)) for chunk in token_chunks(z, w, cal.gated_norm, mod.num_v_heads)]


def token_chunks(t: torch.Tensor, w: int, batch: int, per_token: int) -> list[torch.Tensor]:
    """t's [w*per_token, ...] rows as chunks of at most ``batch`` tokens."""
    if w <= batch:
        return [t]
    return [t[i * per_token:(i + min(batch, w - i)) * per_token] for i in range(0, w, batch)]


def gated_norm(mod, core, gates: list[torch.Tensor], w: int, batch: int):
    """Qwen3_5RMSNormGated over [w*Hv, dv] rows, op for op, in chunks of ``batch`` tokens, with
    the gate's activation already made (``gdn_output_gate``)."""
    norm = mod.norm
    outs = []
    for chunk, gate in zip(token_chunks(core, w, batch, mod.num_v_heads), gates):
        h = chunk.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + norm.variance_epsilon)
        h = norm.weight * h.to(chunk.dtype)
        outs.append((h * gate).to(chunk.dtype))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def recurrent_rule(query, key, value, beta, decay, decay_exp, rec_state, cal, rec_capture=None, out_dtype=None,
                   deferred: bool = False):
    """transformers' torch_recurrent_gated_delta_rule, token by token, starting from ``rec_state``
    and leaving the final state in it. Everything before the loop is made by ``gdn_qkv`` and
    ``gdn_decay``: query (L2-normed and scaled), key (L2-normed) and value as [1,Hv,w,d] fp32;
    beta and decay as [1,Hv,w] fp32; ``decay_exp`` = exp(decay) when taken over the window."""
    w = value.shape[2]
    out_dtype = out_dtype or value.dtype
    state = rec_state.to(value)
    batched_readout = uses_batched_readout(w, rec_capture is not None, cal)
    outs = []
    for i in range(w):
        q_t, k_t, v_t = query[:, :, i], key[:, :, i], value[:, :, i]
        # exp of this token's decay, in the serial layout unless proven layout-invariant
        decay_t = (decay_exp[:, :, i] if decay_exp is not None else decay[:, :, i].contiguous().exp())[..., None, None]
        state = state * decay_t
        beta_t = beta[:, :, i].unsqueeze(-1)
        kv_mem = (state * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta_t
        if batched_readout:  # every row's state lands in its capture slot; read out all at the end
            state = torch.add(state, k_t.unsqueeze(-1) * delta.unsqueeze(-2), out=rec_capture[i])
            continue
        if i == w - 1:  # the last update lands in the live state itself (HF: new tensor, then copy_)
            state = torch.add(state, k_t.unsqueeze(-1) * delta.unsqueeze(-2), out=rec_state)
        else:
            state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
            if rec_capture is not None:  # accepting every row needs no capture of the last
                rec_capture[i].copy_(state)
        outs.append((state * q_t.unsqueeze(-1)).sum(dim=-2))
    if batched_readout:
        if not deferred:
            rec_state.copy_(rec_capture[w - 1])
        return batched_readout_rows(query, rec_capture[:w], cal.readout).to(out_dtype)
    # [1,Hv,w,dv] like HF's zero-filled output buffer, built without the fill and the copies
    core = outs[0].unsqueeze(2) if w == 1 else torch.stack(outs, dim=2)
    return core.transpose(1, 2).contiguous().to(out_dtype)


def uses_batched_readout(w: int, capturing: bool, cal) -> bool:
    """Whether a window's rows leave their states in the capture slots and are read out together."""
    return w > 1 and capturing and cal.readout > 1


def batched_readout_rows(query, states, batch: int) -> torch.Tensor:
    """Every row's output (state_i * q_i).sum(-2) from the captured states [w,1,Hv,dk,dv], over
    ``batch`` rows per reduction (proven equal to the 1-row sum), as [1,w,Hv,dv]. The products
    are elementwise, so only the sum's row count matters; the product is kept contiguous like the
    serial step's."""
    w = states.shape[0]
    prod = states * query.permute(2, 0, 1, 3).unsqueeze(-1)  # [w,1,Hv,dk,1] per-row queries
    if not prod.is_contiguous():
        prod = prod.contiguous()
    core = rows(lambda t: t.sum(dim=-2), prod, 0, batch)  # [w,1,Hv,dv]
    return core.view(1, w, *core.shape[2:])


# --------------------------------------------------------------------------- gated attention


def attention_pre(mod, x, cos, sin, cal, consts: Constants, lanes: Lanes = SERIAL):
    """Projections, per-head norms, RoPE. Returns (per-row contiguous queries, the output gate's
    sigmoid, this window's keys and values [1,KV,w,hd]; ``write_kv`` puts them in the cache).
    Query, key and value are independent until attention reads them: three lanes."""
    w = x.shape[1]
    hd = mod.head_dim

    def query_and_gate():
        query, gate = torch.chunk(linear(mod.q_proj, x, cal).view(1, w, -1, hd * 2), 2, dim=-1)
        if not cal.elementwise:  # HF's contiguous gate, so that sigmoid sees the serial layout
            gate = gate.reshape(1, w, -1)
        query = rms_norm(mod.q_norm, query.view(1, w, -1, hd), cal, consts, cal.head_norm).transpose(1, 2)
        return rotary(query, cos, sin), ew(torch.sigmoid, gate, 1, cal)

    def key():
        key = rms_norm(mod.k_norm, linear(mod.k_proj, x, cal).view(1, w, -1, hd), cal, consts,
                       cal.head_norm).transpose(1, 2)
        return rotary(key, cos, sin)

    def value():
        return linear(mod.v_proj, x, cal).view(1, w, -1, hd).transpose(1, 2)

    (query, gate), key, value = lanes.fork(query_and_gate, key, value)
    if w == 1:
        return [query], gate, key, value
    # each row's query as its own contiguous [1,H,1,hd] block, as the serial step has it: one
    # copy into [w,H,hd] order, then views
    by_row = query.transpose(1, 2).contiguous()
    q_rows = [by_row[:, i].unsqueeze(2) for i in range(w)]
    return q_rows, gate, key, value


def write_kv(kbuf, vbuf, key, value, start: int) -> None:
    """A window's keys and values into the cache at positions start..start+w-1, as two plain copies
    at a host-side offset: on a GPU under deterministic algorithms, an ``index_copy_`` at
    device-side positions (what a graph could hold) is a sort-based ``index_put_`` of several
    kernels."""
    w = key.shape[2]
    kbuf[:, :, start:start + w].copy_(key)
    vbuf[:, :, start:start + w].copy_(value)


def rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one of its two tensors, op for op (it treats q and
    k alike and separately), so that q and k can be rotated on different lanes."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    t_rot, t_pass = t[..., :rotary_dim], t[..., rotary_dim:]
    return torch.cat([(t_rot * cos) + (rotate_half(t_rot) * sin), t_pass], dim=-1)


def attention_core(mod, q_rows, kbuf, vbuf, start: int, out: torch.Tensor, contiguous_kv: bool,
                   lanes: Lanes = SERIAL) -> None:
    """q_len=1 attention for each row, over exactly the KV length the serial step would see; the
    rows are independent, so they run on the lanes. Kept outside CUDA graphs: the length changes
    every token."""
    def row(i: int) -> torch.Tensor:
        k, v = kbuf[:, :, :start + i + 1], vbuf[:, :, :start + i + 1]
        if contiguous_kv:
            k, v = k.contiguous(), v.contiguous()
        return serial_sdpa(mod, q_rows[i], k, v).reshape(1, 1, -1)

    rows_out = lanes.each(row, len(q_rows))
    if len(rows_out) == 1:
        out.copy_(rows_out[0])
    else:  # one copy into the static buffer for the whole window, not one per row
        torch.cat(rows_out, dim=1, out=out)


def attention_post(mod, attn_out, gate, cal):
    """The output gate (its sigmoid made by ``attention_pre``) and o_proj."""
    w = attn_out.shape[1]
    gated = attn_out.view(gate.shape) * gate
    return linear(mod.o_proj, gated.view(1, w, -1), cal)


def mlp(mod, x, cal, lanes: Lanes = SERIAL, gate_up: torch.Tensor | None = None):
    """down(act(gate(x)) * up(x)). Args: x [1,w,H]; ``gate_up``: the [2I, H] buffer the gate and up
    weights are views of (gate_up.py), given only for a window of at most ``cal.gate_up`` rows.
    With it, gate and up are one GEMM; without, two, on two lanes."""
    if gate_up is not None:
        return linear(mod.down_proj, gated_up(mod, x, gate_up, cal), cal)
    act, up = lanes.fork(lambda: ew(mod.act_fn, linear(mod.gate_proj, x, cal), 1, cal),
                         lambda: linear(mod.up_proj, x, cal))
    return linear(mod.down_proj, act * up, cal)


def gated_up(mod, x, gate_up: torch.Tensor, cal) -> torch.Tensor:
    """act(gate(x)) * up(x) [1,w,I] from one GEMM over the stacked weight, split into its halves
    (views of the [1,w,2I] product; the activation and the product are elementwise)."""
    gate, up = torch.chunk(gate_up_product(x, gate_up), 2, dim=-1)
    return ew(mod.act_fn, gate, 1, cal) * up


def gate_up_product(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """[gate(x), up(x)] as one GEMM: x [1,w,H] times the stacked weight [2I, H], [1,w,2I]."""
    return F.linear(x, gate_up)
