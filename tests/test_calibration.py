"""The calibration's proofs must see rare differences, not only frequent ones.

A batched kernel that sums in another order than the 1-row kernel changes a bf16 output only about
once in 10^4 elements, and an fp32 statistic in many rows but not all. These fakes reproduce both
(deterministically) and the proofs must refuse to batch them.
"""
from __future__ import annotations

import copy
import dataclasses

import torch

from decoders.runtime import calibration as C


def _rand(seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, dt=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dt)

    return rand


class RarelyDifferentLinear(torch.nn.Linear):
    """Multi-row products differ from 1-row products in one bf16 step, in ~1 of 10^4 elements,
    from ``from_rows`` rows on."""

    def __init__(self, k, n, from_rows=2, rate=1e-4, seed=1):
        super().__init__(k, n, bias=False, dtype=torch.bfloat16)
        self.from_rows, self.rate = from_rows, rate
        self.flips = torch.Generator().manual_seed(seed)  # drawn only on calls of from_rows rows or more

    def forward(self, x):
        # the base product is row by row, so it is row-invariant by construction: some CPUs' bf16
        # GEMM kernels are not (their multi-row kernel sums in another order), and the fake's own
        # differences must be the only ones
        out = torch.cat([super(RarelyDifferentLinear, self).forward(x[..., i:i + 1, :]) for i in range(x.shape[-2])], dim=-2)
        if x.shape[-2] >= self.from_rows:
            hit = torch.rand(out.shape, generator=self.flips) < self.rate
            out = torch.where(hit, torch.nextafter(out, torch.full_like(out, float("inf"))), out)
        return out


def test_gemm_proof_catches_a_one_in_ten_thousand_difference():
    assert C._gemm_rows(RarelyDifferentLinear(64, 32), 8, _rand()) == 1
    assert C._gemm_rows(RarelyDifferentLinear(64, 32, from_rows=5), 8, _rand()) == 4


def test_gemm_proof_accepts_an_invariant_gemm():
    lin = RarelyDifferentLinear(64, 32, rate=0.0)
    assert C._gemm_rows(lin, 8, _rand()) == 8


def test_calibration_refuses_to_batch_a_model_gemm_that_differs_rarely(tiny):
    """The whole start-up proof, on a model whose lm_head (the only 64x512 GEMM) computes 5-row
    and larger products that differ from its 1-row products in ~1 of 10^4 elements: the proof
    must find the difference and batch that GEMM over at most 4 rows (rows 1..4 are equal by
    construction), while the model's other GEMMs keep what the plain model's proof gives them.
    The flips' seed is one whose first differences come late: a proof comparing one trial per row
    count (GEMM_ELEMENTS_PER_ROW_COUNT = 1024) misses them all and batches 8 rows."""
    backbone = copy.deepcopy(tiny.backbone)
    head = backbone.lm_head
    rare = RarelyDifferentLinear(head.in_features, head.out_features, from_rows=5, seed=4)
    with torch.no_grad():
        rare.weight.copy_(head.weight)
    backbone.lm_head = rare
    model = dataclasses.replace(tiny, backbone=backbone, extra={})
    key = C.gemm_key(head.in_features, head.out_features)
    assert sum(isinstance(m, torch.nn.Linear) and C.gemm_key(m.in_features, m.out_features) == key
               for m in list(backbone.modules()) + list(tiny.mtp.modules())) == 1
    proven = C.calibrate(model)
    assert proven.gemm[key] == 4
    plain = C.calibrate(tiny)
    assert {k: v for k, v in proven.gemm.items() if k != key} == {k: v for k, v in plain.gemm.items() if k != key}


def test_reduction_proof_compares_the_fp32_statistic():
    def mean_differs_from_4_rows(t):
        out = t.mean(-1, keepdim=True)
        if t.shape[1] >= 4:  # another summation order: the last fp32 bit of some rows
            out = torch.where(torch.arange(out.numel()).view(out.shape) % 3 == 0,
                              torch.nextafter(out, torch.full_like(out, float("inf"))), out)
        return out

    assert C._reduction_rows(mean_differs_from_4_rows, (1, 8, 16, 256), 1, 8, _rand()) == 3
    assert C._reduction_rows(lambda t: t.mean(-1, keepdim=True), (1, 8, 16, 256), 1, 8, _rand()) == 8


def test_calibration_is_proven_once_per_model_and_copied(tiny):
    a = C.calibrate(tiny)
    b = C.calibrate(tiny)
    assert a == b and a is not b and a.gemm is not b.gemm
    a.gemm.clear()
    assert C.calibrate(tiny).gemm == b.gemm


def test_fused_qk_norm_proof_compares_each_half_per_token():
    """q and k normalised as one tensor of 2*Hv heads: refused (0) when the stacked statistic
    differs from each half's 1-token one, even for a single token; bounded where it starts to."""
    def sums_differ_for_two_halves(t):
        out = t.sum(-1, keepdim=True)
        if t.shape[1] == 2 * 4:  # the stacked tensor: another order for some rows
            out = torch.where(torch.arange(out.numel()).view(out.shape) % 2 == 0,
                              torch.nextafter(out, torch.full_like(out, float("inf"))), out)
        return out

    def sums_differ_from_3_tokens(t):
        out = t.sum(-1, keepdim=True)
        if t.shape[1] == 2 * 4 and t.shape[2] >= 3:
            out = torch.nextafter(out, torch.full_like(out, float("inf")))
        return out

    assert C._qk_l2norm_rows(4, 64, 8, _rand(), reduce=sums_differ_for_two_halves) == 0
    assert C._qk_l2norm_rows(4, 64, 8, _rand(), reduce=sums_differ_from_3_tokens) == 2
    assert C._qk_l2norm_rows(4, 64, 8, _rand()) == 8
