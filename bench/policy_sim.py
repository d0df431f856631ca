"""What `spec`'s depth policy earns on an acceptance pattern, priced by measured costs, no GPU needed.

    python bench/policy_sim.py --costs FILE[:CONFIG] (--alpha A [--alpha B ...] | --trace FILE [--trace ...])
                               [--stop depth,confidence,oracle] [--depth D] [-n TOKENS] [--prompts K] [--max-depth D]
                               [--overhead-ms MS] [--sync-ms MS] [--draft-scale F] [--row-scale F]
                               [--no-carry] [--json OUT]

It walks the decode loop of ``decoders/spec.py`` round by round with the real ``DepthPolicy``:
plain runs, priced probes, drafting rounds whose catch-up covers the rows since the last draft,
the head's prompt rows at the first draft. Acceptance comes from an instrument's rule (each draft
right with probability alpha, drawn afresh every round, as ``spec-instrument alpha=A``) or from a
trace (``python -m decoders.trace``: the k-th draft of a round starting at stream position t is
right where the traced head's was, as ``spec-instrument trace=FILE``). Each row runs once per
``--stop`` setting, as `spec`'s ``stop`` argument: ``depth`` (the policy's depth per round) or
``confidence`` (drafts chained while ``DepthPolicy.draft_more`` says so, on the trace's recorded
confidences; under an instrument's alpha every draft has the same confidence, as a random head's
are alike, and each draft's read costs ``--sync-ms``), or ``oracle``, a bound: every round knows
how many drafts will be accepted and drafts exactly those, or takes a plain step where that pays
better. Time is the start-up costs
a `spec` run recorded (``costs_s``: a plain step, a chained draft step, each verify window, the
head's prompt rows), plus ``--overhead-ms`` per drafting round for what those op timings leave
out (the round's sync and host work, its rollback). The policy sees the simulated round times,
as it sees measured ones in a decode.

A row's decodes run in order, as one decoder's: each starts from the depth-1 acceptance the last
one that drafted ended with, as `spec` carries it (``--no-carry``: each from the built-in prior).

The ratio printed is decode time only, `fast-serial` at one step per token against the
simulated rounds: the quantity the context bench's ``decode_ms_per_token`` compares (the harness's
ratio also holds each side's prefill, which dilutes it).

``--draft-scale`` and ``--row-scale`` ask what cheaper rounds would earn: the draft step's cost,
and what each verify row costs beyond a one-row window, times F.

``--costs`` reads ``costs_s`` from: a stream (its candidate's config), a JSON object holding it,
or a bench JSON whose ``configs`` maps names to decoder configs (``FILE:NAME`` picks one; the first
with costs otherwise).
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: its scripts' shared modules

from core.prompts import random_prompts  # noqa: E402
from decoders.drafter import PREFILL_ROWS, catch_up_sizes, split_rows  # noqa: E402
from decoders.policy import Calibration, Costs, DepthPolicy  # noqa: E402
from decoders.spec import PLAIN_RUN  # noqa: E402
from decoders.trace import Trace  # noqa: E402
from decoders.trace import load as load_trace  # noqa: E402
from script_args import fraction, new_output, positive_int, run_main  # noqa: E402


@dataclass
class Outcome:
    tokens: int
    seconds: float  # the decode's simulated time, the prefill's first token excluded
    drafting_rounds: int
    plain_steps: int
    probes: int
    accepted: int
    learnt: float | None = None  # the policy's depth-1 acceptance at the end, where it drafted

    def ms_per_token(self) -> float:
        return 1e3 * self.seconds / max(1, self.tokens - 1)


def scaled(costs: Costs, draft: float = 1.0, rows: float = 1.0) -> Costs:
    """``costs`` with the draft step times ``draft`` and each window's rows past its first times ``rows``."""
    one = costs.verify[1]
    return Costs(step=costs.step, draft=costs.draft * draft, head_prefill=costs.head_prefill,
                 verify={w: one + (v - one) * rows for w, v in costs.verify.items()})


def costs_from(spec: str) -> Costs:
    """``costs_s`` from a stream, a config or a bench JSON (``FILE:NAME`` names the config)."""
    path, _, name = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
    if not Path(path).is_file():
        raise SystemExit(f"error: --costs {path}: no such file")
    text = Path(path).read_text()
    try:
        doc = json.loads(text.splitlines()[0]) if path.endswith(".jsonl") else json.loads(text)
    except (ValueError, IndexError) as exc:
        raise SystemExit(f"error: --costs {path}: not JSON ({exc})") from None
    candidates = []
    if "candidate" in doc:
        candidates.append(doc["candidate"].get("config") or {})
    if "configs" in doc:
        configs = doc["configs"]
        if name and name not in configs:
            raise SystemExit(f"error: --costs {path}: no configuration {name!r} (it holds {', '.join(configs)})")
        candidates += [configs[name]] if name else list(configs.values())
    candidates.append(doc)
    for cfg in candidates:
        if isinstance(cfg, dict) and isinstance(cfg.get("costs_s"), dict):
            c = cfg["costs_s"]
            return Costs(step=c["step"], draft=c["draft"], verify={int(w): v for w, v in c["verify"].items()},
                         head_prefill=c.get("head_prefill", 0.0))
    raise SystemExit(f"error: no costs_s in {spec}")


class Alpha:
    """Each draft right with probability ``alpha``, drawn afresh per round (the instrument's rule)."""

    def __init__(self, alpha: float, seed: int):
        self.alpha, self.rng = alpha, random.Random(seed)

    def confidence(self, t: int, k: int) -> float:
        return 0.05

    def accepted(self, t: int, depth: int) -> int:
        j = 0
        while j < depth and self.rng.random() < self.alpha:
            j += 1
        return j


class TraceAcceptance:
    """The traced head's bits along one row (``Trace.accepts``)."""

    def __init__(self, row):
        self.row = row

    def confidence(self, t: int, k: int) -> float:
        return Trace.confidence(self.row, t, k)

    def accepted(self, t: int, depth: int) -> int:
        j = 0
        while j < depth and Trace.accepts(self.row, t, j + 1):
            j += 1
        return j


@dataclass(frozen=True)
class Settings:
    max_depth: int = 6
    prompt_len: int = 512
    overhead: float = 0.0  # seconds added to every drafting round
    stop: str = "depth"
    sync: float = 3e-5  # seconds each confidence read adds (stop=confidence)
    explore_every: int = 64
    depth: int | None = None  # a fixed depth, as spec's ``depth`` argument (stop=depth only)
    carry: bool = True  # each decode's prior is the last drafting decode's acceptance, as spec's


def oracle(acceptance, costs: Costs, n: int, settings: Settings = Settings()) -> Outcome:
    """A bound, not a decoder: each round knows how many drafts will be accepted and takes the
    round (a plain step, or exactly that many drafts) with the most tokens per second."""
    out = Outcome(tokens=1, seconds=0.0, drafting_rounds=0, plain_steps=0, probes=0, accepted=0)
    while out.tokens < n:
        right = acceptance.accepted(out.tokens - 1, min(settings.max_depth, n - out.tokens))
        if right and (right + 1) / costs.round_time(right) > 1 / costs.step:
            out.seconds += costs.round_time(right)
            out.drafting_rounds += 1
            out.accepted += right
            out.tokens += min(right + 1, n - out.tokens)
        else:
            out.seconds += costs.step
            out.plain_steps += 1
            out.tokens += 1
    return out


def decodes(accs: list, costs: Costs, n: int, settings: Settings = Settings()) -> list[Outcome]:
    """One decode per acceptance, in order, by one decoder: with ``settings.carry`` each starts
    from the depth-1 acceptance the last decode that drafted ended with, as `spec` does."""
    outs, prior = [], DepthPolicy.prior
    for acceptance in accs:
        outs.append(simulate(acceptance, costs, n, settings, prior))
        if settings.carry and outs[-1].learnt is not None:
            prior = outs[-1].learnt
    return outs


def simulate(acceptance, costs: Costs, n: int, settings: Settings = Settings(),
             prior: float = DepthPolicy.prior) -> Outcome:
    """One decode of ``n`` tokens, as ``SpecDecoder.decode`` runs it, on simulated time, from
    acceptance ``prior`` (``stop="oracle"``: ``oracle``'s bound)."""
    if settings.stop == "oracle":
        return oracle(acceptance, costs, n, settings)
    max_depth, confident = settings.max_depth, settings.stop == "confidence"
    sizes = catch_up_sizes(max_depth + 1, 1 << 30)
    blocks = max(1, -(-(settings.prompt_len - 1) // PREFILL_ROWS))
    policy = DepthPolicy(costs, max_depth, prior=prior, explore_every=settings.explore_every, fixed=settings.depth,
                         first_draft=blocks * costs.head_prefill,
                         catch_up_calls=lambda rows: len(split_rows(rows, sizes)),
                         calibration=Calibration() if confident else None)
    out = Outcome(tokens=1, seconds=0.0, drafting_rounds=0, plain_steps=0, probes=0, accepted=0)
    pending, drafting, drafted = 1, True, False  # head rows to catch up: the prompt's last
    while out.tokens < n:
        depth = min(policy.choose(), n - out.tokens)
        first = bool(depth) and not drafted
        if first:
            out.seconds += blocks * costs.head_prefill
            drafted = True
        t = out.tokens - 1  # the round starts at stream position t
        if policy.probing:
            calls = len(split_rows(pending, sizes))
            seconds = costs.step + calls * costs.draft
            hit = acceptance.accepted(t, 1) == 1
            if not first:
                policy.observe_probe(seconds)
            policy.update(1, int(hit), [acceptance.confidence(t, 1)] if confident else None)
            out.probes += 1
            new, pending, drafting = 1, 1, False
        elif depth == 0:
            rounds = policy.plain_rounds(min(PLAIN_RUN, n - out.tokens))
            seconds = rounds * costs.step
            policy.observe(0, seconds, rounds)
            out.plain_steps += rounds
            new, drafting = rounds, False
            pending += rounds
        else:
            confidences, reads = None, 0.0
            if confident:  # the round drafts while the policy asks for more, up to max_depth
                cap, confidences = min(max_depth, n - out.tokens), []
                while True:
                    confidences.append(acceptance.confidence(t, len(confidences) + 1))
                    if not (len(confidences) < cap and policy.draft_more(confidences)):
                        break
                depth, reads = len(confidences), len(confidences) * settings.sync
            calls = len(split_rows(pending, sizes))
            seconds = (calls + depth - 1) * costs.draft + costs.verify[depth + 1] + settings.overhead + reads
            j = acceptance.accepted(t, depth)
            policy.update(depth, j, confidences)
            if drafting:
                policy.observe(depth, seconds)
            out.drafting_rounds += 1
            out.accepted += j
            new, pending, drafting = j + 1, j + 1, True
        out.seconds += seconds
        out.tokens += min(new, n - out.tokens)
    out.learnt = policy.learnt()
    return out


def rows_for(args) -> list[tuple[str, list]]:
    """(label, one acceptance per prompt) for every --alpha and --trace asked for."""
    out = []
    for alpha in args.alpha or []:
        out.append((f"alpha {alpha:g}", [Alpha(alpha, seed) for seed in range(args.prompts)]))
    for path in args.trace or []:
        trace = load_trace(path)
        if args.random_vocab:  # the rows the instrument replays for random-512's first prompts
            rows = [trace.row_for(p["token_ids"]) for p in random_prompts(args.random_vocab, args.prompts)]
        else:
            rows = trace.rows[:args.prompts] if args.prompts else trace.rows
        out.append((f"trace {Path(path).name}", [TraceAcceptance(r) for r in rows]))
    return out


def row(label: str, outs: list[Outcome], costs: Costs) -> dict:
    ratios = [costs.step * 1e3 / o.ms_per_token() for o in outs]
    rounds = sum(o.drafting_rounds for o in outs)
    return {"row": label, "ratio_median": statistics.median(ratios), "ratio_mean": statistics.mean(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ms_per_token": statistics.median(o.ms_per_token() for o in outs),
            "accepted_per_round": sum(o.accepted for o in outs) / rounds if rounds else 0.0,
            "drafting_rounds": rounds, "plain_steps": sum(o.plain_steps for o in outs),
            "probes": sum(o.probes for o in outs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--costs", required=True, help="a stream or JSON holding costs_s (FILE:CONFIG to pick one)")
    ap.add_argument("--alpha", type=fraction, action="append", help="an instrument's acceptance, 0..1 (repeatable)")
    ap.add_argument("--trace", action="append", help="an acceptance trace (repeatable)")
    ap.add_argument("-n", type=positive_int, default=256, help="new tokens per decode (default 256)")
    ap.add_argument("--prompts", type=positive_int, default=10,
                    help="decodes per row: seeds, or a trace's first rows (default 10)")
    ap.add_argument("--random-vocab", type=int, default=None, metavar="V",
                    help="a trace's rows for the first --prompts of random-512 at vocabulary V, as the "
                         "instrument picks them (synthetic-9b: 248320); default: its first rows")
    ap.add_argument("--max-depth", type=positive_int, default=6)
    ap.add_argument("--depth", type=int, default=None, help="a fixed depth (as spec's depth=), with --stop depth")
    ap.add_argument("--prompt-len", type=int, default=512, help="prices the head's prompt rows (default 512)")
    ap.add_argument("--overhead-ms", type=float, default=0.0, help="added to every drafting round (default 0)")
    ap.add_argument("--stop", default="depth",
                    help="comma-separated: depth, confidence, oracle (each round knowing its acceptance: a bound)")
    ap.add_argument("--sync-ms", type=float, default=0.03, help="a confidence read's cost (default 0.03)")
    ap.add_argument("--draft-scale", type=float, default=1.0, help="the draft step's cost times F (default 1)")
    ap.add_argument("--row-scale", type=float, default=1.0,
                    help="each verify row past a window's first costs F times as much (default 1)")
    ap.add_argument("--no-carry", action="store_true",
                    help="every decode starts from the policy's built-in prior, not the last decode's acceptance")
    ap.add_argument("--json", type=new_output, help="write the rows here as JSON")
    args = ap.parse_args(argv)
    if not args.alpha and not args.trace:
        ap.error("give --alpha or --trace")
    stops = args.stop.split(",")
    if not set(stops) <= {"depth", "confidence", "oracle"}:
        ap.error("--stop takes depth, confidence and/or oracle")
    if args.depth is not None and (not 1 <= args.depth <= args.max_depth or stops != ["depth"]):
        ap.error("--depth must be within 1..--max-depth, with --stop depth")
    if not (args.draft_scale > 0 and args.row_scale >= 0):
        ap.error("--draft-scale must be > 0 and --row-scale >= 0")
    costs = scaled(costs_from(args.costs), args.draft_scale, args.row_scale)
    table = []
    for label, accs in rows_for(args):
        for stop in stops:
            settings = Settings(max_depth=args.max_depth, prompt_len=args.prompt_len, overhead=args.overhead_ms / 1e3,
                                stop=stop, sync=args.sync_ms / 1e3, depth=args.depth, carry=not args.no_carry)
            # each setting meets the same draws: an instrument's generator starts afresh
            fresh = copy.deepcopy(accs)
            table.append(row(f"{label}, stop {stop}", decodes(fresh, costs, args.n, settings), costs))
    if args.json:
        Path(args.json).write_text(json.dumps({"costs_s": vars(costs), "n": args.n, "overhead_ms": args.overhead_ms,
                                               "rows": table}, indent=1))
    print(f"step {costs.step * 1e3:.3f} ms, draft {costs.draft * 1e3:.3f} ms, n {args.n}, "
          f"window rows past the first {(costs.verify[2] - costs.verify[1]) * 1e3:.3f} ms, "
          f"overhead {args.overhead_ms:g} ms per drafting round, a confidence read {args.sync_ms:g} ms")
    print("| row | vs fast-serial: median (mean, min-max) | ms/token | accepted per round | drafting rounds | plain steps | probes |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        print(f"| {r['row']} | {r['ratio_median']:.3f}x ({r['ratio_mean']:.3f}, {r['ratio_min']:.3f}-{r['ratio_max']:.3f}) | "
              f"{r['ms_per_token']:.3f} | {r['accepted_per_round']:.2f} | {r['drafting_rounds']} | "
              f"{r['plain_steps']} | {r['probes']} |")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
