"""One module per ``harness`` command: each parses its options and calls one function."""
