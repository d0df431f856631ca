"""``TimeOptions``: every ``harness time`` option as one value; the ``--sampling`` option every
command shares (``parse_sampling``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from core.errors import UserError
from decoders import CONTROL, DEFAULT_DECODER

SAMPLING_HELP = ("Seeded sampling (core.sampling): greedy (the default), a preset (qwen-thinking: temperature=0.6,"
                 "top_p=0.95,top_k=20; qwen-instruct: temperature=0.7,top_p=0.8,top_k=20), or key=value items "
                 "(temperature or t, top_k, top_p, min_p, seed; each once), optionally after a preset: "
                 "qwen-thinking,seed=7. The seed defaults to 0; temperature 0 is greedy, and a filter at "
                 "temperature 0 or a seed with no temperature is refused.")


def parse_sampling(text: str | None, overrides: dict | None = None):
    """``--sampling SPEC`` as a ``core.sampling.Sampler``, with ``overrides`` (field: value, None
    for not given) on top; a SPEC or value that defines none is a UserError."""
    import dataclasses

    from core.sampling import GREEDY, Sampler, SamplerError  # imports torch: only when a command runs

    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    try:
        base = GREEDY if text is None else Sampler.parse(text)
        sampler = dataclasses.replace(base, **given).require_effective()
    except SamplerError as exc:
        what = f"--sampling {text!r}" if text is not None else "sampling"
        raise UserError(f"{what}: {exc}") from None
    if sampler.greedy and "seed" in given and "temperature" not in given and text is None:
        # a user who forgot the temperature would believe they sampled
        raise UserError(f"--seed {given['seed']} without a temperature samples nothing: give --temperature "
                        "above 0 or a --sampling preset to sample")
    return sampler


@dataclass(frozen=True)
class TimeOptions:
    """Every ``harness time`` option, named once (``time_cmd`` builds it from the command line)."""

    decoder: str = DEFAULT_DECODER  # the candidate: a registered name or package.module:attr
    decoder_args: tuple[str, ...] = ()  # KEY=VALUE constructor arguments of the candidate
    control: str = CONTROL  # the reference timed against it
    model: str = "small"  # a built-in model name or a checkpoint directory
    prompts: str | None = None  # a built-in set or a jsonl file; None: the model's default set
    max_new_tokens: int | None = None  # per decode; None: 64 on CPU, 512 on GPU
    legs: int = 2  # timed legs per side per prompt, ABBA
    limit: int | None = None  # only the first K prompts
    warmup_tokens: int = 8  # new tokens of each side's untimed warm-up decode, per prompt
    device: str | None = None  # None: cuda if available, else cpu
    out_dir: Path | None = None  # None: runs/<decoder>-<timestamp>
    force: bool = False  # replace an existing DIR/stream.jsonl
    seed: int = 0  # set before decoding; also draws the warm-up prompts
    sampling: str | None = None  # --sampling SPEC: what decides the tokens, both sides alike; None: greedy
    report: bool = False  # render DIR/report.md after the stream is written
    dist_timeout: float = 1800.0  # under torchrun: seconds without progress before a rank counts as hung

    def __post_init__(self):
        if not isinstance(self.decoder_args, tuple):
            raise ValueError("TimeOptions.decoder_args must be a tuple of KEY=VALUE strings")
        if self.legs < 1 or self.warmup_tokens < 0 or (self.max_new_tokens is not None and self.max_new_tokens < 1):
            raise ValueError(f"TimeOptions out of range: legs={self.legs}, warmup_tokens={self.warmup_tokens}, "
                             f"max_new_tokens={self.max_new_tokens}")
        if self.sampling is not None:
            parse_sampling(self.sampling)  # a SPEC that defines no sampler is refused before anything runs

    @property
    def sampler(self):
        """``--sampling`` as a ``core.sampling.Sampler`` (greedy when not given)."""
        return parse_sampling(self.sampling)
