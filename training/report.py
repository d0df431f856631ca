"""A run's record, ``quality.json`` in the checkpoint directory, and its closing log lines.

The record holds what repeats the run (command, seed, plan, hyperparameters, versions, the pinned
determinism settings and any determinism warnings of training), what it trained on (corpus totals
and the manifest's digest, tokenizer), the model's shape, the training curve and the unloop record,
and the quality sections of ``training.quality.measure_quality``.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
import transformers

from core.models import device_name
from training.export import MANIFEST_FILE
from training.log import log
from training.model import Preset
from training.train import TrainResult

QUALITY_FILE = "quality.json"
SCHEMA = "qwen35-exact/small-quality/1"


@dataclass
class Fitted:
    """What the training phase gives the record: the loop's result, the unloop fine-tune's record
    (None when it did not run) and the determinism warnings raised while training."""

    result: TrainResult
    unloop: dict | None
    warnings: list[str]


def run_report(*, preset: Preset, seed: int, minutes: float | None, init_from: Path | None, base: dict,
               device: torch.device, pinned: dict, corpus, manifest: dict, tok, streams: dict, cfg,
               params: tuple[int, int], ckpt_bytes: int, fitted: Fitted, quality: dict, seconds: dict) -> dict:
    """The quality.json record of one run. ``base``: the --init-from checkpoint's own record ({} for
    none); ``params``: (backbone, head) parameter counts; ``seconds``: {"total", "quality"}."""
    totals = corpus.totals()
    result = fitted.result
    train_tokens = streams["train"].numel()
    return {
        "schema": SCHEMA,
        "command": "python -m training " + " ".join(sys.argv[1:]),
        "preset": preset.name,
        "seed": seed,
        "device": device_name(device),
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "determinism": {"pinned": pinned, "training": "deterministic algorithms, warn-only",
                        "training_warnings": fitted.warnings},
        "corpus": {"python_version": corpus.python_version, "totals": totals,
                   "files_sha256": manifest["files_sha256"], "manifest": MANIFEST_FILE},
        "tokenizer": {"vocab_size": tok.get_vocab_size(), "trained_on": "train split only",
                      "train_bytes_per_token": totals["train"]["bytes"] / train_tokens,
                      "tokens": {s: int(v.numel()) for s, v in streams.items()}},
        "model": {"layer_types": cfg.layer_types, "hidden_size": cfg.hidden_size,
                  "params_backbone": params[0], "params_mtp": params[1], "checkpoint_bytes": ckpt_bytes},
        "training": {
            "objective": f"next-token CE + {preset.mtp_lambda} x MTP CE (token t+2); hidden not detached",
            "plan": result.plan, "steps_done": result.steps_done, "stopped_by": result.stopped_by,
            "repeat_with": f"--seed {seed} --steps {result.plan['steps']}",
            "minutes_cap": minutes, "tokens_seen": result.tokens_seen,
            "epochs": result.tokens_seen / train_tokens,
            "train_seconds": round(result.train_seconds, 1),
            "tokens_per_second": result.tokens_seen / max(result.train_seconds, 1e-9),
            "hyperparameters": {k: v for k, v in dataclasses.asdict(preset).items()
                                if k not in ("model", "name", "corpus_bytes")},
            "precision": "fp32 master weights, bf16 autocast" if device.type == "cuda" else "fp32",
            "best_step": result.best_step, "best_dev_during_training": result.best_dev,
            "curve": result.curve,
            "init_from": None if init_from is None else {"path": str(init_from), "training": base.get("training"),
                                                         "command": base.get("command")},
            "unloop": fitted.unloop,
        },
        **quality,
        "seconds": seconds,
    }


def log_summary(report: dict, out: Path) -> None:
    """The run's closing lines: held-out losses, acceptance, the spec check, where it wrote."""
    h, a = report["heldout"], report["acceptance"]
    log(f"held-out: next-token {h['ntp_loss']:.4f} nats/token ({h['ntp_bits_per_byte']:.3f} bits/byte), "
        f"mtp {h['mtp_loss']:.4f}")
    if a.get("per_depth"):
        log("acceptance (conditional per depth): "
            + ", ".join(f"d{x['depth']} {x['conditional']:.3f}" for x in a["per_depth"])
            + "; tokens/round at fixed depth: "
            + ", ".join(f"{k}: {v:.2f}" for k, v in a["tokens_per_round_at_fixed_depth"].items() if v))
    sc = report.get("spec_check") or {}
    if "mean_accepted_length" in sc:
        log(f"spec (depth {sc['depth']}): exact vs serial {sc['exact_vs_serial']}, "
            f"mean accepted length {sc['mean_accepted_length']:.2f}")
    elif sc:
        log(f"spec check failed: {sc.get('error')}")
    log(f"wrote {out} in {report['seconds']['total']:.0f}s")
