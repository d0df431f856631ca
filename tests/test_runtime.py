"""The exact runtime against the pristine serial path, bit for bit (CPU, eager programs).

For fast-serial steps and for random sequences of verify windows (sizes 1..8) with random accept
lengths, every verified position's logits must equal the serial step's logits exactly, and the
state after rollback must equal the state serial decoding has after the same tokens. Checked on
the built-in tiny model and on a second random config with other head counts, both with the
device's calibration and with everything forced row by row.
"""
import dataclasses
import random

import pytest
import torch
from transformers import DynamicCache, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from core.models import LoadedModel
from decoders.fast_serial import FastSerialDecoder
from decoders.runtime.calibration import Calibration, calibrate
from decoders.runtime.runtime import ExactRuntime
from decoders.serial import SerialDecoder
from fixtures.prompts import DEV_PROMPTS


def random_model(seed=7):
    """A Qwen3.5 with different head counts from tiny: 6 q heads / 3 kv heads, GDN 3 k / 6 v heads
    (so q/k are repeated), attention at layers 1 and 4."""
    cfg = Qwen3_5TextConfig(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=5,
                            num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                            linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=16,
                            linear_value_head_dim=8, layer_types=["linear_attention", "full_attention",
                                                                  "linear_attention", "linear_attention",
                                                                  "full_attention"],
                            eos_token_id=[0])
    torch.manual_seed(seed)
    lm = Qwen3_5ForCausalLM._from_config(cfg, dtype=torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "norm" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return LoadedModel(name="random-heads", backbone=lm, text_config=cfg, device=torch.device("cpu"),
                       eos_token_ids=(0,), identity={"name": "random-heads"})


@pytest.fixture(scope="module")
def other():
    return random_model()


@torch.inference_mode()
def serial_reference(model, prompt, stream):
    """logits[k]: the control's logits after prompt + stream[:k]; states[k]: its cache then."""
    lm = model.backbone
    cache = DynamicCache(config=lm.config)
    out = lm(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    logits, states = [out.logits[:, -1].clone()], [snapshot(lm, cache)]
    for t in stream:
        out = lm(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits.append(out.logits[:, -1].clone())
        states.append(snapshot(lm, cache))
    return logits, states


def snapshot(lm, cache):
    snap = {}
    for i, layer in enumerate(lm.model.layers):
        c = cache.layers[i]
        if hasattr(layer, "self_attn"):
            snap[i] = (c.keys.clone(), c.values.clone())
        else:
            snap[i] = (c.conv_states[0].clone(), c.recurrent_states[0].clone())
    return snap


def assert_state_equal(rt, snap):
    st = rt.state
    for i in st.attn_layers:
        k, v = snap[i]
        n = k.shape[2]
        assert n == rt.length
        assert torch.equal(st.keys[i][:, :, :n], k) and torch.equal(st.values[i][:, :, :n], v), f"KV layer {i}"
    for i in st.gdn_layers:
        conv, rec = snap[i]
        assert torch.equal(st.conv[i], conv), f"conv state layer {i}"
        assert torch.equal(st.rec[i], rec), f"recurrent state layer {i}"


def greedy_stream(model, prompt, n):
    logits, _ = serial_reference(model, prompt, [])
    stream = []
    lm = model.backbone
    cache = DynamicCache(config=lm.config)
    with torch.inference_mode():
        out = lm(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        for _ in range(n):
            t = int(out.logits[:, -1].argmax(-1))
            stream.append(t)
            out = lm(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return stream


@pytest.mark.parametrize("which", ["tiny", "other"])
@pytest.mark.parametrize("forced", [False, True], ids=["calibrated", "row-by-row"])
def test_steps_bit_identical(which, forced, tiny, other):
    model = tiny if which == "tiny" else other
    rng = random.Random(1)
    prompt = [rng.randrange(3, model.vocab_size) for _ in range(23)]
    stream = greedy_stream(model, prompt, 30)
    ref_logits, ref_states = serial_reference(model, prompt, stream)
    rt = ExactRuntime(model, capacity=128, windows=(1,), cal=Calibration.serial_only() if forced else None)
    logits, _ = rt.prefill(prompt)
    assert torch.equal(logits, ref_logits[0])
    for k, t in enumerate(stream):
        prog = rt.step(torch.tensor([[t]]))
        assert torch.equal(prog.ws["logits"][:, -1], ref_logits[k + 1]), f"step {k}"
    assert_state_equal(rt, ref_states[len(stream)])


@pytest.mark.parametrize("which", ["tiny", "other"])
def test_steps_with_fused_qk_l2norm_bit_identical(which, tiny, other):
    """The step path that L2-normalises q and k as one tensor (taken where the calibration proved
    it, as on an H200) against the control. The CPU's own calibration never takes it (its rsqrt is
    not proven size-invariant), so it is forced here."""
    model = tiny if which == "tiny" else other
    base = calibrate(model)
    cal = Calibration(max_rows=8, gemm=dict(base.gemm), hidden_mean=base.hidden_mean, conv_window=base.conv_window,
                      kv_view_ok=base.kv_view_ok, elementwise=True, l2norm=2, qk_l2norm=1, device="cpu",
                      forced=True)
    rng = random.Random(3)
    prompt = [rng.randrange(3, model.vocab_size) for _ in range(19)]
    stream = greedy_stream(model, prompt, 24)
    ref_logits, ref_states = serial_reference(model, prompt, stream)
    rt = ExactRuntime(model, capacity=128, windows=(1,), cal=cal)
    rt.prefill(prompt)
    for k, t in enumerate(stream):
        prog = rt.step(torch.tensor([[t]]))
        assert torch.equal(prog.ws["logits"][:, -1], ref_logits[k + 1]), f"step {k}"
    assert_state_equal(rt, ref_states[len(stream)])


@pytest.mark.parametrize("which", ["tiny", "other"])
@pytest.mark.parametrize("forced", [False, True], ids=["calibrated", "row-by-row"])
def test_random_windows_and_rollback(which, forced, tiny, other):
    model = tiny if which == "tiny" else other
    rng = random.Random(11 if forced else 5)
    prompt = [rng.randrange(3, model.vocab_size) for _ in range(17)]
    n = 70
    stream = greedy_stream(model, prompt, n)
    ref_logits, ref_states = serial_reference(model, prompt, stream)
    rt = ExactRuntime(model, capacity=128, windows=tuple(range(1, 9)),
                      cal=Calibration.serial_only() if forced else None)
    rt.prefill(prompt)
    c, checked, windows = 0, 0, 0
    while c < n - 1:
        w = rng.randint(1, min(8, n - c))
        good = rng.randint(1, w)  # rows whose tokens are the true stream; the rest are wrong drafts
        toks = stream[c:c + good] + [(stream[c + i] + 1 + rng.randrange(model.vocab_size - 1)) % model.vocab_size
                                     for i in range(good, w)]
        prog = rt.verify(torch.tensor([toks]))
        for i in range(good):
            assert torch.equal(prog.ws["logits"][:, i], ref_logits[c + i + 1]), f"window at {c}, row {i}"
            checked += 1
        rows = rng.randint(1, good)
        rt.accept(rows)
        c += rows
        windows += 1
        assert_state_equal(rt, ref_states[c])
    assert checked >= n - 1 and windows > 10


def test_fast_serial_matches_serial_tokens(tiny, tiny_tokenizer):
    serial, fast = SerialDecoder(), FastSerialDecoder(capacity=256)
    serial.prepare(tiny)
    fast.prepare(tiny)
    for p in DEV_PROMPTS[:4]:
        ids = tiny_tokenizer.encode(p["text"])
        assert fast.decode(ids, 40).tokens == serial.decode(ids, 40).tokens


def test_fast_serial_stops_at_eos(tiny, tiny_tokenizer):
    ids = tiny_tokenizer.encode("Shopping list for the week:")
    full = SerialDecoder()
    full.prepare(tiny)
    stream = full.decode(ids, 30).tokens
    eos_model = dataclasses.replace(tiny, eos_token_ids=(stream[9],))
    fast = FastSerialDecoder(capacity=128)
    fast.prepare(eos_model)
    out = fast.decode(ids, 30).tokens
    assert out == stream[: stream.index(stream[9]) + 1]


def test_capacity_is_enforced(tiny):
    rt = ExactRuntime(tiny, capacity=16, windows=(1, 4))
    with pytest.raises(ValueError):
        rt.prefill(list(range(3, 20)))


def test_reset_forgets_the_prompt_and_the_pending_window(tiny):
    rt = ExactRuntime(tiny, capacity=64, windows=(1, 3))
    rt.prefill(list(range(3, 12)))
    rt.verify(torch.tensor([[5, 6, 7]]))
    rt.reset()
    assert rt.length == 0 and rt.last_verify is None
    with pytest.raises(ValueError, match="prefill"):
        rt.step(torch.tensor([[5]]))
    with pytest.raises(ValueError, match="prefill"):
        rt.verify(torch.tensor([[5, 6]]))
    with pytest.raises(ValueError, match="pending"):
        rt.accept(1)


def test_constants_belong_to_the_runtime(tiny):
    """Weight-only constants are made per runtime, so one built after new weights sees them."""
    a = ExactRuntime(tiny, capacity=32, windows=(1,))
    a.prefill(list(range(3, 9)))
    a.step(torch.tensor([[4]]))
    norm = tiny.backbone.model.norm
    made = a.constants.get(norm, "scale", lambda: None)
    assert torch.equal(made, 1.0 + norm.weight.float())
    b = ExactRuntime(tiny, capacity=32, windows=(1,), cal=a.cal)
    assert b.constants.get(norm, "scale", lambda: "fresh") == "fresh"


def test_lanes_off_the_gpu_run_branches_in_order():
    """Without CUDA streams every branch runs in order on the caller's thread, results in order."""
    from decoders.runtime.lanes import SERIAL, Lanes

    lanes = Lanes.on(torch.device("cpu"), 8)
    assert lanes is SERIAL and lanes.width == 1
    seen = []
    assert lanes.fork(*[lambda i=i: seen.append(i) or i * i for i in range(5)]) == [0, 1, 4, 9, 16]
    assert lanes.each(lambda i: seen.append(10 + i) or -i, 3) == [0, -1, -2]
    assert seen == [0, 1, 2, 3, 4, 10, 11, 12]


def test_kept_rows_pass_through_the_ring_at_every_offset(tiny, monkeypatch):
    """With keep_rows, ``flush_rows`` leaves in ``row_hidden`` exactly the hidden row each step
    and each kept window row made, whether the ring (shrunk to 5 slots) filled up, wrapped at an
    offset, or was flushed by a window; rows past an accepted prefix are never taken from it."""
    check_ring_rows(tiny, monkeypatch)


def check_ring_rows(model, monkeypatch) -> None:
    """The ring test on ``model``'s device (test_cuda runs it with graphs)."""
    from decoders.runtime import state as state_mod

    monkeypatch.setattr(state_mod, "RING_ROWS", 5)
    rt = ExactRuntime(model, capacity=96, windows=(1, 2, 3), keep_rows=True)
    dev = model.device
    made = {}
    _, hidden = rt.prefill(list(range(3, 10)))  # 7 positions: the ring's first slot is 7 % 5
    made[6] = hidden[0, -1].clone()
    tok = torch.tensor([[11]], device=dev)

    def steps(k):
        for _ in range(k):
            prog = rt.step(tok)
            made[rt.length - 1] = prog.ws["hidden"][0, 0].clone()

    steps(13)  # fills the ring twice over, each time from a wrapped slot
    start = rt.length
    window = rt.verify(torch.tensor([[12, 13, 14]], device=dev))
    made.update({start + r: window.ws["hidden"][0, r].clone() for r in range(2)})
    rt.accept(2)
    steps(3)
    rt.flush_rows()
    start = rt.length
    window = rt.verify(torch.tensor([[15]], device=dev))  # a window of one row keeps it as windows do
    made[start] = window.ws["hidden"][0, 0].clone()
    rt.accept(1)
    steps(4)
    rt.flush_rows()
    assert rt.ring_from == rt.length == 30
    for p in range(6, rt.length):
        assert torch.equal(rt.state.row_hidden[0, p], made[p]), p
