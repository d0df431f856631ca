"""``harness time``'s timing loop passes one sampler to every decode of both sides and to an
instrument's untimed ``prepare_prompt``; greedy, it passes no sampler at all (decoders that do not
sample take none). No model: the decoders record their calls."""
from types import SimpleNamespace

import pytest
import torch

from core.sampling import GREEDY, Sampler
from decoders.base import DecodeResult, DecodeStats
from harness.timing import Clock, time_prompt

NO_SAMPLER = "no sampler argument"


class Recorder:
    """An instrument that samples, recording the sampler of each call (or that none was given)."""

    name = "recorder"
    instrument = True
    sampling = True

    def __init__(self):
        self.calls = []

    def prepare_prompt(self, prompt_ids, max_new_tokens, **kwargs):
        self.calls.append(("prepare_prompt", kwargs.get("sampler", NO_SAMPLER)))

    def decode(self, prompt_ids, max_new_tokens, **kwargs):
        self.calls.append(("decode", kwargs.get("sampler", NO_SAMPLER)))
        return DecodeResult([1] * max_new_tokens, DecodeStats())


@pytest.mark.parametrize("sampler,passed", [(Sampler.parse("qwen-thinking,seed=3"), None), (GREEDY, NO_SAMPLER),
                                            (None, NO_SAMPLER)])
def test_every_call_of_both_sides_gets_the_sampler(sampler, passed):
    decoders = {"control": Recorder(), "candidate": Recorder()}
    prompt = SimpleNamespace(id="p", token_ids=[3, 4, 5])
    records = time_prompt(prompt, [6, 7, 8], decoders, 4, 2, 2, torch.device("cpu"), Clock.start(), sampler=sampler)
    assert sum(r["type"] == "leg" for r in records) == 4
    want = sampler if passed is None else passed
    for dec in decoders.values():
        # the untimed preparation, the warm-up, then two timed legs
        assert [c[0] for c in dec.calls] == ["prepare_prompt", "decode", "decode", "decode"]
        assert all(c[1] == want for c in dec.calls), dec.calls
