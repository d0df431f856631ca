"""``python -m decoders.trace``: record an acceptance trace (the format: ``decoders.trace``).

The arguments parse before torch and the model code load (start-up time)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from core.clirun import OneLineArgumentParser, Pace
from core.errors import EXIT_INTERRUPTED, UserError
from decoders.trace import MAX_HEAD_TOP_K, MAX_TRACE_DEPTH
from decoders.trace import __doc__ as FORMAT_DOC


def main(argv=None) -> int:
    ap = OneLineArgumentParser(prog="python -m decoders.trace", description=FORMAT_DOC.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--prompts", default=None, help="prompt set (default: the model's default set)")
    ap.add_argument("--limit", type=int, default=None, help="keep the first K prompts")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-depth", type=int, default=6)
    ap.add_argument("--head", default=None, help="a directory written by `heads train` (as spec's head=)")
    ap.add_argument("--shortlist", default=None, help="draft shortlist JSON (as spec's shortlist=)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--sampling", default=None, metavar="SAMPLER",
                    help="trace the sampled stream (core.sampling: e.g. qwen-thinking,seed=7) with coupled drafts")
    ap.add_argument("--uncoupled", action="store_true", help="with --sampling: drafts by plain argmax")
    ap.add_argument("--head-top-k", type=int, default=4, metavar="K",
                    help="record each position's rank among the head's K best at depth 1 (0: none)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = ap.parse_args(argv)

    if args.uncoupled and args.sampling is None:
        return usage_error("--uncoupled needs --sampling")
    for bad, what in ((args.limit is not None and args.limit < 1, "--limit must be >= 1"),
                      (args.max_new_tokens < 1, "-n must be >= 1"),
                      (not 1 <= args.max_depth <= MAX_TRACE_DEPTH, f"--max-depth must be within 1..{MAX_TRACE_DEPTH}"),
                      (not 0 <= args.head_top_k <= MAX_HEAD_TOP_K, f"--head-top-k must be within 0..{MAX_HEAD_TOP_K}")):
        if bad:
            return usage_error(what)

    # torch and the model code load after the arguments parse, and after pin()
    from core import determinism

    determinism.pin()  # before anything starts CUDA
    import transformers

    from core.devices import check_device
    from core.models import load_model
    from core.paths import check_new_output
    from core.prompts import load_prompts
    from core.sampling import Sampler, SamplerError
    from core.schema import write_json_atomic
    from decoders.trace.record import record

    transformers.logging.set_verbosity_error()
    try:
        check_new_output(args.out, args.force)
        device = check_device(args.device)
        try:
            sampler = Sampler.parse(args.sampling) if args.sampling is not None else None
        except SamplerError as exc:
            raise UserError(f"--sampling: {exc}") from None
        model = load_model(args.model, device)
        model.require_mtp("trace")
        prompts, info = load_prompts(args.prompts, model, args.limit)
        data = record(model, prompts, args.max_new_tokens, args.max_depth, args.head, args.shortlist,
                      progress_lines(len(prompts)), sampler=sampler, coupled=not args.uncoupled,
                      head_top_k=args.head_top_k)
    except UserError as exc:
        return usage_error(str(exc))
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    data["prompts"] = info
    write_json_atomic(args.out, data, indent=None)  # a data file: 2-3 KB per 100 positions
    acc = ", ".join(f"{d['conditional']:.3f}" if d["conditional"] is not None else "-"
                    for d in data["acceptance"]["per_depth"])
    print(f"wrote {args.out}: {len(data['rows'])} prompts, conditional acceptance by depth {acc}")
    branch = data["acceptance"].get("second_branch")
    if branch and branch["misses_in_top"].get("2") is not None:
        per_round = ", ".join(f"{v:.3f}" for v in branch["tokens_per_round_at_fixed_depth"].values() if v is not None)
        print(f"depth-1 misses whose token is the second branch: {branch['misses_in_top']['2']:.3f}; "
              f"tokens per round by depth with a second branch at depth 1: {per_round}")
    tenths = ", ".join("-" if b["accepted"] is None else f"{b['accepted']:.2f}" for b in data["acceptance"]["by_confidence"])
    print(f"acceptance by tenth of the head's confidence (0.0-0.1 ... 0.9-1.0): {tenths}")
    return 0


def usage_error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def progress_lines(total: int):
    """``traced i/n (m tokens)`` on stderr after each prompt, with the time left."""
    pace = Pace(total)

    def line(done: int, total: int, tokens: int) -> None:
        print(f"traced {done}/{total} ({tokens} tokens){pace(done)}", file=sys.stderr, flush=True)
    return line
