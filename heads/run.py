"""``heads train`` as one function of one frozen request: checks, model and prompts, training,
summary, save. Exit codes: 0 head saved; 1 not saved (not better, or nothing evaluated); 2 bad
input; 130 interrupted (Ctrl-C), with a line that says what was written."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from core.errors import UserError

EXIT_SAVED, EXIT_NOT_SAVED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


@dataclass(frozen=True)
class TrainRequest:
    """Everything ``heads train`` was asked: where from, where to, and the pipeline's settings
    (``heads.train.HeadTrainConfig`` fields, built once torch is loaded)."""

    model: str
    prompts: str
    out: Path
    device: str | None = None
    force_save: bool = False
    gen_dtype: str = "model"   # "model" or a torch dtype name
    settings: tuple = ()       # (name, value) pairs for HeadTrainConfig


def check_out(out: Path, model_dir: str, names: tuple[str, ...]) -> None:
    """Refuse an --out that is a file, already holds any of the head directory's files ``names``
    (they are never overwritten), is the model's own directory, or cannot be written."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {str(out)!r} exists and is not a directory")
    held = [n for n in names if (out / n).exists()]
    if held:
        raise UserError(f"--out {str(out)!r} already holds {', '.join(held)}; pick another directory")
    p = Path(model_dir)
    if p.is_dir() and out.resolve() == p.resolve():
        raise UserError("--out must not be the model's checkpoint directory (the backbone's files are never touched)")
    parent = out if out.exists() else out.parent
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise UserError(f"--out {str(out)!r} is not writable")


def run_train(req: TrainRequest) -> int:
    """The whole command; returns its exit status. Every failure is one ``error:`` line."""
    checked = []  # set once --out is known to hold none of the head's files
    try:
        return _train(req, checked)
    except UserError as exc:
        _error(str(exc))
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        _error(interrupted_message(req.out, checked[0] if checked else ()))
        return EXIT_INTERRUPTED


def interrupted_message(out: Path, names: tuple[str, ...]) -> str:
    """What a Ctrl-C left: ``names`` are the head directory's files, none of which ``out`` held
    before (the head file is renamed into place last, and whole)."""
    written = [n for n in names if (out / n).is_file()]
    if not written:
        return "interrupted; nothing was written"
    if written[0] == names[0]:
        return f"interrupted; the head was saved to {out}"
    return f"interrupted while saving; {out} holds {', '.join(written)} but no head (delete them)"


def _error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def _train(req: TrainRequest, checked: list) -> int:
    # torch and the pipeline load for a command, not for --help (start-up time), and after pin()
    from core import determinism

    determinism.pin()
    from core.devices import check_device

    device = check_device(req.device)  # before anything heavy loads
    import torch
    import transformers

    from core.models import load_model
    from core.prompts import load_prompts
    from heads import train as T

    transformers.logging.set_verbosity_error()
    cfg = T.HeadTrainConfig(**dict(req.settings),
                            gen_dtype=None if req.gen_dtype == "model" else getattr(torch, req.gen_dtype))
    names = (T.HEAD_FILE, T.SHORTLIST_FILE, T.REPORT_FILE)
    check_out(req.out, req.model, names)
    checked.append(names)
    model = load_model(req.model, device)
    if model.mtp is None:
        raise UserError(f"model {model.name} has no MTP head to train: {model.mtp_missing}")
    prompts, info = load_prompts(req.prompts, model)
    if not prompts:
        raise UserError("the prompt set is empty")
    res = T.train_head(model, prompts, cfg)
    report = res["report"]
    report["prompts"] = info
    print_summary(report, T.summary_lines(report))
    if res["state"] is None:
        _error("no trained checkpoint was evaluated (--steps 0?); nothing saved")
        return EXIT_NOT_SAVED
    if not res["improved"] and not req.force_save:
        print("not saved: the trained head is not better than the starting head on held-out mean accepted "
              "length; pass --force-save to save it anyway", file=sys.stderr)
        return EXIT_NOT_SAVED
    report["forced"] = not res["improved"]
    T.save_head(req.out, res["state"], res["shortlist"], report)
    print(f"wrote {req.out}: {T.HEAD_FILE}, {T.SHORTLIST_FILE}, {T.REPORT_FILE}"
          + (" (forced: not better than the starting head)" if report["forced"] else ""))
    return EXIT_SAVED


def print_summary(report: dict, lines: list[str]) -> None:
    for line in lines:
        print(line)
    g = report["generation"]
    print(f"generation: {g['tokens']} tokens in {g['seconds']:.1f} s over {g['prompts']} prompts")
    for k in ("train", "dev", "heldout"):
        c = g[k]
        print(f"  {k}: {c['tokens']} tokens in {c['seconds']:.1f} s ({c['tokens_per_s'] or 0:.1f} tokens/s, "
              f"{c['decoder']}{'' if c.get('exact', True) else ', not exact'})")
