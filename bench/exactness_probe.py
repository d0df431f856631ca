"""Exactness probe for verify windows with PARTIAL accepts (the runtime bench accepts whole windows).

    python bench/exactness_probe.py [--model synthetic-9b] [--prompt random-1[,random-2,...]] [-n 256]
                                    [--scenarios ...] [--eliminate] [--no-instrument] [--json FILE]

A reference runtime steps serially (fast-serial: bit-equal to the control) along the greedy stream.
Each scenario replays the stream as verify windows of random size w with j true drafts then junk,
accepts j + 1 rows, and after every round compares, bit for bit, the accepted rows' logits with the
reference and the whole live state (conv, recurrent, K/V up to the committed length) with the
reference runtime's state at the same length. It prints the first round where anything differs
(which state, which layer, which (w, j) and the rounds before it), so a break is located, not
only detected. Scenarios: graphs on / off; full accepts only; w = 2 only; with the MTP drafter
running between rounds as `spec` does; and the `spec-instrument` decoder itself (tokens only).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core import determinism  # noqa: E402

determinism.pin()

import torch  # noqa: E402


def state_tensors(rt, length):
    st = rt.state
    out = {"conv": st.conv_all, "rec": st.rec_all}
    for idx in st.attn_layers:
        out[f"k{idx}"] = st.keys[idx][:, :, :length]
        out[f"v{idx}"] = st.values[idx][:, :, :length]
    return out


def first_state_difference(rt, ref_rt, length):
    a, b = state_tensors(rt, length), state_tensors(ref_rt, length)
    for name in a:
        if not torch.equal(a[name], b[name]):
            diff = (a[name].float() - b[name].float()).abs()
            where = None
            if name in ("conv", "rec"):
                per_layer = diff.flatten(1).amax(1)
                where = [int(i) for i in torch.nonzero(per_layer).flatten()[:8]]
            return {"state": name, "max_abs": float(diff.max()), "layers": where}
    return None


@torch.inference_mode()
def reference(model, prompt, n, cal):
    from decoders.runtime.runtime import ExactRuntime

    rt = ExactRuntime(model, capacity=len(prompt) + n + 16, windows=(1,), cal=cal)
    logits, _ = rt.prefill(prompt)
    tokens, rows = [int(logits.argmax(-1))], [logits.clone()]
    while len(tokens) < n + 8:
        prog = rt.step(torch.tensor([[tokens[-1]]], device=model.device))
        rows.append(prog.ws["logits"][:, -1].clone())
        tokens.append(int(prog.ws["argmax"].view(-1)[0]))
    return tokens, torch.cat(rows)


@torch.inference_mode()
def scenario(model, prompt, n, cal, ref_tokens, ref_logits, *, graphs, choose, drafter=False, seed=0):
    from decoders.drafter import MTPDrafter
    from decoders.runtime.runtime import ExactRuntime

    dev, vocab = model.device, model.vocab_size
    cap = len(prompt) + n + 16
    rt = ExactRuntime(model, capacity=cap, windows=tuple(range(1, 8)), cal=cal, use_graphs=graphs)
    ref_rt = ExactRuntime(model, capacity=cap, windows=(1,), cal=cal, use_graphs=graphs)
    dr = MTPDrafter(model, cap) if drafter else None
    rng = random.Random(seed)
    _, hidden = rt.prefill(prompt)
    ref_rt.prefill(prompt)
    if dr:
        dr.prefill(hidden, prompt)
    emitted, history = 1, []  # tokens emitted so far (the first comes from the prefill)
    pend_h, pend_t = [hidden[:, -1:]], [torch.tensor([[ref_tokens[0]]], device=dev)]
    while emitted < n:
        w, j = choose(rng)
        w = min(w, n - emitted + 1)
        j = min(j, w - 1)
        if dr:
            dr.draft(torch.cat(pend_h, 1), torch.cat(pend_t, 1), max(w - 1, 1))
        block = ref_tokens[emitted - 1:emitted + j]  # y then j true drafts
        junk = [(ref_tokens[emitted + i] + 1 + rng.randrange(vocab - 1)) % vocab for i in range(j, w - 1)]
        prog = rt.verify(torch.tensor([block + junk], device=dev))
        bad_rows = [r for r in range(j + 1)
                    if not torch.equal(prog.ws["logits"][0, r], ref_logits[emitted + r])]
        rt.accept(j + 1)
        for t in ref_tokens[emitted - 1:emitted + j]:
            ref_rt.step(torch.tensor([[t]], device=dev))
        history.append((emitted, w, j))
        state = first_state_difference(rt, ref_rt, rt.length)
        if bad_rows or state:
            return {"ok": False, "round": len(history), "position": emitted, "w": w, "j": j,
                    "bad_rows": bad_rows, "state": state, "before": history[-6:-1]}
        pend_h = [prog.ws["hidden"][:, :j + 1].clone()]
        pend_t = [torch.tensor([ref_tokens[emitted:emitted + j + 1]], device=dev)]
        emitted += j + 1
    return {"ok": True, "rounds": len(history)}


CHOOSERS = {
    "partial": lambda r: (r.randint(2, 7), r.randint(0, 6)),
    "full": lambda r: (r.randint(2, 7), 6),  # j is clipped to w - 1: every row accepted
    "w2": lambda r: (2, r.randint(0, 1)),
    "w3": lambda r: (3, r.randint(0, 2)),
}
PLAN = [("partial", True, False), ("partial", False, False), ("full", True, False), ("w2", True, False),
        ("w3", True, False), ("partial", True, True)]


def elimination_variants(cal) -> dict:
    """The calibration with one batched op class (or every GEMM shape alone) run row by row."""
    import dataclasses

    variants = {"serial-only": dataclasses.replace(cal, gemm={k: 1 for k in cal.gemm}, hidden_mean=1, head_norm=1,
                                                   gated_norm=1, l2norm=1, conv_window=False, elementwise=False),
                "gemm=1": dataclasses.replace(cal, gemm={k: 1 for k in cal.gemm}),
                "elementwise=False": dataclasses.replace(cal, elementwise=False)}
    for field_name in ("hidden_mean", "head_norm", "gated_norm", "l2norm"):
        if getattr(cal, field_name) > 1:
            variants[f"{field_name}=1"] = dataclasses.replace(cal, **{field_name: 1})
    if cal.conv_window:
        variants["conv_window=False"] = dataclasses.replace(cal, conv_window=False)
    return variants


def probe_prompt(model, cal, prompt, args) -> dict:
    """Every requested scenario on one prompt; with --eliminate, and if the w=2 scenario is not
    exact, the w=2 scenario again under each elimination variant (then per GEMM shape if turning
    every GEMM row by row was what fixed it)."""
    import dataclasses

    from decoders.spec import InstrumentedSpecDecoder

    ref_tokens, ref_logits = reference(model, prompt, args.n, cal)
    gpu = model.device.type == "cuda"
    wanted = set(args.scenarios.split(","))
    if args.eliminate:
        wanted.add("w2")
    results = {}
    for name, graphs, drafter in PLAN:
        graphs = graphs and gpu
        label = f"{name}{'' if graphs else '-eager'}{'+drafter' if drafter else ''}"
        if label in results or (label not in wanted and label.replace("-eager", "") not in wanted):
            continue
        results[label] = scenario(model, prompt, args.n, cal, ref_tokens, ref_logits, graphs=graphs,
                                  choose=CHOOSERS[name], drafter=drafter)
        print(label, json.dumps(results[label]), flush=True)

    def run_variants(variants):
        for vname, var in variants.items():
            label = f"w2 with {vname}"
            results[label] = scenario(model, prompt, args.n, var, ref_tokens, ref_logits, graphs=gpu,
                                      choose=CHOOSERS["w2"])
            print(label, json.dumps(results[label]), flush=True)

    base = results.get("w2") or results.get("w2-eager")
    if args.eliminate and base is not None and not base["ok"]:
        run_variants(elimination_variants(cal))
        if results["w2 with gemm=1"]["ok"]:
            run_variants({f"gemm {key}=1": dataclasses.replace(cal, gemm={**cal.gemm, key: 1})
                          for key in cal.gemm if cal.gemm[key] > 1})
    for alpha in () if args.no_instrument else (0.85,):
        dec = InstrumentedSpecDecoder(alpha=alpha)
        with torch.inference_mode():
            dec.prepare(model)
        out = dec.decode(prompt, args.n).tokens
        first = next((i for i, (a, b) in enumerate(zip(out, ref_tokens)) if a != b), None)
        results[f"instrument-{alpha}"] = {"ok": first is None, "first_divergence": first}
        print(f"instrument-{alpha}", json.dumps(results[f"instrument-{alpha}"]), flush=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="synthetic-9b")
    ap.add_argument("--prompt", default="random-1", help="prompt id, or several separated by commas")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--scenarios", default="partial,partial-eager,full,w2,w3,partial+drafter",
                    help="comma-separated subset of the base scenarios to run")
    ap.add_argument("--no-instrument", action="store_true", help="skip decoding with spec-instrument")
    ap.add_argument("--eliminate", action="store_true",
                    help="where the w=2 scenario is not exact, rerun it with each batched op class switched "
                         "to row by row in turn (and each GEMM shape, if that is what fixes it)")
    args = ap.parse_args()

    import transformers

    transformers.logging.set_verbosity_error()
    from decoders.runtime.calibration import calibrate
    from core.models import load_model
    from core.prompts import load_prompts

    model = load_model(args.model, args.device)
    prompts, _ = load_prompts("random-512" if model.tokenizer is None else "dev", model)
    by_id = {p.id: p.token_ids for p in prompts}
    wanted = args.prompt.split(",")
    unknown = [w for w in wanted if w not in by_id]
    if unknown:
        print(f"error: unknown prompt {unknown[0]!r}; known: {', '.join(by_id)}", file=sys.stderr)
        return 2
    cal = calibrate(model, max_rows=8)
    print("calibration:", json.dumps(cal.to_json()), flush=True)
    results = {}
    for pid in wanted:
        out = probe_prompt(model, cal, by_id[pid], args)
        results.update({(k if len(wanted) == 1 else f"{pid} {k}"): v for k, v in out.items()})
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print("\n| scenario | exact | first failure |")
    print("|---|---|---|")
    for k, v in results.items():
        fail = "" if v["ok"] else json.dumps(v)[:160]
        print(f"| {k} | {'yes' if v['ok'] else 'NO'} | {fail} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
