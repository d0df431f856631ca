"""Exact-runtime benchmark: control vs fast-serial step vs verify windows vs rollback, one process.

    python bench/runtime_bench.py [--model synthetic-9b] [--prompt-len 512] [--positions 256]

Measures, on one prompt: the control's ms/token (HF serial, DynamicCache); the fast-serial step's
ms/token and the weight bandwidth it achieves; the cost of a verify window of w = 1..8 relative to
one fast-serial step; the cost of a rollback; peak memory of each; and checks that every logit the
runtime computed (steps and every window row) is bit-identical to the control's at that position.
With ``--lanes 1,auto`` it measures a runtime without and one with its parallel streams, one after
the other in one process; ``auto:unstacked`` is that runtime with each MLP's gate and up projections
as two GEMMs instead of one over their stacked weight (``ExactRuntime(stack_gate_up=False)``). On a
GPU every runtime's step is also profiled once eagerly for its kernel count (the kernels its graph
replays). Last, the control runs again on the model whose gate and up weights the runtimes moved
into one buffer, and must give its first logits bit for bit. Exits 1 if any logit differs.
Prints the full table, then the fast-serial step of every runtime side by side (the last table);
--json writes every raw number.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core import determinism  # noqa: E402

determinism.pin()

import torch  # noqa: E402


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def peak_reset(dev):
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def peak(dev):
    return torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None


def weight_bytes_per_token(lm) -> int:
    """Bytes a decode step must stream: every parameter except the embedding table (one row)."""
    total = sum(p.numel() * p.element_size() for p in lm.parameters())
    emb = lm.model.embed_tokens.weight
    return total - emb.numel() * emb.element_size() + emb.shape[1] * emb.element_size()


@torch.inference_mode()
def control_stream(model, prompt, n):
    """The control: HF forward, DynamicCache, one token per forward. Returns tokens, logits per
    position ([n, V]), ms/token, peak bytes."""
    from transformers import DynamicCache

    lm, dev = model.backbone, model.device
    peak_reset(dev)
    cache = DynamicCache(config=lm.config)
    out = lm(input_ids=torch.tensor([prompt], device=dev), past_key_values=cache, use_cache=True, logits_to_keep=1)
    tokens, logits, times = [], [], []
    for _ in range(n):
        row = out.logits[:, -1]
        logits.append(row.clone())
        tok = row.argmax(-1)
        tokens.append(int(tok.item()))
        sync(dev)
        t0 = time.perf_counter()
        out = lm(input_ids=tok.view(1, 1), past_key_values=cache, use_cache=True, logits_to_keep=1)
        out.logits[:, -1].argmax(-1).item()
        times.append(time.perf_counter() - t0)
    return tokens, torch.cat(logits), times, peak(dev)


@torch.inference_mode()
def fast_serial_pass(rt, prompt, tokens, ref):
    dev = rt.device
    logits, _ = rt.prefill(prompt)
    equal = [torch.equal(logits, ref[0:1])]
    times = []
    for i, t in enumerate(tokens[:-1]):
        sync(dev)
        t0 = time.perf_counter()
        prog = rt.step(torch.tensor([[t]], device=dev))
        prog.ws["argmax"].item()
        times.append(time.perf_counter() - t0)
        equal.append(torch.equal(prog.ws["logits"][:, -1], ref[i + 1:i + 2]))
    return equal, times


@torch.inference_mode()
def window_pass(rt, prompt, tokens, ref, w):
    """Verify windows of w true tokens along the stream, accepting all; time each window."""
    dev = rt.device
    rt.prefill(prompt)
    equal, times, c = [], [], 0
    while c + w <= len(tokens) - 1:
        block = torch.tensor([tokens[c:c + w]], device=dev)
        sync(dev)
        t0 = time.perf_counter()
        prog = rt.verify(block)
        prog.ws["argmax"].view(-1)[-1].item()
        times.append(time.perf_counter() - t0)
        for i in range(w):
            equal.append(torch.equal(prog.ws["logits"][:, i], ref[c + i + 1:c + i + 2]))
        rt.accept(w)
        c += w
    return equal, times


@torch.inference_mode()
def rollback_pass(rt, prompt, tokens, w=8, reps=20):
    dev = rt.device
    rt.prefill(prompt)
    times = []
    for c in range(min(reps, len(tokens) - w)):
        rt.verify(torch.tensor([tokens[c:c + w]], device=dev))
        sync(dev)
        t0 = time.perf_counter()
        rt.accept(1)
        sync(dev)
        times.append(time.perf_counter() - t0)
    return times


PROFILED_STEPS = 3


@torch.inference_mode()
def profile_step(rt, tokens, show: bool) -> dict:
    """Kernel count and GPU kernel time per step, from eager runs of the step program (the kernels
    its graph replays); with ``show``, the top kernels too."""
    from torch.profiler import ProfilerActivity, profile

    prog = rt.program(1, capture=False)
    prog.tokens.fill_(tokens[0])
    prog.run_eager()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            prog.run_eager()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.device_time_total for e in events) / PROFILED_STEPS
    launches = sum(e.count for e in events) / PROFILED_STEPS
    print(f"profile: {total / 1e3:.2f} ms GPU time per step in {launches:.0f} kernels", flush=True)
    if show:
        for e in sorted(events, key=lambda e: -e.device_time_total)[:22]:
            print(f"  {e.device_time_total / 3e3:7.3f} ms  {e.count / 3:6.0f}x  {e.key[:100]}", flush=True)
    return {"kernels": launches, "kernel_ms": total / 1e3}


def parse_variant(spec: str) -> tuple[int | None, set[str]]:
    """``COUNT[:flat][:unstacked]`` -> (lane count, None = the runtime's default; its modifiers)."""
    count, *mods = spec.split(":")
    unknown = set(mods) - VARIANT_MODIFIERS
    if unknown or not (count == "auto" or count.isdigit()):
        raise ValueError(f"runtime {spec!r}: expected auto or a lane count, then optionally "
                         f":{' :'.join(sorted(VARIANT_MODIFIERS))}")
    return (None if count == "auto" else int(count)), set(mods)


VARIANT_MODIFIERS = {"flat", "unstacked"}
CONTROL_RECHECK = 32  # positions the control runs again once the runtimes have moved its gate/up weights


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synthetic-9b")
    ap.add_argument("--device", default=None)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--positions", type=int, default=256, help="generated tokens checked bitwise")
    ap.add_argument("--max-window", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--profile", action="store_true", help="print the GPU kernel-time breakdown of one step")
    ap.add_argument("--lanes", type=lambda v: v.split(","), default=["auto"],
                    help="runtimes to measure one after another, e.g. 1,auto,auto:flat,auto:unstacked: 1 = every "
                         "branch in order on one stream, auto = the runtime's default streams, a count = that many, "
                         ":flat = every lane of equal priority, :unstacked = the MLP's gate and up as two GEMMs")
    args = ap.parse_args()
    try:
        for spec in args.lanes:
            parse_variant(spec)
    except ValueError as exc:
        ap.error(str(exc))
    if args.positions <= args.max_window or args.max_window < 1:
        ap.error(f"--positions ({args.positions}) must exceed --max-window ({args.max_window}), which must be >= 1: "
                 "every window size is checked along the stream")

    import transformers

    transformers.logging.set_verbosity_error()
    from core.models import device_name, load_model

    model = load_model(args.model, args.device)
    dev, lm = model.device, model.backbone
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.vocab_size, (args.prompt_len,), generator=gen).tolist()
    print(f"model {args.model} on {device_name(dev)}; prompt {len(prompt)}, {args.positions} positions", flush=True)

    tokens, ref, ctl_times, ctl_peak = control_stream(model, prompt, args.positions)
    print(f"control: {1e3 * statistics.median(ctl_times):.2f} ms/token", flush=True)

    variants = {}
    for lanes in args.lanes:
        variants[lanes] = runtime_variant(model, prompt, tokens, ref, args, lanes)
    # the control on the model the runtimes share with it (as in `harness time`), its gate and up
    # weights now in one buffer: the same tokens and logits as before any runtime existed
    recheck = min(CONTROL_RECHECK, args.positions)
    again_tokens, again_ref, _, _ = control_stream(model, prompt, recheck)
    control_again = [again_tokens == tokens[:recheck]] + [torch.equal(again_ref[i], ref[i]) for i in range(recheck)]
    print(f"control again, after the runtimes: bit-equal {sum(control_again)}/{len(control_again)}", flush=True)
    bpt = weight_bytes_per_token(lm)
    ctl_ms = 1e3 * statistics.median(ctl_times)
    result = {
        "model": args.model, "device": device_name(dev), "prompt_len": len(prompt), "positions": args.positions,
        "control_ms": ctl_ms, "control_GBps": bpt / (ctl_ms / 1e3) / 1e9, "control_peak_bytes": ctl_peak,
        "weight_bytes_per_token": bpt, "raw_control_s": ctl_times, "variants": variants,
        "control_again_bit_equal": [sum(control_again), len(control_again)],
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))

    gb = lambda b: "n/a" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
    total_eq = total_ck = 0
    print("\n| lanes | what | gate/up GEMMs | ms | x step | GB/s | peak | bit-equal |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| | control (HF serial) | 2 | {ctl_ms:.2f} | | {result['control_GBps']:.0f} | {gb(ctl_peak)} | ref |")
    for lanes, v in variants.items():
        step_ms, eq = v["fast_serial_ms"], v["step_bit_equal"]
        print(f"| {lanes} | fast-serial step | {gemms(1, v)} | {step_ms:.2f} | 1.00 | {v['fast_serial_GBps']:.0f} | "
              f"{gb(v['fast_peak_bytes'])} | {eq[0]}/{eq[1]} |")
        for w, win in v["windows"].items():
            print(f"| {lanes} | verify w={w} | {gemms(w, v)} | {win['ms']:.2f} | {win['ms'] / step_ms:.2f} | | | "
                  f"{win['equal']}/{win['checked']} |")
        print(f"| {lanes} | rollback (after w={min(8, args.max_window)}, keep 1) | | {v['rollback_ms']:.3f} | "
              f"{v['rollback_ms'] / step_ms:.3f} | | | |")
        total_eq += eq[0] + sum(win["equal"] for win in v["windows"].values())
        total_ck += eq[1] + sum(win["checked"] for win in v["windows"].values())
    print(f"all runtime logits bit-equal to control: {total_eq}/{total_ck}")
    print(f"control again, after the runtimes moved its gate/up weights: {sum(control_again)}/{len(control_again)}")
    print_step_table(variants)
    return 0 if total_eq == total_ck and all(control_again) else 1


def gemms(w: int, variant: dict) -> str:
    """How a window of w rows ran each MLP's gate and up projections: 1 GEMM or 2."""
    return "1" if w <= variant["gate_up_rows"] else "2"


def print_step_table(variants: dict) -> None:
    """The fast-serial step of every runtime, each beside the same runtime with two gate/up GEMMs."""
    print("\n| lanes | gate/up GEMMs | fast-serial step ms | vs 2 GEMMs | kernels | kernel ms | bit-equal |")
    print("|---|---|---|---|---|---|---|")
    parsed = {spec: parse_variant(spec) for spec in variants}
    for spec, v in variants.items():
        count, mods = parsed[spec]
        base = None if "unstacked" in mods else next(
            (variants[s] for s, (c, m) in parsed.items() if c == count and m == mods | {"unstacked"}), None)
        ratio = f"{v['fast_serial_ms'] / base['fast_serial_ms']:.3f}" if base else ""
        kernels = "n/a" if v["step_kernels"] is None else f"{v['step_kernels']:.0f}"
        kernel_ms = "n/a" if v["step_kernel_ms"] is None else f"{v['step_kernel_ms']:.3f}"
        eq = v["step_bit_equal"]
        print(f"| {spec} | {gemms(1, v)} | {v['fast_serial_ms']:.3f} | {ratio} | {kernels} | {kernel_ms} | "
              f"{eq[0]}/{eq[1]} |")


def runtime_variant(model, prompt, tokens, ref, args, lanes: str) -> dict:
    """One runtime (lanes "auto" = the runtime's default, or a count): its step, every window size
    and rollback along the control's stream, each logit compared with the control's."""
    from decoders.runtime.runtime import ExactRuntime

    dev, lm = model.device, model.backbone
    t0 = time.perf_counter()
    peak_reset(dev)
    before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
    count, mods = parse_variant(lanes)
    rt = ExactRuntime(model, capacity=len(prompt) + args.positions + args.max_window + 8,
                      windows=tuple(range(1, args.max_window + 1)), lanes=count,
                      lane_priority="flat" not in mods, stack_gate_up="unstacked" not in mods)
    setup_s = time.perf_counter() - t0
    # what the runtime holds once built: its state, its graphs' pools, per-stream library workspaces
    held = torch.cuda.memory_allocated(dev) - before if dev.type == "cuda" else None
    print(f"[lanes {lanes}: {rt.lanes.width}] runtime ready in {setup_s:.1f}s, holding "
          f"{'n/a' if held is None else f'{held / 2**30:.3f} GiB'} (state {rt.state.nbytes() / 2**30:.3f} GiB); "
          f"prefill: {rt.prefill_how}; gate/up as one GEMM up to {rt.gate_up_rows} rows; "
          f"calibration {json.dumps(rt.cal.to_json())}", flush=True)

    peak_reset(dev)
    step_equal, step_times = fast_serial_pass(rt, prompt, tokens, ref)
    fast_peak = peak(dev)
    step_ms = 1e3 * statistics.median(step_times)
    print(f"[lanes {lanes}] fast-serial: {step_ms:.2f} ms/token, bit-equal {sum(step_equal)}/{len(step_equal)}",
          flush=True)
    windows = {}
    for w in range(1, args.max_window + 1):
        eq, times = window_pass(rt, prompt, tokens, ref, w)
        windows[w] = {"equal": sum(eq), "checked": len(eq), "ms": 1e3 * statistics.median(times)}
        print(f"[lanes {lanes}] window w={w}: {windows[w]['ms']:.2f} ms ({windows[w]['ms'] / step_ms:.2f}x step), "
              f"bit-equal {sum(eq)}/{len(eq)}", flush=True)
    rb = rollback_pass(rt, prompt, tokens, w=min(8, args.max_window))
    kernels = profile_step(rt, tokens, args.profile) if dev.type == "cuda" else {"kernels": None, "kernel_ms": None}
    bpt = weight_bytes_per_token(lm)
    result = {"lanes": rt.lanes.width, "fast_serial_ms": step_ms, "fast_serial_GBps": bpt / (step_ms / 1e3) / 1e9,
              "windows": windows, "rollback_ms": 1e3 * statistics.median(rb), "runtime_setup_s": setup_s,
              "fast_peak_bytes": fast_peak, "state_bytes": rt.state.nbytes(), "runtime_bytes": held,
              "calibration": rt.cal.to_json(), "gate_up_rows": rt.gate_up_rows,
              "step_kernels": kernels["kernels"], "step_kernel_ms": kernels["kernel_ms"],
              "step_bit_equal": [sum(step_equal), len(step_equal)],
              "raw": {"step_s": step_times, "rollback_s": rb}}
    # a program's segments hold bound methods of the program: only the cycle collector frees a
    # runtime, and the next variant's peak must not include this one's buffers and graphs
    del rt
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return result


if __name__ == "__main__":
    sys.exit(main())
