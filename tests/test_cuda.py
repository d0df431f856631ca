"""The CUDA-graphed runtime, the drafter's graphs and the exact decoders on a GPU, bit for bit.

Every test is marked ``cuda`` and skipped without a GPU (``pytest -m cuda tests/test_cuda.py`` on a
GPU machine). The process runs in the pinned deterministic configuration (conftest.py pins it
before CUDA starts). Models: the built-in ``tiny`` (with its MTP head) and a second small random
Qwen3.5 with other head counts (test_runtime.random_model), both moved to the GPU. The reference
for the runtime is the eager serial control (HF forward + DynamicCache, one token per forward);
for the drafter, the same drafter run eagerly (its drafts need not be exact, only its graphs
faithful).
"""
import dataclasses
import random

import pytest
import torch
from transformers import DynamicCache

from core import determinism
from core.models import load_model
from core.sampling import PRESETS, Sampler
from decoders import get_decoder
from decoders.drafter import MTPDrafter
from decoders.runtime.lanes import Lanes
from decoders.runtime.runtime import ExactRuntime
from decoders.sampled import TargetPicks
from decoders.serial import SerialDecoder
from fixtures.prompts import DEV_PROMPTS
from test_runtime import assert_state_equal, check_ring_rows, random_model, snapshot  # helpers of that test module (tests/ is on the path)

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def models():
    assert not determinism.differences(determinism.PINNED,
                                       {k: v for k, v in determinism.current().items() if k in determinism.PINNED})
    other = random_model()
    other = dataclasses.replace(other, backbone=other.backbone.to("cuda"), device=torch.device("cuda"), extra={})
    return {"tiny": load_model("tiny", "cuda"), "other": other}


@torch.inference_mode()
def control(model, prompt: list[int], n: int):
    """The serial control along its own greedy stream: (stream of n tokens, logits[k] after
    prompt + stream[:k] for k = 0..n, cache snapshots states[k] at the same points)."""
    lm, dev = model.backbone, model.device
    cache = DynamicCache(config=lm.config)
    out = lm(input_ids=torch.tensor([prompt], device=dev), past_key_values=cache, use_cache=True, logits_to_keep=1)
    logits, states, stream = [out.logits[:, -1].clone()], [snapshot(lm, cache)], []
    for _ in range(n):
        nxt = out.logits[:, -1].argmax(-1)
        stream.append(int(nxt.item()))
        out = lm(input_ids=nxt.view(1, 1), past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits.append(out.logits[:, -1].clone())
        states.append(snapshot(lm, cache))
    return stream, logits, states


def random_prompt(model, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, model.vocab_size) for _ in range(n)]


@pytest.mark.parametrize("which", ["tiny", "other"])
def test_graphed_steps_equal_the_control(models, which):
    model = models[which]
    prompt = random_prompt(model, 29, seed=1)
    stream, ref_logits, ref_states = control(model, prompt, 40)
    rt = ExactRuntime(model, capacity=128, windows=(1,))
    assert rt.use_graphs and rt.program(1, capture=False).graphs is not None
    assert rt.lanes.width >= 3  # the layers' branches run on their own streams inside the graphs
    logits, _ = rt.prefill(prompt)
    assert torch.equal(logits, ref_logits[0])
    for k, t in enumerate(stream):
        prog = rt.step(torch.tensor([[t]], device=model.device))
        assert torch.equal(prog.ws["logits"][:, -1], ref_logits[k + 1]), f"step {k}"
        assert int(prog.ws["argmax"].view(-1)[0]) == int(ref_logits[k + 1].argmax(-1))
    assert_state_equal(rt, ref_states[len(stream)])


@pytest.mark.parametrize("which", ["tiny", "other"])
def test_graphed_windows_rollback_and_continue_equal_the_control(models, which):
    """Windows of every size 1..8 (each captured as graphs), with wrong drafts after a true
    prefix, partial accepts (graphed rollbacks) and plain steps in between; every true row's
    logits and the state after every commit equal the control's."""
    model = models[which]
    dev = model.device
    prompt = random_prompt(model, 21, seed=2)
    n = 150
    stream, ref_logits, ref_states = control(model, prompt, n)
    rt = ExactRuntime(model, capacity=256, windows=tuple(range(1, 9)))
    assert all(rt.program(w, capture=True).graphs is not None for w in range(2, 9))
    rt.prefill(prompt)
    rng = random.Random(3)
    c, sizes, partial = 0, set(), 0
    while c < n - 8:
        if rng.random() < 0.15:  # a plain step continues from whatever the last commit left
            prog = rt.step(torch.tensor([[stream[c]]], device=dev))
            assert torch.equal(prog.ws["logits"][:, -1], ref_logits[c + 1]), f"step at {c}"
            c += 1
            assert_state_equal(rt, ref_states[c])
            continue
        w = len(sizes) + 1 if len(sizes) < 8 else rng.randint(1, 8)
        good = rng.randint(1, w)  # rows holding the true stream; the rest are wrong drafts
        toks = stream[c:c + good] + [(stream[c + i] + 1 + rng.randrange(model.vocab_size - 1)) % model.vocab_size
                                     for i in range(good, w)]
        prog = rt.verify(torch.tensor([toks], device=dev))
        for i in range(good):
            assert torch.equal(prog.ws["logits"][:, i], ref_logits[c + i + 1]), f"window {w} at {c}, row {i}"
        rows = rng.randint(1, good)
        rt.accept(rows)
        sizes.add(w)
        partial += rows < w
        c += rows
        assert_state_equal(rt, ref_states[c])
    assert sizes == set(range(1, 9)) and partial >= 10
    assert len(rt._rollback_graphs) >= 5  # rollbacks ran as captured graphs


@pytest.mark.parametrize("coupled,confidence", [(False, False), (True, False), (False, True), (True, True)])
def test_drafter_graphs_equal_the_same_drafter_eager(models, coupled, confidence):
    """Catch-ups of every graphed size (and longer ones in chunks) and chained steps, replayed
    from graphs, draft and write K/V exactly as the same functions run eagerly; coupled to a
    sampler's noise (the coupled graphs, T and the seed read from device tensors) too; with
    ``confidence``, each draft's confidence is the eager one's, bit for bit."""
    model = models["tiny"]
    cap, dev = 256, model.device
    graphed = MTPDrafter(model, cap, max_rows=7, coupled=coupled, confidence=confidence)
    eager = MTPDrafter(model, cap, max_rows=7, use_graphs=False, coupled=coupled, confidence=confidence)
    if coupled:
        for d in (graphed, eager):
            d.couple(Sampler(temperature=0.8, seed=2 ** 63 + 11))
    assert graphed.pool is not None and eager.pool is None
    assert all(graphs is not None for _, graphs in graphed._rows.values())
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(model.vocab_size, (1, cap), generator=g).to(dev)
    hidden = torch.randn(1, cap, model.backbone.config.hidden_size, generator=g).to(device=dev, dtype=graphed.keys.dtype)
    prompt = 12
    for d in (graphed, eager):
        d.prefill(hidden[:, :prompt], tokens[0, :prompt].tolist())
    pos, seen = prompt - 1, set()
    for m, depth in [(1, 1), (3, 4), (7, 2), (2, 6), (5, 1), (16, 3), (4, 7), (40, 2), (6, 5), (65, 3), (1, 1)]:
        rows_h, rows_t = hidden[:, pos:pos + m], tokens[:, pos + 1:pos + 1 + m]
        if confidence:
            def more(confidences, depth=depth):
                return len(confidences) < depth
            got, got_conf = graphed.draft_until(rows_h, rows_t, more)
            want, want_conf = eager.draft_until(rows_h, rows_t, more)
            assert got_conf == want_conf and len(got_conf) == depth, (m, depth)
            got, want = [int(t) for t in got], [int(t) for t in want]
        else:
            got = [int(t) for t in graphed.draft(rows_h, rows_t, depth)]
            want = [int(t) for t in eager.draft(rows_h, rows_t, depth)]
        assert got == want, (m, depth)
        # the rows written since the prefill: the caught-up rows and the chained steps' rows; rows
        # past them are scratch (graph capture's warm-ups write there at construction, and
        # attention never reads a row before it is written again)
        live = graphed.filled + depth - 1
        assert graphed.filled == eager.filled
        assert torch.equal(graphed.keys[:, :, :live], eager.keys[:, :, :live]), (m, depth)
        assert torch.equal(graphed.values[:, :, :live], eager.values[:, :, :live]), (m, depth)
        assert torch.equal(graphed.in_hidden, eager.in_hidden)
        pos += m
        seen.update(got)
    assert len(seen) > 3


@pytest.fixture(scope="module")
def serial_tokens(models):
    model = models["tiny"]
    tok = model.tokenizer.get()
    prompts = [tok.encode(p["text"]) for p in DEV_PROMPTS[:4]]
    serial = SerialDecoder()
    serial.prepare(model)
    return prompts, [serial.decode(ids, 96).tokens for ids in prompts]


@pytest.mark.parametrize("name,kwargs", [("fast-serial", {}), ("spec", {}), ("spec", {"depth": 3}),
                                         ("spec-instrument", {"alpha": 0.8, "max_depth": 6}),
                                         ("spec-instrument", {"alpha": 0.8, "depth": 3}),
                                         ("spec-instrument", {"alpha": 1.0, "depth": 5}),
                                         ("spec", {"stop": "confidence"}),
                                         ("spec-instrument", {"alpha": 0.8, "stop": "confidence"})])
def test_decoders_end_to_end_equal_serial(models, serial_tokens, name, kwargs):
    prompts, want = serial_tokens
    dec = get_decoder(name, **kwargs)
    dec.prepare(models["tiny"])
    assert dec.config()["graphs"] is True
    accepted = 0
    for ids, ref in zip(prompts, want):
        for _ in range(2):  # a second decode reuses every captured graph
            res = dec.decode(ids, 96)
            assert res.tokens == ref
        accepted += res.stats.accepted
    if name == "spec-instrument" and "depth" in kwargs:
        # accepted runs and rollbacks really happened on the GPU. At an adaptive depth the policy
        # may rightly never draft here: tiny is launch-bound on a GPU, so a probe costs about two
        # steps and is priced past a 96-token decode (decoders/policy.py)
        assert accepted > 0


@pytest.mark.parametrize("name,kwargs", [("fast-serial", {}), ("fast-serial", {"read_ahead": False}),
                                         ("spec", {"depth": 0}), ("spec-instrument", {"alpha": 0.8})])
@pytest.mark.parametrize("sampler", [None, Sampler(**PRESETS["qwen-instruct"], seed=8)])
def test_steps_read_ahead_stop_at_eos_and_leave_no_gpu_work(models, name, kwargs, sampler):
    """Plain steps queued one ahead of the host's read (decoders/stepping.py): the control's tokens
    up to an EOS in mid-decode, the step queued past it finished before decode returns, and the
    next decode exact."""
    model = models["tiny"]
    tok = model.tokenizer.get()
    a, b = (tok.encode(p["text"]) for p in DEV_PROMPTS[:2])
    serial = SerialDecoder()
    serial.prepare(model)
    stream = serial.decode(a, 64, sampler=sampler).tokens
    eos_model = dataclasses.replace(model, eos_token_ids=(stream[40],))
    serial.prepare(eos_model)
    want_a, want_b = (serial.decode(ids, 64, sampler=sampler).tokens for ids in (a, b))
    assert len(want_a) < 64
    dec = get_decoder(name, **kwargs)
    dec.prepare(eos_model)
    for ids, want in ((a, want_a), (b, want_b), (a, want_a)):
        assert dec.decode(ids, 64, sampler=sampler).tokens == want
        assert torch.cuda.current_stream().query()  # no GPU work outlives the call


@pytest.mark.parametrize("name,kwargs", [("fast-serial", {}), ("spec-instrument", {"alpha": 0.8, "depth": 3})])
def test_a_decode_past_4096_positions_reserved_up_front_is_exact_and_builds_nothing(models, name, kwargs):
    """4000 prompt + 200 new tokens, past the default capacity of 4096, with every graph over the
    reserved state: the serial control's tokens, and no runtime built during the decode."""
    from decoders.runtime import sizing

    model = dataclasses.replace(models["tiny"], eos_token_ids=(models["tiny"].vocab_size + 7,))  # never emitted
    prompt, n = random_prompt(model, 4000, seed=5), 200
    serial = SerialDecoder()
    serial.prepare(model)
    want = serial.decode(prompt, n).tokens
    dec = get_decoder(name, **kwargs)
    dec.prepare(model)
    dec.reserve(len(prompt) + n)
    built = sizing.builds()
    if hasattr(dec, "prepare_prompt"):
        dec.prepare_prompt(prompt, n)
    assert dec.decode(prompt, n).tokens == want
    assert sizing.builds() == built


@pytest.mark.parametrize("which", ["tiny", "other"])
def test_graphed_steps_keep_their_hidden_rows_through_the_ring(models, which, monkeypatch):
    """A graphed step's hidden row, selected into its ring slot on the device, reaches
    ``row_hidden`` bit for bit at every ring offset, with windows between (test_runtime's check)."""
    check_ring_rows(models[which], monkeypatch)


@pytest.mark.parametrize("name", ["fast-serial", "spec"])
def test_growing_releases_the_old_state_and_graphs(models, name):
    """A decoder grown by reserve() holds about what one built at that size holds, not both."""
    import gc

    from decoders.runtime import sizing

    def held(make) -> tuple[int, object]:
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        dec = make()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before, dec

    capacity = sizing.capacity_for(6000 + 8)
    fresh, dec = held(lambda: prepared(get_decoder(name, capacity=capacity), models["tiny"]))
    del dec
    grown, dec = held(lambda: prepared(get_decoder(name), models["tiny"], reserve=6000))
    assert dec.runtime.capacity == capacity
    assert grown <= 1.05 * fresh + (1 << 20), (grown, fresh)


def prepared(dec, model, reserve: int | None = None):
    dec.prepare(model)
    if reserve is not None:
        dec.reserve(reserve)
    return dec


def test_lanes_fork_and_each_join_back_in_order():
    """Branches on side streams: results in order, and the current stream sees their writes."""
    lanes = Lanes.on(torch.device("cuda"), 4)
    assert lanes.width == 4
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    big = [lambda k=k: (x * k).sum() for k in range(4)]
    assert [float(v) for v in lanes.fork(*big)] == [float((x * k).sum()) for k in range(4)]
    out = torch.zeros(10, device="cuda")
    lanes.each(lambda i: out[i].fill_(i + 1), 10)
    assert out.tolist() == [float(i + 1) for i in range(10)]
    more = [lambda k=k: (x * k).sum() for k in range(9)]  # more branches than lanes share the side streams
    assert [float(v) for v in lanes.fork(*more)] == [float((x * k).sum()) for k in range(9)]


@pytest.mark.parametrize("which", ["tiny", "other"])
def test_windows_with_and_without_lanes_are_bit_identical(models, which):
    """The same windows and rollbacks on one stream, on the lanes, and on the lanes with the eager
    attention rows in order: every logit and the final state equal."""
    model = models[which]
    prompt = random_prompt(model, 23, seed=5)
    stream, _, _ = control(model, prompt, 12)
    runs = {}
    for lanes, spread in ((1, True), (None, True), (None, False)):
        rt = ExactRuntime(model, capacity=96, windows=tuple(range(1, 9)), lanes=lanes)
        rt.spread_eager_rows(spread)
        rt.prefill(prompt)
        logits, at = [], 0
        for w, keep in ((8, 3), (3, 3), (1, 1)):
            logits.append(rt.verify(torch.tensor([stream[at:at + w]], device=model.device)).ws["logits"].clone())
            rt.accept(keep)
            at += keep
        runs[rt.lanes.width, spread] = (logits, [t.clone() for t in rt.state.tensors()])
    assert [width for width, _ in runs][0] == 1 and all(width >= 8 for width, _ in list(runs)[1:])
    (a_logits, a_state), *others = runs.values()
    for b_logits, b_state in others:
        assert all(torch.equal(a, b) for a, b in zip(a_logits, b_logits))
        assert all(torch.equal(a, b) for a, b in zip(a_state, b_state))


@pytest.mark.parametrize("which", ["tiny", "other"])
def test_graphed_prefill_scan_is_proven_and_equals_the_control(models, which, monkeypatch):
    """The runtime's prefill, its chunk scans replayed from graphs, against transformers' forward:
    final hidden states and every cache tensor, for prompts of 1 to 5 chunks and past the graphed
    range (which runs the scan eagerly)."""
    from decoders.runtime import prefill

    model = models[which]
    monkeypatch.setattr(prefill, "MAX_GRAPHED_CHUNKS", 4)
    rt = ExactRuntime(model, capacity=512, windows=(1,))
    assert isinstance(rt.prefill_rule, prefill.ScanGraphs), rt.prefill_how
    assert sorted(rt.prefill_rule.graphs) == [1, 2, 3, 4] and rt.prefill_rule.prove_each(seed=1) is None
    text = model.backbone.model
    for length in (1, 63, 64, 65, 200, 300):
        ids = torch.tensor([random_prompt(model, length, length)], device="cuda")
        want_hidden, want_cache = prefill.control_forward(text, ids)
        got_hidden, got_cache = prefill.prefill_forward(text, ids, rt.prefill_rule)
        assert torch.equal(got_hidden, want_hidden), length
        for got, want in zip(prefill.cache_tensors(got_cache, text.config),
                             prefill.cache_tensors(want_cache, text.config)):
            assert torch.equal(got, want), length


SAMPLED = [Sampler(temperature=0.3, seed=1), Sampler(temperature=0.6, seed=2), Sampler(temperature=1.0, seed=3),
           Sampler(**PRESETS["qwen-thinking"], seed=4), Sampler(temperature=1.0, top_p=0.8, min_p=0.02, seed=2 ** 64 - 1)]


class _Rows:
    """What TargetPicks reads of a window program: its logits, positions, start and width."""

    def __init__(self, logits: torch.Tensor, start: int):
        self.w = logits.shape[1]
        self.ws = {"logits": logits}
        self.positions = torch.arange(start, start + self.w, device=logits.device)
        self.start = start


@torch.inference_mode()
def test_graphed_picks_equal_pick_tensor_on_the_9b_vocabulary():
    """A pick replayed from its CUDA graph (seed and position read from device tensors) is
    ``Sampler.pick_tensor`` on the same row, bit for bit, for every filter, on 248,320 logits;
    allowed_mask itself captures (no host copy inside it)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(1, 7, 248320, device="cuda", generator=g) * 3).to(torch.bfloat16)
    prog = _Rows(logits, start=1000)
    picks = TargetPicks(torch.device("cuda"), use_graphs=True)
    for sampler in SAMPLED + [Sampler(temperature=0.7, top_k=20, seed=5)]:
        picks.bind(sampler)
        for rep in range(3):
            logits.copy_((torch.randn(1, 7, 248320, device="cuda", generator=g) * 3).to(torch.bfloat16))
            prog.positions.copy_(torch.arange(1000 + 9 * rep, 1007 + 9 * rep, device="cuda"))
            prog.start = 1000 + 9 * rep
            got = [int(picks.row(prog, r)) for r in range(7)]
            want = [sampler.pick(logits[0, r], prog.start + r + 1) for r in range(7)]
            assert got == want, (sampler, rep)
        assert len(picks._graphs[tuple(picks._graphs)[-1]]) == 7  # one graph per row, reused


@torch.inference_mode()
@pytest.mark.parametrize("w", [2, 5, 8])
def test_a_windows_rows_in_one_graph_equal_their_lone_picks_on_the_9b_vocabulary(w):
    """``TargetPicks.rows``: a window's rows picked in one call (``pick_rows_from_keys``), eager
    and replayed from its CUDA graph, are each row's ``Sampler.pick_tensor``, bit for bit, for
    every filter, on 248,320 logits."""
    g = torch.Generator(device="cuda").manual_seed(w)
    logits = (torch.randn(1, w, 248320, device="cuda", generator=g) * 3).to(torch.bfloat16)
    prog = _Rows(logits, start=2000)
    picks = TargetPicks(torch.device("cuda"), use_graphs=True)
    eager = TargetPicks(torch.device("cuda"), use_graphs=False)
    samplers = SAMPLED + [Sampler(temperature=0.7, top_k=20, seed=5), Sampler(**PRESETS["qwen-instruct"], seed=6),
                          Sampler(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=7)]
    for sampler in samplers:
        picks.bind(sampler, [prog], windows=True)
        eager.bind(sampler)
        for rep in range(3):
            logits.copy_((torch.randn(1, w, 248320, device="cuda", generator=g) * 3).to(torch.bfloat16))
            logits[0, :, ::97] = logits[0, :, 5:6]  # equal logits, some at the top-k boundary
            prog.start = 2000 + 11 * rep
            want = [sampler.pick(logits[0, r], prog.start + r + 1) for r in range(w)]
            assert picks.rows(prog).tolist() == want, (sampler, rep)
            assert eager.rows(prog).tolist() == want, (sampler, rep)
        assert len(picks._graphs[tuple(picks._graphs)[-1]]) == w + 1  # the rows' graphs and the window's


@pytest.fixture(scope="module")
def sampled_serial_tokens(models):
    model = models["tiny"]
    tok = model.tokenizer.get()
    prompts = [tok.encode(p["text"]) for p in DEV_PROMPTS[:3]]
    serial = SerialDecoder()
    serial.prepare(model)
    return prompts, {s: [serial.decode(ids, 64, sampler=s).tokens for ids in prompts] for s in SAMPLED}


@pytest.mark.parametrize("name,kwargs", [("fast-serial", {}), ("spec", {}), ("spec", {"depth": 3}),
                                         ("spec", {"depth": 3, "coupled": False}),
                                         ("spec", {"depth": 4, "lazy_rows": True}),
                                         ("spec-instrument", {"alpha": 0.6, "max_depth": 6}),
                                         ("spec-instrument", {"alpha": 0.8, "depth": 4, "lazy_rows": True}),
                                         ("spec-instrument", {"alpha": 0.8, "depth": 3}),
                                         ("spec-instrument", {"alpha": 1.0, "depth": 5}),
                                         ("spec-instrument", {"alpha": 0.8, "stop": "confidence"})])
def test_decoders_sample_as_serial_on_cuda(models, sampled_serial_tokens, serial_tokens, name, kwargs):
    """At T in {0.3, 0.6, 1.0}, with and without top-k / top-p / min-p, every token equals the
    serial control's under the same sampler, through the graphed steps, windows, rollbacks,
    coupled drafts and graphed picks; greedy after sampling is still the greedy stream."""
    dec = get_decoder(name, **kwargs)
    dec.prepare(models["tiny"])
    assert dec.config()["graphs"] is True and dec.sampling
    if name != "fast-serial":  # graphed runtime: a window's rows in one call unless asked otherwise
        assert dec.config()["lazy_rows"] is kwargs.get("lazy_rows", False)
    assert_samples_as_serial(dec, sampled_serial_tokens, serial_tokens, drafts_kept=name == "spec-instrument" and "depth" in kwargs)


@pytest.mark.parametrize("spread", [True, False])
@pytest.mark.parametrize("kwargs", [{"alpha": 0.8, "depth": 4, "lazy_rows": True}, {"alpha": 0.8, "depth": 3}])
def test_sampling_is_exact_whichever_way_the_eager_rows_run(models, sampled_serial_tokens, serial_tokens, kwargs, spread):
    """``measure_costs`` picks by timing whether a window's eager attention rows run on the lanes
    or in order, so a loaded card may take the way an idle one never does: both, forced, sample
    as the serial control does."""
    dec = get_decoder("spec-instrument", **kwargs)
    dec.prepare(models["tiny"])
    assert dec.runtime.lanes.width > 1
    dec.runtime.spread_eager_rows(spread)
    assert dec.config()["eager_rows_on_lanes"] is spread
    assert_samples_as_serial(dec, sampled_serial_tokens, serial_tokens, drafts_kept=True)


def assert_samples_as_serial(dec, sampled_serial_tokens, serial_tokens, drafts_kept: bool) -> None:
    """Every sampled decode, twice, and then a greedy one, equal the serial control's tokens."""
    prompts, want = sampled_serial_tokens
    accepted = 0
    for sampler in SAMPLED:
        for ids, ref in zip(prompts, want[sampler]):
            for _ in range(2):  # a second decode reuses every captured graph
                res = dec.decode(ids, 64, sampler=sampler)
                assert res.tokens == ref, (sampler, ids[:4])
            accepted += res.stats.accepted
    if drafts_kept:
        assert accepted > 0
    greedy_prompts, greedy_want = serial_tokens
    assert dec.decode(greedy_prompts[0], 96).tokens == greedy_want[0]


def window_rows(rt, prompt: list[int], stream: list[int], w: int) -> list[torch.Tensor]:
    """Every row's logits of windows of w true tokens along the stream, each accepted whole."""
    dev = rt.device
    rt.prefill(prompt)
    out, c = [], 0
    while c + w <= len(stream):
        prog = rt.verify(torch.tensor([stream[c:c + w]], device=dev))
        out += [prog.ws["logits"][:, i].clone() for i in range(w)]
        rt.accept(w)
        c += w
    return out


@pytest.mark.parametrize("which", ["tiny", "other"])
def test_gate_up_in_one_buffer_keeps_the_control_and_one_gemm_equals_it(which):
    """On a model never stacked before: moving each MLP's gate and up weights into one buffer adds
    no memory and leaves the control's logits (prefills of 1, 29 and 300 tokens, then its steps)
    bit for bit as they were; then the graphed runtime as calibrated (one GEMM for windows of up to
    ``cal.gate_up`` rows) and the two-GEMM runtime give the control's logits at every window size
    1..8 and every step."""
    from decoders.runtime.gate_up import stack_gate_up

    if which == "tiny":
        model = load_model("tiny", "cuda")
    else:
        other = random_model()
        model = dataclasses.replace(other, backbone=other.backbone.to("cuda"), device=torch.device("cuda"), extra={})
    prompts = [random_prompt(model, n, seed=n) for n in (1, 29, 300)]
    before = [control(model, p, 24)[:2] for p in prompts]
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    buffers = stack_gate_up(model.backbone)
    torch.cuda.synchronize()
    assert len(buffers) == len(model.backbone.model.layers) and torch.cuda.memory_allocated() == allocated
    after = [control(model, p, 24)[:2] for p in prompts]
    for (s0, l0), (s1, l1) in zip(before, after):
        assert s0 == s1 and all(torch.equal(a, b) for a, b in zip(l0, l1))

    windows = tuple(range(1, 9))
    one = ExactRuntime(model, capacity=512, windows=windows)
    two = ExactRuntime(model, capacity=512, windows=windows, cal=one.cal, stack_gate_up=False)
    assert one.gate_up_rows == one.cal.gate_up and two.gate_up_rows == 0
    assert all(bool(one.program(w, capture=True).gate_up) == (w <= one.cal.gate_up) for w in windows)
    prompt, (stream, ref) = prompts[1], before[1]
    for w in windows:
        for rt in (one, two):
            rows = window_rows(rt, prompt, stream, w)
            assert len(rows) == len(stream) // w * w
            for i, row in enumerate(rows):
                assert torch.equal(row, ref[i + 1]), f"gate_up_rows {rt.gate_up_rows}, window {w}, position {i}"
    for rt in (one, two):
        rt.prefill(prompt)
        for k, t in enumerate(stream):
            prog = rt.step(torch.tensor([[t]], device=model.device))
            assert torch.equal(prog.ws["logits"][:, -1], ref[k + 1]), f"gate_up_rows {rt.gate_up_rows}, step {k}"
