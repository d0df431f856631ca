"""Fresh prompts for a retime: never the stream's own prompts nor drawn from their tokens, from a
space no decoder can enumerate in advance, each as long as one of the stream's prompts.

Where they come from (``Source``, named in retime.json):
  random ids   for a set of token ids (``random-512*``, or a custom file of ids): ids drawn over
               the model's whole vocabulary;
  snippets     for a set of text (``stdlib-*``: the same split; ``dev`` or a custom file of text:
               the stdlib corpus's dev split): a snippet from a file and line start the seed
               picks, any line start of the split, never one where one of the stream's prompts
               starts, cut to the mirrored prompt's length;
  --fresh FILE the auditor's own prompts (jsonl of {id, text | token_ids}), a regular file, each
               cut to the length of the stream prompt it mirrors.
When no source fits (a text set on a model without a tokenizer, snippets too short, an auditor's
file with too few long prompts), ``NoFreshPrompts`` is raised: the retime's verdict is then
UNVERIFIED, never a pass. Every draw (a prompt, its warm-up, its spare) has a generator of its
own from the retime's secret seed, so the ids a worker is sent tell it nothing of the rest.
"""
from __future__ import annotations

import os
import random
import stat
from dataclasses import dataclass
from pathlib import Path

from core.errors import UserError
from core.prompts import RANDOM_SETS, SNIPPET_CHARS, load_prompts, parse_corpus_spec, snippet_at, snippet_files

from audit.pipeline import prompt_set_spec
from audit.stream import BadInput, PromptRun, Run

# a fresh corpus snippet is cut this long (twice a set's own) so that it is long enough once
# encoded for the prompt it mirrors, at almost any line start; line starts tried for one
FRESH_SNIPPET_CHARS = 2 * SNIPPET_CHARS
SNIPPET_TRIES = 64
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
    source: dict  # {"kind": "random-ids" | "snippets" | "file", "how": a sentence, ...}


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
    try:
        files = snippet_files(split, FRESH_SNIPPET_CHARS)
    except UserError as exc:
        raise NoFreshPrompts(str(exc)) from None
    tokenizer = model.tokenizer.get()

    def draw(rng, n, held):
        return corpus_snippet(rng, files, tokenizer, n, held, split)
    return draw, {"kind": "snippets", "split": split,
                  "how": f"snippets of the stdlib corpus's {split} split ({source_name} is a set of text) from "
                         "line starts the seed picks, cut to each mirrored prompt's length"}


def corpus_snippet(rng: random.Random, files: list, tokenizer, length: int, held: set, split: str) -> list[int]:
    """The first ``length`` tokens of a snippet from a file and line start ``rng`` picks, one that
    starts unlike every one of the stream's prompts. Any line start of the split may come, so a
    decoder cannot decode every fresh prompt in advance as it could a fixed list."""
    starts = {h[:HELD_START_TOKENS] for h in held}
    for _ in range(SNIPPET_TRIES):
        f = files[rng.randrange(len(files))]
        ids = tokenizer.encode(snippet_at(f.text, rng.randrange(len(f.text)), FRESH_SNIPPET_CHARS))
        if len(ids) >= length and tuple(ids[:HELD_START_TOKENS]) not in starts:
            return list(ids[:length])
    raise NoFreshPrompts(f"no {split} snippet of {length} tokens at {SNIPPET_TRIES} line starts: the stream's "
                         "prompts are longer than the split's snippets")


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
