"""Start-up proof of which op classes may be batched over a verify window, and over how many rows.

The exact runtime computes a window of w tokens in one pass, yet every logit must be bit-identical
to what the serial control computes one token at a time. That holds for an op batched over w
rows only if the kernel the library picks for w rows computes each row exactly as it does for one
row: true on an H200 for most GEMMs up to 16 rows, false for the 4096-wide RMSNorm mean from 2
rows on in the deterministic configuration (bench/NOTES.md). Those facts belong to a GPU, library
build and shape, so they are measured here, at start-up, on the actual device, dtype and shapes
(the model's own weight matrices, random activations), and the window batches only where proven
and loops rows elsewhere. The findings go into the run header.

A proof has to be sensitive enough to see a rare difference. Where the op's result is fp32 (the
norms' statistics) it is compared in fp32, where another summation order shows in most rows.
Where it is bf16 (GEMMs, the conv) another order changes only about one element in 10^4, so the
proof compares tens of thousands of elements per row count, not one random trial.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from decoders.runtime import gate_up as gate_up_layout
from decoders.runtime import layers as L


@dataclass
class Calibration:
    """Largest row count proven bit-equal to 1-row results, per op class (1 = loop rows)."""

    max_rows: int
    gemm: dict[str, int] = field(default_factory=dict)  # "KxN" -> rows
    hidden_mean: int = 1  # RMSNorm's statistic over hidden_size, rows counted in tokens
    head_norm: int = 1  # q_norm / k_norm over head_dim, rows counted in tokens
    gated_norm: int = 1  # Gated-DeltaNet output norm over head_v_dim, rows counted in tokens
    l2norm: int = 1  # q/k L2 norm in the recurrent rule, tokens
    readout: int = 1  # the recurrence's output sum over dk, from each row's captured state, tokens
    # q and k L2-normed as one [1, 2*Hv, tokens, dk] tensor against each alone per token; tokens,
    # 0 = never (the fused tensor's rsqrt also sees another size, so it needs `elementwise` too)
    qk_l2norm: int = 0
    conv_window: bool = False  # depthwise conv over the window == per-token update rule
    kv_view_ok: bool = False  # q_len=1 SDPA over a view of the static KV buffer == over a contiguous copy
    # the MLP's gate and up projections as one GEMM over their stacked weight [2I, H] (gate_up.py)
    # against each alone on one row, and act(gate) * up from its halves; tokens, 0 = never
    gate_up: int = 0
    # Transcendental elementwise ops (exp, sigmoid, softplus, silu, rsqrt) give each element the
    # same bits whatever the tensor's size and layout. True of CUDA kernels; CPU kernels switch
    # between vectorised and scalar code by size and stride, so there it must be proven too.
    elementwise: bool = False
    device: str = ""
    forced: bool = False  # set by tests that override the proof

    def gemm_rows(self, linear: torch.nn.Module) -> int:
        return self.gemm.get(gemm_key(linear.in_features, linear.out_features), 1)

    def to_json(self) -> dict:
        return asdict(self)

    def __post_init__(self):
        if not self.elementwise:  # the norms' rsqrt then has to run row by row as well
            self.head_norm = self.gated_norm = self.l2norm = 1
            self.qk_l2norm = 0

    @classmethod
    def serial_only(cls, max_rows: int = 8) -> "Calibration":
        """Nothing batched: every row computed alone (what an unproven device must do)."""
        return cls(max_rows=max_rows, forced=True, device="forced:serial-only")


def gemm_key(k: int, n: int) -> str:
    return f"{k}x{n}"


def _proven_rows(max_rows: int, same_for: callable) -> int:
    """Largest m such that same_for(m') holds for every m' <= m (rows found equal one by one)."""
    proven = 0
    for m in range(1, max_rows + 1):
        if not same_for(m):
            break
        proven = m
    return max(proven, 1)


def _proven_prefix_rows(fn, xs: list, dim: int, max_rows: int) -> int:
    """Largest m such that, for every input x, ``fn`` over x's first m tokens (along ``dim``)
    equals, token for token, ``fn`` over each of those tokens alone."""
    singles = [torch.cat([fn(x.narrow(dim, i, 1).contiguous()) for i in range(max_rows)], dim=dim) for x in xs]
    return _proven_rows(max_rows, lambda m: m == 1 or all(
        torch.equal(fn(x.narrow(dim, 0, m).contiguous()), one.narrow(dim, 0, m)) for x, one in zip(xs, singles)))


def calibrate(model, max_rows: int = 8, seed: int = 0) -> Calibration:
    """Prove row-invariance for every op class the window batches, on model's device and shapes.
    The proof depends only on the model's weights, shapes and device, so it is made once per
    loaded model (and MTP head) and each caller gets its own copy."""
    cache = model.extra.setdefault("calibrations", {}) if hasattr(model, "extra") else {}
    key = (max_rows, seed, id(model.mtp))
    if key not in cache:
        cache[key] = (model.mtp, _calibrate(model, max_rows, seed))  # holding the head keeps its id unique
    return copy.deepcopy(cache[key][1])


@torch.inference_mode()
def _calibrate(model, max_rows: int, seed: int) -> Calibration:
    lm = model.backbone
    dev, dtype = model.device, lm.lm_head.weight.dtype
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=dev, dtype=dt)

    cal = Calibration(max_rows=max_rows, device=str(dev), elementwise=True)
    # GEMMs: every distinct (in, out) shape among the model's Linear layers, with their real weights.
    linears = {}
    for module in list(lm.modules()) + (list(model.mtp.modules()) if model.mtp is not None else []):
        if isinstance(module, torch.nn.Linear):
            linears.setdefault(gemm_key(module.in_features, module.out_features), module)
    for key, lin in sorted(linears.items()):
        cal.gemm[key] = _gemm_rows(lin, max_rows, rand)

    # Norms: batching one is exact iff its fp32 statistic is, since what follows is elementwise.
    # The statistic is compared in fp32, where any change of summation order shows in most rows;
    # comparing the bf16 norm output instead hides all but ~1 in 10^4 of them, so a kernel that
    # flips a real row can pass. Each is the exact call layers.py makes, on its exact shape and layout.
    def mean_last(t):
        return t.mean(-1, keepdim=True)

    cfg = lm.config
    cal.hidden_mean = _reduction_rows(mean_last, (1, max_rows, cfg.hidden_size), 1, max_rows, rand)
    attn = next((ly.self_attn for ly in lm.model.layers if hasattr(ly, "self_attn")), None)
    if attn is not None:
        cal.head_norm = min(_reduction_rows(mean_last, (1, max_rows, heads, attn.head_dim), 1, max_rows, rand)
                            for heads in {cfg.num_attention_heads, cfg.num_key_value_heads})
        cal.kv_view_ok = _kv_view_equal(attn, lm.config, rand)

    gdn = next((ly.linear_attn for ly in lm.model.layers if hasattr(ly, "linear_attn")), None)
    if gdn is not None:
        hv, dv, dk = gdn.num_v_heads, gdn.head_v_dim, gdn.head_k_dim
        # Qwen3_5RMSNormGated over [tokens * Hv, dv] rows
        cal.gated_norm = _reduction_rows(lambda t: mean_last(t.reshape(-1, dv)).view(t.shape[0], hv, 1),
                                         (max_rows, hv, dv), 0, max_rows, rand)
        # l2norm's sum of squares over [1, Hv, tokens, dk]
        cal.l2norm = _reduction_rows(_sum_last, (1, hv, max_rows, dk), 2, max_rows, rand)
        # the recurrence's readout (state * q).sum(-2), over the captured states [tokens, 1, Hv, dk, dv]
        cal.readout = _reduction_rows(lambda t: t.sum(-2), (max_rows, 1, hv, dk, dv), 0, max_rows, rand)
        cal.qk_l2norm = _qk_l2norm_rows(hv, dk, max_rows, rand)
        cal.conv_window = _conv_window_equal(gdn, max_rows, rand)
    cal.elementwise = _elementwise_equal(model, max_rows, gen)
    cal.__post_init__()
    # after the elementwise proof: the stacked path's activation runs as ``cal`` says
    mlp = next((ly.mlp for ly in lm.model.layers if gate_up_layout.stackable(ly.mlp)), None)
    if mlp is not None:
        cal.gate_up = _gate_up_rows(mlp, max_rows, rand, cal)
    return cal


# Output elements compared per row count. A GEMM kernel chosen for m rows that sums in another
# order than the 1-row kernel changes a bf16 output only when the fp32 difference crosses a
# rounding boundary: about 1 element in 10^4. One random trial of a 4096 -> 32 projection
# (in_proj_a / in_proj_b on the 9B shape) compares 256 elements and would pass such a kernel
# about 97% of the time, while a 256-token decode feeds it ~400,000 real elements. 2^16 elements
# per row count detect a 10^-4 flip rate with probability 1 - e^-6.5.
GEMM_ELEMENTS_PER_ROW_COUNT = 1 << 16
GEMM_MAX_TRIALS = 4096


def gemm_trials(out_features: int) -> int:
    return max(1, min(GEMM_MAX_TRIALS, -(-GEMM_ELEMENTS_PER_ROW_COUNT // (2 * out_features))))


def _gemm_rows(lin: torch.nn.Linear, max_rows: int, rand) -> int:
    """Largest m whose m-row products equal the 1-row products row for row, in every trial."""
    xs = [rand(1, max_rows, lin.in_features) for _ in range(gemm_trials(lin.out_features))]
    return _proven_prefix_rows(lin, xs, 1, max_rows)


def _gate_up_rows(mlp, max_rows: int, rand, cal: Calibration) -> int:
    """Largest m such that, for every m' <= m, one GEMM over the stacked weight on m' rows equals,
    row for row, the gate and up GEMMs each on one row (what the control computes per token), and
    ``layers.gated_up`` from its halves equals act(gate) * up of those rows; 0 if not even for one
    row. The weight is a fresh [2I, H] copy: the same shape, strides and alignment as the buffer."""
    gate, up = mlp.gate_proj, mlp.up_proj
    weight = torch.cat([gate.weight, up.weight])
    xs = [rand(1, max_rows, gate.in_features) for _ in range(gemm_trials(weight.shape[0]))]
    refs = []
    for x in xs:
        halves = [(gate(x[:, i:i + 1].contiguous()), up(x[:, i:i + 1].contiguous())) for i in range(max_rows)]
        refs.append((torch.cat([torch.cat(h, dim=-1) for h in halves], dim=1),
                     torch.cat([mlp.act_fn(g) * u for g, u in halves], dim=1)))

    def same(m: int) -> bool:
        for x, (product, gated) in zip(xs, refs):
            xm = x[:, :m].contiguous()
            if not torch.equal(L.gate_up_product(xm, weight), product[:, :m]):
                return False
            out = L.gated_up(mlp, xm, weight, cal)
            if not (out.is_contiguous() and torch.equal(out, gated[:, :m])):  # down_proj reads it as the serial step's
                return False
        return True

    return _proven_rows(max_rows, same) if same(1) else 0


REDUCTION_TRIALS = 16


def _reduction_rows(reduce, shape, token_dim: int, max_rows: int, rand, trials: int = REDUCTION_TRIALS) -> int:
    """Largest m such that ``reduce`` over m tokens (along token_dim of a contiguous fp32 tensor)
    equals, token for token, ``reduce`` over each token alone, in every trial."""
    return _proven_prefix_rows(reduce, [rand(*shape, dt=torch.float32) for _ in range(trials)], token_dim, max_rows)


def _sum_last(t: torch.Tensor) -> torch.Tensor:
    return t.sum(-1, keepdim=True)  # l2norm's statistic, as layers.l2norm computes it


def _qk_l2norm_rows(hv: int, dk: int, max_rows: int, rand, trials: int = REDUCTION_TRIALS,
                    reduce=_sum_last) -> int:
    """Largest token count m for which the sum of squares over q and k stacked as one
    [1, 2*hv, m, dk] tensor equals, for every token and each of q and k, the serial step's sum over
    that one [1, hv, 1, dk] tensor (0 if not even for one token)."""
    def same(m: int) -> bool:
        for _ in range(trials):
            qk = rand(1, 2 * hv, m, dk, dt=torch.float32)
            whole = reduce(qk)
            for h in (slice(0, hv), slice(hv, 2 * hv)):
                for i in range(m):
                    one = reduce(qk[:, h, i:i + 1].contiguous())
                    if not torch.equal(one, whole[:, h, i:i + 1]):
                        return False
        return True

    return _proven_rows(max_rows, same) if same(1) else 0


def _elementwise_equal(model, max_rows: int, gen, trials: int = 32) -> bool:
    """Each transcendental op the window batches, on every row width it meets, batched over rows
    (and over the transposed layout the recurrence uses) vs applied to one contiguous row."""
    cfg = model.backbone.config
    widths = {cfg.linear_num_value_heads, cfg.intermediate_size, cfg.hidden_size,
              cfg.num_attention_heads * cfg.head_dim, 1}
    fns = {"exp": torch.exp, "sigmoid": torch.sigmoid, "softplus": F.softplus, "silu": F.silu,
           "rsqrt": lambda t: torch.rsqrt(t.abs() + 1e-6)}
    dev = model.device
    for name, fn in fns.items():
        for dtype in (torch.float32, torch.bfloat16):
            for width in sorted(widths):
                for _ in range(trials):
                    x = (torch.randn(max_rows, width, generator=gen) * 4).to(device=dev, dtype=dtype)
                    whole = fn(x)
                    if not all(torch.equal(whole[i], fn(x[i:i + 1].contiguous())[0]) for i in range(max_rows)):
                        return False
                    cols = fn(x.t().contiguous())  # [width, rows]: a per-token column of the recurrence
                    if not all(torch.equal(cols[:, i], fn(x[i].contiguous())) for i in range(max_rows)):
                        return False
    return True


def _conv_window_equal(gdn, max_rows: int, rand) -> bool:
    """The depthwise conv over [state ++ window] vs the serial update rule applied token by token.
    Its outputs are bf16, so like a GEMM's they show another summation order only rarely: as many
    elements are compared per window size as in a GEMM proof."""
    k, c = gdn.conv_kernel_size, gdn.conv_dim
    weight = gdn.conv1d.weight.squeeze(1).unsqueeze(1)

    def conv(t):
        return F.conv1d(t, weight, gdn.conv1d.bias, padding=0, groups=c)

    for _ in range(gemm_trials(c)):
        cat = rand(1, c, k + max_rows)  # state (k) ++ max_rows tokens; token i reads cat[i : i+k+1]
        singles = torch.cat([conv(cat[:, :, i:i + k + 1].contiguous())[:, :, -1:] for i in range(max_rows)], dim=-1)
        if not all(torch.equal(conv(cat[:, :, :k + m])[:, :, -m:], singles[:, :, :m]) for m in range(2, max_rows + 1)):
            return False
    return True


def _kv_view_equal(attn, config, rand) -> bool:
    """q_len=1 SDPA over a prefix view of a larger buffer vs over a contiguous tensor."""
    kvh, hd = config.num_key_value_heads, attn.head_dim
    cap = 96
    kbuf, vbuf = rand(1, kvh, cap, hd), rand(1, kvh, cap, hd)
    for length in (1, 7, 33, 64, 95):
        q = rand(1, config.num_attention_heads, 1, hd)
        a = L.serial_sdpa(attn, q, kbuf[:, :, :length], vbuf[:, :, :length])
        b = L.serial_sdpa(attn, q, kbuf[:, :, :length].contiguous(), vbuf[:, :, :length].contiguous())
        if not torch.equal(a, b):
            return False
    return True
