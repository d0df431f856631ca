"""The MTP head's wiring, checked on named checkpoint weights against a hand computation.

Every weight here is read straight from fixtures/tiny's safetensors files by its checkpoint name
(``mtp.fc.weight``, ``mtp.layers.0.self_attn.q_proj.weight``, ...), never through the module, so a
loader that put a tensor in the wrong slot, or a head that wires its inputs differently from the
documented convention (core/mtp.py), fails here:

  fused  = fc(cat([RMSNorm_e(embed(t+1)), RMSNorm_h(h_t)]))     embedding half FIRST
  h_t    = the backbone's last hidden state AFTER its final norm (what feeds lm_head)
  RMSNorm(x) = x * rsqrt(mean(x^2) + eps) * (1 + w)               zero-centred, statistic in fp32
  draft  = lm_head(mtp.norm(layer(fused)))                        shared embed_tokens and lm_head
  the head's row for (h_t, token t+1) sits at RoPE position t; chained steps at t+1, t+2, ...

The tiny fixture gives every norm a small random weight, so swapped norms are distinguishable.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from core.models import TINY_DIR
from core.mtp import new_mtp_cache

PROMPT = [319, 284, 75, 404, 289, 345, 456, 284, 351, 315, 41, 310]


@pytest.fixture(autouse=True)
def _no_autograd():
    """The loaded modules' parameters require grad; nothing here needs it."""
    with torch.inference_mode():
        yield


@pytest.fixture(scope="module")
def W() -> dict[str, torch.Tensor]:
    """Checkpoint tensors by their names in the released layout."""
    index = json.loads((TINY_DIR / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(TINY_DIR / shard), framework="pt") as fh:
            for key in fh.keys():
                out[key] = fh.get_tensor(key)
    return out


@pytest.fixture(scope="module")
def cfg(tiny):
    c = tiny.text_config
    return {
        "eps": c.rms_norm_eps,
        "heads": c.num_attention_heads,
        "kv_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "theta": c.rope_parameters["rope_theta"],
        "rot_dim": int(c.head_dim * c.rope_parameters["partial_rotary_factor"]),
    }


@pytest.fixture(scope="module")
def states(tiny):
    """Backbone hidden states on PROMPT: post-norm (feeds lm_head) and pre-norm (input of the norm)."""
    captured = {}
    hook = tiny.backbone.model.norm.register_forward_hook(lambda mod, args, out: captured.update(pre=args[0]))
    try:
        with torch.inference_mode():
            ids = torch.tensor([PROMPT])
            post = tiny.backbone.model(input_ids=ids).last_hidden_state
            logits = tiny.backbone(input_ids=ids).logits
    finally:
        hook.remove()
    return {"post": post, "pre": captured["pre"], "logits": logits}


# --------------------------------------------------------------------------- hand computation


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm as the checkpoint defines it: statistic in fp32, scale (1 + w)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(x.dtype)


def hand_fuse(W, cfg, token_ids, hidden, order="embed-first", norms="right"):
    e_in = F.embedding(token_ids, W["model.language_model.embed_tokens.weight"])
    w_e, w_h = W["mtp.pre_fc_norm_embedding.weight"], W["mtp.pre_fc_norm_hidden.weight"]
    if norms == "swapped":
        w_e, w_h = w_h, w_e
    e, h = rms(e_in, w_e, cfg["eps"]), rms(hidden, w_h, cfg["eps"])
    parts = [e, h] if order == "embed-first" else [h, e]
    return F.linear(torch.cat(parts, -1), W["mtp.fc.weight"])


def rotary(x: torch.Tensor, positions: list[int], cfg) -> torch.Tensor:
    """Partial rotary embedding by hand: the first rot_dim dims of each head rotate (rotate-half
    convention), the rest pass through. x [1, heads, T, head_dim]."""
    d = cfg["rot_dim"]
    inv_freq = 1.0 / (cfg["theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.tensor(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    rot, keep = x[..., :d], x[..., d:]
    half = rot.shape[-1] // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    return torch.cat([rot * cos + rotated * sin, keep], -1)


def hand_layer(W, cfg, x: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """mtp.layers.0 (gated full attention + SwiGLU MLP) over rows x [1,T,H], causal, by hand."""
    p = "mtp.layers.0."
    T, nh, nkv, hd = x.shape[1], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    a = rms(x, W[p + "input_layernorm.weight"], cfg["eps"])
    q, gate = F.linear(a, W[p + "self_attn.q_proj.weight"]).view(1, T, nh, 2 * hd).chunk(2, dim=-1)
    gate = gate.reshape(1, T, nh * hd)
    q = rms(q, W[p + "self_attn.q_norm.weight"], cfg["eps"]).transpose(1, 2)
    k = rms(F.linear(a, W[p + "self_attn.k_proj.weight"]).view(1, T, nkv, hd), W[p + "self_attn.k_norm.weight"],
            cfg["eps"]).transpose(1, 2)
    v = F.linear(a, W[p + "self_attn.v_proj.weight"]).view(1, T, nkv, hd).transpose(1, 2)
    q, k = rotary(q, positions, cfg), rotary(k, positions, cfg)
    k = k.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * hd ** -0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    attn = (probs @ v.float()).to(x.dtype).transpose(1, 2).reshape(1, T, nh * hd)
    attn = attn * torch.sigmoid(gate)
    x = x + F.linear(attn, W[p + "self_attn.o_proj.weight"])
    m = rms(x, W[p + "post_attention_layernorm.weight"], cfg["eps"])
    mlp = F.linear(F.silu(F.linear(m, W[p + "mlp.gate_proj.weight"])) * F.linear(m, W[p + "mlp.up_proj.weight"]),
                   W[p + "mlp.down_proj.weight"])
    return x + mlp


def hand_head(W, cfg, token_ids, hidden, positions, **variant) -> torch.Tensor:
    """Normed head output for rows (hidden[i], token_ids[i]) at ``positions`` (causal among them)."""
    fused = hand_fuse(W, cfg, token_ids, hidden, **variant)
    return rms(hand_layer(W, cfg, fused, positions), W["mtp.norm.weight"], cfg["eps"])


def hand_logits(W, out: torch.Tensor) -> torch.Tensor:
    return F.linear(out, W["lm_head.weight"])


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# A one-row head call attends to one key (softmax weight exactly 1), so the hand computation above
# reproduces it bit for bit. With several rows, SDPA's bf16 arithmetic and the fp32 softmax here
# round differently by a few bf16 ulps (TOL); every wiring mistake moves the result by > WRONG.
TOL = 0.05
WRONG = 0.1


# --------------------------------------------------------------------------- names and sharing


def test_checkpoint_names_match_the_head(tiny, W):
    ckpt = {k[4:] for k in W if k.startswith("mtp.")}
    assert ckpt == set(tiny.mtp.state_dict())
    for name in ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "fc.weight", "norm.weight"):
        assert name in ckpt
    # the head owns no embedding or output projection: both are the backbone's
    assert not any("embed" in k.replace("pre_fc_norm_embedding", "") or "lm_head" in k for k in ckpt)
    h = tiny.text_config.hidden_size
    assert tuple(W["mtp.fc.weight"].shape) == (h, 2 * h)
    # layers.0 is gated full attention: q_proj emits query and gate
    assert tiny.mtp.layers[0].block_type == "full_attention"
    heads, hd = tiny.text_config.num_attention_heads, tiny.text_config.head_dim
    assert tuple(W["mtp.layers.0.self_attn.q_proj.weight"].shape) == (2 * heads * hd, h)
    # the norms are distinguishable (the fixture makes them so)
    assert not torch.equal(W["mtp.pre_fc_norm_embedding.weight"], W["mtp.pre_fc_norm_hidden.weight"])


def test_hidden_state_is_post_norm_and_feeds_lm_head(tiny, W, states, cfg):
    post, pre = states["post"], states["pre"]
    assert torch.equal(post, rms(pre, W["model.language_model.norm.weight"], cfg["eps"]))
    assert torch.equal(hand_logits(W, post), states["logits"])
    assert maxdiff(pre, post) > WRONG


# --------------------------------------------------------------------------- the fuse step


def test_fuse_is_embedding_first_with_named_norms(tiny, W, cfg, states):
    t = len(PROMPT) - 2
    tok, hidden = torch.tensor([[PROMPT[t + 1]]]), states["post"][:, t:t + 1]
    with torch.inference_mode():
        got = tiny.mtp.fuse(tiny.backbone.model.embed_tokens(tok), hidden)
    assert torch.equal(got, hand_fuse(W, cfg, tok, hidden)), "fuse differs from fc(cat[norm_e(e), norm_h(h)])"
    # each plausible mistake gives a clearly different result
    assert maxdiff(got, hand_fuse(W, cfg, tok, hidden, order="hidden-first")) > WRONG
    assert maxdiff(got, hand_fuse(W, cfg, tok, hidden, norms="swapped")) > WRONG
    assert maxdiff(got, hand_fuse(W, cfg, tok, states["pre"][:, t:t + 1])) > WRONG


def test_norm_is_zero_centred(tiny, W, cfg):
    """The scale is (1 + w) (zero-centred), not w (the Llama convention)."""
    x = torch.randn(1, 3, tiny.text_config.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():
        got = tiny.mtp.pre_fc_norm_hidden(x)
    assert torch.equal(got, rms(x, W["mtp.pre_fc_norm_hidden.weight"], cfg["eps"]))
    plain = (x.float() * W["mtp.pre_fc_norm_hidden.weight"].float()
             * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + cfg["eps"])).to(x.dtype)
    assert maxdiff(got, plain) > WRONG


# --------------------------------------------------------------------------- the whole head


def test_head_and_draft_logits_match_hand_computation(tiny, W, cfg, states):
    t = len(PROMPT) - 2
    tok, hidden = torch.tensor([[PROMPT[t + 1]]]), states["post"][:, t:t + 1]
    bb = tiny.backbone
    with torch.inference_mode():
        out = tiny.mtp(hidden, tok, torch.tensor([t]), bb, cache=new_mtp_cache(tiny.mtp))
        logits = bb.lm_head(out)
    want = hand_head(W, cfg, tok, hidden, [t])
    assert torch.equal(out, want), maxdiff(out, want)
    assert torch.equal(logits, hand_logits(W, want))
    # the same computation with each wiring mistake is far off
    for variant in ({"order": "hidden-first"}, {"norms": "swapped"}):
        assert maxdiff(out, hand_head(W, cfg, tok, hidden, [t], **variant)) > WRONG, variant
    assert maxdiff(out, hand_head(W, cfg, tok, states["pre"][:, t:t + 1], [t])) > WRONG
    # and the head itself notices which hidden state it is given
    with torch.inference_mode():
        out_pre = tiny.mtp(states["pre"][:, t:t + 1], tok, torch.tensor([t]), bb, cache=new_mtp_cache(tiny.mtp))
    assert maxdiff(out, out_pre) > WRONG


def test_draft_logits_use_shared_embedding_and_lm_head(tiny, W, cfg, states):
    """Perturbing the backbone's embed_tokens / lm_head changes the head's draft; they are shared."""
    import copy

    t = len(PROMPT) - 2
    tok, hidden = torch.tensor([[PROMPT[t + 1]]]), states["post"][:, t:t + 1]
    bb = copy.deepcopy(tiny.backbone)
    with torch.inference_mode():
        base = bb.lm_head(tiny.mtp(hidden, tok, torch.tensor([t]), bb, cache=new_mtp_cache(tiny.mtp)))
        bb.model.embed_tokens.weight[PROMPT[t + 1]].mul_(-1)
        flipped = bb.lm_head(tiny.mtp(hidden, tok, torch.tensor([t]), bb, cache=new_mtp_cache(tiny.mtp)))
        assert maxdiff(base, flipped) > WRONG
        bb.model.embed_tokens.weight[PROMPT[t + 1]].mul_(-1)
        bb.lm_head.weight.mul_(2)
        doubled = bb.lm_head(tiny.mtp(hidden, tok, torch.tensor([t]), bb, cache=new_mtp_cache(tiny.mtp)))
    assert torch.equal(doubled, base * 2)


# --------------------------------------------------------------------------- positions


def chained(tiny, hidden, token, start: int, steps: int, offsets=None):
    """Chained drafting as spec-naive does it: one head cache, step i at RoPE position start+i
    (or start+offsets[i]), each step fed the previous step's normed output and argmax token."""
    head, bb = tiny.mtp, tiny.backbone
    cache = new_mtp_cache(head)
    outs, tokens = [], []
    offsets = offsets or list(range(steps))
    with torch.inference_mode():
        for i in range(steps):
            hidden = head(hidden, token, torch.tensor([start + offsets[i]]), bb, cache=cache)
            token = bb.lm_head(hidden).argmax(-1).view(1, 1)
            outs.append(hidden)
            tokens.append(token)
    return outs, tokens


def hand_keys(W, cfg, tokens: torch.Tensor, hidden: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """The MTP layer's rotated keys for each row, one row at a time: [1, kv_heads, T, head_dim]."""
    p = "mtp.layers.0."
    rows = []
    for i, pos in enumerate(positions):
        x = hand_fuse(W, cfg, tokens[:, i:i + 1], hidden[:, i:i + 1])
        a = rms(x, W[p + "input_layernorm.weight"], cfg["eps"])
        k = rms(F.linear(a, W[p + "self_attn.k_proj.weight"]).view(1, 1, cfg["kv_heads"], cfg["head_dim"]),
                W[p + "self_attn.k_norm.weight"], cfg["eps"]).transpose(1, 2)
        rows.append(rotary(k, [pos], cfg))
    return torch.cat(rows, dim=2)


def test_chained_steps_rotate_at_documented_positions(tiny, W, cfg, states):
    """The head's KV cache after three chained steps holds exactly the keys rotated at positions
    t, t+1, t+2 (bitwise), not t+1.. (the other plausible convention); and the outputs match the
    hand computation of three causal rows at those positions."""
    t = len(PROMPT) - 2
    tok, hidden = torch.tensor([[PROMPT[t + 1]]]), states["post"][:, t:t + 1]
    head, bb = tiny.mtp, tiny.backbone
    cache = new_mtp_cache(head)
    outs, toks, h, k = [], [], hidden, tok
    for i in range(3):
        h = head(h, k, torch.tensor([t + i]), bb, cache=cache)
        k = bb.lm_head(h).argmax(-1).view(1, 1)
        outs.append(h)
        toks.append(k)
    # rows: (h_t, token t+1), (out_0, draft_1), (out_1, draft_2)
    row_hidden = torch.cat([hidden, outs[0], outs[1]], dim=1)
    row_tokens = torch.cat([tok, toks[0], toks[1]], dim=1)
    cached = cache.layers[0].keys
    assert cached.shape == (1, cfg["kv_heads"], 3, cfg["head_dim"])
    assert torch.equal(cached, hand_keys(W, cfg, row_tokens, row_hidden, [t, t + 1, t + 2]))
    shifted = hand_keys(W, cfg, row_tokens, row_hidden, [t + 1, t + 2, t + 3])
    assert maxdiff(cached, shifted) > WRONG
    # only the first rot_dim dims of each head rotate
    assert torch.equal(cached[..., cfg["rot_dim"]:], shifted[..., cfg["rot_dim"]:])

    got = torch.cat(outs, dim=1)
    assert maxdiff(got, hand_head(W, cfg, row_tokens, row_hidden, [t, t + 1, t + 2])) < TOL
    # a different spacing between chained steps changes what the later steps compute
    outs_skewed, _ = chained(tiny, hidden, tok, t, 2, offsets=[0, 2])
    assert torch.equal(outs_skewed[0], outs[0])
    assert not torch.equal(outs_skewed[1], outs[1])
    # a single row with a fresh cache attends only to itself: its position cannot matter
    assert torch.equal(hand_head(W, cfg, tok, hidden, [t]), hand_head(W, cfg, tok, hidden, [t + 7]))


def test_absolute_position_shift_pins_current_behaviour(tiny, W, cfg, states):
    """RoPE depends on relative positions only, so starting the chain at t+1 instead of t changes
    the result by rounding at most; both match the hand computation at their own positions."""
    t = len(PROMPT) - 2
    tok, hidden = torch.tensor([[PROMPT[t + 1]]]), states["post"][:, t:t + 1]
    at_t, toks = chained(tiny, hidden, tok, t, 2)
    at_t1, toks1 = chained(tiny, hidden, tok, t + 1, 2)
    assert [int(x) for x in toks] == [int(x) for x in toks1]
    assert maxdiff(at_t[1], at_t1[1]) < TOL
    rows_h = torch.cat([hidden, at_t[0]], 1)
    rows_t = torch.cat([tok, toks[0]], 1)
    assert maxdiff(at_t1[1], hand_head(W, cfg, rows_t, rows_h, [t + 1, t + 2])[:, 1:]) < TOL


def test_multi_row_call_is_causal_and_equals_chained_steps(tiny, states):
    """A T-row head call (the causal mask) equals T chained one-row calls, within rounding."""
    t = len(PROMPT) - 4
    post = states["post"]
    hidden = post[:, t:t + 3]
    toks = torch.tensor([PROMPT[t + 1:t + 4]])
    head, bb = tiny.mtp, tiny.backbone
    with torch.inference_mode():
        multi = head(hidden, toks, torch.arange(t, t + 3), bb, cache=new_mtp_cache(head))
        cache = new_mtp_cache(head)
        single = torch.cat([head(hidden[:, i:i + 1], toks[:, i:i + 1], torch.tensor([t + i]), bb, cache=cache)
                            for i in range(3)], 1)
        first_alone = head(hidden[:, :1], toks[:, :1], torch.tensor([t]), bb, cache=new_mtp_cache(head))
    assert maxdiff(multi, single) < TOL
    assert maxdiff(multi[:, :1], first_alone) < TOL  # row 0 does not see rows 1, 2


def test_spec_naive_feeds_the_documented_inputs(tiny, states, monkeypatch):
    """spec-naive's first draft: hidden = post-norm state of the last prompt token (position
    P-1), token = the backbone's first emitted token, head position P-1; then P, P+1."""
    from decoders.spec_naive import SpecNaiveDecoder

    calls = []
    real = type(tiny.mtp).forward

    def spy(self, hidden, token_ids, positions, backbone, cache=None):
        out = real(self, hidden, token_ids, positions, backbone, cache=cache)
        calls.append((hidden.clone(), token_ids.clone(), positions.tolist(), out.clone()))
        return out

    monkeypatch.setattr(type(tiny.mtp), "forward", spy)
    dec = SpecNaiveDecoder(k=3)
    dec.prepare(tiny)
    result = dec.decode(PROMPT, 6)
    P = len(PROMPT)
    assert len(calls) >= 3
    (h0, tok0, pos0, out0), (h1, tok1, pos1, _), (_, _, pos2, _) = calls[:3]
    assert torch.equal(h0, states["post"][:, -1:])
    assert int(tok0) == result.tokens[0] == int(states["logits"][0, -1].argmax())
    assert (pos0, pos1, pos2) == ([P - 1], [P], [P + 1])
    assert torch.equal(h1, out0)  # chained: the head's own normed output
    assert int(tok1) == int(tiny.backbone.lm_head(out0).argmax())
