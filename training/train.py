"""The training loop: backbone and MTP head trained jointly from scratch.

Loss: next-token CE + ``mtp_lambda`` x the head's CE for token t+2 (``training.model.losses``).
fp32 master weights, bf16 autocast on CUDA (fp32 on CPU), AdamW (matrices decayed), linear warmup
then cosine to ``min_lr_frac``. The step count is ``steps``, or planned: ``max_epochs`` passes over
the train split, lowered after ``calib_steps`` steps to what the measured speed fits into the time
cap (still inside the warmup, so ``--steps N`` with the logged N repeats the run exactly). The time
cap also stops training outright. The best weights by dev objective are kept (``TrainResult``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from training.data import WindowSampler
from training.log import log, progress
from training.model import Preset, add_dropout, losses


@dataclass
class TrainResult:
    plan: dict              # {"rule", "steps", ...}: how the step count was set
    best_step: int
    best_dev: dict          # dev losses at best_step
    steps_done: int
    stopped_by: str         # "steps", "time" or "init-from"
    tokens_seen: int
    train_seconds: float
    curve: list = field(default_factory=list)   # one dev point per evaluation
    best_state: tuple = ()  # (backbone, head) state dicts on the CPU; emptied once exported


def lr_at(step: int, p: Preset, steps: int) -> float:
    if step < p.warmup:
        return p.lr * (step + 1) / p.warmup
    progress = min(1.0, (step - p.warmup) / max(1, steps - p.warmup))
    return p.lr * (p.min_lr_frac + (1 - p.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def param_groups(modules, weight_decay: float):
    decay, no_decay, seen = [], [], set()
    for m in modules:
        for name, p in m.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def snapshot(module) -> dict:
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def plan_steps(p: Preset, train_tokens: int) -> int:
    """The step count that makes ``max_epochs`` passes over the train split."""
    return max(1, math.ceil(p.max_epochs * train_tokens / (p.batch * p.seq_len)))


@torch.no_grad()
def evaluate_loss(backbone, head, windows: torch.Tensor, batch: int, device, amp: bool) -> dict:
    """Mean next-token and MTP losses over ``windows`` [n, T], per token, in eval mode."""
    was = backbone.training
    backbone.eval()
    head.eval()
    tot_ntp = tot_mtp = 0.0
    n_ntp = n_mtp = 0
    for i in range(0, windows.shape[0], batch):
        ids = windows[i: i + batch].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            ntp, mtp = losses(backbone, head, ids)
        B, T = ids.shape
        tot_ntp += float(ntp) * B * (T - 1)
        tot_mtp += float(mtp) * B * (T - 2)
        n_ntp += B * (T - 1)
        n_mtp += B * (T - 2)
    backbone.train(was)
    head.train(was)
    return {"ntp_loss": tot_ntp / max(n_ntp, 1), "mtp_loss": tot_mtp / max(n_mtp, 1),
            "windows": int(windows.shape[0]), "tokens": int(windows.numel())}


def train(backbone, head, train_stream, dev_windows, p: Preset, steps: int | None, device, seed: int,
          minutes: float | None) -> TrainResult:
    """``steps`` given: exactly that many steps (a pure function of the seed and the corpus, unless
    the time cap cuts it short). ``steps`` None: ``plan_steps``, lowered after ``calib_steps`` steps
    (still inside the warmup, which does not depend on the total) to what the measured speed fits
    into the time cap; the plan is logged and recorded so that ``--steps N`` repeats the run."""
    amp = device.type == "cuda"
    backbone.to(device).train()
    head.to(device).train()
    hooks = add_dropout([backbone, head], p.dropout)
    plan = {"rule": "given", "steps": steps}
    if steps is None:
        steps = plan_steps(p, train_stream.numel())
        plan = {"rule": f"{p.max_epochs} epochs", "steps": steps}
        if minutes is not None and p.calib_steps > 10:
            assert p.calib_steps < p.warmup, "the plan must be fixed while the LR is still warming up"
            plan["rule"] += " or what fits the time cap"
    params = [q for q in list(backbone.parameters()) + list(head.parameters())]
    opt = torch.optim.AdamW(param_groups([backbone, head], p.weight_decay), lr=p.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=amp)
    sampler = WindowSampler(train_stream, p.seq_len, p.batch, seed)
    budget = None if minutes is None else minutes * 60.0
    tokens_per_step = p.batch * p.seq_len
    best = {"loss": float("inf")}
    best_state, best_step, curve = (), -1, []
    acc = torch.zeros(2, device=device)
    acc_n, last_t, last_step = 0, time.perf_counter(), 0
    t0 = time.perf_counter()
    stopped_by, done = "steps", 0
    calib_t = None

    def run_eval(at_step: int) -> None:
        nonlocal best, best_state, best_step
        dev = evaluate_loss(backbone, head, dev_windows, p.batch, device, amp)
        objective = dev["ntp_loss"] + p.mtp_lambda * dev["mtp_loss"]
        point = {"step": at_step, "tokens": at_step * tokens_per_step, "seconds": round(time.perf_counter() - t0, 2),
                 "dev_ntp": round(dev["ntp_loss"], 5), "dev_mtp": round(dev["mtp_loss"], 5)}
        curve.append(point)
        mark = ""
        if objective < best["loss"]:
            best = {"loss": objective, **dev}
            best_state, best_step = (snapshot(backbone), snapshot(head)), at_step
            mark = "  (best)"
        log(f"eval step {at_step}: dev next-token {dev['ntp_loss']:.4f}  dev mtp {dev['mtp_loss']:.4f}{mark}")

    bar = progress(steps, "train", "step")
    while done < steps:
        step = done
        bar.update(1)
        if plan["rule"].endswith("time cap") and step in (10, p.calib_steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step == 10:
                calib_t = time.perf_counter()
            else:
                per_step = (time.perf_counter() - calib_t) / (p.calib_steps - 10)
                left = budget - (time.perf_counter() - t0)
                fit = step + int(left / (per_step * 1.05))  # 5 % for evaluations
                steps = max(p.calib_steps + 1, min(steps, fit))
                bar.total = steps
                bar.refresh()
                plan.update({"steps": steps, "seconds_per_step": per_step, "fits_time_cap": fit})
                log(f"plan: {per_step * 1e3:.0f} ms/step -> {steps} steps "
                    f"({steps * tokens_per_step / train_stream.numel():.1f} epochs); repeat with --steps {steps}")
        lr = lr_at(step, p, steps)
        for g in opt.param_groups:
            g["lr"] = lr
        ids = sampler.next().to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            ntp, mtp = losses(backbone, head, ids)
        loss = ntp + p.mtp_lambda * mtp
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, p.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        acc += torch.stack([ntp.detach(), mtp.detach()])
        acc_n += 1
        done = step + 1
        if done % p.log_every == 0 or done == steps:
            vals = (acc / acc_n).tolist()  # synchronises
            if not all(math.isfinite(v) for v in vals):
                raise RuntimeError(f"non-finite training loss at step {done}: {vals}")
            now = time.perf_counter()
            tps = (done - last_step) * tokens_per_step / max(now - last_t, 1e-9)
            log(f"step {done}/{steps}  ntp {vals[0]:.4f}  mtp {vals[1]:.4f}  lr {lr:.2e}  "
                f"{tps / 1e3:.1f}k tok/s  epoch {sampler.epoch}  {now - t0:.0f}s")
            acc.zero_()
            acc_n, last_t, last_step = 0, now, done
        out_of_time = budget is not None and time.perf_counter() - t0 > budget
        if done % p.eval_every == 0 or done == steps or out_of_time:
            run_eval(done)
        if out_of_time and done < steps:
            stopped_by = "time"
            log(f"time budget of {minutes} min reached after {done} of {steps} steps")
            break
    bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    for h in hooks:
        h.remove()
    return TrainResult(plan=plan, best_step=best_step, best_dev={k: v for k, v in best.items() if k != "loss"},
                       steps_done=done, stopped_by=stopped_by, tokens_seen=done * tokens_per_step,
                       train_seconds=seconds, curve=curve, best_state=best_state)
