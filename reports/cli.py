"""``reports``: render a run directory into a readable report (``reports render RUN_DIR``)."""
from __future__ import annotations

from pathlib import Path

import click

from core.clirun import OneLineUsageGroup, PathArg
from core.errors import UserError, fail
from core.version import version_option


@click.group(cls=OneLineUsageGroup,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@version_option
def main():
    """Reports on harness runs: what was timed, how fast, whether it was exact.

    \b
    Typical use:
      harness time --out runs/x          # writes runs/x/stream.jsonl
      audit replay runs/x/stream.jsonl   # writes runs/x/audit.json
      reports render runs/x              # writes runs/x/report.md and runs/x/figures/
    """


@main.command("render", short_help="Write report.md and figures for a run directory.")
@version_option
@click.argument("run_dir", type=PathArg(), metavar="RUN_DIR")
@click.option("--debug", is_flag=True, help="On an unexpected failure show the traceback, not one line.")
def render_cmd(run_dir: Path, debug: bool):
    """Write RUN_DIR/report.md and RUN_DIR/figures/*.png from RUN_DIR/stream.jsonl (and audit.json).

    The report opens with a one-screen summary: model, device, decoders, prompts, N, legs, median
    speed ratio (recomputed from the raw legs, the harness's own beside it), and the audit's score,
    verdict and first divergence. Figures: speedup per prompt with each prompt's exactness; ms per
    token of every decoder; acceptance-length histogram and acceptance by draft depth; draft depth
    per round (when the decoder records depth_trace); peak memory (CUDA only, n/a on CPU); time split
    into draft/verify/rollback/other (when recorded).

    Without RUN_DIR/audit.json, or with one made from a different stream (its stream_sha256 does
    not match), the report says NOT AUDITED at the top. Bad or incomplete input is one line
    'error: ...' and exit status 2; nothing is written unless the whole report renders. Only
    this command's own files are replaced: a report.md it did not write is refused, and
    figures/ keeps every file but the figures it draws.

    A token audit (audit_tokens.json, from `audit tokens`) adds a section: per-generation
    exactness and a histogram of the divergence margins; a directory holding only
    audit_tokens.json gets that report alone. The decoders' full configurations are in an appendix.
    """
    from reports.render import render_run  # matplotlib loads only when a report is rendered: --help stays fast

    try:
        summary = render_run(run_dir)
    except UserError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        fail("interrupted; nothing was written", 130)
    except Exception as exc:  # noqa: BLE001 - one line for the user; --debug shows the traceback
        if debug:
            raise
        fail(f"could not render {run_dir}: {type(exc).__name__}: {exc} (nothing was written; --debug for details)")
    for b in summary["banners"]:
        click.echo(f"{b['title']}: {b['text']}", err=True)
    click.echo(f"wrote {summary['report']}  ({len(summary['figures'])} figures in "
               f"{Path(summary['report']).parent / 'figures'})")


if __name__ == "__main__":
    main()
