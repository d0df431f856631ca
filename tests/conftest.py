"""Shared fixtures: the built-in tiny model is loaded once per test session."""
import pytest

from harness import determinism

determinism.pin()  # every test runs in the configuration the harness and audit use


@pytest.fixture(scope="session")
def tiny():
    import transformers

    transformers.logging.set_verbosity_error()
    from harness.models import load_model

    return load_model("tiny", "cpu")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny):
    return tiny.tokenizer.get()
