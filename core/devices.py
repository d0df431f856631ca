"""``--device`` values, checked before any work: the devices this project runs on are the CPU and
CUDA GPUs. Anything else (``gpu``, ``mps``, ``cuda`` on a machine without one, ``cuda:7`` on a
machine with two) is one clear UserError naming the valid choices, not a traceback or a blamed
checkpoint later on."""
from __future__ import annotations

import re

import torch

from core.errors import UserError

_CUDA = re.compile(r"cuda(?::(\d+))?")


def choices() -> str:
    """The valid values on this machine, for a message."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        return "cpu (this machine has no CUDA GPU)"
    return "cpu, cuda" + (f", cuda:0..cuda:{count - 1}" if count > 1 else ", cuda:0")


def check_device(spec: str | None) -> str | None:
    """``spec`` if this machine can run on it (cpu, cuda, cuda:N); None stays None (the caller's
    default). Otherwise a UserError naming the valid choices."""
    if spec is None:
        return None
    if spec == "cpu":
        return spec
    match = _CUDA.fullmatch(spec)
    if match is None:
        raise UserError(f"--device {spec!r} is not a device this project runs on; valid: {choices()}")
    if not torch.cuda.is_available():
        raise UserError(f"--device {spec!r} requested but this machine has no CUDA GPU; valid: {choices()}")
    if match.group(1) is not None and int(match.group(1)) >= torch.cuda.device_count():
        raise UserError(f"--device {spec!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s); "
                        f"valid: {choices()}")
    return spec
