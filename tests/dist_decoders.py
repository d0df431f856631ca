"""Plug-in decoders that go wrong on one prompt, for the torchrun tests (tests/test_dist.py).

Launched as ``--decoder dist_decoders:ATTR`` with ``PYTHONPATH=tests``. Each is exact serial
decoding until it meets the prompt named by ``DIST_TEST_PROMPT`` (default ``prose-letter``,
prompt 1 of the built-in dev set, so rank 1 of 2 runs it), and then fails in its own way.

Run as a script (``torchrun tests/dist_decoders.py time ...``), this file is ``harness`` with a
short stall limit at the results exchange only: see the end of the file.
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


# Rank 0 meets the hung rank at the results exchange, where HANG_LIMIT_S without progress is enough
# to call it hung (the hung rank never moves again). Every other wait keeps --dist-timeout, so a
# rank that starts up or loads the model late on a busy machine is never mistaken for the hang.
HANG_LIMIT_S = 1.0

if __name__ == "__main__":
    from core import dist
    from harness.cli import main

    real_wait_for = dist.Session.wait_for

    def wait_for(session, stage):
        if stage == "results":
            session.timeout_s = HANG_LIMIT_S
        return real_wait_for(session, stage)

    dist.Session.wait_for = wait_for
    main(prog_name="harness")
