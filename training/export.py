"""Export in Qwen3.5's released multimodal layout, with fixtures/make_tiny.py's writer.

A checkpoint directory holds a config with ``text_config``, two safetensors shards (bf16) with
``model.language_model.*``, ``lm_head.*`` and ``mtp.*``, the tokenizer and its config, the generation
config, and ``corpus_manifest.json`` (Python version, every corpus file's sha256 and split).
``core.models.load_model`` loads it as it loads a released Qwen3.5.
"""
from __future__ import annotations

import json
from pathlib import Path

from fixtures.make_tiny import release_tensors, write_release, write_tokenizer_config
from training.outdir import MANIFEST_FILE, replace_checkpoint


def export(out: Path, cfg, backbone_sd: dict, head_sd: dict, tok) -> int:
    """The released layout via make_tiny's writer; returns the bytes of the safetensors files."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    write_tokenizer_config(out, model_max_length=cfg.max_position_embeddings)
    write_release(out, cfg, release_tensors(backbone_sd, head_sd))
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


def write_checkpoint(out: Path, cfg, state: tuple[dict, dict], tok, manifest: dict, force: bool = False) -> int:
    """Put the checkpoint of ``state`` (backbone, head state dicts) and the corpus manifest at
    ``out``, whole or not at all (``training.outdir.replace_checkpoint``: an earlier run's
    checkpoint is replaced; another directory only with ``force``, its other files kept); returns
    the bytes of the safetensors files."""
    sizes = []

    def write(directory: Path) -> None:
        sizes.append(export(directory, cfg, state[0], state[1], tok))
        (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")

    replace_checkpoint(out, write, force)
    return sizes[0]
