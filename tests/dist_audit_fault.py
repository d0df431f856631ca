"""``audit replay`` whose replay fails on one prompt, for tests/test_dist.py (run as a script by
torchrun). The audit has no plug-ins, so the fault is patched in: ``audit.replay.replay_one``
raises on the prompt named by ``DIST_TEST_PROMPT`` (default ``prose-letter``, rank 1 of 2)."""
import os

import audit.replay as replay

real_replay_one = replay.replay_one


def replay_one(stepper, p, *args, **kwargs):
    if p.id == os.environ.get("DIST_TEST_PROMPT", "prose-letter"):
        raise RuntimeError("deliberate replay failure")
    return real_replay_one(stepper, p, *args, **kwargs)


replay.replay_one = replay_one

if __name__ == "__main__":
    from audit.cli import main

    main(prog_name="audit")
