"""Timing harness: loads models, runs decoders side by side, writes stream.jsonl.

Kept import-light: the audit imports ``harness.schema``, ``harness.models`` and
``harness.determinism`` and must not pull in timing or decoding code.
"""
