"""transformers' ``custom_generate`` hook: ``model.generate(..., custom_generate=DIR,
trust_remote_code=True)`` on a ``Qwen3_5ForCausalLM`` loaded the usual way returns exactly what
``generate(do_sample=False)`` returns, in the same shapes, decoded by ``spec``."""
from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from transformers import Qwen3_5ForCausalLM
from transformers.generation.streamers import BaseStreamer

from core.models import SMALL_DIR, TINY_DIR
from core.sampling import Sampler
from decoders import hf_generate
from decoders.hf_generate import CUSTOM_GENERATE_DIR
from decoders.serial import SerialDecoder

# on `small`, greedy decoding emits an EOS right after this prompt
EOS_PROMPT = "if __name__ == '__main__':\n    main()\n"
PROMPTS = ["def fib(n):", "import os\n", "The river ran", EOS_PROMPT]


@pytest.fixture(scope="module", params=["tiny", "small"])
def hf(request):
    transformers.logging.set_verbosity_error()
    path = {"tiny": TINY_DIR, "small": SMALL_DIR}[request.param]
    model = Qwen3_5ForCausalLM.from_pretrained(str(path))
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    return request.param, model, tok


def exact(model, ids, **kw):
    return model.generate(ids, custom_generate=CUSTOM_GENERATE_DIR, trust_remote_code=True, **kw)


def test_equals_greedy_generate_prompt_by_prompt(hf):
    name, model, tok = hf
    hit_eos = False
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)])
        want = model.generate(ids, do_sample=False, max_new_tokens=24)
        got = exact(model, ids, max_new_tokens=24)
        assert got.dtype == want.dtype == torch.long and torch.equal(got, want), prompt
        hit_eos |= want.shape[1] < ids.shape[1] + 24
    if name == "small":
        assert hit_eos, "EOS_PROMPT should end before max_new_tokens on small"
    # the exact decoder that ran was spec, with the checkpoint's MTP head
    assert {d.name for d in hf_generate._OPENED[model].values()} == {"spec"}


def test_batch_pads_after_eos_and_dict_output(hf):
    name, model, tok = hf
    a, b = tok.encode(EOS_PROMPT), tok.encode("def fib(n):")
    width = min(len(a), len(b))
    ids = torch.tensor([a[-width:], b[-width:]])  # equal lengths: no padding of prompts
    want = model.generate(ids, do_sample=False, max_new_tokens=16, return_dict_in_generate=True)
    got = exact(model, ids, max_new_tokens=16, return_dict_in_generate=True)
    assert type(got) is type(want)
    assert torch.equal(got.sequences, want.sequences)
    assert got.scores is None and got.logits is None
    plain = exact(model, ids, max_new_tokens=16, attention_mask=torch.ones_like(ids))
    assert torch.equal(plain, want.sequences)


def test_max_length_and_explicit_eos(hf):
    _, model, tok = hf
    ids = torch.tensor([tok.encode("import os\n")])
    want = model.generate(ids, do_sample=False, max_length=ids.shape[1] + 9)
    assert torch.equal(exact(model, ids, max_length=ids.shape[1] + 9), want)
    stream = want[0, ids.shape[1]:].tolist()
    eos = stream[4]
    want = model.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=eos, pad_token_id=eos)
    got = exact(model, ids, max_new_tokens=12, eos_token_id=eos, pad_token_id=eos)
    assert torch.equal(got, want) and got.shape[1] <= ids.shape[1] + stream.index(eos) + 1


class Collect(BaseStreamer):
    def __init__(self):
        self.puts = []
        self.ended = False

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_sees_prompt_then_every_token(hf):
    _, model, tok = hf
    ids = torch.tensor([tok.encode("def fib(n):")])
    theirs, ours = Collect(), Collect()
    model.generate(ids, do_sample=False, max_new_tokens=10, streamer=theirs)
    exact(model, ids, max_new_tokens=10, streamer=ours)
    assert ours.puts[0] == theirs.puts[0] == ids[0].tolist()
    assert sum(ours.puts[1:], []) == sum(theirs.puts[1:], []) and ours.ended


@pytest.mark.parametrize("kw,match", [
    ({"do_sample": True}, "do_sample"),
    ({"num_beams": 2}, "num_beams"),
    ({"repetition_penalty": 1.3}, "repetition_penalty"),
    ({"output_scores": True, "return_dict_in_generate": True}, "output_scores"),
    ({"attention_mask": torch.tensor([[0, 1, 1]])}, "attention_mask"),
])
def test_what_greedy_exactness_cannot_honour_is_refused(hf, kw, match):
    _, model, _ = hf
    with pytest.raises(ValueError, match=match):
        exact(model, torch.tensor([[5, 6, 7]]), max_new_tokens=4, **kw)


def test_seeded_sampler_gives_serial_sampling(hf):
    """``sampler=`` (this project's seeded sampler, not HF's do_sample) decodes exactly what the
    serial control samples with it; a bad one, or one for a greedy-only decoder, is refused."""
    _, model, tok = hf
    ids = torch.tensor([tok.encode("def fib(n):")])
    got = exact(model, ids, max_new_tokens=12, sampler="qwen-thinking,seed=2")
    control = SerialDecoder()
    control.prepare(hf_generate.loaded_model(model, hf_generate.token_ids(model.generation_config.eos_token_id)))
    want = control.decode(ids[0].tolist(), 12, sampler=Sampler.parse("qwen-thinking,seed=2")).tokens
    assert got[0, ids.shape[1]:].tolist() == want
    with pytest.raises(ValueError, match="sampler: temperature"):
        exact(model, ids, max_new_tokens=4, sampler="temperature=-1")
    with pytest.raises(ValueError, match="greedily only"):
        exact(model, ids, max_new_tokens=4, sampler="qwen-thinking", decoder="spec-naive")


def test_model_without_mtp_falls_back_to_fast_serial(tmp_path):
    transformers.logging.set_verbosity_error()
    model = Qwen3_5ForCausalLM.from_pretrained(str(TINY_DIR))
    model.save_pretrained(tmp_path)  # transformers drops mtp.*: a text-only checkpoint without a head
    bare = Qwen3_5ForCausalLM.from_pretrained(str(tmp_path))
    ids = torch.tensor([[5, 60, 70, 80]])
    want = bare.generate(ids, do_sample=False, max_new_tokens=12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = exact(bare, ids, max_new_tokens=12)
    assert torch.equal(got, want)
    assert any("fast-serial" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="MTP head"):
        exact(bare, ids, max_new_tokens=4, decoder="spec")


def test_other_dtype_is_refused():
    transformers.logging.set_verbosity_error()
    model = Qwen3_5ForCausalLM.from_pretrained(str(TINY_DIR), dtype=torch.float32)
    with pytest.raises(ValueError, match="bfloat16"):
        exact(model, torch.tensor([[5, 6, 7]]), max_new_tokens=4)
