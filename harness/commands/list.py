"""``harness list``: the registered decoders, built-in models and prompt sets (no torch import)."""
from __future__ import annotations

import click

from core.catalog import BUILTIN_MODELS, BUILTIN_PROMPTS, DEFAULT_MODEL
from core.version import version_option
from decoders import CONTROL, DEFAULT_DECODER, REGISTRY


@click.command("list")
@version_option
def list_cmd():
    """Show the registered decoders, built-in models and built-in prompt sets (starts fast: no torch)."""
    width = 2 + max(len(n) for n in [*REGISTRY, *BUILTIN_MODELS, *BUILTIN_PROMPTS])
    click.echo("decoders (--decoder NAME, or package.module:attr):")
    for name, entry in REGISTRY.items():
        tag = " [control]" if name == CONTROL else " [default]" if name == DEFAULT_DECODER else ""
        args = f" (--decoder-arg: {', '.join(entry.args)})" if entry.args else ""
        click.echo(f"  {name:<{width}}{entry.description}{args}{tag}")
    click.echo("built-in models (--model NAME, or a checkpoint directory):")
    for name, desc in BUILTIN_MODELS.items():
        click.echo(f"  {name:<{width}}{desc}{' [default]' if name == DEFAULT_MODEL else ''}")
    click.echo("built-in prompt sets (--prompts NAME, or a jsonl file):")
    for name, desc in BUILTIN_PROMPTS.items():
        click.echo(f"  {name:<{width}}{desc}")
