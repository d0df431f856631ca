"""The decoders under a seeded sampler (core/sampling.py) emit exactly the serial control's tokens
with the same sampler (CPU, tiny).

``fast-serial``, ``spec`` (fixed depths, adaptive, coupled and not, lazy and all-rows picking, a
shortlist) and ``spec-instrument`` (forced acceptance from the sampled control's stream) at
T in {0.3, 0.6, 1.0} with and without top-k / top-p / min-p and the two Qwen presets, over several
prompts and seeds, EOS stops included; T = 0 is today's greedy path; the per-row picks of a verify
window are the control's lone picks; the cheats of tests/bad_decoders.py are caught at their first
wrong token, with its position.
"""
import dataclasses
import json
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import bad_decoders
from core.sampling import Sampler, gumbel, noise_at, position_key
from decoders.drafter import DRAFT_CANDIDATES, MTPDrafter
from decoders.fast_serial import FastSerialDecoder
from decoders.policy import Costs
from decoders.runtime.runtime import ExactRuntime
from decoders.sampled import TargetPicks, device_seed, pick_at, settings
from decoders.serial import SerialDecoder
from decoders.spec import InstrumentedSpecDecoder, SpecDecoder
from fixtures.prompts import DEV_PROMPTS

SAMPLERS = [
    Sampler(temperature=0.3, seed=1),
    Sampler(temperature=0.6, seed=2),
    Sampler(temperature=1.0, seed=3),
    Sampler(temperature=0.3, top_k=5, min_p=0.05, seed=4),
    Sampler(temperature=0.6, top_k=8, top_p=0.9, seed=5),
    Sampler(temperature=1.0, top_p=0.8, seed=2 ** 64 - 1),
    Sampler.parse("qwen-thinking,seed=7"),
    Sampler.parse("qwen-instruct,seed=8"),
]
N = 24
# CPU windows are slow (eager), so measured costs keep an adaptive policy shallow; costs shaped like
# the H200's (bench/NOTES.md), with no online timing, make it draft deep
DEEP = Costs(step=1.0, draft=0.05, verify={w: 1 + 0.1 * (w - 1) for w in range(1, 8)})


@pytest.fixture(scope="module")
def serial(tiny):
    dec = SerialDecoder()
    dec.prepare(tiny)
    return dec


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    return [tiny_tokenizer.encode(p["text"]) for p in DEV_PROMPTS[:3]]


@pytest.fixture(scope="module")
def want(serial, prompts):
    """The control's tokens for (prompt index, sampler, n), each decoded once."""
    done = {}

    def get(i: int, sampler: Sampler | None, n: int = N) -> list[int]:
        if (i, sampler, n) not in done:
            done[i, sampler, n] = serial.decode(prompts[i], n, sampler=sampler).tokens
        return done[i, sampler, n]
    return get


@pytest.fixture(scope="module")
def shortlist_file(tmp_path_factory, want):
    """A request-independent shortlist: the most frequent ids of sampled and greedy text."""
    counts = Counter()
    for i in range(3):
        counts.update(want(i, None))
        counts.update(want(i, SAMPLERS[2]))
    path = tmp_path_factory.mktemp("shortlist") / "shortlist.json"
    path.write_text(json.dumps({"ids": [t for t, _ in counts.most_common(120)], "source": "test"}))
    return str(path)


def build(name: str, model, shortlist: str):
    dec = {
        "fast-serial": lambda: FastSerialDecoder(),
        "spec-d1": lambda: SpecDecoder(depth=1),
        "spec-d3": lambda: SpecDecoder(depth=3),
        "spec-d6-uncoupled": lambda: SpecDecoder(depth=6, coupled=False),
        "spec-adaptive": lambda: SpecDecoder(max_depth=4),
        "spec-d2-all-rows": lambda: SpecDecoder(depth=2, lazy_rows=False),
        "spec-d3-shortlist": lambda: SpecDecoder(depth=3, shortlist=shortlist),
        "inst-0.6-d4": lambda: InstrumentedSpecDecoder(alpha=0.6, depth=4, seed=1),
        "inst-0.9-adaptive": lambda: InstrumentedSpecDecoder(alpha=0.9, max_depth=6, seed=2, online_costs=False),
        "inst-1.0-d5-shortlist": lambda: InstrumentedSpecDecoder(alpha=1.0, depth=5, shortlist=shortlist),
        "inst-0.8-d5-all-rows": lambda: InstrumentedSpecDecoder(alpha=0.8, depth=5, seed=3, lazy_rows=False),
    }[name]()
    dec.prepare(model)
    if name == "inst-0.9-adaptive":
        dec.costs = DEEP
    return dec


@pytest.mark.parametrize("name", ["fast-serial", "spec-d1", "spec-d3", "spec-d6-uncoupled", "spec-adaptive",
                                  "spec-d2-all-rows", "spec-d3-shortlist", "inst-0.6-d4", "inst-0.9-adaptive",
                                  "inst-1.0-d5-shortlist", "inst-0.8-d5-all-rows"])
def test_sampled_tokens_equal_serial(tiny, prompts, want, shortlist_file, name):
    dec = build(name, tiny, shortlist_file)
    assert dec.sampling is True
    accepted = 0
    for k, sampler in enumerate(SAMPLERS):
        i = k % len(prompts)
        res = dec.decode(prompts[i], N, sampler=sampler)
        assert res.tokens == want(i, sampler), (name, sampler)
        accepted += res.stats.accepted
    if name.startswith("inst"):
        assert accepted > 0  # accepted runs, rollbacks and catch-ups under sampling really happened
    # the decoder goes back to greedy decoding, exactly
    assert dec.decode(prompts[0], N).tokens == want(0, None)


def test_several_seeds_one_sampler(tiny, prompts, serial):
    fs, spec = FastSerialDecoder(), SpecDecoder(depth=2)
    for dec in (fs, spec):
        dec.prepare(tiny)
    streams = set()
    for seed in (0, 11, 2 ** 40 + 3):
        s = Sampler.parse(f"qwen-thinking,seed={seed}")
        ref = serial.decode(prompts[1], 20, sampler=s).tokens
        streams.add(tuple(ref))
        assert fs.decode(prompts[1], 20, sampler=s).tokens == ref
        assert spec.decode(prompts[1], 20, sampler=s).tokens == ref
    assert len(streams) == 3  # the seed matters


def test_temperature_zero_is_todays_greedy(tiny, prompts, want):
    zero = Sampler(temperature=0.0, top_k=5, top_p=0.5, seed=9)
    assert zero.greedy
    for dec in (FastSerialDecoder(), SpecDecoder(depth=3), InstrumentedSpecDecoder(alpha=0.8, depth=3)):
        dec.prepare(tiny)
        for i in range(2):
            assert dec.decode(prompts[i], N, sampler=zero).tokens == dec.decode(prompts[i], N).tokens == want(i, None)
        # greedy never reaches the sampled path's picks
        assert dec.picks is None or dec.picks.picked == 0


def test_eos_stops_under_sampling(tiny, prompts, serial):
    s = SAMPLERS[4]
    stream = serial.decode(prompts[0], 40, sampler=s).tokens
    eos_model = dataclasses.replace(tiny, eos_token_ids=(stream[13],))
    ref = SerialDecoder()
    ref.prepare(eos_model)
    expect = ref.decode(prompts[0], 40, sampler=s).tokens
    assert expect[-1] == stream[13] and len(expect) < 40
    for dec in (FastSerialDecoder(), SpecDecoder(depth=2), SpecDecoder(depth=0),
                InstrumentedSpecDecoder(alpha=0.9, depth=5)):
        dec.prepare(eos_model)
        assert dec.decode(prompts[0], 40, sampler=s).tokens == expect


def test_instrument_prepares_the_sampled_controls_stream(tiny, prompts, want):
    dec = InstrumentedSpecDecoder(alpha=0.85, depth=3)
    dec.prepare(tiny)
    s = SAMPLERS[6]
    dec.prepare_prompt(prompts[2], N, sampler=s)  # as the harness calls it, untimed
    dec.prepare_prompt(prompts[2], N)
    assert dec.reference[(tuple(prompts[2]), s)][:N] == want(2, s)
    assert dec.reference[(tuple(prompts[2]), Sampler())][:N] == want(2, None)
    calls = []
    real = dec.prepare_prompt
    dec.prepare_prompt = lambda *a, **k: calls.append(1) or real(*a, **k)
    assert dec.decode(prompts[2], N, sampler=s).tokens == want(2, s)
    assert calls == []  # the prepared stream was used


def test_lazy_rows_default_follows_the_runtime_and_rejects_other_values(tiny):
    """auto (the default, also ``lazy_rows=none``): lazy rows on an eager runtime such as the
    CPU's, a window's rows in one call where graphs replay (tests/test_cuda.py); an explicit
    value is kept; anything else is refused before any model is touched."""
    for arg, want in (({}, True), ({"lazy_rows": None}, True), ({"lazy_rows": "auto"}, True),
                      ({"lazy_rows": False}, False)):
        dec = SpecDecoder(depth=2, **arg)
        dec.prepare(tiny)
        assert dec.config()["lazy_rows"] is want and dec.config()["graphs"] is False
    for bad in ("yes", 1, "false"):
        with pytest.raises(ValueError, match="lazy_rows must be true, false or auto"):
            SpecDecoder(lazy_rows=bad)


def test_lazy_rows_pick_only_the_rows_a_round_needs(tiny, prompts, want):
    s = SAMPLERS[1]
    for lazy in (True, False):
        dec = InstrumentedSpecDecoder(alpha=0.5, depth=5, seed=4, lazy_rows=lazy)
        dec.prepare(tiny)
        stats = dec.decode(prompts[0], N, sampler=s).stats
        rounds, plain = sum(stats.accept_hist.values()), stats.extra["depth_trace"].count(0)
        per_round = stats.accepted if lazy else stats.drafted
        assert stats.extra["rows_picked"] == per_round + rounds + plain
        assert stats.accepted < stats.drafted  # rejections happened, so lazy picked fewer rows


def test_coupling_raises_acceptance_on_the_random_head(tiny, prompts):
    """tiny's random head and model are both near uniform at T = 1: coupled, both argmaxes follow
    the same noise and agree often; uncoupled, the head's argmax almost never is the sample."""
    s = Sampler(temperature=1.0, seed=5)
    got = {}
    for coupled in (True, False):
        dec = SpecDecoder(depth=2, coupled=coupled)
        dec.prepare(tiny)
        got[coupled] = sum(dec.decode(ids, N, sampler=s).stats.accepted for ids in prompts)
    assert got[True] > 3 * got[False] + 3


def test_coupled_draft_is_the_argmax_with_the_targets_noise(tiny):
    ids = list(range(7, 400, 3))
    dr = MTPDrafter(tiny, 64, shortlist=ids, coupled=True)
    full = MTPDrafter(tiny, 64, coupled=True)
    s = Sampler(temperature=0.7, seed=2 ** 63 + 5)
    torch.manual_seed(0)
    for drafter, vocab in ((dr, torch.tensor(ids)), (full, torch.arange(tiny.vocab_size))):
        drafter.couple(s)
        for q in (3, 17, 250):
            row = torch.randn(1, 1, tiny.text_config.hidden_size).to(drafter.head_weight.dtype)
            logits = F.linear(row, drafter.head_weight).reshape(-1)
            score = logits.to(torch.float64) / 0.7 + gumbel(s.seed, q, tiny.vocab_size)[vocab]
            # only the head's DRAFT_CANDIDATES largest logits compete
            score[logits < torch.topk(logits, DRAFT_CANDIDATES).values[-1]] = -float("inf")
            assert int(drafter.coupled_token(row, torch.tensor([q]))) == int(vocab[score.argmax()])
        drafter.couple(None)
        assert not drafter.coupled
    with pytest.raises(ValueError, match="coupled"):
        MTPDrafter(tiny, 64).couple(s)


def test_pick_at_is_pick_tensor_with_the_position_keys_in_a_tensor():
    # the keys as the host computes them (exact integers) and as int64 tensor ops compute them
    # from a tensor seed and position: the same keys, the same pick
    torch.manual_seed(3)
    for vocab in (97, 4096):
        for k, sampler in enumerate(SAMPLERS):
            for position in (0, 5, 2 ** 33 + 7):
                row = (torch.randn(vocab) * 3).to(torch.bfloat16)
                row[vocab // 2] = row.max()  # a tie at the top
                want = sampler.pick_tensor(row, position)
                host = torch.tensor(position_key(sampler.seed, position))
                device = torch.stack(position_key(torch.tensor(device_seed(sampler.seed)), torch.tensor(position)))
                assert torch.equal(host, device), (sampler, position)
                assert int(pick_at(sampler, row, host)) == int(want), (sampler, position)


def test_device_seed_and_noise_at_ids():
    ids = torch.tensor([0, 5, 6, 511, 200, 3])
    for seed in (0, 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, 0xDEADBEEFCAFEF00D):
        t = torch.tensor(device_seed(seed))
        assert torch.equal(gumbel(t, torch.tensor(41), 512), gumbel(seed, 41, 512))
        assert torch.equal(noise_at(seed, 41, ids), gumbel(seed, 41, 512)[ids])
        assert torch.equal(noise_at(t, torch.tensor([41]), ids), gumbel(seed, 41, 512)[ids])


@torch.inference_mode()
def control_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The serial control's logits row after prompt + tokens (prefill, then one token per forward)."""
    lm = model.backbone
    cache = DynamicCache(config=lm.config)
    out = lm(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    for t in tokens:
        out = lm(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


@torch.inference_mode()
def test_window_rows_pick_as_the_controls_lone_rows(tiny, prompts, want):
    """Each row of a verify window, picked alone (its own call), is the control's pick from its
    own logits at that position: the rows' logits are the control's bits, and a row's pick does
    not see the others (pick_rows of the whole window gives the same)."""
    rt = ExactRuntime(tiny, capacity=128, windows=tuple(range(1, 7)))
    picks = TargetPicks(rt.device, use_graphs=False)
    prompt, stream = prompts[1], want(1, None)
    for w in (2, 6):
        for sampler in SAMPLERS:
            picks.bind(sampler)
            rt.prefill(prompt)
            start = rt.length
            prog = rt.verify(torch.tensor([stream[:w]]))
            rows = [int(picks.row(prog, r)) for r in range(w)]
            together = sampler.pick_rows(prog.ws["logits"][0], start + 1).tolist()
            lone = []
            for r in range(w):
                logits = control_logits(tiny, prompt, stream[:r + 1])
                assert torch.equal(prog.ws["logits"][0, r], logits)
                lone.append(sampler.pick(logits, start + r + 1))
            assert rows == lone == together, (w, sampler)
            rt.reset()


def first_wrong(got: list[int], want: list[int], prompt_len: int) -> tuple[int, int] | None:
    """(index, absolute position) of the first token that differs from the control's, or None."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i, prompt_len + i
    if len(got) != len(want):
        i = min(len(got), len(want))
        return i, prompt_len + i
    return None


CHEAT_SAMPLERS = [Sampler(temperature=1.0, top_k=5, seed=21), Sampler(temperature=1.0, top_p=0.8, seed=22),
                  Sampler.parse("qwen-thinking,seed=23")]


@pytest.mark.parametrize("cheat", ["OtherSeed", "ShiftedPositions", "DropsFilter", "DraftDistribution"])
def test_sampling_cheats_are_caught_at_their_first_wrong_token(tiny, prompts, serial, cheat):
    dec = getattr(bad_decoders, cheat)()
    dec.prepare(tiny)
    assert dec.sampling is True
    assert dec.decode(prompts[0], 16).tokens == serial.decode(prompts[0], 16).tokens  # greedy: honest
    for k, sampler in enumerate(CHEAT_SAMPLERS):
        ids = prompts[k % len(prompts)]
        expect = serial.decode(ids, 32, sampler=sampler).tokens
        got = dec.decode(ids, 32, sampler=sampler).tokens
        found = first_wrong(got, expect, len(ids))
        assert found is not None, (cheat, sampler)
        index, position = found
        assert position == len(ids) + index and got[:index] == expect[:index]
        # the prefix agrees, so the cheat saw the control's logits there: the control's pick is
        # the sampler's, and the cheat's token is its shortcut's (a draft the target never checked)
        logits = control_logits(tiny, ids, expect[:index])
        assert expect[index] == sampler.pick(logits, position)
        if cheat == "DraftDistribution":
            assert got[index] != sampler.pick(logits, position)
        else:
            assert got[index] == dec.choose(sampler, logits, position)


def test_one_call_windows_are_priced_by_their_own_timing(tiny):
    """With ``lazy_rows=false`` a window's prior adds its rows' one call, timed per width at the
    sampler's first decode, not w lone picks; lazy windows add w picks."""
    s = SAMPLERS[1]
    for lazy in (True, False):
        dec = SpecDecoder(lazy_rows=lazy)
        dec.prepare(tiny)
        dec.picks.bind(s)
        costs = dec.sampled_costs(s)
        pick, _, windows = dec._sampled_costs[settings(s)]
        assert bool(windows) is not lazy and pick > 0
        for w, base in dec.costs.verify.items():
            assert costs.verify[w] == base + (w * pick if lazy else windows[w])
