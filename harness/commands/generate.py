"""``harness generate``: parse the options, decode one prompt with an exact decoder."""
from __future__ import annotations


import click

from core.errors import fail
from core.version import version_option
from core.clirun import IntRange, PathArg
from harness.commands.common import run_cli
from harness.generate import GenerateOptions, StdoutLost, run_generate  # torch loads only when it runs
from harness.options import SAMPLING_HELP, parse_sampling


@click.command("generate")
@version_option
@click.argument("prompt", required=False)
@click.option("--prompt-file", type=PathArg(), default=None, metavar="FILE",
              help="Read the prompt text from FILE (UTF-8) instead of the PROMPT argument.")
@click.option("--prompt-ids", type=PathArg(), default=None, metavar="FILE",
              help="Read the prompt as token ids, a JSON list in FILE (for models without a tokenizer, "
                   "such as synthetic-9b), instead of text.")
@click.option("--chat", is_flag=True,
              help="Apply the tokenizer's chat template to the prompt as one user message, with the "
                   "assistant's turn opened (Qwen's ChatML layout when the tokenizer has no template).")
@click.option("--model", default=GenerateOptions.model, show_default=True, metavar="MODEL",
              help="Built-in model name (small, tiny, synthetic-9b) or a Qwen3.5 checkpoint directory.")
@click.option("--decoder", default=GenerateOptions.decoder, show_default=True, metavar="NAME",
              help="Decoder: a registered name (see `harness list`) or package.module:attr.")
@click.option("--decoder-arg", "decoder_args", multiple=True, metavar="KEY=VALUE",
              help="Constructor argument for the decoder (repeatable), e.g. max_depth=4.")
@click.option("--device", default=None, help="cpu, cuda or cuda:N. Default: cuda if available, else cpu.")
@click.option("--max-new-tokens", "-n", type=IntRange(min=1), default=GenerateOptions.max_new_tokens,
              show_default=True, help="The most new tokens; decoding stops earlier right after an EOS.")
@click.option("--json", "json_out", is_flag=True,
              help="Print one JSON object on stdout (prompt_ids, token_ids, text, finish_reason, stats, "
                   "decoder, model, sampler) instead of streaming the text; the stats line still goes to stderr.")
@click.option("--record", type=PathArg(), default=None, metavar="FILE",
              help="Append the prompt and output token ids to FILE as one `audit tokens` line "
                   "(with the decoder, model and N), so `audit tokens FILE --model MODEL` can check it.")
@click.option("--sampling", default=None, metavar="SPEC", help=SAMPLING_HELP)
@click.option("--temperature", type=float, default=None, help="Sampling temperature (over --sampling); 0: greedy.")
@click.option("--top-k", type=int, default=None, help="Keep the K most likely tokens (0: off).")
@click.option("--top-p", type=float, default=None, help="Keep the smallest set of mass P (1: off).")
@click.option("--min-p", type=float, default=None, help="Keep tokens of at least P times the top one's probability (0: off).")
@click.option("--seed", type=int, default=None, help="The sampler's seed (default 0): the same seed, the same tokens.")
def generate_cmd(json_out, sampling, temperature, top_k, top_p, min_p, seed, **options):
    """Generate a continuation of PROMPT with an exact decoder, streaming the text: greedy, or
    sampled with a seeded sampler (--sampling, --temperature, --top-k, --top-p, --min-p, --seed).

    The prompt is PROMPT, the text of --prompt-file, token ids from --prompt-ids, or stdin
    (PROMPT "-", or no PROMPT with stdin not a terminal). The text goes to stdout as the decoder emits it; a stats line (tokens,
    seconds, tokens/s, time to first token, mean accepted length, drafted/accepted) goes to stderr
    at the end. The tokens are exactly serial decoding's with the same sampler (greedy: the
    argmax; sampled: the sampler's pick at each token's absolute position): it stops right after
    the first EOS, or after N tokens. --record and --json record the sampler (greedy too): `audit
    tokens` judges each recorded line under its own.
    """
    overrides = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p, "seed": seed}
    opts = run_cli(lambda: GenerateOptions(json=json_out, sampler=parse_sampling(sampling, overrides), **options))
    run_cli(lambda: interruptible(opts))


def interruptible(opts: GenerateOptions) -> None:
    try:
        run_generate(opts)
    except KeyboardInterrupt:
        fail("interrupted; no record was written", 130)
    except StdoutLost as exc:
        fail(f"{exc}; stopped, no record was written", 1)
