"""What one sampled pick costs, stage by stage, on one row of logits of the 9B vocabulary.

    python bench/pick_bench.py [--vocab 248320] [--device cuda] [--reps 200] [--window 5]
                               [--samplers 'qwen-thinking;qwen-instruct;temperature=1,top_k=50;temperature=1']
                               [--json FILE]

For each sampler, each stage of ``core.sampling.pick_from`` is timed alone on a random bf16 row:
the ranking keys, the top-k of those keys (one ``torch.topk`` over the row), for scale a top-k of
the float32 values (not a ranking: equal values come in any order), the candidates with
their filters, the whole pick with the seed and position in device tensors (the keys hashed on the
device) and with the position's keys in a device tensor (``core.sampling.pick_from_keys``, what the
decoders' graphs run), and that pick with its read to the host (``.item()``, what a lazy verify
round pays per row), then a window of ``--window`` rows: row by row (each row's pick, as the lazy
and the per-row paths run them) and in one call (``core.sampling.pick_rows_from_keys``, what
``lazy_rows=false`` runs). On a GPU each stage is captured in a CUDA graph, as the decoders run it, and timed by
CUDA events over ``--reps`` replays (the read: by the host clock); on a CPU, eagerly. The coupled
draft's top-64 over a 32k-token shortlist is timed once for scale. The table (microseconds per
call) is printed last.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from core.sampling import (Sampler, SamplerError, candidates, pick_from, pick_from_keys,  # noqa: E402
                           pick_rows_from_keys, position_key, ranking_keys)

DEFAULT_SAMPLERS = "qwen-thinking;qwen-instruct;temperature=1,top_k=50;temperature=1"


def per_call_us(fn, device: torch.device, reps: int) -> float:
    """Microseconds per call of ``fn``: graph replays between CUDA events on a GPU, eager on a CPU."""
    if device.type != "cuda":
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6
    from decoders.runtime.graphs import capture_segments

    graph = capture_segments([("graph", fn)], torch.cuda.graph_pool_handle())[0]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def read_us(fn, device: torch.device, reps: int) -> float:
    """Microseconds per call of ``fn`` followed by ``.item()`` on its result (host clock)."""
    if device.type == "cuda":
        from decoders.runtime.graphs import capture_segments

        out = torch.zeros((), dtype=torch.long, device=device)
        graph = capture_segments([("graph", lambda: out.copy_(fn()))], torch.cuda.graph_pool_handle())[0]

        def call():
            graph.replay()
            return out.item()
    else:
        def call():
            return fn().item()
    call()
    t0 = time.perf_counter()
    for _ in range(reps):
        call()
    return (time.perf_counter() - t0) / reps * 1e6


def bench_sampler(sampler: Sampler, vocab: int, device: torch.device, reps: int, window: int) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(vocab)
    rows = (torch.randn(window, vocab, generator=gen) * 3).to(torch.bfloat16).to(device)
    row = rows[0]
    seed = torch.tensor(sampler.seed - (1 << 64) if sampler.seed >= 1 << 63 else sampler.seed, device=device)  # its int64 bits
    position = torch.tensor(1000, device=device)
    keys_at = torch.tensor(position_key(sampler.seed, 1000), device=device)
    window_keys = torch.tensor([position_key(sampler.seed, 1000 + r) for r in range(window)], device=device)
    k1s, k2s = window_keys[:, 0].contiguous(), window_keys[:, 1].contiguous()
    k = sampler.top_k if 0 < sampler.top_k < vocab else vocab
    keys = ranking_keys(row)
    top_k = (lambda: torch.topk(keys, k).values) if k < vocab else (lambda: torch.sort(keys, descending=True).values)
    stages = {
        "keys": per_call_us(lambda: ranking_keys(row), device, reps),
        "top-k": per_call_us(top_k, device, reps),
        "top-k, float32 values": per_call_us(lambda: torch.topk(row.float(), min(k, vocab - 1)).values, device, reps),
        "candidates": per_call_us(lambda: candidates(row, sampler)[2], device, reps),
        "pick, seed and position": per_call_us(lambda: pick_from(row, sampler, seed, position), device, reps),
        "pick, keys": per_call_us(lambda: pick_from_keys(row, sampler, keys_at[0], keys_at[1]), device, reps),
        "pick + read": read_us(lambda: pick_from_keys(row, sampler, keys_at[0], keys_at[1]), device, reps),
        f"{window} rows, row by row": per_call_us(
            lambda: [pick_from_keys(rows[r], sampler, k1s[r], k2s[r]) for r in range(window)], device, reps),
        f"{window} rows, one call": per_call_us(lambda: pick_rows_from_keys(rows, sampler, k1s, k2s), device, reps),
    }
    return {"sampler": sampler.describe(), "k": k, "us": stages}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=248_320, help="row length (default: the Qwen3.5 vocabulary)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--samplers", default=DEFAULT_SAMPLERS, help="';' between sampler descriptions")
    ap.add_argument("--window", type=int, default=5, help="rows of the window stages (default 5)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    try:
        samplers = [Sampler.parse(s) for s in args.samplers.split(";")]
    except SamplerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if any(s.greedy for s in samplers) or args.vocab < 2 or args.reps < 1 or args.window < 1:
        print("error: samplers must be non-greedy, --vocab >= 2, --reps >= 1 and --window >= 1", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    results = [bench_sampler(s, args.vocab, device, args.reps, args.window) for s in samplers]
    shortlist = (torch.randn(32_768) * 3).to(torch.bfloat16).to(device)
    draft_us = per_call_us(lambda: torch.topk(shortlist, 64).indices, device, args.reps)
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "vocab": args.vocab, "reps": args.reps,
                                         "samplers": results, "draft_top64_us": draft_us}, indent=1))
    names = list(results[0]["us"])
    print(f"\nvocab {args.vocab}, {device}; coupled draft's top-64 of 32,768: {draft_us:.1f} us\n")
    print("| sampler | k | " + " | ".join(names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    for r in results:
        print(f"| {r['sampler']} | {r['k']} | " + " | ".join(f"{r['us'][n]:.1f}" for n in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
