"""The seeded sampler (core/sampling.py): an exact sample of the filtered softmax, a pure function
of (seed, position, logits), greedy at T = 0, and one-line errors for descriptions that are not a
sampler."""
import math

import pytest
import torch
from scipy import stats

from core.sampling import GREEDY, NAME, PRESETS, Sampler, SamplerError, allowed_mask, gumbel, hash_bits, probabilities


def test_hash_is_exact_32_bit_and_matches_python_integers():
    # the tensor hash and the same integer arithmetic on Python ints agree for every v
    from core.sampling import _fmix32, position_key
    k1, k2 = position_key(12345, 678)
    h = hash_bits(12345, 678, 300)
    want = [_fmix32((_fmix32(v ^ k1) + k2) & 0xFFFFFFFF) for v in range(300)]
    assert h.tolist() == want
    assert int(h.min()) >= 0 and int(h.max()) < 2 ** 32


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


def test_rows_equal_lone_picks():
    torch.manual_seed(2)
    rows = torch.randn(5, 33)
    s = Sampler(temperature=0.8, top_k=10, top_p=0.9, seed=4)
    assert s.pick_rows(rows, 40).tolist() == [s.pick(rows[i], 40 + i) for i in range(5)]
    assert GREEDY.pick_rows(rows, 0).tolist() == rows.argmax(-1).tolist()


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
