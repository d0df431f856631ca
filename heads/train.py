"""Train (distil) a backbone's MTP draft head on the backbone's own greedy generations.

Pipeline (``heads train``, heads/cli.py):

 1. split: prompts are ordered by sha256 of their id and cut into held-out (~20 %), dev (~10 %,
    at least 1 each; ``max_heldout`` / ``max_dev`` cap them) and train (the rest); the three never
    overlap. Train is trained on; dev loss (the head's CE on dev streams, never training loss)
    drives early stopping; held-out mean accepted length selects the checkpoint and gives the
    before/after report. Because the same held-out prompts select and report, the "after" figure
    carries a (small) selection bias; dev is kept out of it so that stopping is independent of the
    reported number;
 2. generate: greedy continuations. Dev and held-out: one prompt at a time with
    ``FastSerialDecoder``, the exact serial stream spec verifies against (held-out acceptance is
    measured against it). Train: with ``gen_batch`` > 1 (the default, 32), ``generate_batched``:
    plain HF forwards over a batch of equal-length rows, each batch's prompts LEFT-TRUNCATED to its
    shortest (the train examples then use the shortened prompts; the report records the lengths),
    and batched greedy may differ from serial greedy at near-ties (more often with ``gen_dtype``
    float32): acceptable for training data only; ``gen_batch`` 1 generates train exactly too.
    Tokens, seconds and tokens/s are reported per split;
 3. data: one no-grad backbone forward per prompt+stream gives the post-norm hidden states h_t;
    head row t = (h_t, token t+1) at RoPE position t, causal over rows 0..t (``MTPHead.forward``
    with its causal mask), CE of the frozen shared ``lm_head`` on it against token t+2, over the
    continuation rows only (prompt rows are context, as in the head's cache at inference);
 4. training: an fp32 copy of the head (AdamW, grad clip 1); the embedding and ``lm_head`` are
    used through detached fp32 copies, so the backbone's tensors are never touched by autograd or
    the optimiser (the backbone is never written);
 5. evaluation: the head cast back to the model's dtype, chained drafts at fixed depth d against
    the greedy stream, ``training.acceptance.acceptance_runs`` (what spec's head cache sees);
    mean accepted length = tokens per verification round = 1 + accepted drafts per round;
 6. save: ``mtp.safetensors`` (``mtp.*``), ``draft_shortlist.json`` (``decoders.shortlist.from_streams``
    over the train+dev generations, not re-generated), ``report.json``. A head that is not better
    than the starting one on held-out mean accepted length is not saved unless ``force_save``.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import DynamicCache

from core.clirun import Pace
from core.errors import UserError
from core.paths import plain_permissions
from core.prompts import Prompt
from decoders import shortlist as draft_shortlist
from decoders.drafter import HEAD_FILE, SHORTLIST_FILE  # one name for each file, shared with spec
from decoders.fast_serial import FastSerialDecoder
from training.acceptance import acceptance_runs, summarize_acceptance
from training.log import progress, progress_write

REPORT_FILE = "report.json"


def log(msg: str) -> None:
    progress_write(msg, sys.stderr)


# --------------------------------------------------------------------------- splits


def split_prompts(prompts: list, heldout_frac: float = 0.2, dev_frac: float = 0.1,
                  max_heldout: int | None = None, max_dev: int | None = None) -> dict:
    """{'train', 'dev', 'heldout'}: disjoint lists of prompts, by sha256 of the prompt id (stable
    across runs and orders of the file). Needs at least 3 prompts. ``max_heldout`` / ``max_dev``
    cap those splits (their streams are generated exactly, one prompt at a time: the costly part
    of a large set); the prompts they leave go to train."""
    n = len(prompts)
    if n < 3:
        raise UserError(f"need at least 3 prompts (train, dev and held-out splits), got {n}")
    order = sorted(prompts, key=lambda p: hashlib.sha256(p.id.encode()).hexdigest())
    n_held = max(1, round(heldout_frac * n))
    n_dev = max(1, round(dev_frac * n))
    if max_heldout is not None:
        n_held = min(n_held, max(1, max_heldout))
    if max_dev is not None:
        n_dev = min(n_dev, max(1, max_dev))
    n_held = min(n_held, n - 2)
    n_dev = min(n_dev, n - n_held - 1)
    return {"heldout": order[:n_held], "dev": order[n_held:n_held + n_dev], "train": order[n_held + n_dev:]}


# --------------------------------------------------------------------------- generation


def _cost(prompts: int, tokens: int, seconds: float, max_new_tokens: int, decoder: str) -> dict:
    return {"prompts": prompts, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "max_new_tokens": max_new_tokens, "decoder": decoder}


def generate(model, prompts: list, max_new_tokens: int, label: str = "", dec=None) -> tuple[list[list[int]], dict]:
    """Greedy continuations with FastSerialDecoder (exact: the stream spec verifies against), one
    prompt at a time, and their cost. ``dec``: a prepared FastSerialDecoder to reuse."""
    if dec is None:
        dec = FastSerialDecoder()
        dec.prepare(model)
    streams, tokens = [], 0
    t0, pace = time.perf_counter(), Pace(len(prompts))
    with progress(len(prompts), f"generate {label.strip() or 'prompts'}", "prompt") as bar:
        for i, p in enumerate(prompts):
            streams.append(list(dec.decode(p.token_ids, max_new_tokens).tokens))
            tokens += len(streams[-1])
            bar.update(1)
            log(f"generated {label}{i + 1}/{len(prompts)} ({tokens} tokens, {time.perf_counter() - t0:.1f} s)"
                f"{pace(i + 1)}")
    seconds = time.perf_counter() - t0
    return streams, _cost(len(prompts), tokens, seconds, max_new_tokens, FastSerialDecoder.name)


def equal_length_batches(prompts: list, batch: int) -> list[list]:
    """Prompts sorted by (token length, id) and cut into groups of ``batch``; every prompt of a group
    is left-truncated to the group's shortest (its last tokens kept), so a group needs no padding.
    Returns the groups of (possibly shortened) ``Prompt`` copies; ids are kept."""
    order = sorted(prompts, key=lambda p: (len(p.token_ids), p.id))
    groups = []
    for i in range(0, len(order), batch):
        group = order[i:i + batch]
        m = len(group[0].token_ids)
        groups.append([p if len(p.token_ids) == m else Prompt(p.id, p.token_ids[-m:]) for p in group])
    return groups


@torch.inference_mode()
def generate_batched(model, prompts: list, max_new_tokens: int, batch: int = 32, label: str = "",
                     dtype: torch.dtype | None = None) -> tuple[list, list[list[int]], dict]:
    """Greedy continuations for TRAINING data only, ``batch`` sequences per forward.

    Plain HF forwards over a ``DynamicCache`` (prefill of the whole group, then one token per row
    per forward, ``argmax``), no padding and no attention mask: the prompts are grouped by
    ``equal_length_batches``, so every train prompt of a group is LEFT-TRUNCATED to the group's
    shortest prompt and its continuation is the continuation of that shortened prompt. The shortened
    prompts are returned (and must be used as the examples' context); the report records the
    lengths. A row that emits an EOS keeps its tokens up to and including the EOS and leaves the
    batch (its rows are dropped from the cache); the others go on.

    NOT EXACT: a batched forward reduces in another order than the serial one, so at near-ties of
    the logits (bf16 especially) a batched greedy stream may differ from the serial greedy stream
    of the same prompt. That is acceptable for the head's training data (any fluent continuation
    of the backbone teaches it); it is never used for the dev or held-out splits, whose streams
    must be the exact greedy stream spec verifies against (``generate``).

    ``dtype`` (e.g. ``torch.float32``): generate with a copy of the backbone in that dtype instead
    of the backbone itself (on a CPU, bf16 matmuls and the bf16 depthwise conv are several times
    slower than fp32); its greedy stream then differs from the bf16 backbone's wherever bf16
    rounding moves the argmax, not only at batching near-ties. The backbone is never modified.

    Returns (shortened prompts, streams, cost), both lists in the order of ``prompts``."""
    lm, dev = model.backbone, model.device
    if dtype is not None and dtype != lm.dtype:
        lm = copy.deepcopy(lm).to(dtype)
    eos = set(model.eos_token_ids)
    by_id, n_done, tokens = {}, 0, 0
    groups = equal_length_batches(prompts, batch)
    t0, pace = time.perf_counter(), Pace(len(prompts))
    with progress(len(prompts), f"generate {label.strip() or 'prompts'} (batched)", "prompt") as bar:
        for group in groups:
            toks = _generate_group(lm, group, dev, eos, max_new_tokens)
            for p, s in zip(group, toks):
                by_id[p.id] = (p, s)
                tokens += len(s)
            n_done += len(group)
            bar.update(len(group))
            log(f"generated {label}{n_done}/{len(prompts)} ({tokens} tokens, {time.perf_counter() - t0:.1f} s)"
                f"{pace(n_done)}")
    seconds = time.perf_counter() - t0
    used = [by_id[p.id][0] for p in prompts]
    streams = [by_id[p.id][1] for p in prompts]
    cost = _cost(len(prompts), tokens, seconds, max_new_tokens, "hf-batched")
    orig = [len(p.token_ids) for p in prompts]
    kept = [len(p.token_ids) for p in used]
    cost.update({
        "batch": batch, "batches": len(groups), "exact": False, "dtype": str(lm.dtype).removeprefix("torch."),
        "note": "plain HF forwards over a DynamicCache, batch rows of equal length: each batch's prompts "
                "left-truncated to its shortest; batched greedy may differ from serial greedy at near-ties "
                "(training data only; dev and held-out are generated exactly)",
        "prompt_tokens": {"original": sum(orig), "used": sum(kept),
                          "truncated_prompts": sum(a != b for a, b in zip(orig, kept)),
                          "max_cut": max(a - b for a, b in zip(orig, kept)) if orig else 0},
        "truncated": {p.id: [a, b] for p, a, b in zip(prompts, orig, kept) if a != b},
    })
    return used, streams, cost


def _generate_group(lm, group: list, dev, eos: set, max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of one group of equal-length prompts (``generate_batched``)."""
    cache = DynamicCache(config=lm.config)
    ids = torch.tensor([p.token_ids for p in group], device=dev)
    out = lm(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    alive = list(range(len(group)))  # the group's rows still in the batch, in cache order
    toks: list[list[int]] = [[] for _ in group]
    while True:
        nxt = out.logits[:, -1].argmax(-1)
        keep = []
        for r, (g, t) in enumerate(zip(alive, nxt.tolist())):
            toks[g].append(t)
            if t not in eos and len(toks[g]) < max_new_tokens:
                keep.append(r)
        if not keep:
            return toks
        if len(keep) < len(alive):
            sel = torch.tensor(keep, device=dev)
            cache.reorder_cache(sel)  # every layer: attention K/V, conv and recurrent states
            nxt = nxt.index_select(0, sel)
            alive = [alive[r] for r in keep]
        out = lm(input_ids=nxt.view(-1, 1), past_key_values=cache, use_cache=True, logits_to_keep=1)


def generate_splits(model, splits: dict, max_new_tokens: int, gen_batch: int = 32,
                    gen_dtype: torch.dtype | None = None) -> tuple[dict, dict, dict]:
    """Continuations of every split: train batched (``generate_batched``) when ``gen_batch`` > 1,
    dev and held-out always by the exact ``generate``. Returns (splits with the train prompts as
    actually used, streams per split, cost: totals plus one entry per split)."""
    used, streams, cost = dict(splits), {}, {}
    dec = FastSerialDecoder()
    dec.prepare(model)
    for k in ("heldout", "dev", "train"):
        if k == "train" and gen_batch > 1:
            used[k], streams[k], cost[k] = generate_batched(model, splits[k], max_new_tokens, gen_batch, "train ",
                                                            gen_dtype)
        else:
            streams[k], cost[k] = generate(model, splits[k], max_new_tokens, k + " ", dec)
    total = _cost(sum(c["prompts"] for c in cost.values()), sum(c["tokens"] for c in cost.values()),
                  sum(c["seconds"] for c in cost.values()), max_new_tokens,
                  "hf-batched (train) + fast-serial (dev, heldout)" if gen_batch > 1 else "fast-serial")
    total.update(cost)
    return used, streams, total


def build_shortlist(model, prompts: list, streams: list, max_new_tokens: int, size: int) -> dict:
    """The shortlist from the generations already made (decoders.shortlist counts them)."""
    return draft_shortlist.from_streams(model, streams, max_new_tokens, min(size, model.vocab_size))


# --------------------------------------------------------------------------- data and loss


@torch.no_grad()
def hidden_states(model, prompts: list, streams: list) -> list[dict]:
    """One example per prompt: ids [1,L], the backbone's post-norm hidden [1,L,H] in fp32 and the
    prompt length. The backbone runs without grad and is only read."""
    lm, dev = model.backbone, model.device
    out = []
    for p, s in zip(prompts, streams):
        ids = torch.tensor([p.token_ids + s], device=dev)
        if ids.shape[1] < 3:
            continue
        h = lm.model(input_ids=ids, use_cache=False).last_hidden_state.float()
        out.append({"ids": ids, "hidden": h, "P": len(p.token_ids)})
    return out


class FrozenShared:
    """fp32 copies of the backbone's embedding and lm_head (detached: the backbone is never part of
    the autograd graph) and a stand-in ``backbone`` for ``MTPHead.forward``."""

    def __init__(self, model):
        inner = model.backbone.model
        self.embed_w = inner.embed_tokens.weight.detach().float()
        self.lm_w = model.backbone.lm_head.weight.detach().float()
        embed = lambda ids: F.embedding(ids, self.embed_w)  # noqa: E731
        self.backbone = SimpleNamespace(model=SimpleNamespace(embed_tokens=embed, rotary_emb=inner.rotary_emb))

    def logits(self, out):
        return F.linear(out, self.lm_w)


def example_loss(head, shared: FrozenShared, ex: dict) -> tuple[torch.Tensor, int]:
    """Sum of CE over the continuation rows (row t predicts token t+2, t >= P-1) and their count."""
    ids, h, P = ex["ids"], ex["hidden"], ex["P"]
    T = ids.shape[1]
    out = head(h[:, : T - 2], ids[:, 1: T - 1], torch.arange(T - 2, device=ids.device), shared.backbone)
    first = max(P - 1, 0)
    logits = shared.logits(out[:, first:])
    target = ids[:, first + 2:]
    n = target.numel()
    if n == 0:
        return logits.sum() * 0.0, 0
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), reduction="sum"), n


@torch.no_grad()
def mean_loss(head, shared, examples: list[dict]) -> float | None:
    tot, n = 0.0, 0
    for ex in examples:
        loss, k = example_loss(head, shared, ex)
        tot += float(loss)
        n += k
    return tot / n if n else None


# --------------------------------------------------------------------------- evaluation


def evaluate(backbone, head, prompts: list, streams: list, depth: int) -> dict:
    """Acceptance per depth and mean accepted length at fixed depth ``depth`` on these prompts:
    chained drafts of ``head`` (in the backbone's dtype, on its device) against the greedy streams."""
    rows, lens = [], []
    for p, s in zip(prompts, streams):
        if len(s) < 2:
            continue  # no token t+2 after the prompt's last row
        A, L = acceptance_runs(backbone, head, [p.token_ids], [s], depth)
        rows.append(A[0])
        # summarize with a common P = 1: token t+k+1 exists iff j + k < len(stream)
        lens.append(int(L[0]) - len(p.token_ids) + 1)
    if not rows:
        return {"positions": 0, "per_depth": [], "mean_accepted_length": None, "depth": depth}
    width = max(r.numel() for r in rows)
    A = torch.full((len(rows), width), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        A[i, : r.numel()] = r
    s = summarize_acceptance(A, torch.tensor(lens), 1, depth)
    s["mean_accepted_length"] = s["tokens_per_round_at_fixed_depth"][str(depth)]
    s["depth"] = depth
    return s


def _mal(ev: dict) -> float:
    v = ev.get("mean_accepted_length")
    return -math.inf if v is None else v


# --------------------------------------------------------------------------- training


@contextlib.contextmanager
def _training_determinism(device):
    """Backward ops may lack deterministic CUDA kernels: warn-only while training (as the
    ``training`` package does), the pinned configuration again afterwards."""
    prev = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if prev[0] and torch.device(device).type == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])


def head_state(head, dtype) -> dict:
    return {k: v.detach().to(dtype).clone() for k, v in head.state_dict().items()}


@dataclass(frozen=True)
class HeadTrainConfig:
    """Every setting of ``train_head`` (``heads train``'s options), checked on construction."""

    max_new_tokens: int = 128               # greedy tokens generated per prompt (-n)
    steps: int = 200                        # optimizer steps at most (early stopping may end sooner)
    lr: float = 3e-4                        # AdamW learning rate of the fp32 head copy
    eval_every: int = 50                    # steps between evaluations (dev loss, held-out acceptance)
    depth: int = 4                          # draft depth of the acceptance measurement
    batch: int = 4                          # train sequences per step
    patience: int = 3                       # evaluations without dev-loss improvement before stopping
    seed: int = 0                           # torch's seed and the batch sampler's
    shortlist_size: int = 32768             # draft shortlist ids (capped at the vocabulary)
    gen_batch: int = 32                     # train-split generation rows per batch; 1: exact, one at a time
    gen_dtype: torch.dtype | None = None    # dtype of the batched train generation; None: the model's
    max_heldout: int | None = None          # cap on held-out prompts (None: 20 % of the set)
    max_dev: int | None = None              # cap on dev prompts (None: 10 % of the set)

    def __post_init__(self):
        if (self.steps < 1 or self.eval_every < 1 or self.depth < 1 or self.batch < 1 or self.gen_batch < 1
                or self.max_new_tokens < 2):
            raise UserError("--steps, --eval-every, --depth, --batch and --gen-batch must be >= 1, and -n >= 2")
        if (self.max_heldout is not None and self.max_heldout < 1) or (self.max_dev is not None and self.max_dev < 1):
            raise UserError("--max-heldout and --max-dev must be >= 1")


def train_head(model, prompts: list, cfg: HeadTrainConfig) -> dict:
    """The whole pipeline short of saving. Returns a dict with 'report' (JSON-able), 'state' (the
    selected head's state dict in the model's dtype, or None if no trained checkpoint was
    evaluated), 'improved' and 'shortlist'. ``cfg.gen_batch`` > 1 generates the train split batched
    (``generate_batched``: shortened prompts, not exact; ``cfg.gen_dtype`` a dtype for it other than
    the model's); dev and held-out are always exact. ``cfg.max_heldout`` / ``cfg.max_dev`` cap those
    splits."""
    if model.mtp is None:
        raise UserError(f"model {model.name} has no MTP head to train: {model.mtp_missing}")
    if not prompts:
        raise UserError("the prompt set is empty")
    dtype = model.backbone.lm_head.weight.dtype
    splits = split_prompts(prompts, max_heldout=cfg.max_heldout, max_dev=cfg.max_dev)
    log("splits: " + ", ".join(f"{k} {len(v)}" for k, v in splits.items()))

    splits, S, gen_cost = generate_splits(model, splits, cfg.max_new_tokens, cfg.gen_batch, cfg.gen_dtype)
    for k in ("train", "dev", "heldout"):
        g = gen_cost[k]
        log(f"generation {k}: {g['tokens']} tokens in {g['seconds']:.1f} s ({g['decoder']}, "
            f"{g['tokens_per_s'] or 0:.1f} tokens/s)")

    log("building the draft shortlist (train + dev generations)")
    sl_prompts = splits["train"] + splits["dev"]
    shortlist = build_shortlist(model, sl_prompts, S["train"] + S["dev"], cfg.max_new_tokens, cfg.shortlist_size)

    log("backbone hidden states (no grad)")
    t0 = time.perf_counter()
    data = {k: hidden_states(model, splits[k], S[k]) for k in ("train", "dev")}
    hidden_s = time.perf_counter() - t0
    if not data["train"]:
        raise UserError("no training rows: every train generation is shorter than 2 tokens")

    shared = FrozenShared(model)
    head = copy.deepcopy(model.mtp).float().train()
    eval_head = copy.deepcopy(model.mtp).eval()
    torch.manual_seed(cfg.seed)

    def held(step: int) -> dict:
        eval_head.load_state_dict(head_state(head, dtype))
        ev = evaluate(model.backbone, eval_head, splits["heldout"], S["heldout"], cfg.depth)
        head.eval()
        dl = mean_loss(head, shared, data["dev"])
        head.train()
        return {"step": step, "dev_loss": dl, "heldout": ev}

    before = held(0)
    log(f"step 0: held-out mean accepted length {before['heldout']['mean_accepted_length']}, "
        f"dev loss {before['dev_loss']}")
    with _training_determinism(model.device):
        run = fit(head, shared, data["train"], held, before, cfg, dtype)
    improved = run.best is not None and _mal(run.best["heldout"]) > _mal(before["heldout"])
    report = {
        "model": model.identity,
        "depth": cfg.depth,
        "splits": {k: [p.id for p in v] for k, v in splits.items()},
        "split_rule": {"by": "sha256 of the prompt id", "heldout_frac": 0.2, "dev_frac": 0.1,
                       "max_heldout": cfg.max_heldout, "max_dev": cfg.max_dev},
        "generation": gen_cost,
        "hidden_states_seconds": hidden_s,
        "training": {"steps_requested": cfg.steps, "steps_run": run.steps, "lr": cfg.lr, "batch": cfg.batch,
                     "eval_every": cfg.eval_every, "patience": cfg.patience, "seed": cfg.seed,
                     "stopped_early": run.stopped_early, "seconds": run.seconds,
                     "train_rows": sum(max(ex["ids"].shape[1] - max(ex["P"] - 1, 0) - 2, 0) for ex in data["train"]),
                     "early_stopping": "dev loss (head CE on dev streams), patience in evaluations",
                     "selection": "max held-out mean accepted length at fixed depth"},
        "before": before,
        "after": run.best,
        "selected_step": run.best["step"] if run.best else None,
        "improved": improved,
        "history": run.history,
        "shortlist": {k: v for k, v in shortlist.items() if k != "ids"},
    }
    return {"report": report, "state": run.best_state, "improved": improved, "shortlist": shortlist}


@dataclass
class Fit:
    """What ``fit`` did: every evaluation (``before`` first), the best one by held-out mean
    accepted length and its head's state in the model's dtype (None: no step evaluated), the steps
    run, whether dev loss stopped it early, and its seconds."""
    history: list[dict]
    best: dict | None = None
    best_state: dict | None = None
    steps: int = 0
    stopped_early: bool = False
    seconds: float = 0.0


def fit(head, shared: FrozenShared, train: list[dict], held, before: dict, cfg: HeadTrainConfig, dtype) -> Fit:
    """``cfg.steps`` AdamW steps on batches drawn (seeded) from ``train``, with ``held(step)``'s
    evaluation every ``cfg.eval_every`` steps and at the last; stops once dev loss has not improved
    for ``cfg.patience`` evaluations."""
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    run = Fit(history=[before])
    best_dev, bad_evals, train_losses = before["dev_loss"], 0, []
    t0, pace = time.perf_counter(), Pace(cfg.steps)  # an early stop comes sooner than the time left says
    with progress(cfg.steps, "train head", "step") as bar:
        for step in range(1, cfg.steps + 1):
            bar.update(1)
            run.steps = step
            train_losses.append(train_step(head, shared, train, opt, gen, cfg.batch))
            if step % cfg.eval_every != 0 and step != cfg.steps:
                continue
            rec = held(step)
            rec["train_loss"] = sum(train_losses[-cfg.eval_every:]) / len(train_losses[-cfg.eval_every:])
            run.history.append(rec)
            log(f"step {step}: train loss {rec['train_loss']:.4f}, dev loss {rec['dev_loss']}, "
                f"held-out mean accepted length {rec['heldout']['mean_accepted_length']}{pace(step)}")
            if run.best is None or _mal(rec["heldout"]) > _mal(run.best["heldout"]):
                run.best, run.best_state = rec, head_state(head, dtype)
            if rec["dev_loss"] is None:
                continue  # no dev rows (every dev stream ended at once): no early stopping
            if best_dev is None or rec["dev_loss"] < best_dev:
                best_dev, bad_evals = rec["dev_loss"], 0
                continue
            bad_evals += 1
            if bad_evals >= cfg.patience:
                run.stopped_early = True
                log(f"early stop at step {step}: dev loss did not improve for {cfg.patience} evaluations")
                break
    run.seconds = time.perf_counter() - t0
    return run


def train_step(head, shared: FrozenShared, train: list[dict], opt, gen: torch.Generator, batch: int) -> float:
    """One optimiser step on ``batch`` examples drawn from ``train``; its mean loss per row (0.0
    where the batch has no rows, and no step is taken)."""
    idx = torch.randint(len(train), (batch,), generator=gen).tolist()
    opt.zero_grad(set_to_none=True)
    losses = [example_loss(head, shared, train[i]) for i in idx]
    n = sum(k for _, k in losses)
    if not n:
        return 0.0
    loss = sum(l for l, _ in losses) / n
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    opt.step()
    return loss.item()


def save_head(out: Path, state: dict, shortlist: dict, report: dict) -> None:
    """Write the head directory. All three files are written under temporary names first, then
    renamed into place, the head file last: a head file exists only when the whole save did, and
    an interruption leaves no temporary file behind."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {"mtp." + k: v.detach().cpu().contiguous() for k, v in state.items()}
    meta = {"format": "pt", "selected_step": str(report.get("selected_step"))}
    writers = {HEAD_FILE: lambda path: save_file(tensors, str(path), metadata=meta),
               SHORTLIST_FILE: lambda path: path.write_text(_json_text(shortlist)),
               REPORT_FILE: lambda path: path.write_text(_json_text(report))}
    staged = []  # (temporary, final) paths
    try:
        for name, write in writers.items():
            staged.append((out / f".{name}.tmp", out / name))
            write(staged[-1][0])
            plain_permissions(staged[-1][0])  # safetensors writes its file private to its owner
        for tmp, final in reversed(staged):  # the head file last
            tmp.replace(final)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)


def _json_text(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n"


def summary_lines(report: dict) -> list[str]:
    lines = []
    for name in ("before", "after"):
        rec = report.get(name)
        if not rec:
            lines.append(f"{name}: (no trained checkpoint evaluated)")
            continue
        ev = rec["heldout"]
        per = " ".join(f"d{d['depth']}={d['conditional']:.3f}" for d in ev["per_depth"])
        lines.append(f"{name} (step {rec['step']}): mean accepted length {ev['mean_accepted_length']} "
                     f"at depth {ev['depth']}; acceptance per depth {per}")
    return lines
