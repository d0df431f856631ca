"""``heads``: draft-head tools.

    heads train --model MODEL --prompts PROMPTS [-n 128] [--steps N] [--lr LR] [--eval-every K]
                [--depth 4] [--batch 4] [--patience 3] [--shortlist-size K] [--seed 0]
                [--gen-batch 32] [--gen-dtype model] [--max-heldout N] [--max-dev N]
                [--device DEV] [--force-save] --out DIR

Exit codes: 0 head saved; 1 not saved because it is not better than the starting head on held-out
mean accepted length (pass --force-save to save it anyway); 2 bad input (one ``error:`` line).
Progress goes to stderr; the before/after summary to stdout.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from core.errors import UserError


def _check_out(out: Path, model_dir: str, head_file: str) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {str(out)!r} exists and is not a directory")
    if (out / head_file).exists():
        raise UserError(f"--out {str(out)!r} already holds {head_file}; pick another directory")
    p = Path(model_dir)
    if p.is_dir() and out.resolve() == p.resolve():
        raise UserError("--out must not be the model's checkpoint directory (the backbone's files are never touched)")
    parent = out if out.exists() else out.parent
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise UserError(f"--out {str(out)!r} is not writable")


def cmd_train(args) -> int:
    # torch and the pipeline load for a command, not for --help (start-up time), and after pin()
    from core import determinism

    determinism.pin()
    import torch
    import transformers

    from core.models import load_model
    from core.prompts import load_prompts
    from heads import train as T

    transformers.logging.set_verbosity_error()
    try:
        cfg = T.HeadTrainConfig(max_new_tokens=args.max_new_tokens, steps=args.steps, lr=args.lr,
                                eval_every=args.eval_every, depth=args.depth, batch=args.batch,
                                patience=args.patience, seed=args.seed, shortlist_size=args.shortlist_size,
                                gen_batch=args.gen_batch,
                                gen_dtype=None if args.gen_dtype == "model" else getattr(torch, args.gen_dtype),
                                max_heldout=args.max_heldout, max_dev=args.max_dev)
        _check_out(args.out, args.model, T.HEAD_FILE)
        model = load_model(args.model, args.device)
        if model.mtp is None:
            raise UserError(f"model {model.name} has no MTP head to train: {model.mtp_missing}")
        prompts, info = load_prompts(args.prompts, model)
        if not prompts:
            raise UserError("the prompt set is empty")
        res = T.train_head(model, prompts, cfg)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = res["report"]
    report["prompts"] = info
    for line in T.summary_lines(report):
        print(line)
    g = report["generation"]
    print(f"generation: {g['tokens']} tokens in {g['seconds']:.1f} s over {g['prompts']} prompts")
    for k in ("train", "dev", "heldout"):
        c = g[k]
        print(f"  {k}: {c['tokens']} tokens in {c['seconds']:.1f} s ({c['tokens_per_s'] or 0:.1f} tokens/s, "
              f"{c['decoder']}{'' if c.get('exact', True) else ', not exact'})")
    if res["state"] is None:
        print("error: no trained checkpoint was evaluated (--steps 0?); nothing saved", file=sys.stderr)
        return 1
    if not res["improved"] and not args.force_save:
        print("not saved: the trained head is not better than the starting head on held-out mean accepted "
              "length; pass --force-save to save it anyway", file=sys.stderr)
        return 1
    report["forced"] = not res["improved"]
    T.save_head(args.out, res["state"], res["shortlist"], report)
    print(f"wrote {args.out}: {T.HEAD_FILE}, draft_shortlist.json, {T.REPORT_FILE}"
          + (" (forced: not better than the starting head)" if report["forced"] else ""))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="heads", description="Draft-head tools")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train/distil the MTP draft head on the backbone's own greedy generations",
                       description=__doc__.split("\n\n")[1])
    t.add_argument("--model", required=True, help="checkpoint directory or built-in name (small, tiny, synthetic-9b)")
    t.add_argument("--prompts", required=True, help="prompt set: jsonl file, or a built-in set (stdlib-train for small, "
                   "or stdlib-train:N for N snippets, e.g. stdlib-train:2048; random-512-offline for synthetic-9b; dev)")
    t.add_argument("--gen-batch", type=int, default=32, metavar="B",
                   help="generate the TRAIN split's continuations B sequences at a time (plain HF forwards; each "
                        "batch's prompts left-truncated to its shortest; may differ from exact greedy at near-ties, "
                        "which is fine for training data). Dev and held-out are always generated exactly by "
                        "fast-serial. 1: train exactly too (slow). Default: 32")
    t.add_argument("--gen-dtype", choices=["model", "float32"], default="model",
                   help="dtype of the batched train generation: the model's own (default) or a float32 copy of "
                        "the backbone (on a CPU ~4x faster than bf16, but its greedy stream departs from the bf16 "
                        "backbone's more often); hidden states and evaluation always use the model itself")
    t.add_argument("--max-heldout", type=int, default=None, metavar="N",
                   help="at most N held-out prompts (default: 20%% of the set). Held-out and dev streams are "
                        "generated exactly, one prompt at a time: cap them for a large set; the rest goes to train")
    t.add_argument("--max-dev", type=int, default=None, metavar="N", help="at most N dev prompts (default: 10%% of the set)")
    t.add_argument("-n", "--max-new-tokens", type=int, default=128, help="greedy tokens generated per prompt")
    t.add_argument("--steps", type=int, default=200)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--eval-every", type=int, default=50)
    t.add_argument("--depth", type=int, default=4, help="draft depth of the acceptance measurement")
    t.add_argument("--batch", type=int, default=4, help="sequences per step")
    t.add_argument("--patience", type=int, default=3, help="evaluations without dev-loss improvement before stopping")
    t.add_argument("--shortlist-size", type=int, default=32768)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default=None)
    t.add_argument("--force-save", action="store_true", help="save even if not better than the starting head")
    t.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    return cmd_train(args)


if __name__ == "__main__":
    sys.exit(main())
