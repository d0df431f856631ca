"""``ServeOptions``: every ``harness serve`` option as one value (no heavy imports)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from core.catalog import DEFAULT_MODEL

DEFAULT_MAX_TOKENS = 256  # a request that names no max_tokens gets this many (capped by the limit)
# prompt + max_tokens of the longest request, unless the model's context is shorter: the decoder's
# static state is sized for it at start (about 44 KB a position for spec on the 9B shape: 0.36 GB here)
DEFAULT_MAX_CONTEXT = 8192


@dataclass(frozen=True)
class ServeOptions:
    """Every ``harness serve`` option, named once (``serve_cmd`` builds it from the command line)."""

    model: str = DEFAULT_MODEL  # a built-in model name or a checkpoint directory
    decoder: str = "spec"  # a registered decoder name or package.module:attr
    decoder_args: tuple[str, ...] = ()  # KEY=VALUE constructor arguments of the decoder
    device: str | None = None  # None: cuda if available, else cpu
    host: str = "127.0.0.1"
    port: int = 8000  # 0: pick a free port (printed)
    queue_size: int = 8  # requests that may wait while one decodes; one more is answered 429
    max_new_tokens_limit: int = 4096  # a request asking for more is answered 400
    # prompt tokens + max_tokens; a longer request is answered 400. None: the model's context, at
    # most DEFAULT_MAX_CONTEXT (a larger value than the model's context is refused at start)
    max_context: int | None = None
    record: Path | None = None  # append every finished request's ids here (audit tokens' shape (a))
    served_model_name: str | None = None  # None: the model's name

    def __post_init__(self):
        if not isinstance(self.decoder_args, tuple):
            raise ValueError("ServeOptions.decoder_args must be a tuple of KEY=VALUE strings")
        if (not 0 <= self.port <= 65535 or self.queue_size < 1 or self.max_new_tokens_limit < 1
                or (self.max_context is not None and self.max_context < 2)):
            raise ValueError(f"ServeOptions out of range: port={self.port}, queue_size={self.queue_size}, "
                             f"max_new_tokens_limit={self.max_new_tokens_limit}, max_context={self.max_context}")

    def context_for(self, model_context: int | None) -> int:
        """The longest request served: ``max_context``, or by default the model's context capped
        at DEFAULT_MAX_CONTEXT."""
        if self.max_context is not None:
            return self.max_context
        return min(DEFAULT_MAX_CONTEXT, model_context or DEFAULT_MAX_CONTEXT)

    @property
    def default_max_tokens(self) -> int:
        return min(DEFAULT_MAX_TOKENS, self.max_new_tokens_limit)
