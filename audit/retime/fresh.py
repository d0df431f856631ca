"""Fresh prompts for a retime: never the stream's own prompts nor drawn from their tokens, from a
space no decoder can enumerate in advance, each as long as one of the stream's prompts.

Where they come from (``Source``, named in retime.json):
  random ids   for a set of token ids (``random-512*``, or a custom file of ids): ids drawn over
               the model's whole vocabulary;
  line runs    for a set of text (``stdlib-*``: the same split; ``dev`` or a custom file of text:
               the stdlib corpus's dev split): pieces joined until the text encodes to the
               mirrored prompt's length, then cut to it; each piece the whole lines from a line
               start drawn anew over the whole split until it holds ``PIECE_CHARS`` characters (two
               or three lines of code; fewer for a prompt too short for ``MIN_PIECES`` of them), so
               that a prompt of P pieces is one of (line starts)^P; never starting like one of the
               stream's prompts;
  --fresh FILE the auditor's own prompts (jsonl of {id, text | token_ids}), a regular file, each
               cut to the length of the stream prompt it mirrors.
When no source fits (a text set on a model without a tokenizer, a split without lines, an
auditor's file with too few long prompts), ``NoFreshPrompts`` is raised: the retime's verdict is then
UNVERIFIED, never a pass. Every draw (a prompt, its warm-up, its spare) has a generator of its
own from the retime's secret seed, so the ids a worker is sent tell it nothing of the rest.
"""
from __future__ import annotations

import bisect
import os
import random
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from core.corpus import collect
from core.errors import UserError
from core.prompts import RANDOM_SETS, load_prompts, parse_corpus_spec

from audit.pipeline import prompt_set_spec
from audit.stream import BadInput, PromptRun, Run

# a piece of a fresh text prompt: whole lines from one line start until it holds this many
# characters, two or three lines of code (about 25 tokens), so that a prompt of 512 tokens has
# some twenty pieces, each drawn anew
PIECE_CHARS = 64
# a prompt too short for this many pieces of PIECE_CHARS has pieces of this share of its
# characters (still whole lines: a prompt of a line or two is one or two pieces)
MIN_PIECES = 3
# characters of a split a tokenizer's characters per token are measured on
SAMPLE_CHARS = 1 << 16
# prompts drawn for one fresh prompt before the split is given up on (each started like one of
# the stream's prompts)
PROMPT_TRIES = 64
# encodes in a row that add no token before the split is given up on
STALLED_ENCODES = 8
# a fresh prompt may not begin with the first this many tokens of one of the stream's prompts
HELD_START_TOKENS = 8
# the corpus split that stands in for a text set that is not itself a corpus set (dev, a file)
TEXT_SPLIT = "dev"
# an auditor's --fresh file larger than this is refused unread (a prompt file is kilobytes)
FRESH_FILE_MAX_BYTES = 64 << 20


class NoFreshPrompts(Exception):
    """No source gives fresh prompts for this stream: the retime cannot verify its speed."""


@dataclass
class FreshPrompt:
    id: str
    token_ids: list[int]
    warmup_ids: list[int]
    mirrors: str  # the stream prompt whose length it has
    spare: "FreshPrompt | None" = None  # measured in its place if its legs are unstable


@dataclass(frozen=True)
class Draw:
    """Two looks of fresh prompts (each with its spare) and where they came from."""

    first: list[FreshPrompt]
    second: list[FreshPrompt]
    source: dict  # {"kind": "random-ids" | "line-runs" | "file", "how": a sentence, ...}


def draw_rng(seed: int, what: str) -> random.Random:
    """The generator of one draw (``what`` names it) from the retime's seed."""
    return random.Random(f"qwen35-exact/retime/{seed}/{what}")


def random_ids(rng: random.Random, vocab: int, length: int) -> list[int]:
    """``length`` ids drawn over the whole vocabulary ``range(vocab)``, with replacement."""
    return [rng.randrange(vocab) for _ in range(length)]


def stream_kind(run: Run) -> tuple[str, str | None]:
    """("ids" | "text", the corpus split for text): what kind of prompts the stream's set holds."""
    source = (run.header.get("prompts") or {}).get("source") or ""
    spec = prompt_set_spec(source) if source.startswith("builtin:") else None
    if spec in RANDOM_SETS:
        return "ids", None
    try:
        corpus = parse_corpus_spec(spec) if spec else None
    except UserError:
        corpus = None
    if corpus is not None:
        return "text", corpus[0]
    if spec == "dev" or any(p.text for p in run.prompts):
        return "text", TEXT_SPLIT
    return "ids", None


def prompt_drawer(run: Run, model):
    """(draw(rng, length, held) -> ids, source) for the stream's kind of prompts."""
    source_name = (run.header.get("prompts") or {}).get("source") or "no source"
    kind, split = stream_kind(run)
    if kind == "ids":
        def draw(rng, n, held):
            return random_ids(rng, model.vocab_size, n)
        return draw, {"kind": "random-ids", "how": f"random token ids over the whole vocabulary of "
                                                   f"{model.vocab_size} ({source_name} is a set of ids)"}
    if model.tokenizer is None:
        raise NoFreshPrompts(f"{source_name} is a set of text, but the model has no tokenizer to encode fresh text")
    runs = LineRuns(LineStarts.of(split), model.tokenizer.get())
    return runs.draw, {"kind": "line-runs", "split": split, "line_starts": len(runs.lines),
                       "piece_chars": PIECE_CHARS, "min_pieces": MIN_PIECES,
                       "how": f"runs of lines of the stdlib corpus's {split} split ({source_name} is a set of "
                              f"text), each from one of its {len(runs.lines)} line starts drawn anew, "
                              f"{PIECE_CHARS} characters or more (shorter for a prompt too short for "
                              f"{MIN_PIECES} such runs), joined and cut to each mirrored prompt's length"}


class LineStarts:
    """Every line start of a corpus split, each as likely as the next: where a piece of a fresh text
    prompt begins."""

    def __init__(self, texts: list[str], split: str):
        self.texts, self.split = texts, split
        self.starts = [[m.start() for m in re.finditer(r"(?m)^", t) if m.start() < len(t)] for t in texts]
        self.before, total = [], 0  # line starts in the files before each one
        for s in self.starts:
            self.before.append(total)
            total += len(s)
        self.total = total

    @classmethod
    def of(cls, split: str) -> "LineStarts":
        lines = cls([f.text for f in collect().split(split)], split)
        if not lines.total:
            raise NoFreshPrompts(f"the standard library here has no {split}-split lines to draw fresh prompts from")
        return lines

    def __len__(self) -> int:
        return self.total

    def sample(self) -> str:
        """The start of every file, up to ``SAMPLE_CHARS`` in all: text to measure a tokenizer on."""
        return "".join(t[:SAMPLE_CHARS // 32] for t in self.texts)[:SAMPLE_CHARS]

    def piece(self, rng: random.Random, chars: int) -> str:
        """The whole lines from a line start ``rng`` picks until they hold ``chars`` characters (or
        the file ends), ending in a newline."""
        k = rng.randrange(self.total)
        f = bisect.bisect_right(self.before, k) - 1
        text, start = self.texts[f], self.starts[f][k - self.before[f]]
        end = start
        while end < len(text) and end - start < chars:
            newline = text.find("\n", end)
            end = len(text) if newline < 0 else newline + 1
        return text[start:end] if text[end - 1] == "\n" else text[start:end] + "\n"


class LineRuns:
    """Fresh text prompts: pieces of a split's lines (``LineStarts.piece``), each drawn anew,
    joined until the text encodes to the mirrored length, then cut to it. A prompt of P pieces is
    one of (line starts)^P, so no decoder can decode them all in advance; a prompt too short for
    ``MIN_PIECES`` pieces of ``PIECE_CHARS`` characters gets shorter pieces (at the tokenizer's
    characters per token on the split), so that a short prompt is several pieces too."""

    def __init__(self, lines: LineStarts, tokenizer):
        self.lines, self.tokenizer = lines, tokenizer
        sample = lines.sample()
        self.chars_per_token = len(sample) / max(1, len(tokenizer.encode(sample)))

    def piece_chars(self, length: int) -> int:
        """Characters a piece of a ``length``-token prompt holds at least."""
        return max(1, min(PIECE_CHARS, int(length * self.chars_per_token / MIN_PIECES)))

    def draw(self, rng: random.Random, length: int, held: set) -> list[int]:
        """The first ``length`` tokens of joined pieces, starting unlike every one of the stream's
        prompts (``held``)."""
        openings = {h[:HELD_START_TOKENS] for h in held}
        for _ in range(PROMPT_TRIES):
            ids = self.joined(rng, length)
            if tuple(ids[:HELD_START_TOKENS]) not in openings:
                return ids
        raise NoFreshPrompts(f"{PROMPT_TRIES} prompts drawn from the {self.lines.split} split each started like "
                             "one of the stream's prompts")

    def joined(self, rng: random.Random, length: int) -> list[int]:
        """Pieces drawn and joined until the text encodes to at least ``length`` tokens, cut to it;
        encoded again only once the text is as long as the characters per token so far ask for."""
        chars = self.piece_chars(length)
        text, ids, stalled = "", [], 0
        while len(ids) < length:
            chars_per_token = len(text) / len(ids) if ids else self.chars_per_token
            want = len(text) + max(1, int((length - len(ids)) * chars_per_token))
            before = len(ids)
            while len(text) < want:
                text += self.lines.piece(rng, chars)
            ids = self.tokenizer.encode(text)
            # a piece may merge into the tokens before it; a tokenizer that never grows is given up on
            stalled = stalled + 1 if len(ids) <= before else 0
            if stalled == STALLED_ENCODES:
                raise NoFreshPrompts(f"the {self.lines.split} split's lines encode to no more than {len(ids)} "
                                     f"tokens, however many are joined (a prompt of {length} tokens is mirrored)")
        return list(ids[:length])


def read_fresh_file(path: Path, model) -> list[list[int]]:
    """The auditor's prompts, in file order: a regular file of bounded size, read by the prompt
    loader's rules (``core.prompts.load_prompts``: id, exactly one of text or token_ids, ids in
    the vocabulary). Bad input (``BadInput``) when it is not such a file."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise BadInput(f"--fresh {path}: cannot read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise BadInput(f"--fresh {path}: not a regular file")
    if st.st_size > FRESH_FILE_MAX_BYTES:
        raise BadInput(f"--fresh {path}: {st.st_size} bytes, more than a prompt file holds "
                       f"(at most {FRESH_FILE_MAX_BYTES})")
    try:
        prompts, _ = load_prompts(str(path), model)
    except UserError as exc:
        raise BadInput(f"--fresh: {exc}") from None
    return [p.token_ids for p in prompts]


def file_drawer(path: Path, model):
    """(draw, source) handing out the auditor's prompts in file order, each the next one at least
    as long as the prompt it mirrors (cut to its length) and unlike the stream's prompts."""
    pool = read_fresh_file(path, model)
    used = [False] * len(pool)

    def draw(rng, n, held):
        starts = {h[:HELD_START_TOKENS] for h in held}
        for i, ids in enumerate(pool):
            if not used[i] and len(ids) >= n and tuple(ids[:HELD_START_TOKENS]) not in starts:
                used[i] = True
                return list(ids[:n])
        raise NoFreshPrompts(f"--fresh {path}: too few unused prompts of at least {n} tokens unlike the stream's")
    return draw, {"kind": "file", "file": str(path), "prompts_in_file": len(pool),
                  "how": f"the auditor's prompts from {path} (--fresh), in file order, cut to each mirrored "
                         "prompt's length"}


def fresh_prompts(run: Run, model, k: int, seed: int, fresh_file: Path | None = None) -> Draw:
    """Two looks of ``k`` fresh prompts, each of the length of one of the stream's prompts (the
    stream's prompts in an order the seed picks, again from the start when ``k`` is more), each
    with a spare of the same length. From an auditor's file only the first look is required; its
    second look and spares are drawn while the file lasts."""
    order = draw_rng(seed, "mirrors").sample(run.prompts, len(run.prompts))
    mirrors = [order[i % len(order)] for i in range(k)]
    draw, source = file_drawer(fresh_file, model) if fresh_file else prompt_drawer(run, model)
    held = {tuple(p.token_ids) for p in run.prompts}

    def fresh(fid: str, m: PromptRun) -> FreshPrompt:
        tokens = draw(draw_rng(seed, f"prompt/{fid}"), len(m.token_ids), held)
        if tuple(tokens) in held:
            raise NoFreshPrompts(f"a fresh prompt drawn for {m.id!r} is one of the stream's own prompts")
        # the warm-up, as the harness does it: another prompt of the same length
        return FreshPrompt(fid, tokens, random_ids(draw_rng(seed, f"warmup/{fid}"), model.vocab_size,
                                                   len(tokens)), m.id)

    def optional(fid: str, m: PromptRun) -> FreshPrompt | None:
        try:
            return fresh(fid, m)
        except NoFreshPrompts:
            if fresh_file is None:
                raise
            return None

    looks: list[list[FreshPrompt]] = [[], []]
    first = [fresh(f"fresh-{i}", m) for i, m in enumerate(mirrors)]
    for fp, m in zip(first, mirrors):
        fp.spare = optional(f"{fp.id}-again", m)
    looks[0] = first
    for i, m in enumerate(mirrors):
        fp = optional(f"fresh-{k + i}", m)
        if fp is None:
            looks[1] = []
            break
        fp.spare = optional(f"{fp.id}-again", m)
        looks[1].append(fp)
    return Draw(looks[0], looks[1], source)
