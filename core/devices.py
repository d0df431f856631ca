"""``--device`` validated up front, before any model loads: a bad name is one clear line, not a
failure deep inside a loader."""
from __future__ import annotations

import re

from core.errors import UserError

_CUDA = re.compile(r"cuda(?::(\d+))?")


def check_device(spec: str | None) -> str:
    """The device string to use for ``spec``: None means ``cuda`` when a CUDA GPU is present, else
    ``cpu``. Accepts ``cpu``, ``cuda`` and ``cuda:N`` (only when that GPU exists); anything else
    raises ``UserError`` naming the choices this machine offers."""
    import torch  # only when a command runs, so that --help stays fast

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec is None:
        return "cuda" if n_gpus else "cpu"
    spec = spec.strip()
    if spec == "cpu":
        return spec
    m = _CUDA.fullmatch(spec)
    if m and n_gpus and (m.group(1) is None or int(m.group(1)) < n_gpus):
        return spec
    raise UserError(f"--device {spec!r} is not available on this machine; choose {choices(n_gpus)}")


def choices(n_gpus: int) -> str:
    """The devices ``check_device`` accepts, in words."""
    if n_gpus == 0:
        return "cpu (no CUDA GPU here)"
    gpus = "cuda:0" if n_gpus == 1 else f"cuda:0 .. cuda:{n_gpus - 1}"
    return f"cpu, cuda or {gpus}"
