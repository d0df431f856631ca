"""How often `audit retime` would score a candidate that is exactly as fast as the control.

    python bench/retime_null.py [--trials 1000] [--seed 0]

Each simulated retime times n fresh prompts, 2 legs per side, every leg a fixed time plus noise
drawn alike for both sides (a serial-speed candidate on a loaded machine). It prints, per noise
shape and prompt count, the share of retimes with a positive score (the interval's bottom above 1)
under two rules side by side:

  median/boot  each prompt's ratio the control's median leg over the candidate's first, the
               interval a percentile bootstrap of the median (9999 resamples)
  first/order  the retime's rule (audit.retime.judge): the control's first leg over the
               candidate's first, the distribution-free order-statistic interval

and the share of prompts whose ratio lies above 1 under each ratio rule. A sound rule scores such
a candidate at most 2.5% of the time.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import numpy as np
from scipy import stats
from tqdm import tqdm

from audit.retime import judge

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: its scripts' shared modules

from script_args import positive_int  # noqa: E402

NOISES = {
    # bursts of other work: an exponential share of the leg's time on top of it
    "exp 10%": lambda rng: 1 + rng.expovariate(1 / 0.1),
    "exp 50%": lambda rng: 1 + rng.expovariate(1 / 0.5),
    # a quiet machine with rare large bursts
    "rare 3x": lambda rng: 1 + (2.0 if rng.random() < 0.15 else 0.02 * rng.random()),
    "lognormal 0.3": lambda rng: rng.lognormvariate(0, 0.3),
}
PROMPTS = (3, 4, 6, 9)


def bootstrap_low(ratios: list[float], rng: np.random.Generator) -> float:
    if len(set(ratios)) == 1:
        return ratios[0]
    res = stats.bootstrap((np.asarray(ratios),), np.median, n_resamples=9999, confidence_level=0.95,
                          method="percentile", vectorized=True, axis=-1, rng=rng)
    return float(res.confidence_interval.low)


def simulate(noise, n: int, trials: int, seed: int, progress=None) -> dict:
    """``progress``: called with 1 after each trial."""
    rng, nrng = random.Random(seed), np.random.default_rng(seed)
    scored = {"median/boot": 0, "first/order": 0}
    above = {"median": 0, "first": 0}
    for _ in range(trials):
        median_rule, first_rule = [], []
        for _ in range(n):
            control, candidate = [noise(rng), noise(rng)], [noise(rng), noise(rng)]
            median_rule.append(statistics.median(control) / candidate[0])
            first_rule.append(control[0] / candidate[0])
        above["median"] += sum(r > 1 for r in median_rule)
        above["first"] += sum(r > 1 for r in first_rule)
        scored["median/boot"] += bootstrap_low(median_rule, nrng) > 1
        low = judge.interval(first_rule)[0]
        scored["first/order"] += low is not None and low > 1
        if progress:
            progress(1)
    return {"scored": {k: v / trials for k, v in scored.items()},
            "above": {k: v / (trials * n) for k, v in above.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=positive_int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print("| noise | prompts | ratio > 1, median rule | ratio > 1, first rule | scored, median/boot | "
          "scored, first/order |")
    print("|---|---|---|---|---|---|", flush=True)
    # on stderr, with the time left: the table on stdout stays clean
    with tqdm(total=len(NOISES) * len(PROMPTS) * args.trials, unit="retime", file=sys.stderr,
              dynamic_ncols=True, mininterval=1.0) as bar:
        for name, noise in NOISES.items():
            for n in PROMPTS:
                r = simulate(noise, n, args.trials, args.seed + n, bar.update)
                order = "no interval" if n < judge.MIN_PROMPTS else f"{r['scored']['first/order']:.1%}"
                bar.write(f"| {name} | {n} | {r['above']['median']:.1%} | {r['above']['first']:.1%} | "
                          f"{r['scored']['median/boot']:.1%} | {order} |", file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
