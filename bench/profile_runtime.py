"""Where a step, a verify window, a draft step and the prefill spend GPU time (kernel profile).

    python bench/profile_runtime.py [--model synthetic-9b] [--prompt-len 512] [--calls 20] [--lanes 1,auto] [--json FILE]

For each op it reports wall ms per call (host clock around synchronised calls), the host's ms to
issue one call (the loop's time before its closing sync: near the wall, the op is host bound or
waits for the device inside), the GPU's busy time per call (the union of kernel intervals: the
critical path as run), the sum of GPU kernel time, the kernel count, the share of each kernel
class (GEMM, reduction, elementwise, copy/cat, attention, other), and the top kernels. The step and
the windows are profiled once per runtime named in --lanes (one stream, and the runtime's default
lanes), so the two sit side by side.
Kernel sum above busy time is concurrency; wall above busy time is the GPU idling (launch or
host bound), placed by the idle gaps' lengths: sub-microsecond gaps are the GPU starting the next
dependent kernel, longer ones wait for the host. "step + token read" is a loop that reads each
token on the host before issuing the next step; "step, token read a step later" is fast-serial's,
which issues step t+1 before it reads token t (decoders/stepping.py). Diagnostic only: speed claims come from the side-by-side benchmarks.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core import determinism  # noqa: E402

determinism.pin()

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

CLASSES = (("attention", ("flash", "fmha", "attention", "sdpa")),
           ("gemm", ("gemm", "gemv", "xmma", "cutlass", "sm90", "nvjet", "splitk")),
           ("reduction", ("reduce",)),
           ("copy/cat", ("copy", "cat", "memcpy", "memset", "index")),
           ("elementwise", ("elementwise", "vectorized", "unrolled")))


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def sync():
    torch.cuda.synchronize()


def profile_op(fn, calls: int):
    fn(), fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = (time.perf_counter() - t0) / calls
    sync()
    wall = (time.perf_counter() - t0) / calls
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync()
    kernels = defaultdict(lambda: [0, 0.0])
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[e.name]
            k[0] += 1
            k[1] += e.device_time
            spans.append((e.time_range.start, e.time_range.end))
    per_call = {n: (c / calls, us / calls) for n, (c, us) in kernels.items()}
    return {"wall_ms": wall * 1e3, "host_ms": issued * 1e3,
            "kernel_ms": sum(us for _, us in per_call.values()) / 1e3,
            "kernels": sum(c for c, _ in per_call.values()),
            "busy_ms": busy_time(spans) / calls / 1e3,
            "span_ms": (max(b for _, b in spans) - min(a for a, _ in spans)) / calls / 1e3 if spans else 0.0,
            "gaps": idle_gaps(spans, calls),
            "classes": class_split(per_call),
            "top": sorted(([n[:90], c, us] for n, (c, us) in per_call.items()), key=lambda r: -r[2])[:25]}


def busy_intervals(spans) -> list[tuple[float, float]]:
    """The union of kernel intervals, as disjoint (start, end) pairs in time order (us)."""
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def busy_time(spans) -> float:
    """Time at least one kernel runs (the union of their intervals, us). On one stream it equals the
    kernel-time sum; with lanes it is less by what ran concurrently, and it is the estimate of the
    critical path as run. The wall above it is time the GPU idled."""
    return sum(b - a for a, b in busy_intervals(spans))


# Idle gaps by length (us): under ~1 us is the GPU's own start of the next dependent kernel inside
# a graph; tens of us are waits for work the host had not yet issued (a segment boundary, an eager
# kernel) or for a host read.
GAP_BUCKETS = (1.0, 3.0, 10.0, 30.0, float("inf"))


def gap_label(hi: float) -> str:
    i = GAP_BUCKETS.index(hi)
    lo = GAP_BUCKETS[i - 1] if i else 0.0
    return f"<{hi:g}us" if not i else (f"{lo:g}-{hi:g}us" if hi != float("inf") else f">={lo:g}us")


def idle_gaps(spans, calls: int) -> dict[str, dict[str, float]]:
    """Per call: how many idle gaps between busy intervals fall in each length bucket, and their ms."""
    runs = busy_intervals(spans)
    out = {gap_label(hi): {"count": 0.0, "ms": 0.0} for hi in GAP_BUCKETS}
    for (_, end), (start, _) in zip(runs, runs[1:]):
        gap = start - end
        bucket = out[gap_label(next(hi for hi in GAP_BUCKETS if gap < hi))]
        bucket["count"] += 1 / calls
        bucket["ms"] += gap / 1e3 / calls
    return out


def class_split(per_call):
    out = defaultdict(lambda: [0.0, 0.0])
    for name, (c, us) in per_call.items():
        out[kernel_class(name)][0] += c
        out[kernel_class(name)][1] += us
    return {k: {"count": v[0], "us": v[1]} for k, v in out.items()}


def enclosing(frames, times) -> list[tuple[str, ...]]:
    """For each time in ``times``, the names of the frames (start, end, name) that enclose it,
    outermost first: a sweep over both in time order (the frames nest, as calls do)."""
    frames = sorted(frames)
    order = sorted(range(len(times)), key=lambda k: times[k])
    out: list[tuple[str, ...]] = [()] * len(times)
    active, i = [], 0
    for k in order:
        t = times[k]
        while i < len(frames) and frames[i][0] <= t:
            active.append(frames[i])
            i += 1
        active = [f for f in active if f[1] >= t]
        out[k] = tuple(f[2] for f in active)
    return out


def waits_by_place(gaps, launches, frames, depth: int = 3) -> list[tuple[str, int, float]]:
    """Where the GPU waited on the host. ``gaps``: (idle start, idle us, correlation id of the
    work that ended it); ``launches``: correlation id -> the host's launch time; ``frames``: the
    project's Python frames (start, end, name). A gap whose work was launched after the GPU went
    idle is charged to the innermost ``depth`` project frames around that launch; one launched
    before is the GPU's own ("queued"). Returns (place, gaps, us), largest first."""
    late = [(g, launches[c]) for g in gaps for c in [g[2]] if c in launches and launches[c] > g[0]]
    places = enclosing(frames, [t for _, t in late])
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for (g, _), chain in zip(late, places):
        key = " > ".join(chain[-depth:]) or "(no project frame)"
        totals[key][0] += 1
        totals[key][1] += g[1]
    queued = [g for g in gaps if not (g[2] in launches and launches[g[2]] > g[0])]
    totals["queued before the GPU went idle"] = [len(queued), sum(g[1] for g in queued)]
    return sorted(((k, n, us) for k, (n, us) in totals.items()), key=lambda r: -r[2])


def project_frames(prof) -> list[tuple[float, float, str]]:
    """The project's Python frames (start us, end us, name) in a ``with_stack`` profile, from the
    profiler's event tree (its Python calls; the kineto events' own flag for them is not in every
    torch), on the kineto events' clock. The tracer names a frame "package/module.py(line):
    function", relative to its import root."""
    from torch._C._profiler import _EventType

    ours = {p.name for p in Path(__file__).resolve().parent.parent.iterdir() if p.is_dir()}
    frames, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        todo.extend(node.children)
        if node.tag == _EventType.PyCall and node.name.split("/", 1)[0] in ours:
            frames.append((node.start_time_ns / 1e3, node.end_time_ns / 1e3, node.name))
    return frames


def trace_decode(decode, min_gap_us: float = 10.0) -> list[tuple[str, int, float]]:
    """One decode under the profiler with Python frames: its GPU idle gaps of at least
    ``min_gap_us``, charged by ``waits_by_place``."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        decode()
        sync()
    events = prof.profiler.kineto_results.events()
    cuda = torch.autograd.DeviceType.CUDA
    gpu = sorted((e.start_ns() / 1e3, e.end_ns() / 1e3, e.correlation_id()) for e in events if e.device_type() == cuda)
    launches = {e.correlation_id(): e.start_ns() / 1e3 for e in events
                if e.device_type() != cuda and e.name().startswith("cu") and e.correlation_id()}
    frames = project_frames(prof)
    gaps, end = [], None
    for a, b, corr in gpu:
        if end is not None and a - end >= min_gap_us:
            gaps.append((end, a - end, corr))
        end = b if end is None else max(end, b)
    return waits_by_place(gaps, launches, frames)


@torch.inference_mode()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="synthetic-9b")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--windows", default="2,4,7")
    ap.add_argument("--json", default=None)
    ap.add_argument("--decode", type=int, default=128,
                    help="tokens of one instrument decode at alpha 0.6 profiled whole (0: none): the rounds' gaps")
    ap.add_argument("--trace-tokens", type=int, default=32,
                    help="tokens of a further instrument decode profiled with Python frames, to say where the GPU "
                         "waits on the host (0: none)")
    ap.add_argument("--shortlist", default="bench/synthetic9b-shortlist-32k.json",
                    help="the instrument's draft shortlist (the benchmarks' own)")
    ap.add_argument("--lanes", default="1,auto",
                    help="step and windows profiled for each: 1 = one stream, auto = the runtime's default lanes")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_runtime: needs a CUDA GPU", file=sys.stderr)
        return 2
    from decoders.runtime.runtime import ExactRuntime
    from decoders.spec import SpecDecoder
    from core.models import load_model

    model = load_model(args.model, "cuda")
    windows = [int(w) for w in args.windows.split(",")]
    spec = SpecDecoder(max_depth=max(windows) - 1, capacity=max(4096, args.prompt_len + 512))
    spec.prepare(model)
    rt, dr = spec.runtime, spec.drafter
    print("calibration:", json.dumps(rt.cal.to_json()))
    print("prefill:", rt.prefill_how)
    print("costs (ms):", {k: (round(v * 1e3, 3) if not isinstance(v, dict) else {w: round(x * 1e3, 3) for w, x in v.items()})
                          for k, v in vars(spec.costs).items()})
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.vocab_size, (args.prompt_len,), generator=gen).tolist()
    logits, hidden = rt.prefill(prompt)
    dr.prefill(hidden, prompt)
    tok = logits.argmax(-1).view(1, 1)
    dr.draft(hidden[:, -1:], tok, 1)  # the last prompt row: leaves a chained step's inputs live

    def step(runtime):
        runtime.prefill(prompt)  # a fresh position range: every call commits one position
        return lambda: runtime.step(tok)

    def step_and_read(runtime):
        runtime.prefill(prompt)
        return lambda: runtime.step(tok).ws["argmax"].item()  # fast-serial's loop: each token read on the host

    def step_read_ahead(runtime):
        from decoders.stepping import TokenReader

        runtime.prefill(prompt)
        reader, held = TokenReader(runtime.device), []

        def call():  # fast-serial's loop: queue the next step, then read the token before it
            held.append(reader.post(runtime.step(tok).ws["argmax"]))
            if len(held) > 1:
                reader.read(held.pop(0))
        return call

    def window(runtime, w):
        block = tok.expand(1, w).contiguous()
        return lambda: runtime.verify(block)  # never accepted

    def window_eager(w):
        return rt.program(w, capture=True).run_eager

    def hf_forward():
        from transformers import DynamicCache

        cache = DynamicCache(config=model.backbone.config)
        model.backbone.model(input_ids=torch.tensor([prompt], device=model.device), past_key_values=cache, use_cache=True)

    def runtime_prefill():
        rt.prefill(prompt)

    def drafter_prefill():
        dr.prefill(hidden, prompt)

    n = args.prompt_len
    ops = {}
    for lanes in args.lanes.split(","):
        runtime = rt if lanes == "auto" else ExactRuntime(model, rt.capacity, windows=tuple(windows), cal=rt.cal,
                                                          lanes=int(lanes))
        tag = f"lanes {runtime.lanes.width}"
        ops[f"step (graphed, {tag})"] = step(runtime)
        ops[f"step + token read ({tag})"] = step_and_read(runtime)
        ops[f"step, token read a step later ({tag})"] = step_read_ahead(runtime)
        ops.update({f"window {w} (graphed, {tag})": window(runtime, w) for w in windows})
    rt.prefill(prompt)
    dr.prefill(hidden, prompt)
    dr.draft(hidden[:, -1:], tok, 1)
    ops.update({f"window {max(windows)} (eager)": window_eager(max(windows)),
                "draft step": lambda: dr.chained_step(dr.filled), f"HF forward {n} (control's prefill)": hf_forward,
                f"runtime prefill {n}": runtime_prefill, f"drafter prefill {n}": drafter_prefill})
    if args.decode:
        from decoders.spec import InstrumentedSpecDecoder

        inst = InstrumentedSpecDecoder(alpha=0.6, shortlist=args.shortlist)
        inst.prepare(model)
        rounds = []

        def decode():
            result = inst.decode(prompt, args.decode)
            rounds.append(sum(1 for d in result.stats.extra["depth_trace"] if d))

        ops[f"decode, instrument alpha 0.6, {args.decode} tokens"] = decode
    results = {}
    for name, fn in ops.items():
        results[name] = profile_op(fn, args.calls if "prefill" not in name and "HF" not in name
                                   and "decode," not in name else 3)
        if name.startswith("decode,"):
            results[name]["drafting_rounds"] = rounds[-1]
        r = results[name]
        print(f"\n== {name}: wall {r['wall_ms']:.3f} ms (host {r['host_ms']:.3f}), "
              + (f"{r['drafting_rounds']} drafting rounds, " if "drafting_rounds" in r else "") +
              f"kernels {r['kernel_ms']:.3f} ms in {r['kernels']:.0f} kernels, "
              f"busy {r['busy_ms']:.3f} ms, profiled span {r['span_ms']:.3f} ms")
        print("   idle gaps per call: " + ", ".join(f"{k} {v['count']:.1f} ({v['ms']:.3f} ms)"
                                                    for k, v in r["gaps"].items()))
        for cls, v in sorted(r["classes"].items(), key=lambda kv: -kv[1]["us"]):
            print(f"   {cls:12s} {v['count']:7.1f} kernels {v['us'] / 1e3:8.3f} ms")
        for n, c, us in r["top"][:15]:
            print(f"   {us:9.1f} us {c:6.1f}x  {n}")
    if args.decode and args.trace_tokens:
        places = trace_decode(lambda: inst.decode(prompt, args.trace_tokens))
        results["decode waits"] = [{"place": k, "gaps": n, "us": us} for k, n, us in places]
        print(f"\n== where a {args.trace_tokens}-token instrument decode's GPU waits (idle gaps >= 10 us, "
              "charged to the project frames that launched the work ending each)")
        for k, n, us in places[:15]:
            print(f"   {us / 1e3:8.3f} ms {n:6d} gaps  {k}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("\n| op | wall ms | host ms | busy ms | kernel ms | kernels | gemm ms | reduce ms | elementwise ms | "
          "copy/cat ms | attention ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if not isinstance(r, dict):  # the decode's waits, printed above
            continue
        c = r["classes"]
        get = lambda k: c.get(k, {"us": 0.0})["us"] / 1e3  # noqa: E731
        print(f"| {name} | {r['wall_ms']:.3f} | {r['host_ms']:.3f} | {r['busy_ms']:.3f} | {r['kernel_ms']:.3f} | "
              f"{r['kernels']:.0f} | {get('gemm'):.3f} | "
              f"{get('reduction'):.3f} | {get('elementwise'):.3f} | {get('copy/cat'):.3f} | {get('attention'):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
