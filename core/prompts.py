"""Prompt sets: a jsonl file of ``{"id": str, "text": str}`` or ``{"id": str, "token_ids": [int]}``.

Built-in sets:
  dev         fixtures/prompts/dev.jsonl: prose, code, lists, dialogue, math (needs a tokenizer)
  random-512  8 prompts of 512 token ids drawn from a fixed seed (for models without a tokenizer,
              such as synthetic-9b; random weights make any prompt equally meaningful)
  stdlib-train / stdlib-dev / stdlib-heldout
              snippets (~400 characters from a line start) of the running Python's standard library,
              from one split of core/corpus.py (the split the built-in `small` model was trained
              with): 512 / 32 / 10 prompts by default; NAME:N (e.g. stdlib-train:2048, N within 1..100,000)
              cuts N snippets instead: snippet k comes from file k mod (number of files) at a line
              start hashed from (path, k), so the first 512 of stdlib-train:N are stdlib-train and a
              larger N adds new snippets (several per file). stdlib-train feeds `heads train`;
              stdlib-heldout is for measurement only, never for a choice. Which files exist depends
              on the Python version (the header's sha256 covers the prompts' text)
  random-512-offline  64 other prompts of 512 random ids (another seed): for building offline
              artifacts (draft shortlists, head training data) apart from the benchmark prompts
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from core.catalog import BUILTIN_PROMPTS  # noqa: F401 - re-exported
from core.corpus import collect
from core.errors import UserError
from core.models import FIXTURES
from core.schema import jsonl_values, read_regular

DEV_FILE = FIXTURES / "prompts" / "dev.jsonl"

# name -> (corpus split, default count); NAME:N asks for N snippets
CORPUS_SETS = {"stdlib-train": ("train", 512), "stdlib-dev": ("dev", 32), "stdlib-heldout": ("heldout", 10)}
MAX_CORPUS_PROMPTS = 100_000  # NAME:N beyond it is a typo, not a set: 100k snippets are ~60 MB of text
SNIPPET_CHARS = 400
# name -> (count, seed, id prefix)
RANDOM_SETS = {"random-512": (8, 0, "random"), "random-512-offline": (64, 1, "offline")}


@dataclass
class Prompt:
    id: str
    token_ids: list[int]
    text: str | None = None


def corpus_prompts(split: str, count: int, chars: int = SNIPPET_CHARS) -> list[dict]:
    """``count`` snippets spread over a split's files (round-robin in path order), each starting at
    a line start chosen by a hash of (path, k): the same on every machine with the same stdlib."""
    files = snippet_files(split, chars)
    out = []
    for k in range(count):
        f = files[k % len(files)]
        h = int.from_bytes(hashlib.sha256(f"{f.path}\0{k}".encode()).digest()[:8], "big")
        out.append({"id": f"{split}-{k}:{f.path}", "text": snippet_at(f.text, h, chars)})
    return out


def snippet_files(split: str, chars: int = SNIPPET_CHARS) -> list:
    """The split's files long enough to cut snippets of ``chars`` characters from."""
    files = [f for f in collect().split(split) if len(f.text) > 2 * chars]
    if not files:
        raise UserError(f"the standard library here has no {split}-split files to cut prompts from")
    return files


def snippet_at(text: str, position: int, chars: int = SNIPPET_CHARS) -> str:
    """``chars`` characters of ``text`` from the line start at or before ``position`` (taken modulo
    the room left for a whole snippet)."""
    start = text.rfind("\n", 0, position % (len(text) - chars)) + 1
    return text[start:start + chars]


def parse_corpus_spec(spec: str) -> tuple[str, int] | None:
    """``(split, count)`` for a corpus set given as ``NAME`` or ``NAME:N`` (N an integer within 1..MAX_CORPUS_PROMPTS); None
    when ``spec`` names no corpus set (another built-in set or a file). A bad count, or a count
    given to a set that takes none, is a UserError."""
    name, sep, count = spec.partition(":")
    if name in CORPUS_SETS:
        split, default = CORPUS_SETS[name]
        if not sep:
            return split, default
        if not (count.isascii() and count.isdigit()) or not 1 <= int(count) <= MAX_CORPUS_PROMPTS:
            raise UserError(f"prompt set {spec!r}: the count after {name + ':'!r} must be an integer within "
                            f"1..{MAX_CORPUS_PROMPTS} (e.g. {name}:2048)")
        return split, int(count)
    if sep and (name in RANDOM_SETS or name == "dev") and not Path(spec).is_file():
        raise UserError(f"prompt set {name!r} takes no count (only the corpus sets "
                        f"{', '.join(CORPUS_SETS)} do, as NAME:N); use --limit to take fewer prompts")
    return None


def default_prompt_set(model) -> str:
    """The built-in trained on the stdlib is measured on the stdlib's held-out split; other models
    with a tokenizer on the varied dev set; models without one on random ids."""
    if model.identity.get("name") == "small":
        return "stdlib-heldout"
    return "dev" if model.tokenizer is not None else "random-512"


def random_prompts(vocab: int, count: int = 8, length: int = 512, seed: int = 0, prefix: str = "random") -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"id": f"{prefix}-{i}", "token_ids": torch.randint(0, vocab, (length,), generator=gen).tolist()}
            for i in range(count)]


def parse_jsonl(path: Path, raw: bytes | None = None) -> list[tuple[int, dict]]:
    """(line number, object) for every non-blank line of a prompt file: a regular file of at most
    ``core.schema.MAX_JSONL_BYTES`` (``raw``: its bytes, when already read)."""
    if not path.exists() and not path.is_symlink():
        raise UserError(f"prompt file {str(path)!r} not found")
    entries = []
    for lineno, obj in jsonl_values(path, at=lambda n: f"{path}:{n}", raw=raw):
        if not isinstance(obj, dict):
            raise UserError(f"{path}:{lineno}: each line must be a JSON object")
        entries.append((lineno, obj))
    if not entries:
        raise UserError(f"{path}: no prompts in the file")
    return entries


def is_unicode(text: str) -> bool:
    """Encodable as UTF-8: JSON lets a lone surrogate (``"\\ud800"``) through, no tokenizer takes one."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def load_prompts(spec: str | None, model, limit: int | None = None) -> tuple[list[Prompt], dict]:
    """Resolve a prompt set against a model. Returns the prompts and a description for the header."""
    spec = spec or default_prompt_set(model)
    corpus = parse_corpus_spec(spec)
    if corpus is not None:
        entries = list(enumerate(corpus_prompts(*corpus), start=1))
        source = f"builtin:{spec}"
        digest_src = json.dumps([e for _, e in entries], sort_keys=True).encode()
    elif spec in RANDOM_SETS:
        count, seed, prefix = RANDOM_SETS[spec]
        entries = list(enumerate(random_prompts(model.vocab_size, count, seed=seed, prefix=prefix), start=1))
        source = f"builtin:{spec}"
        digest_src = json.dumps([e for _, e in entries], sort_keys=True).encode()
    else:
        path = DEV_FILE if spec == "dev" else Path(spec)
        if not path.exists() and not path.is_symlink():
            raise UserError(f"prompt file {str(path)!r} not found, and {spec!r} is not a built-in prompt set "
                            f"({', '.join(BUILTIN_PROMPTS)}; corpus sets also as NAME:N, e.g. stdlib-train:2048)")
        digest_src = read_regular(path)  # hashed and parsed from one read: the file may change
        entries = parse_jsonl(path, digest_src)
        source = "builtin:dev" if spec == "dev" else str(path)
    if limit is not None and source.startswith("builtin:"):
        entries = entries[:limit]  # a built-in set is valid by construction: tokenize only what is used
    prompts, seen = [], set()
    for lineno, obj in entries:
        pid = obj.get("id")
        if not isinstance(pid, str) or not pid:
            raise UserError(f"{source}:{lineno}: prompt needs a non-empty string 'id'")
        if pid in seen:
            raise UserError(f"{source}:{lineno}: duplicate prompt id {pid!r}")
        seen.add(pid)
        has_text, has_ids = "text" in obj, "token_ids" in obj
        if has_text == has_ids:
            raise UserError(f"{source}:{lineno}: prompt {pid!r} needs exactly one of 'text' or 'token_ids'")
        if has_ids:
            ids = obj["token_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise UserError(f"{source}:{lineno}: prompt {pid!r}: token_ids must be a non-empty list of integers")
            bad = [t for t in ids if not 0 <= t < model.vocab_size]
            if bad:
                raise UserError(f"{source}:{lineno}: prompt {pid!r}: token id {bad[0]} outside the vocabulary "
                                f"(0..{model.vocab_size - 1})")
            prompts.append(Prompt(pid, list(ids)))
        else:
            text = obj["text"]
            if not isinstance(text, str) or not text:
                raise UserError(f"{source}:{lineno}: prompt {pid!r}: text must be a non-empty string")
            if not is_unicode(text):
                raise UserError(f"{source}:{lineno}: prompt {pid!r}: text holds a lone surrogate (an escape such "
                                "as \\ud800 that is no character)")
            if model.tokenizer is None:
                raise UserError(f"{source}: prompt {pid!r} is text, but model {model.name} has no tokenizer; "
                                "give token_ids (or use --prompts random-512)")
            ids = model.tokenizer.get().encode(text)
            if not ids:
                raise UserError(f"{source}:{lineno}: prompt {pid!r} tokenizes to nothing")
            prompts.append(Prompt(pid, list(ids), text))
    if limit is not None:
        prompts = prompts[:limit]
    info = {"source": source, "sha256": hashlib.sha256(digest_src).hexdigest(), "count": len(prompts)}
    return prompts, info
