"""``python -m harness``: the ``harness`` command, also as torchrun's module entry
(``torchrun --nproc-per-node G -m harness time ...``)."""
from harness.cli import main

main()
