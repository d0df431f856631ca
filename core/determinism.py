"""The one pinned deterministic configuration that control, candidate and audit all run in.

With default settings the same serial decode on an H200 gives different logits from run to run
(q_len=1 attention goes to cuDNN); with ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` set before CUDA starts
and ``torch.use_deterministic_algorithms(True)`` it is bit-reproducible. cuDNN attention and TF32
are also switched off explicitly, so the configuration does not depend on defaults.
``pin()`` must run before anything touches CUDA; ``current()`` reads back what is in force.
"""
from __future__ import annotations

import os

import torch

PINNED = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "deterministic_algorithms": True,
    "cudnn_sdp_enabled": False,
    "matmul_allow_tf32": False,
    "cudnn_allow_tf32": False,
    "cudnn_deterministic": True,
    "cudnn_benchmark": False,
    # deterministic mode fills every torch.empty with NaN by default: extra kernels, no effect on
    # the arithmetic of correct code, so it is switched off for control and candidate alike
    "fill_uninitialized_memory": False,
}


class DeterminismError(RuntimeError):
    pass


def pin() -> dict:
    """Put this process in the pinned configuration and return it as recorded."""
    want = PINNED["CUBLAS_WORKSPACE_CONFIG"]
    have = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if have != want:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            raise DeterminismError(
                "CUDA started before CUBLAS_WORKSPACE_CONFIG was set; pin() must run first")
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = want
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.utils.deterministic.fill_uninitialized_memory = False
    return current()


def current() -> dict:
    return {
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled(),
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
        # recorded, not pinned: it changes GEMM bits, so a run records what it ran with
        "bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
    }


def differences(recorded: dict, actual: dict | None = None) -> list[str]:
    """Settings whose recorded value differs from the one in force (or the pinned one)."""
    actual = actual if actual is not None else current()
    out = []
    for key in actual:
        if recorded.get(key) != actual.get(key):
            out.append(f"{key}: recorded {recorded.get(key)!r}, now {actual.get(key)!r}")
    return out
