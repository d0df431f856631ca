"""One prompt timed side by side (``time_one``), and what its records say."""
from __future__ import annotations

import click

from harness.options import TimeOptions
from harness.prepare import Setup


def legs_only(records: list[dict]) -> list[dict]:
    return [r for r in records if r["type"] == "leg"]


def time_one(setup: Setup, prompt, opts: TimeOptions, on_leg=None) -> tuple[list[dict], dict]:
    """One prompt, side by side: its leg records (each followed by any violation its check found)
    and the harness's summary of the legs."""
    from harness.timing import summarize_prompt, time_prompt  # imports torch: loads only when a command runs

    records = time_prompt(prompt, setup.warmups[prompt.id], {"control": setup.control, "candidate": setup.candidate},
                          setup.max_new_tokens, opts.legs, opts.warmup_tokens, setup.dev, setup.clock, setup.watch,
                          on_leg, sampler=opts.sampler)
    legs = legs_only(records)
    summary = summarize_prompt(prompt.id, legs)
    summary["same_tokens_as_control"] = all(r["tokens"] == legs[0]["tokens"] for r in legs)
    return records, summary


def warn_violations(records: list[dict], prefix: str = "") -> None:
    for rec in records:
        if rec["type"] == "violation":
            click.echo(f"{prefix}WARNING: in-process integrity, {rec['at']}: {rec['problem']} "
                       "(written to the stream; the audit fails it)", err=True)
