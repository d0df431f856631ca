"""Data: the stdlib corpus, the tokenizer trained on its train split, id streams and batches.

The corpus is the running Python's stdlib sources (core/corpus.py), split by file into train, dev
and held-out parts that never share a file. The tokenizer is a byte-level BPE trained on train only,
with the normalizer and pre-tokenizer that transformers' ``Qwen2Tokenizer`` rebuilds when it loads a
Qwen checkpoint (NFC, Qwen's split regex, byte level), so that ``AutoTokenizer`` on the exported
checkpoint encodes exactly as training did. Each split becomes one id stream, documents separated by
<|endoftext|>; training reads shuffled windows of it (``WindowSampler``), evaluation fixed ones.
"""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from tokenizers import decoders as tokenizer_decoders
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from core.corpus import Corpus, collect
from training.model import Preset

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
DOC_SEPARATOR = "<|endoftext|>"
SPLITS = ("train", "dev", "heldout")


def load_corpus(preset: Preset) -> Corpus:
    """This Python's stdlib corpus (core/corpus.py), cut to the preset's byte budget if it has one."""
    corpus = collect()
    return corpus.subset(preset.corpus_bytes) if preset.corpus_bytes else corpus


def load_tokenizer(ckpt: Path) -> Tokenizer:
    """The tokenizer of an exported checkpoint (``--init-from``, ``--measure-only``)."""
    return Tokenizer.from_file(str(ckpt / "tokenizer.json"))


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with Qwen2Tokenizer's own normalizer and pre-tokenizer (transformers rebuilds
    those when it loads a Qwen tokenizer, whatever tokenizer.json says)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = tokenizer_decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_splits(tok: Tokenizer, corpus: Corpus) -> dict[str, torch.Tensor]:
    """{split: one id stream of that split's documents} for train, dev and held-out."""
    return {s: encode_stream(tok, corpus.texts(s)) for s in SPLITS}


def encode_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents' ids, each followed by <|endoftext|>, as one int64 tensor."""
    sep = tok.token_to_id(DOC_SEPARATOR)
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(sep)
    return torch.tensor(ids, dtype=torch.int64)


class WindowSampler:
    """Epochs of shuffled, non-overlapping windows of ``T`` tokens over the train stream; each
    epoch starts at a random offset so window boundaries move. Driven by one CPU generator."""

    def __init__(self, stream: torch.Tensor, T: int, batch: int, seed: int):
        if stream.numel() < T * batch + T:
            raise ValueError(f"train stream of {stream.numel()} tokens is too short for {batch} x {T}")
        self.stream, self.T, self.batch = stream, T, batch
        self.gen = torch.Generator().manual_seed(seed + 2)
        self.epoch, self.queue = 0, torch.empty(0, dtype=torch.int64)
        self.arange = torch.arange(T)

    def _refill(self) -> None:
        offset = int(torch.randint(0, self.T, (1,), generator=self.gen))
        n = (self.stream.numel() - offset) // self.T
        starts = offset + torch.arange(n) * self.T
        self.queue = starts[torch.randperm(n, generator=self.gen)]
        self.epoch += 1

    def next(self) -> torch.Tensor:
        if self.queue.numel() < self.batch:
            self._refill()
        starts, self.queue = self.queue[: self.batch], self.queue[self.batch:]
        return self.stream[starts[:, None] + self.arange[None, :]]


def fixed_windows(stream: torch.Tensor, T: int, cap: int) -> torch.Tensor:
    """Non-overlapping windows from the start of a stream (evaluation)."""
    n = min(stream.numel() // T, cap)
    return stream[: n * T].view(n, T)
