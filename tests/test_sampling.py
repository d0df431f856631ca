"""The seeded sampler (core/sampling.py): an exact sample of the filtered softmax, a pure function
of (seed, position, logits), greedy at T = 0, and one-line errors for descriptions that are not a
sampler."""
import math

import pytest
import torch
from scipy import stats

from core.sampling import (GREEDY, NAME, PRESETS, Sampler, SamplerError, allowed_mask, gumbel, hash_bits,
                           pick_from_keys, pick_rows_from_keys, position_key, probabilities, ranked)


def test_hash_is_exact_32_bit_and_matches_python_integers():
    # the tensor hash and the same integer arithmetic on Python ints agree for every v
    from core.sampling import _fmix32, position_key
    k1, k2 = position_key(12345, 678)
    h = hash_bits(12345, 678, 300)
    want = [_fmix32((_fmix32(v ^ k1) + k2) & 0xFFFFFFFF) for v in range(300)]
    assert h.tolist() == want
    assert int(h.min()) >= 0 and int(h.max()) < 2 ** 32


def test_hash_steps_on_tensors_equal_the_integer_arithmetic():
    # the one-kernel multiply-add of _mul32 and the split position keys, on int64 tensors, against
    # Python's exact integers (seeds above 2**63 - 1 as their two's-complement int64)
    from core.sampling import _M32, _fmix32, _mul32, position_key, seed_key
    gen = torch.Generator().manual_seed(5)
    xs = torch.randint(0, 2 ** 32, (2000,), dtype=torch.int64, generator=gen)
    for c in (0x7FEB352D, 0x846CA68B, 1, _M32):
        assert _mul32(xs, c).tolist() == [(x * c) & _M32 for x in xs.tolist()]
    assert _fmix32(xs).tolist() == [_fmix32(x) for x in xs.tolist()]
    for seed in (0, 7, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1):
        t = torch.tensor(seed - (1 << 64) if seed >= 1 << 63 else seed)
        assert int(seed_key(t)) == seed_key(seed)
        for position in (0, 41, 2 ** 32 + 3):
            assert [int(k) for k in position_key(t, torch.tensor(position))] == list(position_key(seed, position))


def test_noise_depends_on_seed_position_and_token_only():
    g = gumbel(7, 100, 50)
    assert torch.equal(g, gumbel(7, 100, 50))
    assert torch.equal(g[:20], gumbel(7, 100, 20))  # the vocabulary size changes no value
    assert not torch.equal(g, gumbel(8, 100, 50))
    assert not torch.equal(g, gumbel(7, 101, 50))
    assert len(set(g.tolist())) == 50


def test_noise_is_standard_gumbel():
    g = torch.cat([gumbel(s, p, 64) for s in range(20) for p in range(50)]).numpy()
    assert stats.kstest(g, stats.gumbel_r.cdf).pvalue > 1e-3
    assert abs(g.mean() - 0.5772156649) < 0.02


def test_greedy_is_argmax_bit_for_bit():
    torch.manual_seed(0)
    for _ in range(20):
        row = torch.randn(1, 97)
        row[0, 5] = row.max()  # a tie: the first index wins, as argmax does
        assert GREEDY.pick(row, 3) == int(row[0].argmax())
    assert Sampler(temperature=0, top_k=3, top_p=0.5, seed=9).greedy


@pytest.mark.parametrize("sampler", [
    Sampler(temperature=1.0),
    Sampler(temperature=0.6),
    Sampler(temperature=0.7, top_k=4),
    Sampler(temperature=1.0, top_p=0.8),
    Sampler(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05),
])
def test_chi_square_against_the_filtered_softmax(sampler):
    """Over many seeds (and positions), the sampled tokens follow the analytic filtered softmax."""
    torch.manual_seed(1)
    logits = torch.randn(10) * 1.5
    want = probabilities(logits, sampler).numpy()
    draws = 6000
    counts = torch.zeros(10)
    for seed in range(draws):
        s = Sampler(temperature=sampler.temperature, top_k=sampler.top_k, top_p=sampler.top_p,
                    min_p=sampler.min_p, seed=seed)
        counts[s.pick(logits, seed % 7)] += 1
    support = want > 0
    assert counts[torch.from_numpy(~support)].sum() == 0  # nothing outside the allowed set
    observed = counts.numpy()[support]
    expected = want[support] * draws
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_filters():
    z = torch.tensor([3.0, 1.0, 2.0, 2.0, 0.0, -1.0], dtype=torch.float64)
    assert allowed_mask(z, Sampler(temperature=1, top_k=2)).tolist() == [True, False, True, False, False, False]
    assert allowed_mask(z, Sampler(temperature=1, top_k=3)).tolist() == [True, False, True, True, False, False]
    p = torch.softmax(z, 0)
    # top-p keeps the token that crosses p
    mask = allowed_mask(z, Sampler(temperature=1, top_p=float(p[0]) + 1e-9))
    assert mask.tolist() == [True, False, True, False, False, False]
    assert allowed_mask(z, Sampler(temperature=1, top_p=1e-6)).tolist() == [True] + [False] * 5
    mask = allowed_mask(z, Sampler(temperature=1, min_p=math.exp(-1.5)))
    assert mask.tolist() == [True, False, True, True, False, False]


def reference_pick(logits: torch.Tensor, sampler: Sampler, position: int) -> int:
    """The module docstring's definition over the whole vocabulary in plain Python: rank by the
    float32 logit (equal ones by the smaller id), top-k, top-p and min-p in rank order, then the
    argmax of z + G over the kept tokens, ties to the smallest id."""
    vocab = logits.numel()
    rank_of = [float(x) for x in logits.float()]
    order = sorted(range(vocab), key=lambda v: (-rank_of[v], v))
    k = sampler.top_k if 0 < sampler.top_k < vocab else vocab
    cand = order[:k]
    z = {v: float(logits[v].double()) / sampler.temperature for v in cand}
    kept = list(cand)
    if sampler.top_p < 1:
        top = z[cand[0]]
        mass = [math.exp(z[v] - top) for v in cand]
        total, before, kept = sum(mass), 0.0, []
        for v, m in zip(cand, mass):
            if not kept or before < sampler.top_p:
                kept.append(v)
            before += m / total
    if sampler.min_p > 0:
        top = z[cand[0]]
        kept = [v for v in kept if math.exp(z[v] - top) >= sampler.min_p]
    noise = gumbel(sampler.seed, position, vocab).tolist()
    return max(sorted(kept), key=lambda v: z[v] + noise[v])  # max keeps the first (smallest id) of equals


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_picks_follow_the_definition_over_the_whole_vocabulary(dtype):
    """The candidate-based pick (a top-k of unique keys, filters on k values, noise at k ids) is
    the definition written over the whole vocabulary, ties and signed zeros included."""
    torch.manual_seed(5)
    samplers = [Sampler(temperature=0.6, top_k=20, top_p=0.95), Sampler(temperature=1.0, top_p=0.9),
                Sampler(temperature=0.3), Sampler(temperature=0.7, top_k=5, min_p=0.1),
                Sampler(temperature=1.0, top_k=3)]
    for trial in range(30):
        row = (torch.randn(300) * 2).to(dtype)
        row[::7] = row[3]  # many equal logits, some at the top-k boundary
        row[10], row[11] = -0.0, 0.0
        if trial % 3 == 0:
            row[50] = row.max()  # a tie at the top
        for s in samplers:
            s = Sampler(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, seed=trial)
            assert s.pick(row, 100 + trial) == reference_pick(row, s, 100 + trial), (trial, s)


def test_ranking_is_by_value_then_id():
    row = torch.tensor([1.0, 3.0, -0.0, 3.0, 0.0, -2.0, float("-inf"), 2.0])
    assert ranked(row, 8).tolist() == [1, 3, 7, 0, 2, 4, 5, 6]
    assert ranked(row, 3).tolist() == [1, 3, 7]
    with pytest.raises(ValueError, match="2\\*\\*20"):
        ranked(torch.zeros((1 << 20) + 1), 4)



def test_rows_equal_lone_picks():
    torch.manual_seed(2)
    rows = torch.randn(5, 33)
    s = Sampler(temperature=0.8, top_k=10, top_p=0.9, seed=4)
    assert s.pick_rows(rows, 40).tolist() == [s.pick(rows[i], 40 + i) for i in range(5)]
    assert GREEDY.pick_rows(rows, 0).tolist() == rows.argmax(-1).tolist()


WINDOW_SAMPLERS = [Sampler(temperature=0.6, top_k=20, top_p=0.95), Sampler(temperature=0.7, top_k=20, top_p=0.8),
                   Sampler(temperature=1.0, top_p=0.9), Sampler(temperature=0.3), Sampler(temperature=1.0, top_k=3),
                   Sampler(temperature=0.7, top_k=5, min_p=0.1), Sampler(temperature=0.5, min_p=0.2),
                   Sampler(temperature=1.0, top_k=50, top_p=0.5, min_p=0.05)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_window_of_rows_in_one_call_picks_each_rows_lone_token(dtype):
    """``pick_rows_from_keys``: every row the token ``pick_from_keys`` gives it alone, ties, signed
    zeros and one-row windows included, for every filter combination."""
    torch.manual_seed(9)
    for trial in range(12):
        n = 1 + trial % 6
        rows = (torch.randn(n, 400) * 2).to(dtype)
        rows[:, ::9] = rows[:, 4:5]  # equal logits, some at the top-k boundary
        rows[0, 10], rows[-1, 11] = -0.0, 0.0
        rows[n // 2, 60] = rows[n // 2].max()  # a tie at the top
        for s in WINDOW_SAMPLERS:
            s = Sampler(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, seed=1000 + trial)
            keys = [position_key(s.seed, 50 + trial + r) for r in range(n)]
            k1 = torch.tensor([k[0] for k in keys])
            k2 = torch.tensor([k[1] for k in keys])
            alone = [int(pick_from_keys(rows[r], s, *keys[r])) for r in range(n)]
            assert pick_rows_from_keys(rows, s, k1, k2).tolist() == alone, (trial, s)
            assert alone == [s.pick(rows[r], 50 + trial + r) for r in range(n)]


def test_parse_presets_and_json_round_trip():
    s = Sampler.parse("qwen-thinking,seed=7")
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.6, 0.95, 20, 7)
    assert Sampler.parse("temperature=0.3,top_k=5,seed=1") == Sampler(temperature=0.3, top_k=5, seed=1)
    assert Sampler.parse("greedy") == GREEDY
    assert Sampler.parse("t=1.0") == Sampler(temperature=1.0)
    for name in PRESETS:
        assert Sampler.from_json(Sampler.parse(name).to_json()) == Sampler.parse(name)
    assert Sampler.from_json(None) == GREEDY
    assert Sampler.parse(s.describe()) == s
    assert s.to_json()["name"] == NAME


@pytest.mark.parametrize("text", ["", "hot", "temperature=-1", "temperature=nan", "top_p=0", "top_p=1.5",
                                  "top_k=-2", "top_k=2.5", "min_p=1", "seed=-1", "seed=x", "foo=1",
                                  "seed=1,qwen-thinking", "temperature=0.5,,seed=1", f"seed={2 ** 64}"])
def test_bad_descriptions_are_sampler_errors(text):
    with pytest.raises(SamplerError):
        Sampler.parse(text)


@pytest.mark.parametrize("doc", [{"name": "other"}, {"name": NAME, "temperature": True}, [1],
                                 {"name": NAME, "temperature": 0.5, "extra": 1}, {"name": NAME, "seed": 1.5}])
def test_bad_json_is_a_sampler_error(doc):
    with pytest.raises(SamplerError):
        Sampler.from_json(doc)


@pytest.mark.parametrize("text", ["top_k=5", "top_p=0.5,seed=3", "min_p=0.1", "qwen-thinking,temperature=0"])
def test_a_filter_at_temperature_0_is_refused_not_ignored(text):
    with pytest.raises(SamplerError, match="has no effect at temperature 0"):
        Sampler.parse(text)


@pytest.mark.parametrize("text", ["seed=7", "min_p=0,seed=3"])
def test_a_seed_without_a_temperature_is_refused_not_ignored(text):
    """A seed with no temperature draws nothing: as with a filter, the user meant to sample. A
    temperature of 0 or the greedy preset, given with it, says greedy was meant."""
    with pytest.raises(SamplerError, match=r"seed=\d without a temperature samples nothing"):
        Sampler.parse(text)
    assert Sampler.parse("greedy,seed=3").greedy and Sampler.parse("temperature=0,seed=2").greedy


@pytest.mark.parametrize("text,match", [
    ("seed=7,seed=8", "sampler key 'seed' given twice"),
    ("temperature=0.6,t=0", "sampler key 'temperature' given twice"),
    ("qwen-thinking,qwen-instruct", "preset 'qwen-instruct' must come first"),
    ("top_k=1.5", "top_k='1.5' is not an integer"),
    ("temperature=warm", "temperature='warm' is not a number"),
])
def test_a_description_error_says_what_is_wrong(text, match):
    with pytest.raises(SamplerError, match=match):
        Sampler.parse(text)
