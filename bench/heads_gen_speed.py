"""Generation speed of `heads train`'s train-split generators on one prompt set.

    python bench/heads_gen_speed.py [--model small] [--prompts stdlib-train:64] [-n 32]
                                    [--batches 32,1] [--gen-dtype model|float32] [--device cpu] [--hidden]

For each B in --batches: B > 1 is ``heads.train.generate_batched`` (HF forwards over B rows of
equal length, prompts left-truncated per batch; not exact), B = 1 the exact ``generate``
(FastSerialDecoder, one prompt at a time, the full prompts). Prints tokens, seconds, tokens/s and,
for B > 1, how many batched streams equal the exact streams of the same (truncated) prompts
(a re-generation with FastSerialDecoder that is not timed). --hidden also times
``heads.train.hidden_states`` (one backbone forward per prompt+stream) on the first batched run.
"""
from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--prompts", default="stdlib-train:64")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=32)
    ap.add_argument("--batches", default="32,1")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hidden", action="store_true")
    ap.add_argument("--gen-dtype", default="model", choices=["model", "float32"])
    ap.add_argument("--no-compare", action="store_true", help="skip the exactness comparison")
    args = ap.parse_args()

    # torch and the model code load after the arguments parse (start-up time) and after pin()
    from core import determinism

    determinism.pin()
    import transformers

    transformers.logging.set_verbosity_error()
    import torch

    from core.models import load_model
    from core.prompts import load_prompts
    from heads import train as T

    model = load_model(args.model, args.device)
    prompts, info = load_prompts(args.prompts, model)
    print(f"model {args.model}, prompts {info['source']} ({len(prompts)}), -n {args.max_new_tokens}, "
          f"torch threads {torch.get_num_threads()}")
    for b in (int(x) for x in args.batches.split(",")):
        if b > 1:
            dt = None if args.gen_dtype == "model" else torch.float32
            used, streams, c = T.generate_batched(model, prompts, args.max_new_tokens, b, dtype=dt)
            pt = c["prompt_tokens"]
            line = (f"B={b:<4} hf-batched {c['dtype']}: {c['tokens']} tokens in {c['seconds']:.1f} s = {c['tokens_per_s']:.1f} "
                    f"tokens/s; prompt tokens {pt['original']} -> {pt['used']} ({pt['truncated_prompts']} "
                    f"truncated, max cut {pt['max_cut']})")
            if not args.no_compare:
                exact, _ = T.generate(model, used, args.max_new_tokens)
                same = sum(a == e for a, e in zip(streams, exact))
                pos = sum(next((i for i, (x, y) in enumerate(zip(a, e)) if x != y), min(len(a), len(e)))
                          for a, e in zip(streams, exact))
                line += (f"; {same}/{len(streams)} streams equal fast-serial's on the same prompts, "
                         f"{pos / max(sum(len(e) for e in exact), 1):.1%} of tokens before the first difference")
            print(line, flush=True)
            if args.hidden:
                args.hidden = False
                t0 = time.perf_counter()
                ex = T.hidden_states(model, used, streams)
                s = time.perf_counter() - t0
                print(f"hidden_states: {len(ex)} examples in {s:.1f} s ({s / max(len(ex), 1) * 1000:.0f} ms each)")
        else:
            _, c = T.generate(model, prompts, args.max_new_tokens)
            print(f"B=1    fast-serial: {c['tokens']} tokens in {c['seconds']:.1f} s = {c['tokens_per_s']:.1f} tokens/s",
                  flush=True)


if __name__ == "__main__":
    main()
