"""``python -m harness``: the ``harness`` command, also as torchrun's module entry
(``torchrun --nproc-per-node G -m harness time ...``)."""
from core.errors import run_cli


def main():
    from harness.cli import main  # inside run_cli: a Ctrl-C while the command's code imports is one line

    return main()


run_cli(main)
