"""The runtime's prefill forward against transformers' forward, bit for bit: the final hidden states
and every cache tensor, for prompts across chunk boundaries, on tiny and on a config with other
head counts (q/k repeated); the chunked rule alone against transformers' function. The graphed
scan is checked on a GPU (test_cuda.py)."""
import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from decoders.runtime.prefill import CHUNK, ScanGraphs, cache_tensors, chunk_rule, control_forward, prefill_forward
from test_runtime import random_model

LENGTHS = (1, 5, 63, 64, 65, 130)


@pytest.fixture(scope="module")
def other():
    return random_model()


@pytest.mark.parametrize("which", ["tiny", "other"])
@pytest.mark.parametrize("length", LENGTHS)
def test_prefill_forward_equals_the_control(which, length, request):
    model = request.getfixturevalue(which)
    text = model.backbone.model
    gen = torch.Generator().manual_seed(length)
    ids = torch.randint(3, text.config.vocab_size, (1, length), generator=gen)
    want_hidden, want_cache = control_forward(text, ids)
    got_hidden, got_cache = prefill_forward(text, ids)
    assert torch.equal(got_hidden, want_hidden)
    want, got = cache_tensors(want_cache, text.config), cache_tensors(got_cache, text.config)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("length", (1, 64, 100, 200))
def test_chunk_rule_equals_transformers(length):
    gen = torch.Generator().manual_seed(length)
    heads, dim = 4, 16
    query, key, value = (torch.randn(1, length, heads, dim, generator=gen).to(torch.bfloat16) for _ in range(3))
    beta = torch.rand(1, length, heads, generator=gen).to(torch.bfloat16)
    g = -torch.rand(1, length, heads, generator=gen)
    want_out, want_state = hf.torch_chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=None,
                                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
    got_out, got_state = chunk_rule(query, key, value, g, beta)
    assert torch.equal(got_out, want_out) and torch.equal(got_state, want_state)


@pytest.mark.parametrize("which", ["tiny", "other"])
def test_scan_buffers_and_views_keep_every_bit(which, request):
    """The graphed scan's data path (inputs copied into shared buffers, per-chunk-count views, the
    output and state handed back) with a plain call in place of each graph, which is what it is
    off a GPU: prompts within its chunk range and past it (eager) equal the control's prefill."""
    model = request.getfixturevalue(which)
    text = model.backbone.model
    scan = ScanGraphs(text.config, 2, "cpu")
    assert sorted(scan.graphs) == [1, 2] and scan.prove_each() is None
    for length in (1, CHUNK, CHUNK + 1, 2 * CHUNK, 2 * CHUNK + 1):
        ids = torch.randint(3, text.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        want_hidden, want_cache = control_forward(text, ids)
        got_hidden, got_cache = prefill_forward(text, ids, scan)
        assert torch.equal(got_hidden, want_hidden)
        assert all(torch.equal(g, w) for g, w in zip(cache_tensors(got_cache, text.config),
                                                      cache_tensors(want_cache, text.config)))


def test_the_runtime_takes_only_a_proven_prefill(tiny, monkeypatch):
    """Graphed scan where graphs are on (off a GPU its graphs are plain calls), else the eager rule;
    a rule that moves one value is refused, down to the control's own forward."""
    import dataclasses

    from decoders.runtime import prefill

    model = dataclasses.replace(tiny, extra={})
    rule, how = prefill.choose_prefill(model, 512, use_graphs=False)
    assert rule is prefill.padded_rule and how == "eager scan, proven"
    rule, how = prefill.choose_prefill(model, 512, use_graphs=True)
    assert isinstance(rule, ScanGraphs) and how == "graphed scan up to 8 chunks, proven"

    exact = prefill.padded_rule

    def off_by_a_little(*args):
        out, state = exact(*args)
        return out, state + 1e-3

    assert prefill.prove(model.backbone.model, off_by_a_little, 512) == "the cache differs at 37 tokens"
    monkeypatch.setattr(prefill, "padded_rule", off_by_a_little)
    rule, how = prefill.choose_prefill(dataclasses.replace(tiny, extra={}), 512, use_graphs=True)
    assert rule is None and how.endswith("the control's forward") and "graphed scan: the cache differs" in how
