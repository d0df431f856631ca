"""``TimeOptions``: every ``harness time`` option as one value."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from core.sampling import GREEDY, Sampler
from decoders import CONTROL, DEFAULT_DECODER



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
    sampler: Sampler = GREEDY  # what decides the tokens, both sides alike (core.sampling)
    report: bool = False  # render DIR/report.md after the stream is written
    dist_timeout: float = 1800.0  # under torchrun: seconds without progress before a rank counts as hung

    def __post_init__(self):
        if not isinstance(self.decoder_args, tuple):
            raise ValueError("TimeOptions.decoder_args must be a tuple of KEY=VALUE strings")
        if self.legs < 1 or self.warmup_tokens < 0 or (self.max_new_tokens is not None and self.max_new_tokens < 1):
            raise ValueError(f"TimeOptions out of range: legs={self.legs}, warmup_tokens={self.warmup_tokens}, "
                             f"max_new_tokens={self.max_new_tokens}")
