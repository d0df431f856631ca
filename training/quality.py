"""Quality of an exported checkpoint, measured as ``core.models.load_model`` loads it (bf16).

``measure_quality`` gives the quality phase of a run: dev and held-out losses; greedy samples from
held-out prompts beside the source's own continuation, with a loop check (``loops``) also on dev
prompts (the figure a choice between training variants may use, since held-out is only reported);
MTP acceptance per depth (``training.acceptance``); and the real ``spec`` decoder on the same
prompts (exact vs serial, its mean accepted length). ``remeasure`` (``--measure-only``) measures an
existing checkpoint the same way, into ``quality.remeasured.json``.
"""
from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from pathlib import Path

import torch

from core.models import device_name, load_model
from decoders.serial import SerialDecoder
from decoders.spec import SpecDecoder
from training.acceptance import mtp_acceptance
from training.data import encode_splits, fixed_windows, load_corpus, load_tokenizer
from training.log import log, progress
from training.model import Preset, require_checkpoint
from training.outdir import write_text_atomic
from training.train import evaluate_loss

REMEASURED_FILE = "quality.remeasured.json"


def heldout_prompts(files, tok, n: int, per_file: int, prompt_len: int, ref_len: int) -> list[dict]:
    """Up to ``n`` prompts from held-out files (files in sha256-of-path order), ``per_file`` per
    file, each starting at a line start at k/(per_file+1) of the file: ``prompt_len`` ids, and the
    file's own next ``ref_len`` ids as the reference continuation."""
    out = []
    for f in sorted(files, key=lambda f: hashlib.sha256(f.path.encode()).hexdigest()):
        for k in range(1, per_file + 1):
            cut = f.text.find("\n", len(f.text) * k // (per_file + 1))
            if cut < 0:
                continue
            ids = tok.encode(f.text[cut + 1:], add_special_tokens=False).ids
            if len(ids) < prompt_len + ref_len:
                continue
            out.append({"path": f.path, "char_offset": cut + 1, "ids": ids[:prompt_len],
                        "reference": ids[prompt_len: prompt_len + ref_len]})
            if len(out) == n:
                return out
    return out


def loops(tokens: list[int], tail: int = 32, max_period: int = 16) -> bool:
    """True when the stream ends in a short cycle: its last ``tail`` tokens repeat with period <= max_period."""
    if len(tokens) < tail:
        return False
    t = tokens[-tail:]
    return any(all(t[i] == t[i + q] for i in range(tail - q)) for q in range(1, max_period + 1))


def distinct_ngrams(tokens: list[int], n: int = 4) -> float | None:
    grams = [tuple(tokens[i: i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def bar_iter(bar, items):
    for item in items:
        yield item
        bar.update(1)


def decode_all(dec, prompts: list[list[int]], n: int, desc: str) -> list[list[int]]:
    """``dec``'s tokens for every prompt, with a progress bar."""
    with progress(len(prompts), desc, "prompt") as bar:
        return [dec.decode(q, n).tokens for q in bar_iter(bar, prompts)]


def measure_quality(out: Path, corpus, tok, p: Preset, device: str, streams_by_split: dict, spec: bool = True) -> dict:
    """The quality sections of quality.json for the checkpoint at ``out``, measured on ``device``."""
    model = load_model(str(out), device)
    dev = model.device
    res = {}
    for split in ("dev", "heldout"):
        cap = p.eval_windows if split == "dev" else p.heldout_windows
        windows = fixed_windows(streams_by_split[split], p.seq_len, cap)
        with torch.inference_mode():
            res[split] = evaluate_loss(model.backbone, model.mtp, windows, p.batch, dev, amp=False)
    held = corpus.split("heldout")
    held_bytes = sum(f.size for f in held)
    held_tokens = int(streams_by_split["heldout"].numel())
    bpt = held_bytes / max(held_tokens, 1)
    res["heldout"]["bytes_per_token"] = bpt
    res["heldout"]["ntp_bits_per_byte"] = res["heldout"]["ntp_loss"] / math.log(2) / bpt

    prompts = heldout_prompts(held, tok, p.prompts, p.prompts_per_file, p.prompt_len, p.new_tokens)
    dec = SerialDecoder()
    dec.prepare(model)
    t0 = time.perf_counter()
    streams = decode_all(dec, [q["ids"] for q in prompts], p.new_tokens, "quality: serial")
    serial_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    acc = mtp_acceptance(model.backbone, model.mtp, [q["ids"] for q in prompts], streams, p.depth) if prompts else {}
    acc_s = time.perf_counter() - t0
    # the streams' decode time is recorded here, beside their source, and not among the loop figures,
    # which a re-measure reproduces exactly
    acc.update({"prompts": len(prompts), "prompt_len": p.prompt_len, "max_new_tokens": p.new_tokens,
                "stream": "serial greedy (decoders.serial)", "stream_seconds": round(serial_s, 2),
                "seconds": round(acc_s, 2)})
    spec = spec_check(model, [q["ids"] for q in prompts], streams, p) if prompts and spec else None
    eos = set(model.eos_token_ids)
    gen_only = [[t for t in s if t not in eos] for s in streams]
    samples = [{"path": q["path"], "char_offset": q["char_offset"], "prompt": tok.decode(q["ids"]),
                "greedy": tok.decode(s), "reference": tok.decode(q["reference"]), "greedy_tokens": len(s),
                "ends_with_eos": bool(s and s[-1] in eos), "loops": loops(s)}
               for q, s in zip(prompts[: p.samples], streams)]
    distinct = [d for d in (distinct_ngrams(s) for s in gen_only) if d is not None]
    # The same loop measure on dev prompts: what a choice between training variants may use, since
    # held-out is only ever reported
    dev_prompts = heldout_prompts(corpus.split("dev"), tok, p.prompts, p.prompts_per_file, p.prompt_len, p.new_tokens)
    dev_streams = decode_all(dec, [q["ids"] for q in dev_prompts], p.new_tokens, "quality: dev loops")
    return {
        "dev": res["dev"],
        "heldout": res["heldout"],
        "acceptance": acc,
        "spec_check": spec,
        "samples": samples,
        "repetition": {
            "streams": len(streams),
            "looping_fraction": sum(loops(s) for s in streams) / max(len(streams), 1),
            "distinct_4gram_mean": sum(distinct) / len(distinct) if distinct else None,
            "reference_distinct_4gram_mean": _mean([distinct_ngrams(q["reference"]) for q in prompts]),
            # the same check on the source's own continuations: how often real code ends in a cycle
            "reference_looping_fraction": sum(loops(q["reference"]) for q in prompts) / max(len(prompts), 1),
            "ended_with_eos": sum(bool(s and s[-1] in eos) for s in streams),
        },
        "dev_repetition": {
            "streams": len(dev_streams),
            "looping_fraction": sum(loops(s) for s in dev_streams) / max(len(dev_streams), 1),
            "reference_looping_fraction": sum(loops(q["reference"]) for q in dev_prompts) / max(len(dev_prompts), 1),
        },
    }


def spec_check(model, prompts: list[list[int]], streams: list[list[int]], p: Preset) -> dict:
    """The real ``spec`` decoder at a fixed depth on the same prompts: its tokens must equal the serial
    streams (exactness), and its tokens per round should match ``mtp_acceptance``'s simulation."""
    try:
        dec = SpecDecoder(depth=p.depth)
        dec.prepare(model)
        t0 = time.perf_counter()
        with progress(len(prompts), "quality: spec", "prompt") as bar:
            results = [dec.decode(q, p.new_tokens) for q in bar_iter(bar, prompts)]
        seconds = time.perf_counter() - t0
    except Exception as exc:  # recorded in quality.json: a decoder failure must not lose the run
        return {"error": f"{type(exc).__name__}: {exc}"}
    drafted = [sum(x) for x in zip(*[r.stats.drafted_by_depth for r in results])]
    accepted = [sum(x) for x in zip(*[r.stats.accepted_by_depth for r in results])]
    rounds = sum(sum(r.stats.accept_hist.values()) for r in results)
    return {
        "decoder": "spec", "depth": p.depth,
        "exact_vs_serial": all(r.tokens == s for r, s in zip(results, streams)),
        "mismatching_prompts": sum(r.tokens != s for r, s in zip(results, streams)),
        "drafted_by_depth": drafted, "accepted_by_depth": accepted,
        "acceptance_by_depth": [a / d if d else None for a, d in zip(accepted, drafted)],
        "mean_accepted_length": (sum(accepted) + rounds) / rounds if rounds else None,
        "seconds": round(seconds, 2),
    }


def remeasure(ckpt: Path, preset: Preset, device: str, spec: bool = True) -> dict:
    """Quality of an existing checkpoint, measured as a training run measures its own (same corpus
    splits, prompts and loop check, on this machine), into ``<ckpt>/quality.remeasured.json``:
    figures for a shipped model that predate a measure, comparable with a new run's."""
    require_checkpoint(ckpt)
    corpus = load_corpus(preset)
    tok = load_tokenizer(ckpt)
    streams = encode_splits(tok, corpus)
    t0 = time.perf_counter()
    quality = measure_quality(ckpt, corpus, tok, preset, device, streams, spec)
    report = {"schema": "qwen35-exact/small-quality-remeasured/1",
              "command": "python -m training " + " ".join(sys.argv[1:]),
              "device": device_name(torch.device(device)), "python_version": corpus.python_version,
              "files_sha256": corpus.manifest()["files_sha256"], **quality,
              "seconds": round(time.perf_counter() - t0, 1)}
    path = ckpt / REMEASURED_FILE
    write_text_atomic(path, json.dumps(report, indent=1) + "\n")
    r, d = report["repetition"], report["dev_repetition"]
    log(f"dev: next-token {report['dev']['ntp_loss']:.4f}, loops {d['looping_fraction']:.3f} "
        f"(source {d['reference_looping_fraction']:.3f}); held-out: next-token {report['heldout']['ntp_loss']:.4f}, "
        f"loops {r['looping_fraction']:.3f} (source {r['reference_looping_fraction']:.3f}); wrote {path}")
    return report
