"""``heads train`` as one function of one frozen request: checks, model and prompts, training,
summary, save. Exit codes: 0 head saved; 1 not saved (not better, or nothing evaluated); 2 bad
input (including an --out that cannot be written, found before training, or a write that failed
at the end); 130 interrupted (Ctrl-C), with a line that says what was written."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from core.errors import EXIT_INTERRUPTED, UserError
from core.paths import try_new_file

EXIT_SAVED, EXIT_NOT_SAVED, EXIT_BAD_INPUT = 0, 1, 2


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


def check_out(out: Path, model_dir: Path | str | None, names: tuple[str, ...]) -> None:
    """Refuse an --out that is the model's own checkpoint directory ``model_dir`` (None: the model
    has none, as synthetic-9b), is a file, already holds any of the head directory's files
    ``names`` (they are never overwritten), or cannot be written (``probe_writable``: a real
    file is made and removed, and whatever directories that needed are removed again)."""
    if model_dir is not None and _same_dir(out, Path(model_dir)):
        raise UserError(f"--out {str(out)!r} is the model's checkpoint directory; pick another directory "
                        "(the backbone's files are never touched)")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {str(out)!r} exists and is not a directory")
    held = [n for n in names if (out / n).exists()]
    if held:
        raise UserError(f"--out {str(out)!r} already holds {', '.join(held)}; pick another directory")
    probe_writable(out)


def model_dir_of(model: str) -> Path | None:
    """The checkpoint directory ``--model`` loads from, as ``core.models.load_model`` picks it: a
    built-in name's committed directory (``COMMITTED``; None for a built-in with no directory,
    synthetic-9b), else the path given."""
    from core.catalog import BUILTIN_MODELS
    from core.models import COMMITTED

    if model in COMMITTED:
        return Path(COMMITTED[model])
    if model in BUILTIN_MODELS:
        return None
    return Path(model)


def _same_dir(a: Path, b: Path) -> bool:
    if not b.is_dir():
        return False
    try:
        if a.resolve() == b.resolve():
            return True
        return a.is_dir() and os.path.samefile(a, b)
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop
        return False


def probe_writable(out: Path) -> None:
    """Refused unless a file can really be created in ``out`` (os.access is not asked: as root it
    says yes to read-only and virtual file systems). Directories missing on the way are made for
    the probe and removed again, so the run leaves nothing behind until the head is saved."""
    created: list[Path] = []
    try:
        created = make_dirs(out)
        try_new_file(out, "heads-train")
    except OSError as exc:
        raise UserError(f"--out {str(out)!r} is not writable: {exc.strerror or exc}") from None
    finally:
        remove_dirs(created)


def make_dirs(out: Path) -> list[Path]:
    """Make ``out`` and the missing directories above it; returns those made, outermost first.
    On failure the ones made are removed again and the OSError raised."""
    missing = []
    p = out
    while not (p.exists() or p.is_symlink()) and p != p.parent:
        missing.append(p)
        p = p.parent
    if not p.is_dir():
        raise NotADirectoryError(20, f"{p} is not a directory")
    created: list[Path] = []
    try:
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:  # a "name/.." on the way, or made meanwhile
                if d.is_dir():
                    continue
                raise
            created.append(d)
    except OSError:
        remove_dirs(created)
        raise
    return created


def remove_dirs(created: list[Path]) -> None:
    """Remove the directories ``make_dirs`` made, innermost first, while they are empty: rmdir
    never removes a file, so nothing anyone else put there is lost."""
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            return


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
    check_out(req.out, model_dir_of(req.model), names)
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
    save(req.out, names, lambda: T.save_head(req.out, res["state"], res["shortlist"], report))
    print(f"wrote {req.out}: {T.HEAD_FILE}, {T.SHORTLIST_FILE}, {T.REPORT_FILE}"
          + (" (forced: not better than the starting head)" if report["forced"] else ""))
    return EXIT_SAVED


def save(out: Path, names: tuple[str, ...], write) -> None:
    """Run ``write`` (the head directory's save) into ``out``. A failed write (disk full, a
    directory gone read-only since the check) is one UserError, and leaves neither the head's
    files (``out`` held none of ``names`` before: ``check_out``) nor a directory made for them;
    Ctrl-C leaves what ``interrupted_message`` reports, and no empty directory."""
    from safetensors import SafetensorError

    try:
        created = make_dirs(out)
    except OSError as exc:
        raise UserError(f"cannot write the head to {out}: {exc.strerror or exc}; nothing was saved") from None
    try:
        write()
    except (OSError, SafetensorError) as exc:
        for n in names:
            try:
                (out / n).unlink(missing_ok=True)
            except OSError:
                pass
        remove_dirs(created)
        message = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UserError(f"cannot write the head to {out}: {' '.join(message.split())}; nothing was saved") from None
    except KeyboardInterrupt:
        remove_dirs(created)
        raise


def print_summary(report: dict, lines: list[str]) -> None:
    for line in lines:
        print(line)
    g = report["generation"]
    print(f"generation: {g['tokens']} tokens in {g['seconds']:.1f} s over {g['prompts']} prompts")
    for k in ("train", "dev", "heldout"):
        c = g[k]
        print(f"  {k}: {c['tokens']} tokens in {c['seconds']:.1f} s ({c['tokens_per_s'] or 0:.1f} tokens/s, "
              f"{c['decoder']}{'' if c.get('exact', True) else ', not exact'})")
