"""Draft heads for a frozen backbone: ``heads train`` (its options in heads/cli.py, the command in
heads/run.py) trains or distils the MTP head on the backbone's own greedy generations
(heads/train.py).

A saved head is a directory with ``mtp.safetensors`` (keys ``mtp.*``, exactly the checkpoint's
names, in the model's dtype), ``draft_shortlist.json`` and ``report.json``. The backbone is never
written. ``spec`` drafts with it given ``--decoder-arg head=DIR``; ``decoders.drafter.load_head``
loads it.
"""
