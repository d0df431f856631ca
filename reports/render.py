"""``render_run``: load a run, summarize it, draw the figures and write the report, all-or-nothing.

Everything is produced in a temporary directory inside RUN_DIR. Only when all of it exists is it
moved into place: the old report.md is removed first (so no report ever points at figures being
swapped), then each figure is moved into figures/, then report.md is renamed into place last. A
render that fails at any point leaves the previous report and figures as they were and no new
report.md, so a report.md in RUN_DIR is always a complete one. Only this tool's own files are
replaced: a report.md it did not write is refused before any work, and figures/ keeps every file
but the figures it draws.
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
from reports.markdown import RENDERED_BY, report_text
from reports.summary import summarize_run

REPORT_NAME = "report.md"
FIGURES_DIR = "figures"


def render_run(run_dir) -> dict:
    """Write RUN_DIR/report.md and RUN_DIR/figures/*.png; return the summary the report was built from,
    with ``report`` (its path) and ``figures`` (stem -> absolute path of each figure drawn) added.
    A directory with a token audit (audit_tokens.json) and no stream gets the token audit's report;
    beside a stream, the token audit is a section of the run's report."""
    run_dir = Path(run_dir)
    check_own_files(run_dir)
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


def check_own_files(run_dir: Path) -> None:
    """Refuse, before any work, a report.md this tool did not write and a figures/ that is not a
    directory: a render replaces neither."""
    report, figures = run_dir / REPORT_NAME, run_dir / FIGURES_DIR
    if report.is_symlink() or (report.exists() and not is_own_report(report)):
        raise UserError(f"{report} exists and is not a report `reports render` wrote: it is not replaced; "
                        "move it away first")
    if (figures.exists() or figures.is_symlink()) and not (figures.is_dir() and not figures.is_symlink()):
        raise UserError(f"{figures} exists and is not a directory of figures: it is not replaced; move it away first")


def is_own_report(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read(8 << 20)
    except OSError:
        return False
    return path.is_file() and RENDERED_BY in text.splitlines()


def move_into_place(tmp: Path, run_dir: Path) -> None:
    report, figures = run_dir / REPORT_NAME, run_dir / FIGURES_DIR
    report.unlink(missing_ok=True)
    figures.mkdir(exist_ok=True)
    drawn = {p.name for p in (tmp / FIGURES_DIR).iterdir()}
    for stem in (*FIGURES, tokens.FIGURE_STEM):  # a figure of an earlier render this one did not draw
        if f"{stem}.png" not in drawn:
            (figures / f"{stem}.png").unlink(missing_ok=True)
    for name in sorted(drawn):
        os.replace(tmp / FIGURES_DIR / name, figures / name)
    os.replace(tmp / REPORT_NAME, report)  # last: a report.md present means the render finished
