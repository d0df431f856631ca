"""Names and one-line descriptions of the built-in models and prompt sets, without importing torch
(``harness list`` and ``--help`` read them; ``core.models`` and ``core.prompts`` build them)."""
from __future__ import annotations

DEFAULT_MODEL = "small"

BUILTIN_MODELS = {
    "small": "a small Qwen3.5 (8 layers, 3 Gated-DeltaNet : 1 attention, hidden 256, 4096-token "
    "BPE) with its MTP head, trained on the Python standard library (the training package); CPU-sized",
    "tiny": "deterministic random Qwen3.5 (4 layers: 3 Gated-DeltaNet + 1 attention, MTP head, "
    "512-token BPE tokenizer) in the released checkpoint layout under fixtures/tiny; CPU-sized",
    "synthetic-9b": "the Qwen3.5-9B shape with random bf16 weights and a random MTP head, "
    "built on the GPU from a seed (needs CUDA, ~19 GB)",
}

BUILTIN_PROMPTS = {
    "dev": "10 varied prompts (prose, code, lists, dialogue, math), tokenized with the model's tokenizer",
    "random-512": "8 prompts of 512 random token ids (fixed seed), for models without a tokenizer",
    "random-512-offline": "64 prompts of 512 random token ids (another seed), disjoint from random-512: "
                          "for building shortlists and head data apart from the benchmark prompts",
    "stdlib-train": "512 snippets of the Python stdlib's train split (core/corpus.py), for heads train; "
                    "stdlib-train:N cuts N (any N >= 1, e.g. stdlib-train:2048)",
    "stdlib-dev": "32 snippets of the Python stdlib's dev split (stdlib-dev:N for N)",
    "stdlib-heldout": "10 snippets of the Python stdlib's held-out split (small's default): measurement only "
                      "(stdlib-heldout:N for N)",
}
