"""Host work per plain step of a decoder's own loop, the forward taken out.

    python bench/loop_overhead.py [--model tiny] [-n 2000] [--decoders fast-serial,spec]

Each decoder's runtime step is replaced by a stub that returns the program of a real step made
once (its argmax fixed at a token that is not EOS), so a decode of N tokens times only what the
decoder's loop does around its steps: the policy, the bookkeeping, the reads of emitted tokens.
`spec` at depth 0 also makes its probes, which run real head forwards: the table also shows the
time per token without its drafts' phase (the decode's own time split).
CPU only (the stub skips the graphs a GPU would replay). Diagnostic: speed claims come from
`harness time`.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core import determinism  # noqa: E402

determinism.pin()

import torch  # noqa: E402


def stub_steps(runtime, prompt: list[int], token: int) -> None:
    """Make one real step, then let every later step return its program without a forward."""
    with torch.inference_mode():
        runtime.prefill(prompt)
        prog = runtime.step(torch.tensor([[token]], device=runtime.device))
        prog.ws["argmax"].fill_(token)

    def step(_token):
        runtime.length += 1
        return prog

    runtime.step = step


def loop_us(decoder, prompt: list[int], n: int, reps: int = 5) -> tuple[float, object]:
    """Fastest of ``reps`` decodes, in microseconds per emitted token, and its result."""
    best, result = float("inf"), None
    for _ in range(reps):
        t0 = time.perf_counter()
        result = decoder.decode(prompt, n)
        best = min(best, (time.perf_counter() - t0) / len(result.tokens))
    return best * 1e6, result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("-n", type=int, default=2000, help="tokens per decode")
    ap.add_argument("--decoders", default="fast-serial,spec")
    args = ap.parse_args(argv)

    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    from core.models import load_model
    from decoders import get_decoder

    model = load_model(args.model, "cpu")
    token = next(t for t in range(3, model.vocab_size) if t not in set(model.eos_token_ids))
    prompt = list(range(5, 40))
    rows = []
    for name in args.decoders.split(","):
        dec = get_decoder(name)
        dec.prepare(model)
        dec.reserve(len(prompt) + args.n)  # the size its decode asks for: no rebuild under the stub
        stub_steps(dec.runtime, prompt, token)
        us, res = loop_us(dec, prompt, args.n)
        extra = res.stats.extra or {}
        # the drafts' phase (host clock on a CPU): probes and the head's prompt rows, real forwards
        draft_us = 1e6 * extra.get("time_split", {}).get("draft", 0.0) / len(res.tokens)
        rows.append((name, us, us - draft_us, len(res.tokens), extra.get("probes", 0)))
    print("\n| decoder | host us per token | without the drafts' phase | tokens | probes |")
    print("|---|---|---|---|---|")
    for name, us, loop, n, probes in rows:
        print(f"| {name} | {us:.2f} | {loop:.2f} | {n} | {probes} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
