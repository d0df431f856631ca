"""``reports``: turn a run directory (``stream.jsonl``, and ``audit.json`` where present) into
``report.md`` plus PNG figures.

  load.py      read and check the inputs (``load_run``); bad or partial input is a ``UserError``
  summary.py   every number the report shows, recomputed from the raw records (``summarize_run``)
  figures.py   one ``plot_*`` function per figure, headless (Agg), built from the summary
  markdown.py  the report text (``write_report``), built from the summary alone
  tokens.py    a token audit (``audit tokens``' audit_tokens.json): its section, table and margin histogram
  render.py    ``render_run``: all of the above into a temporary directory, then moved into place
  cli.py       ``reports render RUN_DIR`` (also ``python -m reports``)
"""
