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
Anything greedy ``generate`` would do differently (HF's sampling, beams, logits processors,
scores, padded prompts) is refused with a ValueError; this project's seeded sampler comes as
``sampler="qwen-thinking,seed=7"`` (a ``core.sampling.Sampler`` or its text), the tokens then
serial sampling's with that sampler. docs/api.md describes it.
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
         ("prompt_lookup_num_tokens", (None,)), ("penalty_alpha", (None,)), ("renormalize_logits", (False, None)))
UNSUPPORTED_ARGS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "assistant_model",
                    "negative_prompt_ids", "negative_prompt_attention_mask", "synced_gpus")

_OPENED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {key: ExactDecoder}


def generate(model, inputs=None, generation_config=None, *, decoder: str | None = None,
             decoder_args: dict | None = None, streamer=None, sampler=None, **kwargs):
    """transformers calls this for ``model.generate(..., custom_generate=CUSTOM_GENERATE_DIR)``
    with generate's own arguments. ``decoder`` (default spec, else fast-serial without an MTP
    head) and ``decoder_args`` choose the exact decoder; ``sampler`` (None: greedy) is the seeded
    sampler of ``core.sampling``."""
    for name in UNSUPPORTED_ARGS:
        if kwargs.pop(name, None) not in (None, [], ()):
            raise ValueError(f"exact generate: {name!r} is not supported (greedy decoding only)")
    ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError("exact generate: give input_ids as a LongTensor [batch, prompt length]")
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool(torch.all(mask == 1)):
        raise ValueError("exact generate: an attention_mask with padding is not supported; "
                         "give unpadded prompts (one call per prompt length)")
    config, _ = model._prepare_generation_config(generation_config, **kwargs)
    check_plain(config)
    eos = token_ids(config.eos_token_id)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
    n = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - ids.shape[1]
    if n < 1:
        raise ValueError(f"exact generate: nothing to generate (max_new_tokens {n}); raise max_new_tokens")
    if streamer is not None and ids.shape[0] > 1:
        raise ValueError("exact generate: a streamer takes one row (batch size 1)")
    exact = opened(model, eos, decoder, decoder_args or {})
    try:
        from decoders.api import as_sampler, check_sampling

        sampler = as_sampler(sampler)
        check_sampling(exact.decoder, sampler)
    except UserError as exc:
        raise ValueError(f"exact generate: {exc}") from None
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
    for name, plain in PLAIN:
        value = getattr(config, name, None)
        if value not in plain:
            raise ValueError(f"exact generate: {name}={value!r} is not supported (greedy decoding, "
                             f"do_sample=False, only)")


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
        warnings.warn(f"exact generate: {loaded.mtp_missing}; decoding with {FALLBACK} (the same tokens, "
                      "no speculation)", stacklevel=3)
    try:
        dec = get_decoder(name, **args)
        dec.prepare(loaded)
    except UserError as exc:
        raise ValueError(f"exact generate: {exc}") from None
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
    """(MTPHead, None) from the ``mtp.*`` tensors of checkpoint ``path``, else (None, why)."""
    from safetensors import safe_open

    from core.models import DTYPE, checkpoint_files, load_exact
    from core.mtp import MTPHead

    if not path.is_dir():
        return None, f"{path} is not a local checkpoint directory, so its MTP head cannot be read"
    try:
        files = checkpoint_files(path)
    except UserError as exc:
        return None, str(exc)
    sd = {}
    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as fh:
            sd.update({k[4:]: fh.get_tensor(k) for k in fh.keys() if k.startswith("mtp.")})
    if not sd:
        return None, f"{path} has no mtp.* weights"
    with torch.device(device):
        head = MTPHead(config).to(DTYPE)
    lacking = sorted(set(head.state_dict()) - set(sd))
    if lacking:
        return None, f"{path}: the MTP head is incomplete (lacks mtp.{lacking[0]})"
    load_exact(head, {k: sd[k] for k in head.state_dict()}, f"{path} (mtp)")
    return head.eval(), None
