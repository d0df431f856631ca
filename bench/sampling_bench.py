"""Sampled decoding, timed side by side: fast-serial, spec and the instrument, greedy and under samplers.

    python bench/sampling_bench.py [--models small,synthetic-9b] [--device cuda] [--limit 3] [-n 128]
                                   [--reps 2] [--samplers 'greedy;qwen-thinking;qwen-instruct'] [--seed 1]
                                   [--configs NAME,...] [--json FILE]

Per model, in this one process: the model is built once and every decoder prepared once; each
(decoder, sampler) pair decodes one untimed warm-up (it captures the sampler's graphs); then for
each rep, prompt and sampler the decoders decode in turn (interleaved: a slow spell of the machine
slows all of them), each decode timed whole by the host clock with the device synchronized at
both ends. The instrument's untimed ``prepare_prompt`` gets the sampler, as the harness calls it.
Every token is compared with the serial control's under the same sampler (serial decodes each
prompt and sampler once, untimed); any mismatch is printed and the exit code is 1.

Decoders (``--configs`` picks among them; the default depends on the model):
  fast-serial     the serial baseline, under the same sampler
  spec            adaptive depth, coupled drafts (the head proposes with the target's noise)
  spec-uncoupled  the same with drafts by the head's plain argmax (``coupled=false``)
  spec-dN[-uncoupled]  spec at the fixed depth N (acceptance at a depth the policy does not choose)
  inst-A          spec-instrument at alpha A
  ...-lazy        (after spec or inst) a window's rows picked one by one up to the first
                  rejection (``lazy_rows=true``)
  ...-eager       (after spec or inst) every row of a window picked in one call, then read at
                  once (``lazy_rows=false``); without either suffix, the decoder's default (auto:
                  one call where the runtime replays CUDA graphs, lazy rows where it does not)
  (spec and the instrument on synthetic-9b draft over bench/synthetic9b-shortlist-32k.json)
  small: fast-serial, spec, spec-uncoupled; synthetic-9b: fast-serial, spec, inst-0.6, inst-0.6-lazy,
  inst-0.85, inst-0.85-lazy.
Samplers (``;`` between them): ``greedy``, a preset, or any ``core.sampling`` description such as
``temperature=0.6,top_p=0.95``; prompt i samples with seed ``--seed + i`` (a description's own
seed is replaced). Prompts: small stdlib-heldout, others random-512.

The table (printed last) gives per model, sampler and decoder: ms per token (median over prompts of
each prompt's fastest rep), the speed ratio to fast-serial under the same sampler (median over
prompts of the per-prompt ratio, > 1: faster), the ratio of the decoder's own greedy ms/token to
this one (1: sampling costs nothing), the drafts' acceptance (accepted / drafted), the mean accepted
length (tokens per verify round), the probes (a plain step with one draft beside it) and how many
of them the draft got right, and whether every token was the control's.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # its scripts' shared modules

from script_args import new_output, positive_int, run_main  # noqa: E402

SHORTLIST_9B = str(ROOT / "bench" / "synthetic9b-shortlist-32k.json")
SPEC = re.compile(r"spec(?:-d(\d+))?(-uncoupled)?(-lazy|-eager)?")
INSTRUMENT = re.compile(r"inst-([0-9.]+)(-lazy|-eager)?")
LAZY_ROWS = {"-lazy": True, "-eager": False, None: "auto"}
DEFAULT_CONFIGS = {"small": ["fast-serial", "spec", "spec-uncoupled"],
                   "synthetic-9b": ["fast-serial", "spec", "inst-0.6", "inst-0.6-lazy", "inst-0.85", "inst-0.85-lazy"]}
PROMPTS = {"small": "stdlib-heldout", "tiny": "dev"}


def decoder_for(config: str, model_name: str):
    from decoders import get_decoder

    if config == "fast-serial":
        return get_decoder("fast-serial")
    match = INSTRUMENT.fullmatch(config)
    if match is not None:
        kwargs = {"alpha": float(match[1]), "lazy_rows": LAZY_ROWS[match[2]]}
        if model_name == "synthetic-9b":
            kwargs["shortlist"] = SHORTLIST_9B
        return get_decoder("spec-instrument", **kwargs)
    match = SPEC.fullmatch(config)
    if match is None:
        raise SystemExit(f"error: unknown configuration {config!r}")
    depth, uncoupled, rows = match.groups()
    kwargs = {"coupled": not uncoupled, "lazy_rows": LAZY_ROWS[rows], **({"depth": int(depth)} if depth else {})}
    if model_name == "synthetic-9b":
        kwargs["shortlist"] = SHORTLIST_9B
    return get_decoder("spec", **kwargs)


def samplers_for(names: list[str], seed: int, index: int):
    """(label, Sampler or None) per sampler name, the seed ``seed + index`` (prompt index)."""
    from core.sampling import Sampler

    out = []
    for name in names:
        if name == "greedy":
            out.append((name, None))
            continue
        base = Sampler.parse(name)
        out.append((name, Sampler(base.temperature, base.top_k, base.top_p, base.min_p, seed + index)))
    return out


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_decode(dec, ids, n, sampler, device):
    sync(device)
    t0 = time.perf_counter()
    res = dec.decode(ids, n, sampler=sampler)
    sync(device)
    return res, time.perf_counter() - t0


def bench_model(model_name: str, args) -> list[dict]:
    """One model's rows: per (sampler, decoder, prompt) the fastest rep and its stats."""
    from core.models import load_model
    from core.prompts import load_prompts
    from decoders.serial import SerialDecoder

    model = load_model(model_name, args.device)
    prompts, _ = load_prompts(PROMPTS.get(model_name, "random-512"), model, args.limit)
    configs = args.configs or DEFAULT_CONFIGS.get(model_name, ["fast-serial", "spec", "spec-uncoupled", "inst-0.85"])
    decoders = {}
    for config in configs:
        t0 = time.perf_counter()
        decoders[config] = decoder_for(config, model_name)
        decoders[config].prepare(model)
        print(f"[{model_name}] prepared {config} in {time.perf_counter() - t0:.1f} s", flush=True)
    serial = SerialDecoder()
    serial.prepare(model)
    want = {}
    for i, p in enumerate(prompts):
        for label, sampler in samplers_for(args.samplers, args.seed, i):
            want[i, label] = serial.decode(p.token_ids, args.n, sampler=sampler).tokens
    print(f"[{model_name}] serial references: {len(want)}", flush=True)
    for config, dec in decoders.items():  # warm-ups (untimed) and the instrument's oracle
        for i, p in enumerate(prompts):
            for label, sampler in samplers_for(args.samplers, args.seed, i):
                if getattr(dec, "instrument", False):
                    dec.prepare_prompt(p.token_ids, args.n, sampler=sampler)
                if i == 0:
                    dec.decode(p.token_ids, args.n, sampler=sampler)
    best: dict = {}
    exact_all: dict = {}
    for rep in range(args.reps):
        for i, p in enumerate(prompts):
            for label, sampler in samplers_for(args.samplers, args.seed, i):
                for config, dec in decoders.items():
                    res, seconds = timed_decode(dec, p.token_ids, args.n, sampler, model.device)
                    key = (label, config, i)
                    exact = res.tokens == want[i, label]
                    if not exact:
                        diff = next((k for k, (a, b) in enumerate(zip(res.tokens, want[i, label])) if a != b),
                                    min(len(res.tokens), len(want[i, label])))
                        print(f"MISMATCH {model_name} {config} {label} prompt {p.id}: first wrong token "
                              f"{diff} (position {len(p.token_ids) + diff})", flush=True)
                    st = res.stats
                    row = {"model": model_name, "sampler": label, "decoder": config, "prompt": p.id,
                           "seconds": seconds, "tokens": len(res.tokens), "exact": exact,
                           "drafted": st.drafted, "accepted": st.accepted, "rounds": sum(st.accept_hist.values()),
                           "probes": st.extra.get("probes", 0), "probe_hits": st.extra.get("probe_hits", 0),
                           "sampler_json": sampler.to_json() if sampler is not None else None}
                    exact_all[key] = exact_all.get(key, True) and exact
                    if key not in best or seconds < best[key]["seconds"]:
                        best[key] = row
        print(f"[{model_name}] rep {rep + 1}/{args.reps} done", flush=True)
    for key, row in best.items():
        row["exact"] = exact_all[key]  # every rep's tokens, not only the fastest one's
    return list(best.values())


def summarize(rows: list[dict]) -> list[dict]:
    """Per (model, sampler, decoder): ms/token, ratio to fast-serial, ratio to its greedy, acceptance."""
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["sampler"], r["decoder"]), {})[r["prompt"]] = r
    out = []
    for (model, sampler, decoder), per in by.items():
        ms = {pid: 1e3 * r["seconds"] / r["tokens"] for pid, r in per.items()}
        fs = by.get((model, sampler, "fast-serial"), {})
        greedy = by.get((model, "greedy", decoder), {})
        vs_fs = [1e3 * fs[pid]["seconds"] / fs[pid]["tokens"] / m for pid, m in ms.items() if pid in fs]
        vs_greedy = [1e3 * greedy[pid]["seconds"] / greedy[pid]["tokens"] / m for pid, m in ms.items() if pid in greedy]
        drafted, accepted = sum(r["drafted"] for r in per.values()), sum(r["accepted"] for r in per.values())
        rounds = sum(r["rounds"] for r in per.values())
        out.append({"model": model, "sampler": sampler, "decoder": decoder, "ms_per_token": statistics.median(ms.values()),
                    "vs_fast_serial": statistics.median(vs_fs) if vs_fs else None,
                    "vs_own_greedy": statistics.median(vs_greedy) if vs_greedy else None,
                    "acceptance": accepted / drafted if drafted else None,
                    "mean_accepted_length": (accepted + rounds) / rounds if rounds else None,
                    "probes": sum(r["probes"] for r in per.values()),
                    "probe_hits": sum(r["probe_hits"] for r in per.values()),
                    "exact": all(r["exact"] for r in per.values()), "prompts": len(per)})
    return out


def table(summary: list[dict]) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    lines = ["| model | sampler | decoder | ms/token | vs fast-serial | vs own greedy | acceptance | mean acc. len "
             "| probes (hits) | exact |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for s in summary:
        lines.append(f"| {s['model']} | {s['sampler']} | {s['decoder']} | {f(s['ms_per_token'], '.2f')} | "
                     f"{f(s['vs_fast_serial'], '.3f')}x | {f(s['vs_own_greedy'], '.3f')}x | {f(s['acceptance'], '.3f')} | "
                     f"{f(s['mean_accepted_length'], '.2f')} | {s['probes']} ({s['probe_hits']}) | "
                     f"{'yes' if s['exact'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="small,synthetic-9b")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--limit", type=positive_int, default=3, help="prompts per model")
    ap.add_argument("-n", type=positive_int, default=128, help="new tokens per decode")
    ap.add_argument("--reps", type=positive_int, default=2)
    ap.add_argument("--samplers", default="greedy;qwen-thinking;qwen-instruct")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--configs", default=None, help="decoders, comma-separated (default: the model's, listed below)")
    ap.add_argument("--json", type=new_output, default=None, help="write every row and the summary here")
    args = ap.parse_args(argv)
    args.samplers = [s.strip() for s in args.samplers.split(";") if s.strip()]
    args.configs = args.configs.split(",") if args.configs else None

    from core import determinism

    determinism.pin()  # before anything starts CUDA
    import torch
    import transformers

    from core.sampling import Sampler

    transformers.logging.set_verbosity_error()
    for name in args.samplers:
        if name != "greedy":
            Sampler.parse(name)  # a bad description fails before any model is built
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cpu":
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = []
    for model_name in args.models.split(","):
        rows += bench_model(model_name, args)
    summary = summarize(rows)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary, "device": args.device,
                                         "n": args.n, "reps": args.reps}, indent=1))
    print(f"\n{len(rows)} timed decodes in {time.perf_counter() - t0:.0f} s on {args.device}\n")
    print(table(summary))
    return 0 if all(s["exact"] for s in summary) else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
