"""``audit retime STREAM``: the candidate's speed measured again, on the audit's clock, on fresh
prompts, each side in a process of its own; the verified ratio, its interval and score are the
retime's own (docs/audit.md, ``audit retime``).

  fresh     fresh prompts from a space no decoder can enumerate (``fresh``)
  workers   the two worker processes and their protocol (``workers``)
  measure   the legs, ABBA, on an injectable clock; spares; the second look (``measure``)
  load      what other work took from each side around its legs (``load``)
  judge     the verified figures, the claim beside them, every finding (``judge``)
  document  retime.json and the table (``document``)
  command   the whole retime (``command``)
"""
from audit.retime.command import RetimeOptions, retime
from audit.retime.workers import WorkerError

__all__ = ["RetimeOptions", "WorkerError", "retime"]
