"""``decoders.api``: open_decoder / generate give exactly the serial control's tokens, stream them
as batches that concatenate to the tokens and the text, stop on cancel, and refuse bad input."""
from __future__ import annotations

import dataclasses
import itertools
import threading

import pytest

from core.errors import UserError
from core.models import TINY_DIR, model_context
from core.sampling import Sampler
from decoders.api import Cancelled, ExactDecoder, Generation, GenerationStats, open_decoder
from decoders.base import DecodeResult, DecodeStats
from decoders.serial import SerialDecoder

N = 24
PROMPTS = ["def fib(n):", "The river ran", "import os\nimport sys\n"]


@pytest.fixture(scope="module")
def opened():
    cache = {}

    def get(model: str, name: str) -> ExactDecoder:
        if (model, name) not in cache:
            cache[model, name] = open_decoder(model, name, device="cpu")
        return cache[model, name]
    return get


def serial_tokens(dec: ExactDecoder, ids: list[int], n: int) -> list[int]:
    control = SerialDecoder()
    control.prepare(dec.model)
    return control.decode(ids, n).tokens


@pytest.mark.parametrize("model", ["tiny", "small"])
@pytest.mark.parametrize("name", ["spec", "fast-serial"])
def test_tokens_equal_serial_and_stream_concatenates(opened, model, name):
    dec = opened(model, name)
    assert dec.name == name and dec.eos_token_ids == tuple(dec.model.eos_token_ids)
    for prompt in PROMPTS:
        batches = []
        gen = dec.generate(prompt, N, on_token=lambda ids, text: batches.append((ids, text)))
        assert isinstance(gen, Generation) and isinstance(gen.stats, GenerationStats)
        assert gen.prompt_ids == dec.encode(prompt)
        assert gen.token_ids == serial_tokens(dec, gen.prompt_ids, N)
        assert [t for ids, _ in batches for t in ids] == gen.token_ids
        assert all(ids for ids, _ in batches[:-1])
        assert "".join(text for _, text in batches) == gen.text == dec.text(gen.token_ids)
        ended = gen.token_ids[-1] in dec.eos_token_ids
        assert gen.finish_reason == ("stop" if ended else "length")
        assert len(gen.token_ids) == N or ended
        s = gen.stats
        assert (s.prompt_tokens, s.new_tokens) == (len(gen.prompt_ids), len(gen.token_ids))
        assert s.forwards >= 1 and s.seconds >= 0 and s.time_to_first_token_s is not None
        assert 0 <= s.accepted <= s.drafted
        if name == "fast-serial":
            assert (s.drafted, s.accepted, s.mean_accepted_length) == (0, 0, None)
            # a step is queued before the token before it is read: one ran past an early EOS
            assert s.forwards == len(gen.token_ids) + (ended and len(gen.token_ids) < N)


def test_ids_prompt_and_no_callback(opened):
    dec = opened("tiny", "spec")
    ids = dec.encode(PROMPTS[0])
    gen = dec.generate(ids, 7)
    assert gen.token_ids == serial_tokens(dec, ids, 7) and gen.finish_reason == "length"
    assert gen.text == dec.text(gen.token_ids)


@pytest.mark.parametrize("name", ["spec", "fast-serial"])
def test_stops_right_after_eos(opened, name):
    dec = opened("tiny", name)
    ids = dec.encode(PROMPTS[1])
    stream = serial_tokens(dec, ids, N)
    k = next(k for k in range(3, N) if stream[k] not in stream[:k])
    eos_model = dataclasses.replace(dec.model, eos_token_ids=(stream[k],))
    inner, saved = dec.decoder, dec.decoder.model
    inner.model = eos_model  # the decoders read EOS ids from their model at each decode
    try:
        gen = ExactDecoder(inner, eos_model).generate(ids, N)
    finally:
        inner.model = saved
    assert gen.token_ids == stream[:k + 1] and gen.finish_reason == "stop"


@pytest.mark.parametrize("how", ["event", "raise"])
def test_cancel_stops_at_the_next_batch(opened, how):
    dec = opened("tiny", "fast-serial")
    ids = dec.encode(PROMPTS[0])
    cancel, seen = threading.Event(), []

    def on_token(new, text):
        seen.append(new)
        if len(seen) == 3:
            if how == "raise":
                raise Cancelled()
            cancel.set()
    gen = dec.generate(ids, N, on_token=on_token, cancel=cancel)
    assert gen.finish_reason == "cancelled"
    assert gen.token_ids == serial_tokens(dec, ids, N)[:3] == [t for b in seen for t in b]
    assert gen.stats.new_tokens == 3
    # a cancelled generation leaves the decoder exact for the next one
    assert dec.generate(ids, N).token_ids == serial_tokens(dec, ids, N)


def test_cancel_set_before_start_emits_one_batch(opened):
    dec = opened("tiny", "spec")
    cancel = threading.Event()
    cancel.set()
    gen = dec.generate(PROMPTS[0], N, cancel=cancel)
    assert gen.finish_reason == "cancelled" and len(gen.token_ids) == 1


class Boom(Exception):
    pass


@pytest.mark.parametrize("name", ["spec", "fast-serial"])
def test_callback_exception_propagates_and_decoder_stays_exact(opened, name):
    dec = opened("tiny", name)
    ids = dec.encode(PROMPTS[2])
    want = serial_tokens(dec, ids, N)
    calls = itertools.count()

    def on_token(new, text):
        if next(calls) == 2:
            raise Boom()
    with pytest.raises(Boom):
        dec.generate(ids, N, on_token=on_token)
    assert dec.generate(ids, N).token_ids == want
    # the same through the decoder's own on_tokens: the next decode starts from its own prefill
    with pytest.raises(Boom):
        dec.decoder.decode(ids, N, on_tokens=lambda new: (_ for _ in ()).throw(Boom()))
    assert dec.decoder.decode(ids, N).tokens == want


def test_decoder_on_tokens_batches_are_the_result(opened):
    dec = opened("tiny", "spec")
    ids = dec.encode(PROMPTS[0])
    got = []
    result = dec.decoder.decode(ids, N, on_tokens=got.append)
    assert [t for b in got for t in b] == result.tokens == serial_tokens(dec, ids, N)
    assert all(b for b in got)


def test_spec_naive_streams_its_result(tiny):
    from decoders.spec_naive import SpecNaiveDecoder

    dec = SpecNaiveDecoder()
    dec.prepare(tiny)
    got = []
    result = dec.decode([5, 6, 7, 8], N, on_tokens=got.append)
    assert [t for b in got for t in b] == result.tokens and len(result.tokens) <= N


class ReplayDecoder:
    """A plug-in without ``on_tokens``: emits a fixed token list."""

    name = "replay"

    def __init__(self, tokens):
        self.tokens = tokens

    def prepare(self, model):
        self.model = model

    def config(self):
        return {}

    def decode(self, prompt_ids, max_new_tokens):
        return DecodeResult(self.tokens[:max_new_tokens], DecodeStats(forwards=1))


class StreamingReplay(ReplayDecoder):
    def decode(self, prompt_ids, max_new_tokens, *, on_tokens=None):
        out = self.tokens[:max_new_tokens]
        for t in out:
            if on_tokens is not None:
                on_tokens([t])
        return DecodeResult(out, DecodeStats(forwards=len(out)))


def test_plugin_without_on_tokens_gives_one_batch(tiny):
    dec = ExactDecoder(ReplayDecoder([7, 8, 9]), tiny)
    batches = []
    gen = dec.generate([3, 4], 8, on_token=lambda ids, text: batches.append(ids))
    assert batches == [[7, 8, 9]] and gen.token_ids == [7, 8, 9] and gen.finish_reason == "length"


def test_incomplete_utf8_is_held_back(opened):
    small = opened("small", "fast-serial").model
    tok = small.tokenizer.get()
    text = "x = '\u20ac\u00e9\U0001f600' # \u4e2d\u6587"
    ids = tok.encode(text)
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "the test needs a character split across tokens"
    dec = ExactDecoder(StreamingReplay(ids), small)
    texts = []
    gen = dec.generate([5], len(ids), on_token=lambda new, t: texts.append(t))
    assert gen.text == text == "".join(texts)
    assert not any("\ufffd" in t for t in texts)


def test_injected_clock_times_the_generation(tiny):
    ticks = iter(range(100))
    dec = ExactDecoder(StreamingReplay([7, 8, 9, 10]), tiny, clock=lambda: float(next(ticks)))
    gen = dec.generate([3], 4, on_token=lambda ids, text: None)
    # clock reads: start 0, first batch 1, end 2
    assert gen.stats.time_to_first_token_s == 1.0 and gen.stats.seconds == 2.0
    assert gen.stats.tokens_per_s == 2.0


def test_streamed_tokens_that_differ_from_the_result_are_an_error(tiny):
    class Liar(StreamingReplay):
        def decode(self, prompt_ids, max_new_tokens, *, on_tokens=None):
            on_tokens([1])
            return DecodeResult([2], DecodeStats())
    with pytest.raises(RuntimeError, match="differ"):
        ExactDecoder(Liar([]), tiny).generate([3], 4)


def test_checkpoint_directory(opened):
    dec = open_decoder(str(TINY_DIR), "fast-serial", device="cpu")
    ids = dec.encode(PROMPTS[0])
    assert dec.generate(ids, 12).token_ids == opened("tiny", "fast-serial").generate(ids, 12).token_ids
    assert dec.model.identity["kind"] == "checkpoint"


def test_chat_encoding_uses_chatml_without_a_template(opened):
    dec = opened("tiny", "fast-serial")
    ids = dec.encode_chat([{"role": "user", "content": "hi"}])
    assert ids == dec.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(UserError):
        dec.encode_chat([{"role": "user"}])


@pytest.mark.parametrize("kwargs,match", [
    ({"model": "no-such-model"}, "neither a built-in"),
    ({"model": "tiny", "name": "no-such-decoder"}, "unknown decoder"),
    ({"model": "tiny", "name": "spec", "max_depth": 99}, "max_depth"),
    ({"model": "tiny", "name": "spec", "nonsense": 1}, "nonsense"),
    ({"model": "tiny", "device": "gpu"}, "not supported"),
    ({"model": "tiny", "device": "mps"}, "not supported"),
    ({"model": "tiny", "name": "fast-serial", "max_positions": 4097}, "beyond model tiny's context of 4096"),
])
def test_bad_open_is_a_user_error(kwargs, match):
    with pytest.raises(UserError, match=match):
        open_decoder(**kwargs)


@pytest.mark.parametrize("model,name", [("tiny", "tiny"), (str(TINY_DIR), str(TINY_DIR)), ("small", "small"),
                                        ("synthetic-9b", "synthetic-9b")])
def test_a_length_beyond_the_context_costs_no_load(monkeypatch, model, name):
    """max_positions beyond the model's context is refused from its config, before any weights
    load (synthetic-9b's too, which a CPU could not build), as the loaded model would refuse it."""
    import core.models

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(core.models, "load_model", no_load)
    context = model_context(model)
    assert context is not None and context >= 4096
    with pytest.raises(UserError, match=f"= {context + 1} positions, beyond model {name}'s context of {context}"):
        open_decoder(model, "fast-serial", device="cpu", max_positions=context + 1)


def test_model_context_is_the_loaded_models(opened, tmp_path):
    assert model_context("tiny") == opened("tiny", "fast-serial").model.context
    assert model_context(str(tmp_path / "absent")) is None


@pytest.mark.parametrize("prompt,n,match", [
    ("", 4, "empty"), ([], 4, "empty"), ([-1], 4, "token ids"), ([10**9], 4, "token ids"),
    ([True], 4, "token ids"), (3.5, 4, "text or a list"), ("hi", 0, "max_new_tokens"),
    ("hi", True, "max_new_tokens"), ([5] * 4000, 97, "4097 positions, beyond model tiny's context of 4096"),
])
def test_bad_generate_is_a_user_error(opened, prompt, n, match):
    with pytest.raises(UserError, match=match):
        opened("tiny", "fast-serial").generate(prompt, n)


@pytest.mark.parametrize("name", ["spec", "fast-serial"])
def test_sampler_argument_gives_serial_sampling(opened, name):
    """``generate(sampler=...)`` (a Sampler or its text) emits the control's sampled tokens and
    records the sampler; ``open_decoder(sampler=...)`` sets the default; T = 0 is greedy."""
    dec = opened("tiny", name)
    control = SerialDecoder()
    control.prepare(dec.model)
    ids = dec.encode(PROMPTS[1])
    for given in ("qwen-thinking,seed=3", Sampler(temperature=1.0, top_p=0.8, seed=2 ** 64 - 1)):
        want = Sampler.parse(given) if isinstance(given, str) else given
        batches = []
        gen = dec.generate(ids, N, sampler=given, on_token=lambda new, text: batches.append(new))
        assert gen.token_ids == control.decode(ids, N, sampler=want).tokens
        assert [t for b in batches for t in b] == gen.token_ids and gen.sampler == want
    greedy = dec.generate(ids, N, sampler="temperature=0,seed=4")
    assert greedy.token_ids == serial_tokens(dec, ids, N) and greedy.sampler is None
    default = ExactDecoder(dec.decoder, dec.model, sampler="qwen-instruct,seed=1")
    assert default.generate(ids, 9).token_ids == control.decode(ids, 9, sampler=Sampler.parse("qwen-instruct,seed=1")).tokens
    assert default.generate(ids, 9, sampler="greedy").token_ids == serial_tokens(dec, ids, 9)


def test_a_sampler_is_refused_where_it_cannot_be_honoured(tiny, opened):
    with pytest.raises(UserError, match="greedily only"):
        open_decoder("tiny", "spec-naive", device="cpu", sampler="qwen-thinking")
    from decoders.spec_naive import SpecNaiveDecoder

    inner = SpecNaiveDecoder()
    inner.prepare(tiny)
    naive = ExactDecoder(inner, tiny)
    assert naive.generate([5, 6, 7], 3, sampler="greedy").token_ids  # greedy is always fine
    with pytest.raises(UserError, match="greedily only"):
        naive.generate([5, 6, 7], 3, sampler=Sampler(temperature=0.5))
    for bad, match in (("temperature=-1", "sampler: temperature"), ("nonsense", "sampler: unknown sampler preset"),
                       (0.7, "sampler must be")):
        with pytest.raises(UserError, match=match):
            opened("tiny", "spec").generate([5, 6, 7], 3, sampler=bad)
        with pytest.raises(UserError, match=match):
            open_decoder("tiny", "spec", device="cpu", sampler=bad)


@pytest.mark.parametrize("args", [{"capacity": 0}, {"capacity": -5}, {"stack_gate_up": "maybe"}])
def test_a_bad_fast_serial_argument_is_a_user_error(args):
    from core.errors import UserError
    from decoders.api import open_decoder

    with pytest.raises(UserError):
        open_decoder("tiny", "fast-serial", device="cpu", **args)


def test_spec_refuses_a_capacity_below_one():
    from core.errors import UserError
    from decoders.api import open_decoder

    with pytest.raises(UserError, match="capacity must be >= 1"):
        open_decoder("tiny", "spec", device="cpu", capacity=0)


def test_a_prompt_that_is_not_unicode_is_a_user_error():
    from core.errors import UserError
    from decoders.api import open_decoder

    dec = open_decoder("tiny", "fast-serial", device="cpu")
    for bad in (lambda: dec.encode("a\udcffb"), lambda: dec.encode_chat([{"role": "user", "content": "\ud800"}])):
        with pytest.raises(UserError, match="lone surrogate"):
            bad()
