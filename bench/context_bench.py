"""ms/token against context length: the control, fast-serial and the instrument side by side, one process.

    python bench/context_bench.py --out DIR [--model synthetic-9b] [--contexts 512,2048,8192,16384,32768]
                                  [-n 256] [--control-n 32] [--alphas 0.6,0.85] [--legs 1] [--shortlist FILE]
    python bench/context_bench.py --replot DIR/context.json     # redraw its context.png, no model

The model is built once. Every decoder (``serial``, the control; ``fast-serial``; ``spec-instrument``
at each alpha) is prepared once and sized (``reserve``) for the longest context before anything
is timed. Per context C, one prompt of C - N random ids (seeded by C) and a warm-up prompt of the
same length: each decoder decodes the warm-up (untimed; an instrument's ``prepare_prompt`` too),
then its legs run, the decoders' order reversed on every other leg. A leg is one whole decode,
synchronised on both ends, split at its first emitted token (``on_tokens``): ``prefill s`` is the
time to it, ``decode ms/tok`` the rest over the tokens after it. The control decodes only
``--control-n`` tokens (its eager step costs ~80 ms on the 9B shape); ratios are of decode ms/tok.

Every decoder's tokens are compared with fast-serial's (the control's with its first
``--control-n``); every leg counts the runtimes built during it (``decoders.runtime.sizing``),
which must be none. Peak memory is each leg's ``torch.cuda.max_memory_allocated`` less the other
decoders' resident bytes (all live in this process): the model, the decoder's own state and the
leg's transients. DIR/context.json keeps every leg; DIR/context.png plots decode ms/tok, and the
speed-up over fast-serial, against context. The markdown table is printed last. ``--model tiny`` (CPU) checks the script itself.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: its scripts' shared modules

from script_args import fraction, listed, positive_int, run_main  # noqa: E402

SHORTLIST_9B = "bench/synthetic9b-shortlist-32k.json"  # built from random-512-offline, never these prompts
CONTEXTS = {"synthetic-9b": (512, 2048, 8192, 16384, 32768), "tiny": (64, 256, 1024)}
NEW_TOKENS = {"synthetic-9b": 256, "tiny": 16}
CONTROL_TOKENS = {"synthetic-9b": 32, "tiny": 16}
WARMUP_TOKENS = 4
REFERENCE = "fast-serial"
CONTROL = "serial"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="where context.json and context.png go (required for a run)")
    ap.add_argument("--replot", type=Path, metavar="JSON", help="redraw context.png beside a kept context.json and exit")
    ap.add_argument("--model", default="synthetic-9b")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--contexts", type=listed(positive_int), default=None,
                    help="comma-separated context lengths (prompt + N)")
    ap.add_argument("-n", "--max-new-tokens", type=positive_int, default=None)
    ap.add_argument("--control-n", type=int, default=None, help="new tokens of the control's legs (0: no control)")
    ap.add_argument("--alphas", type=listed(fraction), default="0.6,0.85",
                    help="the instrument's acceptance levels, comma-separated, each 0..1")
    ap.add_argument("--legs", type=positive_int, default=1)
    ap.add_argument("--shortlist", default=None, help=f"the instruments' draft shortlist (synthetic-9b: {SHORTLIST_9B})")
    args = ap.parse_args(argv)
    if args.replot is not None:
        return args
    if args.out is None:
        ap.error("--out is required (or --replot JSON)")
    args.contexts = args.contexts or list(CONTEXTS.get(args.model, CONTEXTS["tiny"]))
    args.max_new_tokens = args.max_new_tokens or NEW_TOKENS.get(args.model, 16)
    args.control_n = min(args.max_new_tokens, CONTROL_TOKENS.get(args.model, 16) if args.control_n is None
                         else args.control_n)  # compared with fast-serial's first tokens
    if args.shortlist is None and args.model == "synthetic-9b":
        args.shortlist = SHORTLIST_9B
    if min(args.contexts) <= args.max_new_tokens:
        ap.error(f"every context must exceed N={args.max_new_tokens} (it holds the prompt and the new tokens)")
    return args


def synchronize(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def allocated(dev) -> int:
    import torch

    synchronize(dev)
    return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0


def build_decoders(model, args) -> tuple[dict, dict]:
    """name -> prepared decoder sized for the longest context, and name -> resident bytes."""
    from decoders import get_decoder
    from decoders.base import reserve_positions
    from decoders.runtime.sizing import capacity_for

    # built at the size reserve() then finds (one build each, not two); margins up to 64 positions
    sized = {"capacity": capacity_for(max(args.contexts) + 64)}
    specs = {REFERENCE: ("fast-serial", sized)}
    if args.control_n > 0:
        specs = {CONTROL: ("serial", {}), **specs}
    extra = {"shortlist": args.shortlist} if args.shortlist else {}
    specs.update({f"inst-{a:g}": ("spec-instrument", {"alpha": a, **sized, **extra}) for a in args.alphas})
    decoders, resident = {}, {}
    for name, (spec, kwargs) in specs.items():
        before, t0 = allocated(model.device), time.perf_counter()
        dec = get_decoder(spec, **kwargs)
        dec.prepare(model)
        reserve_positions(dec, max(args.contexts))
        decoders[name], resident[name] = dec, allocated(model.device) - before
        sizing = dec.config().get("sizing") or {}
        print(f"prepared {name} in {time.perf_counter() - t0:.1f} s: {sizing or 'no static state'}, "
              f"resident {resident[name] / 2**20:.0f} MiB", flush=True)
    return decoders, resident


def context_prompts(vocab: int, context: int, n: int) -> tuple[list[int], list[int]]:
    """The timed prompt and the warm-up prompt of one context: C - N random ids each."""
    rng = random.Random(f"qwen35-exact/context-bench/{context}")
    draw = lambda: [rng.randrange(vocab) for _ in range(context - n)]  # noqa: E731
    return draw(), draw()


def time_leg(decoder, prompt: list[int], n: int, dev) -> dict:
    """One whole decode, split at its first emitted batch; the runtimes built during it."""
    import torch

    from decoders.runtime.sizing import builds

    first = []  # (time, tokens) of the first emitted batch: the prefill's token is read by then

    def on_tokens(new):
        if not first:
            first.append((time.perf_counter(), len(new)))

    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    synchronize(dev)
    built, t0 = builds(), time.perf_counter()
    result = decoder.decode(prompt, n, on_tokens=on_tokens)
    synchronize(dev)
    t1 = time.perf_counter()
    t_first, first_len = first[0] if first else (t1, len(result.tokens))
    rest = len(result.tokens) - first_len
    return {"tokens": list(result.tokens), "wall_s": t1 - t0, "prefill_s": t_first - t0,
            "decode_ms_per_token": 1e3 * (t1 - t_first) / rest if rest > 0 else None,
            "peak_bytes": int(torch.cuda.max_memory_allocated(dev)) if cuda else None,
            "built": builds() - built}


def out_of_memory(fn, dev) -> str | None:
    """Run ``fn``; the error's first line if the device ran out of memory (the bench goes on)."""
    import torch

    try:
        fn()
    except torch.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        return f"out of memory: {str(exc).splitlines()[0]}"
    return None


def run_context(context: int, decoders: dict, resident: dict, model, args) -> tuple[list[dict], dict]:
    """Every leg of one context, and the decoders that ran out of memory there (name -> why)."""
    prompt, warm = context_prompts(model.vocab_size, context, args.max_new_tokens)
    n_of = {name: args.control_n if name == CONTROL else args.max_new_tokens for name in decoders}
    failed = {}

    def prepare(name, dec):  # untimed: an instrument's preparation, the warm-up
        if getattr(dec, "instrument", False) is True:
            dec.prepare_prompt(prompt, n_of[name])
        dec.decode(warm, WARMUP_TOKENS)

    for name, dec in decoders.items():
        why = out_of_memory(lambda: prepare(name, dec), model.device)
        if why:
            failed[name] = why
    legs = []
    for k in range(args.legs):
        order = list(decoders) if k % 2 == 0 else list(reversed(decoders))
        for name in (n for n in order if n not in failed):
            done = []
            why = out_of_memory(lambda: done.append(time_leg(decoders[name], prompt, n_of[name], model.device)),
                                model.device)
            if why:
                failed[name] = why
                print(f"context {context}: {name}: {why}", flush=True)
                continue
            leg = done[0]
            others = sum(b for o, b in resident.items() if o != name)
            own = None if leg["peak_bytes"] is None else leg["peak_bytes"] - others
            legs.append({"context": context, "prompt_tokens": len(prompt), "decoder": name, "leg": k,
                         "own_peak_bytes": own, **leg})
            print(f"context {context}: {name} leg {k}: prefill {leg['prefill_s']:.3f} s, decode "
                  f"{fmt(leg['decode_ms_per_token'], '.2f')} ms/tok, {len(leg['tokens'])} tokens", flush=True)
    return legs, failed


def summarize(legs: list[dict], failed: dict, resident: dict, decoders: dict) -> list[dict]:
    """One row per (context, decoder): medians over its legs, exactness against fast-serial's tokens;
    a decoder that ran out of memory at a context (``failed[(context, name)]``) gets its error."""
    import statistics

    rows = []
    for context in sorted({leg["context"] for leg in legs} | {c for c, _ in failed}):
        mine = [leg for leg in legs if leg["context"] == context]
        ref = next((leg["tokens"] for leg in mine if leg["decoder"] == REFERENCE), None)
        by_name = {}
        for leg in mine:
            by_name.setdefault(leg["decoder"], []).append(leg)
        ms = {name: median([x["decode_ms_per_token"] for x in ls]) for name, ls in by_name.items()}
        for name in decoders:
            if (context, name) in failed:
                rows.append({"context": context, "decoder": name, "error": failed[context, name]})
                continue
            ls = by_name[name]
            peaks = [x["own_peak_bytes"] for x in ls if x["own_peak_bytes"] is not None]
            rows.append({
                "context": context, "decoder": name, "prompt_tokens": ls[0]["prompt_tokens"],
                "tokens": len(ls[0]["tokens"]), "prefill_s": statistics.median(x["prefill_s"] for x in ls),
                "decode_ms_per_token": ms[name],
                "vs_fast_serial": ratio(ms.get(REFERENCE), ms[name]), "vs_control": ratio(ms.get(CONTROL), ms[name]),
                "own_peak_bytes": max(peaks) if peaks else None, "resident_bytes": resident[name],
                "capacity": (decoders[name].config().get("sizing") or {}).get("capacity"),
                "exact": None if ref is None else all(x["tokens"] == ref[:len(x["tokens"])] for x in ls),
                "built": sum(x["built"] for x in ls)})
    return rows


def median(values):
    import statistics

    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(reference, ms):
    return None if reference is None or not ms else reference / ms


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[dict], args) -> None:
    gib = lambda b: "n/a" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    ratio = lambda x, spec: fmt(x, spec) + ("" if x is None else "x")  # noqa: E731
    print(f"\n{args.model}, N={args.max_new_tokens} (control: {args.control_n}), {args.legs} leg(s); "
          "ratios of decode ms/tok; peak = the leg's peak less the other decoders' resident bytes")
    print("\n| context | decoder | prompt | tokens | prefill s | decode ms/tok | vs fast-serial | vs control | "
          "peak GiB | resident GiB | capacity | exact | built in legs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['context']} | {r['decoder']} | {r['error']} |" + " |" * 10)
            continue
        exact = {True: "yes", False: "NO", None: "-"}[r["exact"]]
        print(f"| {r['context']} | {r['decoder']} | {r['prompt_tokens']} | {r['tokens']} | {r['prefill_s']:.3f} | "
              f"{fmt(r['decode_ms_per_token'], '.2f')} | {ratio(r['vs_fast_serial'], '.3f')} | "
              f"{ratio(r['vs_control'], '.2f')} | {gib(r['own_peak_bytes'])} | "
              f"{gib(r['resident_bytes'] if args.device_type == 'cuda' else None)} | {fmt(r['capacity'], 'd')} | "
              f"{exact} | {r['built'] or 'none'} |")


def plot(rows: list[dict], path: Path, title: str) -> bool:
    """Two panels against context: decode ms/tok of every decoder (log scale: the control's ~70 ms
    and the runtime's ~4-8 ms on one axis), and each decoder's speed-up over fast-serial (needs
    matplotlib, as `reports` does)."""
    try:
        from reports.figures import new_figure, save
    except ImportError:
        return False
    fig = new_figure(4.2)
    ms_ax, ratio_ax = fig.subplots(1, 2)
    contexts = sorted({r["context"] for r in rows})
    for i, name in enumerate(dict.fromkeys(r["decoder"] for r in rows)):
        style = {"marker": "o", "label": name, "color": f"C{i}"}  # one colour per decoder in both panels
        mine = [r for r in rows if r["decoder"] == name and r.get("decode_ms_per_token") is not None]
        if mine:
            ms_ax.plot([r["context"] for r in mine], [r["decode_ms_per_token"] for r in mine], **style)
        ratios = [r for r in mine if r.get("vs_fast_serial") is not None and name not in (REFERENCE, CONTROL)]
        if ratios:
            ratio_ax.plot([r["context"] for r in ratios], [r["vs_fast_serial"] for r in ratios], **style)
    ratio_ax.axhline(1.0, color="grey", linewidth=0.8)
    ms_ax.set_yscale("log")
    ms_ax.set_ylabel("decode ms / token")
    ratio_ax.set_ylabel(f"speed-up over {REFERENCE}")
    for ax in (ms_ax, ratio_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [f"{c // 1024}k" if c % 1024 == 0 else str(c) for c in contexts])
        ax.minorticks_off()
        ax.set_xlabel("context (prompt + new tokens)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    return save(fig, path)


def replot(path: Path) -> int:
    """Redraw context.png beside a kept context.json (its rows), with no model and no GPU."""
    try:
        doc = json.loads(path.read_text())
        rows, model = doc["rows"], doc["model"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: {path} is not a context_bench result: {e}", file=sys.stderr)
        return 2
    out = path.with_suffix(".png")
    if not plot(rows, out, f"{model}: decode ms/token vs context"):
        print("error: drawing needs matplotlib", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        return replot(args.replot)
    from core import determinism

    determinism.pin()  # before anything touches CUDA, as the harness does
    import torch
    import transformers

    from core.models import load_model

    transformers.logging.set_verbosity_error()  # expected "no fast kernel" notices
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    model = load_model(args.model, device)
    args.device_type = model.device.type
    print(f"loaded {args.model} on {model.device} in {time.perf_counter() - t0:.1f} s", flush=True)
    decoders, resident = build_decoders(model, args)
    legs, failed = [], {}
    for context in args.contexts:
        got, lost = run_context(context, decoders, resident, model, args)
        legs += got
        failed.update({(context, name): why for name, why in lost.items()})
    rows = summarize(legs, failed, resident, decoders)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"model": args.model, "device": str(model.device), "max_new_tokens": args.max_new_tokens,
           "control_n": args.control_n, "legs": args.legs, "rows": rows,
           "configs": {name: dec.config() for name, dec in decoders.items()},
           "leg_records": [{k: v for k, v in leg.items() if k != "tokens"} for leg in legs]}
    (args.out / "context.json").write_text(json.dumps(doc, indent=1, default=str))
    drew = plot(rows, args.out / "context.png", f"{args.model}: decode ms/token vs context")
    print(f"wrote {args.out / 'context.json'}" + (f" and {args.out / 'context.png'}" if drew else ""))
    print(f"total {time.perf_counter() - t0:.0f} s")
    print_table(rows, args)
    bad = [r for r in rows if "error" in r or r["exact"] is False or r["built"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(run_main(main))
