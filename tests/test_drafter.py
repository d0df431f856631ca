"""The drafter's catch-up over static buffers (CUDA graphs on the GPU, the same functions eagerly
here) drafts exactly what a plain ``forward_rows`` catch-up drafts (CPU, tiny).

The reference builds every row, catch-up and chained, with ``forward_rows``; the drafter under test
copies the pending rows into its per-row-count static buffers and runs its pre/attention/post split
(in chunks of graphed sizes past ``max_rows``). Same ops on the CPU, so the same bits.
"""
import pytest
import torch

from decoders.drafter import MTPDrafter, catch_up_sizes, split_rows
from decoders.spec import SpecDecoder

# (pending rows m, depth) per round: every m up to 8, repeats, and catch-ups past max_rows,
# including ones longer than the largest graphed chunk (as after a run of plain steps)
ROUNDS = [(1, 1), (3, 4), (8, 2), (2, 6), (5, 1), (1, 3), (11, 3), (7, 7), (4, 2), (6, 5), (1, 6), (2, 1),
          (16, 2), (40, 1), (65, 3), (1, 1)]


@torch.inference_mode()
def reference_draft(dr: MTPDrafter, hidden: torch.Tensor, tokens: torch.Tensor, depth: int) -> list[int]:
    """The straightforward catch-up: every head row through ``forward_rows``, in the drafter's
    chunks (a chunk's rows are one batched forward, whose rounding depends on its row count)."""
    start, done = dr.filled, 0
    for rows in dr.catch_up_chunks(tokens.shape[-1]):
        out = dr.forward_rows(hidden[:, done:done + rows], tokens[:, done:done + rows], start + done)[:, -1:]
        done += rows
    pos = dr.filled = start + tokens.shape[-1]
    drafts = [dr.draft_token(out).view(1, 1)]
    for _ in range(depth - 1):
        out = dr.forward_rows(out, drafts[-1], pos)
        drafts.append(dr.draft_token(out).view(1, 1))
        pos += 1
    return [int(d) for d in drafts]


@pytest.mark.parametrize("max_rows", [8, 3])
def test_catch_up_drafts_equal_forward_rows_reference(tiny, max_rows):
    cap = 256
    dr, ref = MTPDrafter(tiny, cap, max_rows=max_rows), MTPDrafter(tiny, cap, max_rows=max_rows)
    assert sorted(dr._rows) == list(range(1, max_rows + 1)) + [16, 32, 64]
    g = torch.Generator().manual_seed(max_rows)
    tokens = torch.randint(tiny.vocab_size, (1, cap), generator=g)
    hidden = torch.randn(1, cap, tiny.backbone.config.hidden_size, generator=g).to(dr.keys.dtype)
    prompt = 10
    for d in (dr, ref):
        d.prefill(hidden[:, :prompt], tokens[0, :prompt].tolist())
    pos, seen = prompt - 1, set()
    for m, depth in ROUNDS:
        rows_h, rows_t = hidden[:, pos:pos + m], tokens[:, pos + 1:pos + 1 + m]  # (h_p, t_{p+1})
        got = [int(d) for d in dr.draft(rows_h, rows_t, depth)]
        assert got == reference_draft(ref, rows_h, rows_t, depth), (m, depth)
        assert dr.filled == ref.filled == pos + m
        # every head row written so far, the chained ones included, is bit-identical
        assert torch.equal(dr.keys, ref.keys) and torch.equal(dr.values, ref.values)
        pos += m
        seen.update(got)
    assert len(seen) > 3  # the drafts really vary with the inputs


def test_long_catch_ups_split_into_graphed_chunks():
    sizes = catch_up_sizes(7, 4096)
    assert sizes == [1, 2, 3, 4, 5, 6, 7, 16, 32, 64]
    assert split_rows(7, sizes) == [7] and split_rows(16, sizes) == [16]
    assert split_rows(65, sizes) == [64, 1] and split_rows(12, sizes) == [7, 5]
    assert split_rows(200, sizes) == [64, 64, 64, 7, 1]
    assert catch_up_sizes(8, 20) == list(range(1, 9)) + [16]  # never past capacity
    assert catch_up_sizes(64, 4096) == list(range(1, 65))


def test_catch_up_checks_capacity(tiny):
    size = tiny.backbone.config.hidden_size
    dr = MTPDrafter(tiny, 12, max_rows=4)
    dr.prefill(torch.zeros(1, 10, size, dtype=dr.keys.dtype), list(range(10)))
    for m in (4, 5):  # graphed and eager: rows 9..9+m-1 do not fit in 12
        with pytest.raises(ValueError, match="capacity"):
            dr.draft(torch.zeros(1, m, size, dtype=dr.keys.dtype), torch.zeros(1, m, dtype=torch.long), 1)
    assert dr.filled == 9


def test_spec_sizes_catch_up_to_its_window(tiny):
    dec = SpecDecoder(max_depth=3)
    dec.prepare(tiny)
    assert sorted(dec.drafter._rows) == [1, 2, 3, 4, 16, 32, 64]  # accepted rows + 1 <= max_depth + 1; long chunks


def test_confidence_leaves_the_drafts_as_they_are_and_is_the_heads_probability_of_each(tiny):
    """``confidence=True``: the same drafts and head rows as without; after each draft ``in_conf``
    is the head's softmax probability of it; ``draft_until`` chains while ``more`` says so."""
    cap = 128
    plain, confident = MTPDrafter(tiny, cap, max_rows=4), MTPDrafter(tiny, cap, max_rows=4, confidence=True)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(tiny.vocab_size, (1, cap), generator=g)
    hidden = torch.randn(1, cap, tiny.backbone.config.hidden_size, generator=g).to(plain.keys.dtype)
    for d in (plain, confident):
        d.prefill(hidden[:, :8], tokens[0, :8].tolist())
    pos = 7
    for m, depth in ((1, 3), (3, 1), (2, 5), (4, 2)):
        rows_h, rows_t = hidden[:, pos:pos + m], tokens[:, pos + 1:pos + 1 + m]
        want = [int(t) for t in plain.draft(rows_h, rows_t, depth)]
        asked = []

        def more(confidences, depth=depth):
            asked.append(list(confidences))
            probs = torch.softmax(torch.nn.functional.linear(confident.in_hidden, confident.head_weight).float(), -1)
            assert confidences[-1] == float(probs.max())  # the draft just made: the head's argmax
            return len(confidences) < depth

        drafts, confidences = confident.draft_until(rows_h, rows_t, more)
        assert [int(t) for t in drafts] == want and len(confidences) == depth
        assert asked == [confidences[:k] for k in range(1, depth + 1)] and all(0 < c <= 1 for c in confidences)
        assert torch.equal(plain.keys, confident.keys)
        pos += m
    with pytest.raises(ValueError, match="confidence=True"):
        plain.draft_until(hidden[:, pos:pos + 1], tokens[:, pos + 1:pos + 2], lambda c: False)
