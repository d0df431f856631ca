"""Plain steps with the host one step behind (decoders/stepping.py): the order of steps and reads,
where a decode stops, and the same tokens as the loop that reads each token first."""
import dataclasses

import pytest
import torch

from core.sampling import Sampler
from decoders.fast_serial import FastSerialDecoder
from decoders.serial import SerialDecoder
from decoders.stepping import TokenReader, steps_read_ahead
from fixtures.prompts import DEV_PROMPTS


class Script:
    """A fake device: step n returns token stream[n]; every step, post and read is logged."""

    def __init__(self, stream):
        self.stream, self.n, self.log = stream, 0, []
        self.slots = {}
        self.slot = 0

    def step(self, y):
        assert y.item() == (self.stream[self.n - 1] if self.n else -1)  # consumes the last step's token
        self.log.append(("step", self.n))
        tok = torch.tensor([self.stream[self.n]])
        self.n += 1
        return tok

    def post(self, token):
        s, self.slot = self.slot, self.slot ^ 1
        assert s not in self.slots, "a slot was overwritten before it was read"
        self.slots[s] = int(token)
        self.log.append(("post", int(token)))
        return s

    def read(self, slot):
        tok = self.slots.pop(slot)
        self.log.append(("read", tok))
        return tok


def run(stream, count, eos=()):
    fake = Script(stream)
    seen = []
    out, y, ran = steps_read_ahead(fake.step, torch.tensor([-1]), count, set(eos), fake, seen.append)
    return fake, out, y, ran, seen


def test_each_step_is_queued_before_the_token_before_it_is_read():
    fake, out, y, ran, seen = run([10, 11, 12, 13], 4)
    assert out == seen == [10, 11, 12, 13] and ran == 4 and int(y) == 13
    assert fake.log == [("step", 0), ("post", 10), ("step", 1), ("post", 11), ("read", 10),
                        ("step", 2), ("post", 12), ("read", 11), ("step", 3), ("post", 13), ("read", 12),
                        ("read", 13)]


@pytest.mark.parametrize("count", [0, 1, 2, 5])
def test_never_more_steps_than_asked(count):
    fake, out, _, ran, _ = run(list(range(20, 40)), count)
    assert out == list(range(20, 20 + count)) and ran == count == fake.n
    assert not fake.slots  # every posted token was read


def test_an_eos_waits_for_the_step_queued_after_it_and_stops():
    fake, out, _, ran, seen = run([5, 6, 7, 8, 9], 5, eos=(7,))
    assert out == seen == [5, 6, 7]
    assert ran == fake.n == 4  # the step after the EOS was queued before the EOS was read
    assert fake.log[-1] == ("read", 8) and not fake.slots  # ... and waited for inside the call


def test_an_eos_on_the_last_allowed_step_queues_nothing_more():
    fake, out, _, ran, _ = run([5, 6, 7], 3, eos=(7,))
    assert out == [5, 6, 7] and ran == fake.n == 3


def test_token_reader_on_the_cpu_reads_what_it_posted():
    reader = TokenReader(torch.device("cpu"))
    a = reader.post(torch.tensor([[41]]))
    b = reader.post(torch.tensor([42]))
    assert a != b and reader.read(a) == 41 and reader.read(b) == 42


@pytest.fixture(scope="module")
def prompts(tiny, tiny_tokenizer):
    return [tiny_tokenizer.encode(p["text"]) for p in DEV_PROMPTS[:3]]


@pytest.mark.parametrize("sampler", [None, Sampler(temperature=0.8, top_k=20, seed=3)])
def test_fast_serial_reading_ahead_emits_the_loop_that_reads_first(tiny, prompts, sampler):
    ahead, first = FastSerialDecoder(capacity=128), FastSerialDecoder(capacity=128, read_ahead=False)
    ahead.prepare(tiny)
    first.prepare(tiny)
    assert ahead.config()["read_ahead"] is True and first.config()["read_ahead"] is False
    for ids in prompts:
        for n in (1, 2, 3, 30):
            got, batches = [], []
            res = ahead.decode(ids, n, on_tokens=batches.append, sampler=sampler)
            want = first.decode(ids, n, sampler=sampler)
            assert res.tokens == want.tokens
            assert [t for b in batches for t in b] == res.tokens and all(len(b) == 1 for b in batches)
            assert want.stats.forwards == len(res.tokens)
            early_eos = res.tokens[-1] in tiny.eos_token_ids and len(res.tokens) < n
            assert res.stats.forwards == len(res.tokens) + early_eos  # the step queued past an EOS ran


@pytest.mark.parametrize("at", [0, 1, 9])
def test_fast_serial_reading_ahead_stops_at_eos(tiny, prompts, at):
    serial = SerialDecoder()
    serial.prepare(tiny)
    stream = serial.decode(prompts[0], 30).tokens
    model = dataclasses.replace(tiny, eos_token_ids=(stream[at],))
    want = stream[:stream.index(stream[at]) + 1]
    ref = SerialDecoder()
    ref.prepare(model)
    after = ref.decode(prompts[1], 30).tokens
    for dec in (FastSerialDecoder(capacity=128), FastSerialDecoder(capacity=128, read_ahead=False)):
        dec.prepare(model)
        batches = []
        assert dec.decode(prompts[0], 30, on_tokens=batches.append).tokens == want
        assert [t for b in batches for t in b] == want
        assert dec.decode(prompts[1], 30).tokens == after  # the step past the EOS left nothing behind


def test_read_ahead_must_be_a_bool():
    with pytest.raises(ValueError, match="read_ahead"):
        FastSerialDecoder(read_ahead="yes")


@pytest.mark.parametrize("sampler", [None, Sampler(temperature=0.8, top_k=20, seed=3)])
def test_spec_streams_each_plain_step_and_counts_its_forwards_as_fast_serial(tiny, prompts, sampler):
    """spec's plain steps reach ``on_tokens`` one token each, as read; its forwards count the step
    queued past an EOS as fast-serial's do."""
    from decoders.spec import SpecDecoder

    serial = SerialDecoder()
    serial.prepare(tiny)
    stream = serial.decode(prompts[0], 30, sampler=sampler).tokens
    model = dataclasses.replace(tiny, eos_token_ids=(stream[20],))
    fast, spec = FastSerialDecoder(capacity=128), SpecDecoder(depth=0)
    fast.prepare(model)
    spec.prepare(model)
    for n in (30, 5):
        want = fast.decode(prompts[0], n, sampler=sampler)
        batches = []
        got = spec.decode(prompts[0], n, on_tokens=batches.append, sampler=sampler)
        assert got.tokens == want.tokens and [t for b in batches for t in b] == got.tokens
        assert all(len(b) == 1 for b in batches)
        assert got.stats.forwards == want.stats.forwards
