"""Small plug-in decoders for the registry and harness tests (``--decoder plugin_decoders:ATTR``).

pytest puts tests/ on sys.path (rootdir conftest, no __init__.py), so these import as
``plugin_decoders`` in-process; a subprocess needs ``PYTHONPATH=tests``.
"""
from __future__ import annotations

import time

from decoders.base import DecodeResult, DecodeStats
from decoders.serial import SerialDecoder


class WrappedSerial:
    """A plug-in that delegates to serial decoding (so it is exact), with its own name and config."""

    name = "wrapped-serial"

    def __init__(self, tag: str = "class"):
        self.tag = tag
        self.inner = SerialDecoder()

    def prepare(self, model) -> None:
        self.inner.prepare(model)

    def config(self) -> dict:
        return {"tag": self.tag}

    def decode(self, prompt_ids, max_new_tokens) -> DecodeResult:
        return self.inner.decode(prompt_ids, max_new_tokens)


def make_wrapped_serial():
    """A zero-argument factory function."""
    return WrappedSerial(tag="factory")


# an already-built decoder object (not callable): used as it is
INSTANCE = WrappedSerial(tag="instance")


class Failing(WrappedSerial):
    """Raises on the ``fail_on``-th call of decode (warm-ups included): a decoder bug mid-run.
    With the default warm-up and --legs 2 the candidate decodes 3 times per prompt, so call 5 is
    the second prompt's first timed leg: the first prompt's records are already written."""

    name = "failing"
    fail_on = 5
    error: type[BaseException] = RuntimeError
    watch = None  # a directory whose listing is recorded in ``seen`` when the failure happens
    seen = None

    def __init__(self):
        super().__init__(tag="failing")
        self.calls = 0

    def decode(self, prompt_ids, max_new_tokens) -> DecodeResult:
        self.calls += 1
        if self.calls >= self.fail_on:
            if self.watch is not None:
                type(self).seen = sorted(p.name for p in self.watch.iterdir())
            raise self.error(f"{self.name}: deliberate failure on decode call {self.calls}")
        return super().decode(prompt_ids, max_new_tokens)


class Interrupted(Failing):
    """As if the user pressed Ctrl-C in the middle of a run."""

    name = "interrupted"
    error = KeyboardInterrupt


class Validates(WrappedSerial):
    """Checks its argument's value in the constructor, as registered decoders do."""

    name = "validates"

    def __init__(self, width: int = 4, tag: str = "validates"):
        if width < 1:
            raise ValueError("width must be at least 1")
        super().__init__(tag=tag)
        self.width = width


class Sleeps(WrappedSerial):
    """Sleeps in every decode (the warm-up included): a run that is still going when it is stopped."""

    name = "sleeps"

    def decode(self, prompt_ids, max_new_tokens) -> DecodeResult:
        time.sleep(600)
        return super().decode(prompt_ids, max_new_tokens)


class LacksDecode:
    """Has a name, prepare and config, but no decode: not a decoder."""

    name = "lacks-decode"

    def prepare(self, model) -> None:
        pass

    def config(self) -> dict:
        return {}


class LacksName:
    def prepare(self, model) -> None:
        pass

    def decode(self, prompt_ids, max_new_tokens) -> DecodeResult:
        return DecodeResult([], DecodeStats())

    def config(self) -> dict:
        return {}


NOT_A_DECODER = 42


def make_nothing():
    return None


class Unreserved:
    """``fast-serial`` sized for 16 positions and without ``reserve``: every longer decode builds a
    larger runtime inside its own time, which the harness must flag."""

    name = "unreserved"

    def __init__(self):
        from decoders.fast_serial import FastSerialDecoder

        self.inner = FastSerialDecoder(capacity=16)

    def prepare(self, model) -> None:
        self.inner.prepare(model)

    def config(self) -> dict:
        return {}

    def decode(self, prompt_ids, max_new_tokens) -> DecodeResult:
        return self.inner.decode(prompt_ids, max_new_tokens)
