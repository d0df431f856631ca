"""Draft heads for a frozen backbone: ``heads train`` (heads/cli.py) trains or distils the MTP head
on the backbone's own greedy generations (heads/train.py); ``load_head`` loads a saved one.

A saved head is a directory with ``mtp.safetensors`` (keys ``mtp.*``, exactly the checkpoint's
names, in the model's dtype), ``draft_shortlist.json`` and ``report.json``. The backbone is never
written. How ``spec`` would pick it up (a later change, not made here): ``harness.models`` would
take an optional head directory (e.g. ``--head DIR``), call ``load_head(model, DIR)`` and put the
result in ``model.mtp`` (and the identity's weights fingerprint), and ``decoders.drafter`` would
read ``DIR/draft_shortlist.json`` in place of the one beside the checkpoint.
"""
from heads.train import HEAD_FILE, load_head  # noqa: F401

__all__ = ["HEAD_FILE", "load_head"]
