"""What every ``harness`` command shares: user mistakes as one ``error:`` line, the sampler option."""
from __future__ import annotations

from core.errors import DistError, Stopped, UserError, fail

SAMPLING_HELP = ("Seeded sampling (core.sampling): greedy (the default), a preset (qwen-thinking: temperature=0.6,"
                 "top_p=0.95,top_k=20; qwen-instruct: temperature=0.7,top_p=0.8,top_k=20), or key=value items "
                 "(temperature or t, top_k, top_p, min_p, seed), optionally after a preset: qwen-thinking,seed=7. "
                 "The seed defaults to 0; temperature 0 is greedy.")


def parse_sampling(text: str | None, overrides: dict | None = None):
    """``--sampling SPEC`` as a ``core.sampling.Sampler``, with ``overrides`` (field: value, None
    for not given) on top; a SPEC or value that defines none is a UserError."""
    import dataclasses

    from core.sampling import GREEDY, Sampler, SamplerError  # imports torch: only when a command runs

    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    try:
        base = GREEDY if text is None else Sampler.parse(text)
        return dataclasses.replace(base, **given)
    except SamplerError as exc:
        what = f"--sampling {text!r}" if text is not None else "sampling"
        raise UserError(f"{what}: {exc}") from None


def run_cli(fn):
    """Turn user mistakes into one line and a non-zero exit; never a traceback for them. Under
    torchrun every rank meets a user mistake alike, so only rank 0 prints it; a rank's own news
    (a hang it saw, a stop) is printed by that rank, prefixed with it."""
    from core import dist  # imports torch: loads only when a command runs

    try:
        return fn()
    except UserError as exc:
        fail(str(exc), quiet=dist.quiet_rank())
    except DistError as exc:
        fail(dist.rank_prefix() + str(exc), 1)
    except Stopped:
        fail(dist.rank_prefix() + "stopped by SIGTERM; nothing was written", 1)
    except KeyboardInterrupt:
        fail("interrupted; nothing was written", 130)
