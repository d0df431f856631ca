"""The timing harness (``harness time``, ``harness list``): runs a decoder and the serial control
side by side and writes stream.jsonl. It sits on top: it imports ``core``, ``decoders`` and
``reports``; nothing imports it.
"""
