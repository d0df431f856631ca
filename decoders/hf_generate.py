"""Hugging Face ``generate()`` through an exact decoder: transformers' ``custom_generate`` hook.

    model = Qwen3_5ForCausalLM.from_pretrained(CHECKPOINT)
    out = model.generate(input_ids, custom_generate=decoders.hf_generate.CUSTOM_GENERATE_DIR,
                         trust_remote_code=True, max_new_tokens=64)

``CUSTOM_GENERATE_DIR`` holds ``custom_generate/generate.py`` (the layout transformers resolves
from a local path), which calls ``generate`` below. It returns what greedy ``generate`` returns,
token for token: a LongTensor [batch, prompt + new], or a ``GenerateDecoderOnlyOutput`` with
``return_dict_in_generate=True``; rows are decoded one by one and a row that ended at an EOS is
padded with ``pad_token_id``. The decoder is ``spec``, drafting with the MTP head read from the
model's own checkpoint directory (``name_or_path``: transformers drops ``mtp.*``); a model whose
checkpoint has no MTP head decodes with ``fast-serial`` (the same tokens) and says so once.
The length is transformers' own: ``max_new_tokens``, else ``max_length`` (counting the prompt),
else its default of 20 new tokens capped at the model's context. Anything greedy ``generate``
would do differently (HF's sampling, beams, logits processors, scores, padded prompts, model
inputs such as ``past_key_values``, another cache than the dynamic one, ``use_cache=False``) is
refused with a ValueError, and so is an argument that neither this path nor ``generate`` knows (a
typo), as ``generate`` refuses it; every mistake in the input reaches the caller as a ValueError.
This project's seeded sampler comes as ``sampler="qwen-thinking,seed=7"`` (a
``core.sampling.Sampler`` or its text), the tokens then serial sampling's with that sampler.
docs/api.md describes it.
"""
from __future__ import annotations

import warnings
import weakref
from pathlib import Path

import torch

from core.errors import UserError

CUSTOM_GENERATE_DIR = str(Path(__file__).resolve().parent / "hf")
FALLBACK = "fast-serial"
# generation settings that make HF's greedy search do something an exact greedy decoder does not:
# (name, the values that leave greedy decoding plain)
PLAIN = (("do_sample", (False, None)), ("num_beams", (1, None)), ("num_beam_groups", (1, None)),
         ("num_return_sequences", (1, None)), ("repetition_penalty", (1.0, None)),
         ("encoder_repetition_penalty", (1.0, None)), ("no_repeat_ngram_size", (0, None)),
         ("bad_words_ids", (None,)), ("min_length", (0, None)), ("min_new_tokens", (0, None)),
         ("forced_bos_token_id", (None,)), ("forced_eos_token_id", (None,)), ("suppress_tokens", (None,)),
         ("begin_suppress_tokens", (None,)), ("sequence_bias", (None,)), ("guidance_scale", (1.0, None)),
         ("exponential_decay_length_penalty", (None,)), ("stop_strings", (None,)), ("max_time", (None,)),
         ("watermarking_config", (None,)), ("output_scores", (False, None)), ("output_logits", (False, None)),
         ("output_attentions", (False, None)), ("output_hidden_states", (False, None)),
         ("prompt_lookup_num_tokens", (None,)), ("penalty_alpha", (None,)), ("renormalize_logits", (False, None)),
         ("remove_invalid_values", (False, None)), ("token_healing", (False, None)), ("constraints", (None,)),
         ("force_words_ids", (None,)), ("dola_layers", (None,)), ("use_mtp", (False, None)),
         ("assistant_early_exit", (None,)))
# the exact decoders reproduce decoding with transformers' dynamic cache, whose arithmetic another
# cache (or none) need not share
CACHE = (("use_cache", (True, None)), ("cache_implementation", (None, "dynamic")))
UNSUPPORTED_ARGS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "assistant_model",
                    "assistant_tokenizer", "negative_prompt_ids", "negative_prompt_attention_mask", "synced_gpus")
OWN_ARGS = "decoder, decoder_args, sampler"

_OPENED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {key: ExactDecoder}


def generate(model, inputs=None, generation_config=None, *, decoder: str | None = None,
             decoder_args: dict | None = None, streamer=None, sampler=None, **kwargs):
    """transformers calls this for ``model.generate(..., custom_generate=CUSTOM_GENERATE_DIR)``
    with generate's own arguments. ``decoder`` (default spec, else fast-serial without an MTP
    head) and ``decoder_args`` choose the exact decoder; ``sampler`` (None: greedy) is the seeded
    sampler of ``core.sampling``. A mistake in the input is a ValueError, as in ``generate``."""
    try:
        return _generate(model, inputs, generation_config, decoder, decoder_args, streamer, sampler, kwargs)
    except UserError as exc:
        # core's UserError is no ValueError; a generate() caller catches ValueError
        raise ValueError(f"exact generate: {exc}") from None


def _generate(model, inputs, generation_config, decoder, decoder_args, streamer, sampler, kwargs):
    for name in UNSUPPORTED_ARGS:
        if kwargs.pop(name, None) not in (None, [], ()):
            raise ValueError(f"exact generate: {name!r} is not supported (greedy decoding only)")
    # generate takes a tokenizer for stop_strings and token healing only, both refused below
    kwargs.pop("tokenizer", None)
    ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError("exact generate: give input_ids as a LongTensor [batch, prompt length]")
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool(torch.all(mask == 1)):
        raise ValueError("exact generate: an attention_mask with padding is not supported; "
                         "give unpadded prompts (one call per prompt length)")
    # as generate decides it, before the model's defaults fill the config in
    default_max = (kwargs.get("max_length") is None
                   and (generation_config is None or generation_config.max_length is None)
                   and model.generation_config.max_length is None)
    default_min = (kwargs.get("min_length") is None
                   and (generation_config is None or generation_config.min_length is None)
                   and model.generation_config.min_length is None)
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    check_plain(config)
    check_model_kwargs(model, model_kwargs)
    n = new_token_count(model, config, ids, default_max, default_min)
    eos = token_ids(config.eos_token_id)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
    if streamer is not None and ids.shape[0] > 1:
        raise ValueError("exact generate: a streamer takes one row (batch size 1)")
    from decoders.api import as_sampler, check_sampling

    sampler = as_sampler(sampler)
    exact = opened(model, eos, decoder, decoder_args or {})
    check_sampling(exact.decoder, sampler)
    rows = [decode_row(exact, row.tolist(), n, streamer, sampler) for row in ids]
    width = max(map(len, rows))
    if any(len(r) < width for r in rows) and pad is None:
        raise ValueError("exact generate: rows of different lengths need a pad_token_id")
    new = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=ids.dtype, device=ids.device)
    sequences = torch.cat([ids, new], dim=1)
    if config.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def check_plain(config) -> None:
    for table, why in ((PLAIN, "greedy decoding, do_sample=False, only"),
                       (CACHE, "the tokens are those of decoding with transformers' dynamic cache, the default")):
        for name, plain in table:
            value = getattr(config, name, None)
            if value not in plain:
                raise ValueError(f"exact generate: {name}={value!r} is not supported ({why})")
    # a generation setting PLAIN does not name yet (a newer transformers) still shows in the mode
    from transformers.generation.configuration_utils import GenerationMode

    mode = config.get_generation_mode()
    if mode != GenerationMode.GREEDY_SEARCH:
        raise ValueError(f"exact generate: these settings make generate run {mode.value}; "
                         "only greedy search (do_sample=False) is supported")


def check_model_kwargs(model, model_kwargs: dict) -> None:
    """Refuse what is left of generate's arguments once the generation config took its own:
    a name the model does not take either (a typo) with generate's own error, and a model input
    (``past_key_values``, ``position_ids``, ...), which the exact decoders, fed the prompt ids
    only, would ignore."""
    try:
        model._validate_model_kwargs(dict(model_kwargs))
    except ValueError as exc:
        raise ValueError(f"exact generate: {exc}; this path's own arguments are {OWN_ARGS}") from None
    given = sorted(k for k, v in model_kwargs.items() if v is not None)
    if given:
        raise ValueError(f"exact generate: model inputs {given} are not supported (the exact decoders "
                         "take the prompt ids and an all-ones attention_mask only)")


def new_token_count(model, config, ids: torch.Tensor, default_max: bool, default_min: bool) -> int:
    """The most tokens greedy ``generate`` adds after ``ids``, by transformers' own rule (and with
    its warning on the default ``max_length``); nothing to generate is a ValueError naming the
    setting that caused it."""
    length = ids.shape[1]
    config = model._prepare_generated_length(config, has_default_max_length=default_max,
                                             has_default_min_length=default_min, model_input_name="input_ids",
                                             input_ids_length=length, inputs_tensor=ids)
    n = config.max_length - length
    if n < 1:
        if config.max_new_tokens is not None:
            why = f"max_new_tokens={config.max_new_tokens}"
        elif not default_max:
            why = (f"max_length={config.max_length} counts the prompt of {length} tokens; raise max_length "
                   "or give max_new_tokens")
        else:
            why = f"a prompt of {length} tokens fills the model's context of {config.max_length} positions"
        raise ValueError(f"exact generate: nothing to generate: {why}")
    model._validate_generated_length(config, length, default_max)
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None and config.max_length > context:  # named as the caller gave it
        what = (f"a prompt of {length} tokens + max_new_tokens={config.max_new_tokens}"
                if config.max_new_tokens is not None else f"max_length={config.max_length}")
        raise ValueError(f"exact generate: {what} = {config.max_length} positions, beyond the model's context "
                         f"of {context}")
    return n


def token_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def decode_row(exact, prompt: list[int], n: int, streamer, sampler=None) -> list[int]:
    if streamer is not None:
        streamer.put(torch.tensor([prompt]))
    on_token = (lambda new, text: new and streamer.put(torch.tensor(new))) if streamer is not None else None
    gen = exact.generate(prompt, n, on_token=on_token, sampler=sampler)
    if streamer is not None:
        streamer.end()
    return gen.token_ids


def opened(model, eos: tuple[int, ...], decoder: str | None, args: dict):
    """The prepared exact decoder for this model, EOS set and decoder (kept while the model lives)."""
    from core import determinism
    from decoders import get_decoder
    from decoders.api import ExactDecoder

    key = (eos, decoder, tuple(sorted(args.items())))
    per_model = _OPENED.setdefault(model, {})
    if key in per_model:
        return per_model[key]
    try:
        determinism.pin()
    except determinism.DeterminismError as exc:
        raise RuntimeError(f"exact generate: {exc} (set CUBLAS_WORKSPACE_CONFIG=:4096:8 before CUDA starts, "
                           "or call core.determinism.pin() first)") from None
    loaded = loaded_model(model, eos)
    name = decoder or ("spec" if loaded.mtp is not None else FALLBACK)
    if decoder is None and loaded.mtp is None:
        warnings.warn(f"exact generate: {loaded.name}: {loaded.mtp_missing}; decoding with {FALLBACK} "
                      "(the same tokens, no speculation)", stacklevel=4)
    dec = get_decoder(name, **args)
    dec.prepare(loaded)
    per_model[key] = ExactDecoder(dec, loaded)
    return per_model[key]


def loaded_model(model, eos: tuple[int, ...]):
    """The HF model itself as the backbone, with the MTP head of its checkpoint directory."""
    from core.models import DTYPE, LoadedModel

    if model.dtype != DTYPE:
        raise ValueError(f"exact generate: the model is {model.dtype}; load it in {DTYPE} (dtype=torch.bfloat16), "
                         "the dtype the exact decoders run")
    if getattr(model.config, "model_type", None) != "qwen3_5_text":
        raise ValueError(f"exact generate: {type(model).__name__} is not a Qwen3_5ForCausalLM")
    path = str(getattr(model, "name_or_path", "") or "")
    head, why = ((None, "the model has no checkpoint directory (name_or_path)") if not path
                 else load_mtp_head(Path(path), model.config, model.device))
    return LoadedModel(name=path or type(model).__name__, backbone=model.eval(), text_config=model.config,
                       device=model.device, eos_token_ids=eos, identity={"name": path, "kind": "hf-model"},
                       mtp=head, mtp_missing=why, tokenizer=None)


def load_mtp_head(path: Path, config, device):
    """(MTPHead, None) from the ``mtp.*`` tensors of checkpoint ``path``, else (None, why); ``why``
    leaves the path out, since ``LoadedModel`` quotes it with its name."""
    from safetensors import safe_open

    from core.models import DTYPE, checkpoint_files, load_exact
    from core.mtp import MTPHead

    if not path.is_dir():
        return None, "name_or_path is not a local checkpoint directory, so its MTP head cannot be read"
    try:
        files = checkpoint_files(path)
    except UserError as exc:
        return None, str(exc).removeprefix(f"{path}: ")
    sd = {}
    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as fh:
            sd.update({k[4:]: fh.get_tensor(k) for k in fh.keys() if k.startswith("mtp.")})
    if not sd:
        return None, "the checkpoint has no mtp.* weights"
    with torch.device(device):
        head = MTPHead(config).to(DTYPE)
    lacking = sorted(set(head.state_dict()) - set(sd))
    if lacking:
        return None, f"the checkpoint's MTP head is incomplete (lacks mtp.{lacking[0]})"
    load_exact(head, {k: sd[k] for k in head.state_dict()}, f"{path} (mtp)")
    return head.eval(), None
