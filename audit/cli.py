"""``audit``: the command group. Each command lives in a module of its own under
``audit/commands/``; this file only gathers them.

``audit replay STREAM`` pins the deterministic configuration, loads the model that recorded the
stream, replays every token through its own pristine serial greedy path, recomputes every ratio
from the raw legs, checks the file for tampering, scores the run and writes audit.json
(``audit.replay_audit``). ``audit retime STREAM`` times the candidate again on fresh prompts, each
side in a worker process of its own, on the audit's clock, and writes retime.json
(``audit.retime``). ``audit tokens FILE`` checks a file of generations against serial decoding
(``audit.tokens``).

Exit codes: 0 everything exact and consistent; 1 the audit ran and found failures; 2 bad input,
or under torchrun a rank (with --workers, a replay worker) that failed or hung (one line on
stderr, nothing written).

torch and transformers load only when a command runs (so ``audit --help`` starts fast).

Import rule: core only; never harness or decoders (tests/test_audit_imports.py).
"""
from __future__ import annotations

import click

from core.clirun import OneLineUsageGroup
from core.version import version_option

from audit.commands.replay import replay_cmd
from audit.commands.retime import retime_cmd
from audit.commands.tokens import tokens_cmd


@click.group(cls=OneLineUsageGroup,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@version_option
def main():
    """Independent audit of harness runs: exactness by replay (greedy or under the recorded seeded
    sampler), ratios from raw legs, tamper checks."""


main.add_command(replay_cmd)
main.add_command(tokens_cmd)
main.add_command(retime_cmd)


if __name__ == "__main__":
    main()
