"""The exact fast runtime (static state, calibration, graphed programs, rollback), kept apart from
decoding policy: decoders (fast-serial, spec) drive it through ExactRuntime's prefill / step /
verify / accept and never touch its internals."""
