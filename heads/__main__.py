"""``python -m heads train ...``: see heads/cli.py."""
import sys

from heads.cli import main

sys.exit(main())
