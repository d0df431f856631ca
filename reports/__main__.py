"""``python -m reports``: the ``reports`` command."""
from core.errors import run_cli


def main():
    from reports.cli import main  # inside run_cli: a Ctrl-C while the command's code imports is one line

    return main()


run_cli(main)
