"""The training pipeline, one phase after another, all seeded under ``core.determinism``'s settings:
corpus and tokenizer (training/data.py), model (training/model.py), training (training/train.py)
and the unloop fine-tune (training/unloop.py) with deterministic algorithms warn-only, export to
``--out`` (training/export.py, whole or not at all; written before the quality phase, so that a run
stopped there keeps it), then quality measured on the exported bf16 checkpoint under the strictly
pinned settings (training/quality.py) into ``quality.json`` (training/report.py).
"""
from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer

from core import determinism
from core.models import device_name
from training.data import DOC_SEPARATOR, encode_splits, fixed_windows, load_corpus, load_tokenizer, train_tokenizer
from training.export import write_checkpoint
from training.log import log
from training.model import Preset, build_models, count_params, load_for_training, text_config
from training.outdir import write_text_atomic
from training.quality import measure_quality
from training.report import QUALITY_FILE, Fitted, log_summary, run_report
from training.train import TrainResult, plan_steps, snapshot, train
from training.unloop import unloop


class Interrupted(KeyboardInterrupt):
    """Ctrl-C after the checkpoint was exported: its message says what is at ``--out``."""


IM_END = "<|im_end|>"


def run(out: Path, preset: Preset, *, device: str, seed: int, minutes: float | None, steps: int | None,
        spec: bool = True, init_from: Path | None = None, force: bool = False) -> dict:
    """Train ``preset`` (or fine-tune the checkpoint ``init_from``), export it to ``out``
    (``training.outdir``: an earlier run's checkpoint is replaced, another directory only with
    ``force``), measure it and write ``out/quality.json``; returns that record."""
    transformers.logging.set_verbosity_error()
    pinned = determinism.pin()
    t_start = time.perf_counter()
    dev = torch.device(device)
    steps = steps or preset.steps

    corpus = load_corpus(preset)
    manifest = corpus.manifest()
    log_corpus(corpus)
    base = init_from_record(init_from, manifest)
    t0 = time.perf_counter()
    tok = load_tokenizer(init_from) if init_from is not None else train_tokenizer(corpus.texts("train"), preset.vocab)
    streams = encode_splits(tok, corpus)
    log_tokens(tok, streams, corpus, "loaded" if init_from else "trained", time.perf_counter() - t0)
    cfg, backbone, head = load_for_training(init_from) if init_from is not None else new_models(preset, tok, seed)
    params = (count_params(backbone), count_params(head))
    log_plan(cfg, params, preset, steps, streams["train"].numel(), dev, minutes, init_from)

    fitted = fit(backbone, head, streams, preset, steps=steps, device=dev, seed=seed, minutes=minutes,
                 init_from=init_from)
    determinism.pin()
    log_fit(fitted.result, dev)

    # exported before the quality phase, so that a run stopped there keeps its checkpoint
    ckpt_bytes = write_checkpoint(out, cfg, fitted.result.best_state, tok, manifest, force)
    log(f"exported {ckpt_bytes / 1e6:.2f} MB of safetensors to {out}; measuring quality on it (bf16)")
    del backbone, head
    fitted.result.best_state = ()
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    try:
        t0 = time.perf_counter()
        quality = measure_quality(out, corpus, tok, preset, device, streams, spec)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted while measuring quality; the checkpoint is in {out}, "
                          f"without {QUALITY_FILE}") from None
    seconds = {"total": round(time.perf_counter() - t_start, 1), "quality": round(time.perf_counter() - t0, 1)}
    report = run_report(preset=preset, seed=seed, minutes=minutes, init_from=init_from, base=base, device=dev,
                        pinned=pinned, corpus=corpus, manifest=manifest, tok=tok, streams=streams, cfg=cfg,
                        params=params, ckpt_bytes=ckpt_bytes, fitted=fitted, quality=quality, seconds=seconds)
    write_text_atomic(out / QUALITY_FILE, json.dumps(report, indent=1) + "\n")
    log_summary(report, out)
    return report


# --------------------------------------------------------------------------- phases of run


def init_from_record(init_from: Path | None, manifest: dict) -> dict:
    """The --init-from checkpoint's quality.json ({} for none, or when it has none); warns when it
    was trained on another corpus than this run's."""
    if init_from is None or not (init_from / QUALITY_FILE).is_file():
        return {}
    base = json.loads((init_from / QUALITY_FILE).read_text())
    if base.get("corpus", {}).get("files_sha256") not in (None, manifest["files_sha256"]):
        log(f"warning: {init_from} was trained on another corpus (Python {base['corpus'].get('python_version')})")
    return base


def new_models(preset: Preset, tok: Tokenizer, seed: int):
    """(config, backbone, head) of a new model; EOS ids <|im_end|> and <|endoftext|> as in Qwen3.5."""
    eot = tok.token_to_id(DOC_SEPARATOR)
    cfg = text_config(preset, [tok.token_to_id(IM_END), eot], eot)
    return (cfg, *build_models(cfg, seed))


def fit(backbone, head, streams: dict, preset: Preset, *, steps: int | None, device: torch.device, seed: int,
        minutes: float | None, init_from: Path | None) -> Fitted:
    """Training (none with ``init_from``), then the unloop fine-tune when the preset asks for it.

    Both run with deterministic algorithms on but warn-only: an op without a deterministic kernel
    (if any, e.g. an attention backward) warns instead of killing the run; the warnings are
    recorded. The caller pins the strict configuration again before quality is measured."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    dev_windows = fixed_windows(streams["dev"], preset.seq_len, preset.eval_windows)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if init_from is None:
            result = train(backbone, head, streams["train"], dev_windows, preset, steps, device, seed, minutes)
        else:
            result = TrainResult(plan={"rule": f"none: --init-from {init_from}", "steps": 0}, best_step=0,
                                 best_dev={}, steps_done=0, stopped_by="init-from", tokens_seen=0, train_seconds=0.0,
                                 best_state=(snapshot(backbone), snapshot(head)))
        unloop_record = None
        if preset.unloop_steps > 0:
            backbone.load_state_dict(result.best_state[0])
            head.load_state_dict(result.best_state[1])
            unloop_record = unloop(backbone, head, streams["train"], dev_windows, preset, device, seed)
            result.best_state = (snapshot(backbone), snapshot(head))
    nondeterministic = sorted({str(w.message).split("\n")[0][:300] for w in caught
                               if "determinis" in str(w.message).lower()})
    for msg in nondeterministic:
        log(f"determinism warning during training: {msg}")
    return Fitted(result=result, unloop=unloop_record, warnings=nondeterministic)


def log_corpus(corpus) -> None:
    log(f"corpus: Python {corpus.python_version} stdlib at {corpus.root}: "
        + ", ".join(f"{s} {v['files']} files {v['bytes'] / 1e6:.2f} MB" for s, v in corpus.totals().items()))


def log_tokens(tok: Tokenizer, streams: dict, corpus, how: str, seconds: float) -> None:
    log(f"tokenizer: {tok.get_vocab_size()} ids, {how} in {seconds:.1f}s; tokens "
        + ", ".join(f"{s} {v.numel():,}" for s, v in streams.items())
        + f"; {corpus.totals()['train']['bytes'] / streams['train'].numel():.2f} bytes/token on train")


def log_plan(cfg, params: tuple[int, int], preset: Preset, steps: int | None, train_tokens: int, dev: torch.device,
             minutes: float | None, init_from: Path | None) -> None:
    n_bb, n_head = params
    log(f"model: {cfg.num_hidden_layers} layers {cfg.layer_types}, hidden {cfg.hidden_size}; backbone "
        f"{n_bb / 1e6:.2f}M + MTP head {n_head / 1e6:.2f}M params = {2 * (n_bb + n_head) / 1e6:.2f} MB in bf16")
    if init_from is not None:
        log(f"training: none, starting from {init_from}")
        return
    planned = steps or plan_steps(preset, train_tokens)
    tokens = planned * preset.batch * preset.seq_len
    log(f"training: {'' if steps else 'up to '}{planned} steps x {preset.batch} x {preset.seq_len} tokens "
        f"({tokens / 1e6:.1f}M tokens, {tokens / train_tokens:.1f} epochs) on {device_name(dev)}"
        + (f", capped at {minutes} min" if minutes else ""))


def log_fit(result: TrainResult, dev: torch.device) -> None:
    log(f"trained {result.steps_done} steps ({result.stopped_by}) in {result.train_seconds:.0f}s, "
        f"{result.tokens_seen / max(result.train_seconds, 1e-9) / 1e3:.1f}k tok/s; best dev at step {result.best_step}"
        + (f"; peak GPU memory {torch.cuda.max_memory_allocated(dev) / 2**30:.1f} GiB" if dev.type == "cuda" else ""))
