"""``harness``: the command group. Each command lives in a module of its own under
``harness/commands/``; this file only gathers them.

torch, transformers, the decoders' modules and the reports load only when a command runs (so
``harness --help`` and ``harness list`` start fast).
"""
from __future__ import annotations

import click

from core.clirun import OneLineUsageGroup
from core.version import version_option
from harness.commands.generate import generate_cmd
from harness.commands.list import list_cmd
from harness.commands.serve import serve_cmd
from harness.commands.time import time_cmd


@click.group(cls=OneLineUsageGroup,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@version_option
def main():
    """Exact speculative decoding for Qwen3.5: time decoders against the serial control, greedy or
    under one seeded sampler (--sampling).

    Every run writes each raw timing leg and token stream to DIR/stream.jsonl; `audit replay`
    then checks every token against serial decoding under the run's sampler and recomputes the
    speed ratios.
    """


main.add_command(generate_cmd)
main.add_command(list_cmd)
main.add_command(time_cmd)
main.add_command(serve_cmd)


if __name__ == "__main__":
    main()
