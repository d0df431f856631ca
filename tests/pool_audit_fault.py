"""``audit replay --workers N`` whose replay worker fails on one prompt, for tests/test_audit_pool.py
(run as a script). The audit has no plug-ins, so the fault is patched in at import: the workers
are spawned, and a spawned process runs this script's top level too (as ``__mp_main__``), so
``audit.replay.walk_one`` is patched in every worker. ``POOL_FAULT`` picks the fault on the walk of
``POOL_FAULT_PROMPT`` (default ``prose-letter``, the second prompt: the second worker's first):

  raise  a RuntimeError
  hang   it never returns; the parent takes a walking worker as hung after HANG_LIMIT_S without
         a message (a worker that takes its model keeps --dist-timeout: a slow start is no hang)
  die    the worker exits at once with exit code 3, without a word
  oom    the second worker runs out of device memory while it takes the model (torch's error)
  weights  the second worker computes with a changed copy of one weight (its own, not the shared one)
  hang-start  the second worker never reads the model the parent sends it, a payload larger than
              a pipe holds (HANG_LIMIT_S for it alone)
"""
import os
import threading

import audit.pool as pool
import audit.replay as replay

HANG_LIMIT_S = 2.0
FAULT = os.environ.get("POOL_FAULT", "raise")
TARGET = os.environ.get("POOL_FAULT_PROMPT", "prose-letter")
real_walk_one = replay.walk_one


def walk_one(stepper, walk, *args, **kwargs):
    if walk.label == TARGET:
        if FAULT == "hang":
            threading.Event().wait()
        if FAULT == "die":
            os._exit(3)
        raise RuntimeError("deliberate replay failure")
    return real_walk_one(stepper, walk, *args, **kwargs)


replay.walk_one = walk_one
if FAULT == "oom":
    import multiprocessing

    real_take_model = pool.take_model

    def take_model(conn):
        if multiprocessing.current_process().name.endswith("-1"):
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 96.00 MiB. GPU 0 has a total "
                                         "capacity of 139.80 GiB of which 32.50 MiB is free.")
        return real_take_model(conn)

    pool.take_model = take_model
if FAULT == "weights":
    import multiprocessing

    real_take_model = pool.take_model

    class OtherWeights:
        """The pipe's end, handing over the model with the final norm's weight replaced by a changed copy."""

        def __init__(self, conn):
            self.conn = conn

        def recv(self):
            model = self.conn.recv()
            norm = model.backbone.model.norm
            norm.weight = type(norm.weight)(norm.weight.detach().clone().add_(1), requires_grad=False)
            return model

    def take_model(conn):
        if multiprocessing.current_process().name.endswith("-1"):
            return real_take_model(OtherWeights(conn))
        return real_take_model(conn)

    pool.take_model = take_model
if FAULT == "hang-start":
    import multiprocessing

    real_take_model = pool.take_model

    def take_model(conn):
        if multiprocessing.current_process().name.endswith("-1"):
            threading.Event().wait()
        return real_take_model(conn)

    pool.take_model = take_model
    pool.WorkerPool.stall_limit = lambda self, w: HANG_LIMIT_S if w.index == 1 else self.opts.timeout_s
    real_init = pool.WorkerPool.__init__

    def padded_init(self, model, *args, **kwargs):
        # a payload larger than a pipe holds: writing it to the hung worker never finishes
        model.extra["padding"] = bytes(16 << 20)
        real_init(self, model, *args, **kwargs)

    pool.WorkerPool.__init__ = padded_init
if FAULT == "hang":
    pool.WorkerPool.stall_limit = lambda self, w: HANG_LIMIT_S if isinstance(w.at, tuple) else self.opts.timeout_s

if __name__ == "__main__":
    from audit.cli import main

    main(prog_name="audit")
