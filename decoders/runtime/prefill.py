"""The control's prefill with the Gated-DeltaNet chunk scans replayed from CUDA graphs.

The control's prefill (transformers' forward over the prompt) is host-bound on a GPU: a 2000-token
prompt on the 9B shape is ~10,500 kernels in ~126 ms of GPU time, each launched from Python. Most
of them are transformers' chunked gated delta rule, which runs after padding the prompt to whole
64-token chunks: every tensor it makes from there on has a shape set by the chunk count n alone,
and it has no weights. So one graph per n, captured once and shared by every Gated-DeltaNet
layer, replays it with the same kernels on the same shapes and strides, hence the same bits.

``prefill_forward`` is transformers' text-model forward with that one function swapped: every
other op is transformers' own module or function, called as its forward calls it. ``chunk_rule``
is the chunked rule op for op, with its part after the padding handed to ``padded_rule`` (eager)
or to a ``ScanGraphs`` (graphed). Which one a runtime uses is proved at start-up against the
control's own forward (``choose_prefill``), as the runtime's other batching is; where neither
proof holds, the runtime runs the control's forward itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from decoders.runtime.graphs import capture_segments

CHUNK = 64  # transformers' chunk size for the prefill's gated delta rule
# prompts up to this many chunks (2048 tokens) replay the scan from graphs; longer ones run it
# eagerly: the graphs' shared buffers and pool grow with the longest one
MAX_GRAPHED_CHUNKS = 32
PROOF_LENGTHS = (37, 150)  # the start-up proof's prompts: one chunk, and three


# --------------------------------------------------------------------------- the chunked rule


def padded_rule(query, key, value, beta, decay) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule after padding: fp32 [B,H,n*C,D] query/key/value and [B,H,n*C]
    beta/decay (queries normalised and scaled). Returns (padded output [B,H,n*C,Dv], final state
    [B,H,Dk,Dv]). Op for op transformers' ``torch_chunk_gated_delta_rule`` from its ``v_beta``
    on, with no initial state; every shape here is set by n."""
    batch, heads, _, k_dim = key.shape
    v_dim = value.shape[-1]
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [x.reshape(x.shape[0], x.shape[1], -1, CHUNK, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta)]
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, CHUNK)
    strictly_upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=query.device).triu(1)
    cum_decay = decay.cumsum(dim=3)
    pairwise = cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)
    pairwise = pairwise.masked_fill(strictly_upper, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)
    del v_beta, k_beta, pairwise, ut_system, decayed_k_beta  # a graph's pool holds its peak: free them early
    state = torch.zeros((batch, heads, k_dim, v_dim), dtype=new_values.dtype, device=new_values.device)
    out = torch.zeros_like(new_values)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]
    for i in range(new_values.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        inter = query[:, :, i] @ state
        out[:, :, i] = inter + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    return out.reshape(batch, heads, -1, v_dim), state


def chunk_rule(query, key, value, g, beta, padded=padded_rule):
    """transformers' ``torch_chunk_gated_delta_rule`` for a prefill (no initial state, final state
    returned, q/k l2-normalised in fp32), op for op; the part after padding is ``padded``."""
    dtype = query.dtype
    length = key.shape[1]
    query, key, value, beta, decay = [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                                      for x in (query, key, value, beta, g)]
    query = hf.l2norm(query, dim=-1, eps=1e-6)
    key = hf.l2norm(key, dim=-1, eps=1e-6)
    query = query * query.shape[-1] ** -0.5
    pad = (CHUNK - length % CHUNK) % CHUNK
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad)) for x in (beta, decay))
    out, state = padded(query, key, value, beta, decay)
    out = out[:, :, :length].transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
    return out, state


class ScanGraphs:
    """``padded_rule`` as one CUDA graph per chunk count n = 1..max_chunks (eager beyond), shared by every
    Gated-DeltaNet layer of a model (the rule has no weights). Inputs and outputs are contiguous
    views of shared buffers, so each graph sees the strides transformers' eager run has: F.pad's
    outputs are contiguous, and so is the rule's padded output. Off a GPU the same buffers and
    views serve a plain call in place of each graph (what the CPU tests exercise)."""

    def __init__(self, config, max_chunks: int, device):
        heads, k_dim, v_dim = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
        rows = max_chunks * CHUNK
        f32 = dict(dtype=torch.float32, device=device)
        self.shapes = (heads, k_dim, v_dim)
        self.flat = {name: torch.zeros(heads * rows * width, **f32)
                     for name, width in (("query", k_dim), ("key", k_dim), ("value", v_dim), ("beta", 1),
                                         ("decay", 1), ("out", v_dim))}
        self.state = torch.zeros(1, heads, k_dim, v_dim, **f32)
        self.pool = torch.cuda.graph_pool_handle() if torch.device(device).type == "cuda" else None
        self.graphs = {n: self._capture(n) for n in range(1, max_chunks + 1)}

    def views(self, n: int) -> dict[str, torch.Tensor]:
        heads, k_dim, v_dim = self.shapes
        rows = n * CHUNK
        dims = {"query": (heads, rows, k_dim), "key": (heads, rows, k_dim), "value": (heads, rows, v_dim),
                "beta": (heads, rows), "decay": (heads, rows), "out": (heads, rows, v_dim)}
        return {name: self.flat[name][:heads * rows * (dim[2] if len(dim) == 3 else 1)].view(1, *dim)
                for name, dim in dims.items()}

    def _capture(self, n: int):
        v = self.views(n)

        def run():
            out, state = padded_rule(v["query"], v["key"], v["value"], v["beta"], v["decay"])
            v["out"].copy_(out)
            self.state.copy_(state)

        if self.pool is None:
            return EagerReplay(run)
        return capture_segments([("graph", run)], self.pool)[0]

    def __call__(self, query, key, value, beta, decay):
        """``padded_rule`` by replay: the inputs are copied in, the output is a view of a shared
        buffer and the state a copy (both valid until the next call)."""
        n = key.shape[2] // CHUNK
        if n not in self.graphs:
            return padded_rule(query, key, value, beta, decay)
        v = self.views(n)
        for name, x in (("query", query), ("key", key), ("value", value), ("beta", beta), ("decay", decay)):
            v[name].copy_(x)
        self.graphs[n].replay()
        return v["out"], self.state.clone()

    @torch.inference_mode()
    def prove_each(self, seed: int = 0) -> str | None:
        """None if every graph reproduces the eager ``padded_rule`` bit for bit on random inputs of
        its chunk count (of the magnitudes a prefill gives it), else which one differs. With the
        whole-forward proof at two lengths, this covers the counts those lengths do not reach."""
        heads, k_dim, v_dim = self.shapes
        device = self.state.device
        gen = torch.Generator(device=device).manual_seed(seed)  # drawn on the device: ~4e8 values at 32 chunks (9B)
        f32 = dict(generator=gen, device=device)
        for n in sorted(self.graphs):
            rows = n * CHUNK
            query, key = (F.normalize(torch.randn(1, heads, rows, k_dim, **f32), dim=-1) for _ in range(2))
            value = torch.randn(1, heads, rows, v_dim, **f32)
            beta = torch.rand(1, heads, rows, **f32)
            decay = -torch.rand(1, heads, rows, **f32)
            want_out, want_state = padded_rule(query, key, value, beta, decay)
            got_out, got_state = self(query, key, value, beta, decay)
            if not (torch.equal(got_out, want_out) and torch.equal(got_state, want_state)):
                return f"the {n}-chunk graph differs from the eager rule"
        return None


class EagerReplay:
    """A graph's stand-in off a GPU: ``replay()`` calls the function."""

    def __init__(self, fn):
        self.replay = fn


# --------------------------------------------------------------------------- the forward


def gated_deltanet(mod, hidden, cache, mask, padded):
    """transformers' ``Qwen3_5GatedDeltaNet.forward`` for a prefill into an empty cache, with the
    chunk rule's padded part given."""
    hidden = hf.apply_mask_to_padding_states(hidden, mask)
    batch, length, _ = hidden.shape
    mixed_qkv = mod.in_proj_qkv(hidden).transpose(1, 2)
    z = mod.in_proj_z(hidden).reshape(batch, length, -1, mod.head_v_dim)
    b = mod.in_proj_b(hidden)
    a = mod.in_proj_a(hidden)
    mixed_qkv = cache.update_conv_state(mixed_qkv, mod.layer_idx, conv_kernel_size=mod.conv_kernel_size)
    mixed_qkv = hf.causal_conv1d_fn(mixed_qkv, mod.conv1d.weight.squeeze(1), mod.conv1d.bias,
                                    activation=mod.activation)
    mixed_qkv = mixed_qkv[:, :, -length:].transpose(1, 2)
    query, key, value = torch.split(mixed_qkv, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
    query = query.reshape(batch, length, -1, mod.head_k_dim)
    key = key.reshape(batch, length, -1, mod.head_k_dim)
    value = value.reshape(batch, length, -1, mod.head_v_dim)
    beta = b.sigmoid()
    g = -mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias)
    if mod.num_v_heads // mod.num_k_heads > 1:
        query = query.repeat_interleave(mod.num_v_heads // mod.num_k_heads, dim=2)
        key = key.repeat_interleave(mod.num_v_heads // mod.num_k_heads, dim=2)
    core, state = chunk_rule(query, key, value, g, beta, padded)
    cache.update_recurrent_state(state, mod.layer_idx)
    core = mod.norm(core.reshape(-1, mod.head_v_dim), z.reshape(-1, mod.head_v_dim))
    return mod.out_proj(core.reshape(batch, length, -1))


@torch.inference_mode()
def prefill_forward(text_model, ids: torch.Tensor, padded=padded_rule):
    """transformers' ``Qwen3_5TextModel.forward(input_ids=ids, past_key_values=DynamicCache(),
    use_cache=True)`` with each Gated-DeltaNet layer's padded chunk rule given. Returns (final
    hidden states [1,P,H], the filled cache)."""
    config = text_model.config
    cache = DynamicCache(config=config)
    embeds = text_model.embed_tokens(ids)
    position_ids = torch.arange(embeds.shape[1], device=embeds.device) + cache.get_seq_length()
    position_ids = position_ids.view(1, 1, -1).expand(4, embeds.shape[0], -1)
    text_position_ids, position_ids = position_ids[0], position_ids[1:]
    mask_args = dict(config=config, inputs_embeds=embeds, attention_mask=None, past_key_values=cache,
                     position_ids=text_position_ids)
    masks = {"full_attention": hf.create_causal_mask(**mask_args),
             "linear_attention": hf.create_recurrent_attention_mask(**mask_args)}
    hidden = embeds
    rotary = text_model.rotary_emb(hidden, position_ids)
    for i, layer in enumerate(text_model.layers[:config.num_hidden_layers]):
        kind = config.layer_types[i]
        if kind == "linear_attention":
            residual = hidden
            hidden = residual + gated_deltanet(layer.linear_attn, layer.input_layernorm(hidden), cache,
                                               masks[kind], padded)
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        else:
            hidden = layer(hidden, position_embeddings=rotary, attention_mask=masks[kind],
                           position_ids=text_position_ids, past_key_values=cache, use_cache=True)
    return text_model.norm(hidden), cache


def choose_prefill(model, capacity: int, use_graphs: bool):
    """The padded chunk rule a runtime's prefill uses, each choice proven at start-up against the
    control's forward (``prove``): the graphed scan where graphs are in use, else the eager rule
    (proven once per loaded model), else None, the control's own forward. Returns (rule, how)."""
    text = model.backbone.model
    config = text.config
    if "linear_attention" not in config.layer_types[:config.num_hidden_layers]:
        return None, "the control's forward (no Gated-DeltaNet layer)"
    failures = []
    if use_graphs:
        try:
            scan = ScanGraphs(config, min(-(-capacity // CHUNK), MAX_GRAPHED_CHUNKS), text.embed_tokens.weight.device)
        except RuntimeError as e:  # a capture the device refuses
            failures.append(f"graphed scan: capture failed ({e})")
        else:
            why = scan.prove_each() or prove(text, scan, capacity)
            if why is None:
                return scan, f"graphed scan up to {max(scan.graphs)} chunks, proven"
            failures.append(f"graphed scan: {why}")
    proofs = model.extra.setdefault("prefill_proofs", {}) if hasattr(model, "extra") else {}
    if "eager" not in proofs:
        proofs["eager"] = prove(text, padded_rule, capacity)
    if proofs["eager"] is None:
        return padded_rule, "; ".join(failures + ["eager scan, proven"])
    return None, "; ".join(failures + [f"eager scan: {proofs['eager']}", "the control's forward"])


def prove(text_model, rule, capacity: int) -> str | None:
    """None if ``prefill_forward`` with ``rule`` equals the control's forward bit for bit (final
    hidden states and every cache tensor) on random prompts of the ``PROOF_LENGTHS`` that fit,
    else what differed."""
    config = text_model.config
    device = text_model.embed_tokens.weight.device
    gen = torch.Generator().manual_seed(0)
    for length in (n for n in PROOF_LENGTHS if n < capacity):
        ids = torch.randint(3, config.vocab_size, (1, length), generator=gen).to(device)
        want_hidden, want_cache = control_forward(text_model, ids)
        got_hidden, got_cache = prefill_forward(text_model, ids, rule)
        if not torch.equal(got_hidden, want_hidden):
            return f"hidden states differ at {length} tokens"
        pairs = zip(cache_tensors(got_cache, config), cache_tensors(want_cache, config))
        if not all(torch.equal(g, w) for g, w in pairs):
            return f"the cache differs at {length} tokens"
    return None


@torch.inference_mode()
def control_forward(text_model, ids: torch.Tensor):
    """transformers' own forward over a prompt into an empty cache: (final hidden states, cache)."""
    cache = DynamicCache(config=text_model.config)
    return text_model(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state, cache


def cache_tensors(cache, config) -> list[torch.Tensor]:
    """Every state a prefill leaves: K/V of attention layers, conv and recurrent states of the others."""
    out = []
    for i, kind in enumerate(config.layer_types[:config.num_hidden_layers]):
        layer = cache.layers[i]
        out += [layer.conv_states[0], layer.recurrent_states[0]] if kind == "linear_attention" else [layer.keys,
                                                                                                      layer.values]
    return out
