"""``python -m training --out DIR``: see training/cli.py."""
from core.errors import run_cli


def main():
    from training.cli import main  # inside run_cli: a Ctrl-C while the command's code imports is one line

    return main()


run_cli(main)
