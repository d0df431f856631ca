"""Independent audit of a harness run: ``audit replay STREAM``, ``audit retime STREAM`` and
``audit tokens FILE``.

The audit trusts no number the harness computed. From the raw records of ``stream.jsonl`` it
replays every emitted token stream through its own pristine serial greedy path (HF forward,
DynamicCache, one token per forward), recomputes every timing ratio from the raw legs, checks
the file for tampering and truncation, and scores the run. ``audit retime`` measures the
candidate's speed again on fresh prompts, the candidate and the control each in a process of its
own, on the audit's clock.

Import rule: the audit uses ``core`` only (the file format, the model loader, the prompt sets,
the pinned configuration, the torchrun plumbing that shards prompts alike in both tools). It
never imports ``harness`` or ``decoders``: a bug there must not be able to hide itself from the
audit (``audit retime`` starts ``harness.worker`` as a program, by module name).
``tests/test_audit_imports.py`` enforces this.

Modules:
  cli           the ``audit`` command group; commands/ holds one module per command (replay, tokens,
                retime), each parsing its options and calling one function
  stream        turn records into a per-prompt structure; structural problems are bad input
  checks        pure checks over that structure (timing, tamper, ratios, memory, warm legs, score)
  replay        the pristine serial greedy replay
  report        the audit.json document and the human table
  replay_audit  ``audit replay``: one stream, several sharing their walks (``ReplayOptions``)
  sharded       the same audit under torchrun: each rank replays its share, rank 0 writes audit.json
  tokens        ``audit tokens``: a file of generations against serial decoding
  retime        ``audit retime``: fresh prompts, one worker process per side, the audit's clock
"""
