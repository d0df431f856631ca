"""What stacking the projections that read one input into one GEMM would save, and whether it is exact.

    python bench/gemm_stack_probe.py [--model synthetic-9b] [--rows 1,2,3,4] [--reps 50] [--json FILE]

For the backbone's first Gated-DeltaNet layer (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), its
first attention layer (q_proj, k_proj, v_proj), an MLP (gate_proj, up_proj) and the single
projections (out_proj, o_proj, down_proj, lm_head), it times each product on m rows alone (and in
two halves of its outputs on two lanes, which fills more of the GPU where one GEMM leaves SMs idle)
and each
stack as one GEMM over the concatenated weight, against the same products one after another and
on lanes (a stream each, as the runtime runs them) (``--reps`` rounds captured in one CUDA graph, so
the host's launch rate does not count), names the kernels the library picked, and
checks, over enough random inputs to compare 2^16 output elements per row count, that every slice
of the stacked product equals the separate product bit for bit (``exact``). The runtime can only
stack what is exact on every row count it runs; the time says whether it would pay.
Diagnostic only: speed claims come from the side-by-side benchmarks.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core import determinism  # noqa: E402

determinism.pin()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

GDN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
ATTENTION = ("q_proj", "k_proj", "v_proj")
MLP = ("gate_proj", "up_proj")


def stacks(names: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Every run of neighbouring projections of at least two (qkv+z, b+a, all four, ...)."""
    return [names[i:j] for i in range(len(names)) for j in range(i + 2, len(names) + 1)]


def graphed_us(products, reps: int, lanes: bool = False) -> float:
    """GPU microseconds per round of ``products`` (callables), from ``reps`` rounds in one graph;
    with ``lanes`` each product of a round runs on a stream of its own (the runtime's lanes), the
    round ending when all have."""
    for fn in products:
        fn()
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in products] if lanes else []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream()
        for _ in range(reps):
            if not lanes:
                for fn in products:
                    fn()
                continue
            for stream, fn in zip(streams, products):
                stream.wait_stream(main)
                with torch.cuda.stream(stream):
                    fn()
            for stream in streams:
                main.wait_stream(stream)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (3 * reps)


def kernel_names(products) -> list[str]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for fn in products:
            fn()
        torch.cuda.synchronize()
    return [e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def stack_exact(weights: list[torch.Tensor], stacked: torch.Tensor, m: int, gen) -> bool:
    """Every slice of the product over ``stacked`` equals the product over its own weight."""
    from decoders.runtime.calibration import gemm_trials

    for _ in range(gemm_trials(stacked.shape[0])):
        x = torch.randn(1, m, stacked.shape[1], generator=gen).to(stacked.device, stacked.dtype)
        if not torch.equal(F.linear(x, stacked), torch.cat([F.linear(x, w) for w in weights], dim=-1)):
            return False
    return True


@torch.inference_mode()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="synthetic-9b")
    ap.add_argument("--rows", default="1,2,3,4")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemm_stack_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    from core.models import load_model

    model = load_model(args.model, "cuda")
    layers = model.backbone.model.layers
    gdn = next(ly.linear_attn for ly in layers if getattr(ly, "linear_attn", None) is not None)
    attn = next(ly.self_attn for ly in layers if getattr(ly, "self_attn", None) is not None)
    groups = {"gdn": (gdn, GDN), "attention": (attn, ATTENTION), "mlp": (layers[0].mlp, MLP)}
    singles = {"out_proj": gdn.out_proj.weight, "o_proj": attn.o_proj.weight,
               "down_proj": layers[0].mlp.down_proj.weight, "lm_head": model.backbone.lm_head.weight}
    gen = torch.Generator().manual_seed(0)
    rows = [int(m) for m in args.rows.split(",")]
    results = []
    print("| rows | what | out | separate us | on lanes us | stacked us | saved us | exact | kernels (stacked) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in rows:
        x = torch.randn(1, m, model.backbone.config.hidden_size, generator=gen).to("cuda", torch.bfloat16)
        for name, w in singles.items():
            xin = x if w.shape[1] == x.shape[-1] else torch.randn(1, m, w.shape[1], generator=gen).to("cuda", w.dtype)
            us = graphed_us([lambda w=w, xin=xin: F.linear(xin, w)], args.reps)
            gbs = w.numel() * w.element_size() / us / 1e3
            results.append({"rows": m, "what": name, "out": w.shape[0], "us": us, "gb_s": gbs,
                            "kernels": kernel_names([lambda w=w, xin=xin: F.linear(xin, w)])})
            print(f"| {m} | {name} | {w.shape[0]} | {us:.1f} ({gbs:.0f} GB/s) | | | | | {results[-1]['kernels']} |",
                  flush=True)
            halves = [h.contiguous() for h in torch.chunk(w, 2)]
            split = graphed_us([lambda h=h, xin=xin: F.linear(xin, h) for h in halves], args.reps, lanes=True)
            exact = stack_exact(halves, w, m, gen)
            results.append({"rows": m, "what": f"{name} in halves on lanes", "out": w.shape[0], "lanes_us": split,
                            "whole_us": us, "exact": exact,
                            "kernels": kernel_names([lambda h=h, xin=xin: F.linear(xin, h) for h in halves])})
            print(f"| {m} | {name} in halves | {w.shape[0]} | {us:.1f} | {split:.1f} | | {us - split:.1f} | "
                  f"{'yes' if exact else 'NO'} | {results[-1]['kernels']} |", flush=True)
            del halves
        for group, (mod, names) in groups.items():
            for stack in stacks(names):
                ws = [getattr(mod, n).weight for n in stack]
                stacked = torch.cat(ws)
                separate = graphed_us([lambda w=w: F.linear(x, w) for w in ws], args.reps)
                on_lanes = graphed_us([lambda w=w: F.linear(x, w) for w in ws], args.reps, lanes=True)
                one = graphed_us([lambda: F.linear(x, stacked)], args.reps)
                exact = stack_exact(ws, stacked, m, gen)
                results.append({"rows": m, "what": "+".join(stack), "group": group, "out": stacked.shape[0],
                                "separate_us": separate, "lanes_us": on_lanes, "stacked_us": one, "exact": exact,
                                "kernels": kernel_names([lambda: F.linear(x, stacked)]),
                                "separate_kernels": kernel_names([lambda w=w: F.linear(x, w) for w in ws])})
                print(f"| {m} | {'+'.join(stack)} | {stacked.shape[0]} | {separate:.1f} | {on_lanes:.1f} | {one:.1f} | "
                      f"{min(separate, on_lanes) - one:.1f} | {'yes' if exact else 'NO'} | {results[-1]['kernels']} |",
                      flush=True)
                del stacked
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
