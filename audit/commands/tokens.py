"""``audit tokens``: parse the options, check a file of generations (``audit.tokens``)."""
from __future__ import annotations


import click

from core.clirun import FiniteFloat, IntRange, PathArg
from core.version import version_option

from audit.commands.common import check_device_option, parse_sampling, run_command


@click.command("tokens")
@version_option
@click.argument("file", metavar="FILE", type=PathArg())
@click.option("--model", "model_spec", required=True, metavar="MODEL",
              help="The model that generated FILE (built-in name or checkpoint dir).")
@click.option("--device", default=None,
              help="Device for the pristine path: cpu, cuda or cuda:N (where present). Default: cuda if available, "
                   "else cpu.")
@click.option("--out", "out_path", default=None, type=PathArg(), metavar="JSON",
              help="Where to write the document; '-' writes it to stdout (the table then goes to stderr). "
                   "Default: audit_tokens.json beside FILE.")
@click.option("--tie-margin", type=FiniteFloat(min=0), default=None, metavar="X",
              help="A divergence whose greedy logit exceeds the emitted token's by at most X is a near-tie. "
                   "Default: 4 ulps of the logits' dtype (bf16) at the top-1 logit.")
@click.option("--reference", type=PathArg(), default=None, metavar="OTHER.jsonl",
              help="The same requests from the engine without speculation: report where each output first "
                   "parts from its counterpart (matched by id, else by line) and what greedy says there. Every "
                   "generation of FILE needs a counterpart (else exit 2).")
@click.option("--limit", type=IntRange(min=1), default=None, metavar="K", help="Audit the first K records only.")
@click.option("-n", "--max-new-tokens", type=IntRange(min=1), default=None, metavar="N",
              help="N, where serial decoding stops without an EOS. Default: the longest output in FILE.")
@click.option("--sampling", default=None, metavar="SPEC",
              help="The seeded sampler claimed by FILE's lines that record none (core.sampling): greedy (the "
                   "default), a preset (qwen-thinking, qwen-instruct) or key=value items (temperature, top_k, "
                   "top_p, min_p, seed), e.g. qwen-thinking,seed=7. Each token must then be the sampler's pick at "
                   "its absolute position (prompt length + index). A line that records its own sampler (harness "
                   "generate/serve --record) is judged under it; given --sampling, it must match.")
def tokens_cmd(file, model_spec, device, out_path, tie_margin, reference, limit, max_new_tokens, sampling):
    """Check FILE's outputs (a jsonl of generations) against serial decoding, greedy or under their sampler.

    \b
    One generation per line, in any of these shapes:
      {"id": "q1", "prompt_token_ids": [...], "output_token_ids": [...]}   ("prompt": "text" also)
      {"prompt_token_ids": [...], "outputs": [{"token_ids": [...]}, ...]}  (serving engine; ids ID/k)
      {"sequences": [[prompt + output ids]], "prompt_length": P}          (generate; or prompt_token_ids)

    Each output is replayed through the audit's pristine serial path: its first divergence (position,
    emitted vs the control's token, top-5 logits, margin) and whether it stops where greedy stops. A divergence
    within the tie margin is a near-tie (arithmetic order can flip it); above it, or a wrong stop, it is
    real. Writes audit_tokens.json and prints a table. Exit 0 all exact, 1 any divergence, 2 bad input.
    """
    from audit.pipeline import log
    from audit.tokens import TokensOptions, run_tokens_audit  # torch loads only when a command runs

    def audit_tokens() -> int:
        opts = TokensOptions(file=file, model=model_spec, device=device, out=out_path, tie_margin=tie_margin,
                             reference=reference, limit=limit, max_new_tokens=max_new_tokens,
                             sampler=parse_sampling(sampling) if sampling is not None else None)
        check_device_option(device)
        return run_tokens_audit(opts, log=log)

    run_command(audit_tokens)
