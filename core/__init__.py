"""The ground every other package stands on; it imports nothing of this project above it.

  errors       UserError (one ``error:`` line, exit 2), DistError, Stopped, and ``fail`` for CLIs
  schema       the stream.jsonl format: records, ABBA roles, sealing and atomic writers
  models       the checkpoint loader, built-in models and their fingerprints
  mtp          the MTP head module and its wiring
  determinism  the pinned deterministic configuration
  dist         torchrun plumbing: sharding, process group, failures
  prompts      prompt sets, built-in and from files
  corpus       the standard-library corpus and its train/dev/held-out split
  continues    counting the SIGCONTs a process receives (another process stopping it)
  version      the package version and the --version option of every command
  catalog      names and descriptions of the built-in models and prompt sets (no torch)
"""
