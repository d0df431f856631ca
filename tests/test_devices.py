"""core.devices.check_device: the one up-front check of every --device option."""
from __future__ import annotations

import pytest
import torch

from core.devices import check_device
from core.errors import UserError


def _gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_cpu_only_machine(monkeypatch):
    _gpus(monkeypatch, 0)
    assert check_device(None) == "cpu"
    assert check_device("cpu") == "cpu"
    for bad in ("cuda", "cuda:0", "gpu", "mps", "", "CPU", "cpu:0", "cuda:x"):
        with pytest.raises(UserError) as exc:
            check_device(bad)
        msg = str(exc.value)
        assert repr(bad) in msg and "cpu" in msg and "no CUDA GPU" in msg and "\n" not in msg


def test_two_gpu_machine(monkeypatch):
    _gpus(monkeypatch, 2)
    assert check_device(None) == "cuda"
    for good in ("cpu", "cuda", "cuda:0", "cuda:1"):
        assert check_device(good) == good
    for bad in ("cuda:2", "gpu", "mps", "cuda:-1", "cuda0"):
        with pytest.raises(UserError) as exc:
            check_device(bad)
        assert "cuda:0 .. cuda:1" in str(exc.value)


def test_one_gpu_names_cuda0(monkeypatch):
    _gpus(monkeypatch, 1)
    with pytest.raises(UserError, match=r"choose cpu, cuda or cuda:0$"):
        check_device("cuda:1")
