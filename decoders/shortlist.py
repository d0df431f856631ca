"""Build a draft shortlist: the token ids the MTP head's draft logits are restricted to.

    python -m decoders.shortlist --model MODEL [--prompts PROMPTS] [-n 256] [--size 32768] --out FILE

Request-independent by construction: built offline, once per model, from token frequencies of the
model's own greedy generations on a prompt set (never from the request being decoded). If fewer
distinct tokens were generated than ``--size``, the rest is filled with the lowest unseen ids, so
the size is what was asked. Stored as JSON ``{"ids": [...], ...}``; put it beside a checkpoint as
``draft_shortlist.json`` and ``spec`` uses it by default. Verification always uses the full
vocabulary: a shortlist can only change which drafts are proposed, never which tokens are emitted.
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from core.clirun import OneLineArgumentParser, Pace
from core.errors import UserError


def build(model, prompts, max_new_tokens: int, size: int, progress=None) -> dict:
    """Generate greedily (exact fast runtime) from every prompt, then count: see from_streams."""
    from decoders.fast_serial import FastSerialDecoder  # torch loads only when the CLI builds (start-up time)

    check_size(size, model.vocab_size)
    dec = FastSerialDecoder()
    dec.prepare(model)
    streams = []
    for i, prompt in enumerate(prompts):
        streams.append(dec.decode(prompt.token_ids, max_new_tokens).tokens)
        if progress:
            progress(i + 1, len(prompts))
    return from_streams(model, streams, max_new_tokens, size)


def check_size(size: int, vocab: int) -> None:
    if size < 1 or size > vocab:
        raise UserError(f"shortlist size must be within 1..{vocab}")


def from_streams(model, streams: list[list[int]], max_new_tokens: int, size: int) -> dict:
    """The ``size`` most frequent ids of already generated streams, then the lowest unseen ids."""
    check_size(size, model.vocab_size)
    counts: Counter = Counter()
    for tokens in streams:
        counts.update(tokens)
    ids = [t for t, _ in counts.most_common(size)]
    seen = set(ids)
    fill = (t for t in range(model.vocab_size) if t not in seen)
    while len(ids) < size:
        ids.append(next(fill))
    return {"ids": ids, "size": size, "generated_tokens": sum(counts.values()),
            "distinct_generated": len(counts), "model": model.identity, "max_new_tokens": max_new_tokens}


def main(argv=None) -> int:
    ap = OneLineArgumentParser(prog="python -m decoders.shortlist", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--prompts", default=None, help="prompt set (default: the model's default set)")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=256)
    ap.add_argument("--size", type=int, default=32768)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1 or args.size < 1:
        print("error: -n and --size must be >= 1", file=sys.stderr)
        return 2

    # torch and the model code load after the arguments parse (start-up time), and after pin()
    from core import determinism

    determinism.pin()
    import transformers

    transformers.logging.set_verbosity_error()
    from core.devices import check_device
    from core.models import load_model
    from core.paths import check_new_output
    from core.prompts import load_prompts
    from core.schema import write_json_atomic

    try:
        check_new_output(args.out, args.force)
        model = load_model(args.model, check_device(args.device))
        prompts, info = load_prompts(args.prompts, model)
        data = build(model, prompts, args.max_new_tokens, min(args.size, model.vocab_size),
                     progress_lines(len(prompts)))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    data["prompts"] = info
    write_json_atomic(args.out, data)
    print(f"wrote {args.out}: {data['size']} ids ({data['distinct_generated']} distinct in "
          f"{data['generated_tokens']} generated tokens)")
    return 0


def progress_lines(total: int):
    """``generated i/n`` on stderr after each prompt, with the time left."""
    pace = Pace(total)
    return lambda done, total: print(f"generated {done}/{total}{pace(done)}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    from core.errors import run_cli

    run_cli(main)
