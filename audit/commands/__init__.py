"""One module per ``audit`` command: each parses its options and calls one function."""
