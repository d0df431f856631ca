"""How often an m-row GEMM's rows differ from the 1-row GEMM, per Linear shape of a model.

    python bench/gemm_row_probe.py [--model synthetic-9b] [--elements 262144] [--max-rows 8] [--json FILE]

For every distinct (in, out) Linear shape of the backbone and MTP head (the real weights), and
every row count m = 2..max_rows, it compares rows of m-row products with the 1-row products of
the same inputs over enough random trials to compare ``--elements`` output elements per m, and
prints the fraction of elements that differ. A nonzero rate means the library picks a kernel for m
rows that sums in another order; a small rate is the dangerous case, because one random trial of
a narrow projection can miss it (see decoders/runtime/calibration.py).
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


@torch.inference_mode()
def flip_rates(lin, max_rows: int, elements: int, gen) -> dict[int, float]:
    dev, dtype = lin.weight.device, lin.weight.dtype
    trials = max(1, -(-elements // (2 * lin.out_features)))
    diff = {m: 0 for m in range(2, max_rows + 1)}
    for _ in range(trials):
        x = torch.randn(1, max_rows, lin.in_features, generator=gen).to(device=dev, dtype=dtype)
        singles = torch.cat([lin(x[:, i:i + 1].contiguous()) for i in range(max_rows)], dim=1)
        for m in diff:
            diff[m] += int((lin(x[:, :m]) != singles[:, :m]).sum())
    return {m: diff[m] / (trials * m * lin.out_features) for m in diff}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="synthetic-9b")
    ap.add_argument("--device", default=None)
    ap.add_argument("--elements", type=int, default=1 << 18, help="output elements compared per shape and m")
    ap.add_argument("--max-rows", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from core.models import load_model

    model = load_model(args.model, args.device)
    linears = {}
    for mod in list(model.backbone.modules()) + (list(model.mtp.modules()) if model.mtp is not None else []):
        if isinstance(mod, torch.nn.Linear):
            linears.setdefault(f"{mod.in_features}x{mod.out_features}", mod)
    gen = torch.Generator().manual_seed(0)
    results = {}
    print(f"| shape | {' | '.join(f'm={m}' for m in range(2, args.max_rows + 1))} |")
    print(f"|---|{'---|' * (args.max_rows - 1)}")
    for key, lin in sorted(linears.items()):
        results[key] = flip_rates(lin, args.max_rows, args.elements, gen)
        print(f"| {key} | {' | '.join(f'{r:.1e}' if r else '0' for r in results[key].values())} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
