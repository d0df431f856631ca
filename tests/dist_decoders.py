"""Plug-in decoders that go wrong on one prompt, for the torchrun tests (tests/test_dist.py).

Launched as ``--decoder dist_decoders:ATTR`` with ``PYTHONPATH=tests``. Each is exact serial
decoding until it meets the prompt named by ``DIST_TEST_PROMPT`` (default ``prose-letter``,
prompt 1 of the built-in dev set, so rank 1 of 2 runs it), and then fails in its own way.
"""
from __future__ import annotations

import os
import time

from decoders.serial import SerialDecoder


class OnePromptGoesWrong:
    """Serial decoding, except on the target prompt's first timed or warm-up decode."""

    name = "one-prompt-goes-wrong"

    def __init__(self):
        self.inner = SerialDecoder()
        self.target = None

    def prepare(self, model) -> None:
        from core.prompts import load_prompts

        self.inner.prepare(model)
        prompts, _ = load_prompts("dev", model)
        wanted = os.environ.get("DIST_TEST_PROMPT", "prose-letter")
        self.target = next(p.token_ids for p in prompts if p.id == wanted)

    def config(self) -> dict:
        return {"target": os.environ.get("DIST_TEST_PROMPT", "prose-letter")}

    def decode(self, prompt_ids, max_new_tokens):
        if list(prompt_ids) == self.target:
            self.go_wrong()
        return self.inner.decode(prompt_ids, max_new_tokens)

    def go_wrong(self) -> None:
        raise NotImplementedError


class Raises(OnePromptGoesWrong):
    """A decoder bug: an exception."""

    name = "raises"

    def go_wrong(self) -> None:
        raise RuntimeError("deliberate failure on the target prompt")


class Hangs(Raises):
    """A hang: never returns (until the launcher stops the process)."""

    name = "hangs"

    def go_wrong(self) -> None:
        while True:
            time.sleep(1)


class Dies(Raises):
    """A crash that Python cannot report: the process is simply gone."""

    name = "dies"

    def go_wrong(self) -> None:
        os._exit(3)
