"""``python -m training --out DIR``: see training/cli.py."""
from training.cli import main

main()
