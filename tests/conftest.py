"""Shared fixtures: the built-in tiny model is loaded once per test session."""
import pytest
import torch

from core import determinism

determinism.pin()  # every test runs in the configuration the harness and audit use
# The tiny model's ops are far too small to gain from threads; on CI's 2 cores a second thread
# only adds contention. Control and candidate share the setting, so exactness is unaffected.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny():
    import transformers

    transformers.logging.set_verbosity_error()
    from core.models import load_model

    return load_model("tiny", "cpu")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny):
    return tiny.tokenizer.get()
