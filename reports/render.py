"""``render_run``: load a run, summarize it, draw the figures and write the report, all-or-nothing.

Everything is produced in a temporary directory inside RUN_DIR. Only when all of it exists is it
moved into place: the old report.md is removed first (so no report ever points at figures being
swapped), then figures/ is swapped in, then report.md is renamed into place last. A render that
fails at any point leaves the previous report and figures as they were and no new report.md, so a
report.md in RUN_DIR is always a complete one.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from core.errors import UserError
from reports import tokens
from reports.figures import FIGURES
from reports.load import STREAM_NAME, TOKENS_AUDIT_NAME, load_run
from reports.markdown import report_text
from reports.summary import summarize_run

REPORT_NAME = "report.md"
FIGURES_DIR = "figures"


def render_run(run_dir) -> dict:
    """Write RUN_DIR/report.md and RUN_DIR/figures/*.png; return the summary the report was built from,
    with ``report`` (its path) and ``figures`` (stem -> absolute path of each figure drawn) added.
    A directory with a token audit (audit_tokens.json) and no stream gets the token audit's report;
    beside a stream, the token audit is a section of the run's report."""
    run_dir = Path(run_dir)
    tokens_path = run_dir / TOKENS_AUDIT_NAME
    tokens_doc = tokens.load_tokens_audit(tokens_path) if tokens_path.is_file() else None
    if tokens_doc is not None and not (run_dir / STREAM_NAME).exists():
        summary = {"run_dir": str(run_dir), "banners": [], "tokens_audit": tokens_doc}
    else:
        summary = summarize_run(load_run(run_dir))
        summary["tokens_audit"] = tokens_doc
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".report-", dir=run_dir))
    except OSError as exc:
        raise UserError(f"cannot write in {run_dir} ({exc.strerror or exc})") from None
    try:
        figures = draw_figures(summary, tmp / FIGURES_DIR)
        (tmp / REPORT_NAME).write_text(full_text(summary, figures, str(tokens_path)), encoding="utf-8")
        move_into_place(tmp, run_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary["report"] = str(run_dir / REPORT_NAME)
    summary["figures"] = {stem: str(run_dir / rel) for stem, rel in figures.items() if rel}
    return summary


def full_text(summary: dict, figures: dict, tokens_path: str) -> str:
    doc = summary["tokens_audit"]
    if "prompts" not in summary:  # a token audit alone
        return tokens.report_text(doc, figures[tokens.FIGURE_STEM], tokens_path)
    text = report_text(summary, figures)
    return text if doc is None else text + "\n" + tokens.section(doc, figures[tokens.FIGURE_STEM], tokens_path) + "\n"


def draw_figures(summary: dict, fig_dir: Path) -> dict:
    """Every figure the run has data for; stem -> path relative to RUN_DIR, or None when skipped."""
    fig_dir.mkdir()
    figures = {}
    plots = dict(FIGURES) if "prompts" in summary else {}
    if summary["tokens_audit"] is not None:
        plots[tokens.FIGURE_STEM] = lambda s, path: tokens.plot_margins(s["tokens_audit"], path)
    for stem, plot in plots.items():
        drawn = plot(summary, fig_dir / f"{stem}.png")
        figures[stem] = f"{FIGURES_DIR}/{stem}.png" if drawn else None
    return figures


def move_into_place(tmp: Path, run_dir: Path) -> None:
    report, figures = run_dir / REPORT_NAME, run_dir / FIGURES_DIR
    report.unlink(missing_ok=True)
    if figures.exists() or figures.is_symlink():
        os.replace(figures, tmp / "previous-figures")  # deleted with tmp
    os.replace(tmp / FIGURES_DIR, figures)
    os.replace(tmp / REPORT_NAME, report)  # last: a report.md present means the render finished
