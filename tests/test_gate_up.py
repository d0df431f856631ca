"""The MLP's gate and up projections as one GEMM over one stacked weight buffer (CPU).

The buffer moves the model's own Parameters (gate_up.py): their values, shapes and strides must
stay, and the serial control on the moved weights must compute the same logits as before. The
runtime that runs the one GEMM (where the calibration proved it) must give the control's logits,
and the two-GEMM runtime's, at every window size; and the calibration must refuse the one GEMM
where it differs from the two by one bit.
"""
import copy
import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F

from core.models import load_model
from decoders.fast_serial import FastSerialDecoder
from decoders.runtime import calibration as C
from decoders.runtime import layers as L
from decoders.runtime.gate_up import stack_gate_up, stacked_weight
from decoders.runtime.runtime import ExactRuntime
from test_runtime import greedy_stream, serial_reference  # helpers of that test module (tests/ is on the path)

MAX_WINDOW = 8


@pytest.fixture(scope="module")
def small():
    return load_model("small", "cpu")


def fresh(model):
    """A copy of the model whose weights have never been stacked (a deep copy gets new storage)."""
    copied = dataclasses.replace(model, backbone=copy.deepcopy(model.backbone), extra={})
    assert all(stacked_weight(layer.mlp) is None for layer in copied.backbone.model.layers)
    return copied


def weights(lm):
    return [(layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight) for layer in lm.model.layers]


def test_stacking_moves_the_storage_and_keeps_each_parameter(tiny):
    model = fresh(tiny)
    lm = model.backbone
    before = [(g, u, g.detach().clone(), u.detach().clone(), g.data_ptr(), u.data_ptr(), g.requires_grad)
              for g, u in weights(lm)]
    buffers = stack_gate_up(lm)
    assert sorted(buffers) == list(range(len(lm.model.layers)))
    for (g, u), (g0, u0, g_vals, u_vals, g_ptr, u_ptr, grad), idx in zip(weights(lm), before, range(len(before))):
        assert g is g0 and u is u0 and isinstance(g, torch.nn.Parameter)  # the same Parameter objects
        assert torch.equal(g, g_vals) and torch.equal(u, u_vals)  # the same values
        assert g.shape == g_vals.shape and g.stride() == g_vals.stride() and g.is_contiguous() and u.is_contiguous()
        assert g.requires_grad == grad and not g.is_inference()
        assert (g.data_ptr(), u.data_ptr()) != (g_ptr, u_ptr)  # only the storage moved
        buf = buffers[idx]
        assert buf.shape == (2 * g.shape[0], g.shape[1]) and buf.is_contiguous()
        assert buf.data_ptr() == g.data_ptr() and torch.equal(buf, torch.cat([g_vals, u_vals]))
    again = stack_gate_up(lm)  # found, not made again: a second runtime's graphs read the same buffer
    assert all(again[i].data_ptr() == buffers[i].data_ptr() for i in buffers)


@pytest.mark.parametrize("load_inference", [False, True])
@pytest.mark.parametrize("prepare_inference", [False, True])
def test_a_model_loaded_or_decoded_under_inference_mode_decodes_as_the_control(load_inference, prepare_inference):
    """A user's ``with torch.inference_mode():`` around loading or decoding: weights made there are
    inference tensors, and their moved halves must stay so (an inference Parameter pointed at an
    ordinary tensor can run no forward)."""
    from decoders.serial import SerialDecoder
    from decoders.spec import SpecDecoder

    with torch.inference_mode(load_inference):
        model = load_model("tiny", "cpu")
    prompt = [5, 6, 7, 8]
    with torch.inference_mode(prepare_inference):
        decoded = []
        for make in (SerialDecoder, FastSerialDecoder, SpecDecoder):
            decoder = make()
            decoder.prepare(model)
            decoded.append(decoder.decode(prompt, 12).tokens)
    assert decoded[1] == decoded[0] and decoded[2] == decoded[0]
    assert all(g.is_inference() == load_inference for g, _ in weights(model.backbone))


@pytest.mark.parametrize("which", ["tiny", "small"])
def test_the_serial_control_is_unchanged_by_the_stacking(which, tiny, small):
    """The control on one model shared with a runtime (as in ``harness time``): its logits after a
    prefill and 20 steps, before the runtime moved the weights and after, bit for bit."""
    model = fresh(tiny if which == "tiny" else small)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, model.vocab_size) for _ in range(n)] for n in (1, 23, 70)]
    streams = [greedy_stream(model, p, 20) for p in prompts]
    before = [serial_reference(model, p, s)[0] for p, s in zip(prompts, streams)]
    rt = ExactRuntime(model, capacity=128, windows=(1,))
    assert rt.gate_up_weights and stacked_weight(model.backbone.model.layers[0].mlp) is not None
    after = [serial_reference(model, p, s)[0] for p, s in zip(prompts, streams)]
    for a, b in zip(before, after):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    assert [greedy_stream(model, p, 20) for p in prompts] == streams


def window_logits(rt, prompt, stream, w):
    """Every row's logits of windows of w true tokens along the stream (each accepted whole)."""
    rt.prefill(prompt)
    out, c = [], 0
    while c + w <= len(stream):
        prog = rt.verify(torch.tensor([stream[c:c + w]]))
        out += [prog.ws["logits"][:, i].clone() for i in range(w)]
        rt.accept(w)
        c += w
    return out


@pytest.mark.parametrize("which", ["tiny", "small"])
def test_one_gemm_equals_the_control_and_two_gemms_at_every_window_size(which, tiny, small):
    model = fresh(tiny if which == "tiny" else small)
    rng = random.Random(4)
    prompt = [rng.randrange(3, model.vocab_size) for _ in range(19)]
    n = 3 * MAX_WINDOW
    stream = greedy_stream(model, prompt, n)
    ref, _ = serial_reference(model, prompt, stream)
    windows = tuple(range(1, MAX_WINDOW + 1))
    one = ExactRuntime(model, capacity=128, windows=windows)
    if one.cal.gate_up < MAX_WINDOW:
        pytest.skip(f"this CPU's GEMM over the stacked weight differs from the two from {one.cal.gate_up + 1} rows "
                    "on (test_calibration_refuses_* covers the refusal)")
    two = ExactRuntime(model, capacity=128, windows=windows, cal=one.cal, stack_gate_up=False)
    assert one.gate_up_rows == MAX_WINDOW and two.gate_up_rows == 0
    assert all(len(one.program(w, capture=True).gate_up) == len(model.backbone.model.layers) for w in windows)
    assert all(not two.program(w, capture=True).gate_up for w in windows)
    for w in windows:
        a, b = window_logits(one, prompt, stream, w), window_logits(two, prompt, stream, w)
        assert len(a) == len(stream) // w * w
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, ref[i + 1]), f"one GEMM, window {w}, position {i}"
            assert torch.equal(y, ref[i + 1]), f"two GEMMs, window {w}, position {i}"
    one.prefill(prompt)
    for k, t in enumerate(stream):
        assert torch.equal(one.step(torch.tensor([[t]])).ws["logits"][:, -1], ref[k + 1]), f"step {k}"


def test_fast_serial_records_its_choice_and_decodes_the_same_either_way(tiny):
    model = fresh(tiny)
    ids = list(range(3, 30))
    on, off = FastSerialDecoder(capacity=128), FastSerialDecoder(capacity=128, stack_gate_up=False)
    on.prepare(model)
    off.prepare(model)
    assert on.config()["stack_gate_up"] and on.config()["gate_up_rows"] == on.runtime.cal.gate_up
    assert on.config()["calibration"]["gate_up"] == on.runtime.cal.gate_up
    assert not off.config()["stack_gate_up"] and off.config()["gate_up_rows"] == 0
    assert on.decode(ids, 24).tokens == off.decode(ids, 24).tokens


def one_bit_off_from(rows: int, half: str):
    """A stacked GEMM that is the two GEMMs row by row (row-invariant by construction, so the fake's
    own difference is the only one), with one element one bf16 step off from ``rows`` rows on."""
    def product(x, weight):
        n = weight.shape[0] // 2
        out = torch.cat([torch.cat([F.linear(x[:, i:i + 1], weight[:n]), F.linear(x[:, i:i + 1], weight[n:])], dim=-1)
                         for i in range(x.shape[1])], dim=1)
        if x.shape[1] >= rows:
            col = 0 if half == "gate" else out.shape[-1] - 1
            one = out[0, rows - 1, col]
            out[0, rows - 1, col] = torch.nextafter(one, one + 1)
        return out

    return product


@pytest.mark.parametrize("half", ["gate", "up"])
@pytest.mark.parametrize("rows", [1, 2, 5, MAX_WINDOW + 1])
def test_calibration_refuses_a_stacked_gemm_one_bit_off(tiny, monkeypatch, rows, half):
    """From the first row count whose product is one bit off in a single element, the stacked GEMM
    is refused (0 = never, where even one row differs), and the runtime runs two GEMMs there."""
    model = fresh(tiny)
    monkeypatch.setattr(L, "gate_up_product", one_bit_off_from(rows, half))
    cal = C.calibrate(model, max_rows=MAX_WINDOW)
    assert cal.gate_up == min(rows - 1, MAX_WINDOW)
    assert cal.to_json()["gate_up"] == cal.gate_up
    rt = ExactRuntime(model, capacity=64, windows=tuple(range(1, MAX_WINDOW + 1)), cal=cal)
    assert rt.gate_up_rows == cal.gate_up
    for w in range(1, MAX_WINDOW + 1):
        assert bool(rt.program(w, capture=True).gate_up) == (w <= cal.gate_up)
