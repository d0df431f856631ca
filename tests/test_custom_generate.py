"""transformers' ``custom_generate`` hook: ``model.generate(..., custom_generate=DIR,
trust_remote_code=True)`` on a ``Qwen3_5ForCausalLM`` loaded the usual way returns exactly what
``generate(do_sample=False)`` returns, in the same shapes, decoded by ``spec``."""
from __future__ import annotations

import re
import warnings

import pytest
import torch
import transformers
from transformers import GenerationConfig, Qwen3_5ForCausalLM
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


def recorded(call):
    """call()'s result and the messages of the warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = call()
    return out, [str(w.message) for w in caught]


@pytest.mark.parametrize("length", [
    {}, {"max_new_tokens": None}, {"max_new_tokens": 6}, "max_length", "generation_config",
])
def test_length_is_generates_own(hf, length):
    """With no length argument greedy generate adds 20 tokens (with its warning on the default
    max_length), whatever the prompt length; max_length counts the prompt, in an argument or a
    GenerationConfig. custom_generate follows, shape and warning alike."""
    _, model, tok = hf
    text = tok.encode("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 4)
    for size in (5, 30):
        ids = torch.tensor([text[:size]])
        kw = ({"max_length": size + 7} if length == "max_length"
              else {"generation_config": GenerationConfig(max_length=size + 5)} if length == "generation_config"
              else length)
        want, theirs = recorded(lambda: model.generate(ids, do_sample=False, **kw))
        got, ours = recorded(lambda: exact(model, ids, **kw))
        assert torch.equal(got, want), (size, kw)
        if not kw or kw == {"max_new_tokens": None}:
            assert want.shape == (1, size + 20)
        default_warning = [m for m in theirs if "default `max_length`" in m]
        assert default_warning == [m for m in ours if "default `max_length`" in m]
        assert bool(default_warning) == (not kw or kw == {"max_new_tokens": None})


@pytest.mark.parametrize("hf", ["tiny"], indirect=True)  # tiny: a prompt of 4090 tokens in a second
def test_default_length_stops_at_the_context(hf):
    """generate's default of 20 new tokens is capped at the model's context; a prompt that
    fills the context leaves nothing to generate, a ValueError."""
    _, model, _ = hf
    context = model.config.max_position_embeddings
    ids = torch.tensor([[5 + i % 400 for i in range(context - 6)]])
    want, theirs = recorded(lambda: model.generate(ids, do_sample=False))
    got, ours = recorded(lambda: exact(model, ids))
    assert want.shape == (1, context) and torch.equal(got, want)
    assert [m for m in theirs if "max_length" in m] == [m for m in ours if "max_length" in m] != []
    full = torch.tensor([[5] * context])
    with pytest.raises(ValueError, match=f"fills the model's context of {context}"):
        exact(model, full)


def test_nothing_to_generate_names_the_setting(hf):
    _, model, _ = hf
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with pytest.raises(ValueError, match="max_length"):
        model.generate(ids, do_sample=False, max_length=3)
    with pytest.raises(ValueError, match=r"max_length=3 counts the prompt of 5 tokens; raise max_length"):
        exact(model, ids, max_length=3)


@pytest.mark.parametrize("kw", [{"sampling": "qwen-thinking"}, {"max_new_token": 8}, {"decodr": "fast-serial"}])
def test_unknown_argument_is_refused_as_generate_refuses_it(hf, kw):
    """A name neither generate nor the model takes (a typo) is generate's ValueError naming it,
    not silently ignored."""
    _, model, _ = hf
    ids = torch.tensor([[5, 6, 7]])
    named = re.escape(f"not used by the model: {list(kw)}")
    with pytest.raises(ValueError, match=named):
        model.generate(ids, do_sample=False, max_new_tokens=4, **kw)
    with pytest.raises(ValueError, match=named + ".*decoder, decoder_args, sampler"):
        exact(model, ids, max_new_tokens=4, **kw)


def test_what_generate_ignores_stays_accepted(hf):
    """A None model argument (generate skips it) and a tokenizer (generate's, for stop strings)
    change nothing, here as in generate."""
    _, model, tok = hf
    ids = torch.tensor([tok.encode("def fib(n):")])
    want = model.generate(ids, do_sample=False, max_new_tokens=8, sampling=None, tokenizer=tok)
    assert torch.equal(exact(model, ids, max_new_tokens=8, sampling=None, tokenizer=tok), want)


def test_input_mistakes_are_value_errors(hf):
    """core's UserError (not a ValueError) never reaches a generate() caller."""
    _, model, _ = hf
    with pytest.raises(ValueError, match=r"prompt token ids must be integers in 0\.\.\d+"):
        exact(model, torch.tensor([[10**6]]), max_new_tokens=4)
    context = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"context of {context}"):
        exact(model, torch.tensor([[5] * (context + 5)]), max_new_tokens=4)
    with pytest.raises(ValueError, match="takes no argument 'k'"):
        exact(model, torch.tensor([[5, 6, 7]]), max_new_tokens=4, decoder_args={"k": -1})


def test_a_length_beyond_the_context_names_the_callers_setting(hf):
    _, model, _ = hf
    context = model.config.max_position_embeddings
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match=rf"max_length={context + 1} = {context + 1} positions, beyond the model's "
                                         rf"context of {context}"):
        exact(model, ids, max_length=context + 1)
    with pytest.raises(ValueError, match=rf"a prompt of 3 tokens \+ max_new_tokens={context} = {context + 3} "
                                         rf"positions, beyond the model's context of {context}"):
        exact(model, ids, max_new_tokens=context)


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
    ({"position_ids": torch.tensor([[0, 1, 2]])}, r"model inputs \['position_ids'\]"),
    ({"token_healing": True}, "token_healing"),
    ({"dola_layers": "high"}, "dola_layers"),
    ({"use_mtp": True}, "use_mtp"),
])
def test_what_greedy_exactness_cannot_honour_is_refused(hf, kw, match):
    _, model, _ = hf
    with pytest.raises(ValueError, match=match):
        exact(model, torch.tensor([[5, 6, 7]]), max_new_tokens=4, **kw)


def test_a_setting_plain_does_not_name_is_refused_by_its_mode(monkeypatch):
    """Greedy search is checked as generate decides it, not only setting by setting."""
    monkeypatch.setattr(hf_generate, "PLAIN", ())
    with pytest.raises(ValueError, match="beam_search"):
        hf_generate.check_plain(GenerationConfig(num_beams=2))
    hf_generate.check_plain(GenerationConfig())


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
    got, said = recorded(lambda: exact(bare, ids, max_new_tokens=12))
    assert torch.equal(got, want)
    said = [m for m in said if "fast-serial" in m]
    assert said and said[0].count(str(tmp_path)) == 1
    with pytest.raises(ValueError, match="MTP head") as refused:
        exact(bare, ids, max_new_tokens=4, decoder="spec")
    assert str(refused.value).count(str(tmp_path)) == 1 and "no mtp.* weights" in str(refused.value)


def test_other_dtype_is_refused():
    transformers.logging.set_verbosity_error()
    model = Qwen3_5ForCausalLM.from_pretrained(str(TINY_DIR), dtype=torch.float32)
    with pytest.raises(ValueError, match="bfloat16"):
        exact(model, torch.tensor([[5, 6, 7]]), max_new_tokens=4)


@pytest.mark.parametrize("kw", [{"use_cache": False}, {"cache_implementation": "static"}])
def test_another_cache_is_refused(hf, kw):
    """The tokens are those of decoding with the dynamic cache; asking for another (or none) is
    refused rather than answered with tokens that setting may not produce."""
    _, model, _ = hf
    (name, value), = kw.items()
    with pytest.raises(ValueError, match=rf"{name}={value!r} is not supported \(the tokens are those of decoding "
                                         r"with transformers' dynamic cache"):
        exact(model, torch.tensor([[5, 6, 7]]), max_new_tokens=4, **kw)


def test_the_default_cache_named_is_accepted(hf):
    _, model, _ = hf
    ids = torch.tensor([[5, 6, 7]])
    want = model.generate(ids, do_sample=False, max_new_tokens=6)
    assert torch.equal(exact(model, ids, max_new_tokens=6, use_cache=True, cache_implementation="dynamic"), want)
