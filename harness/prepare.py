"""Everything a process needs before its first timed leg (``Setup``), built by ``prepare_run``.

torch and the model load only when a command runs: the imports inside functions say so.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import click

from core.errors import UserError
from decoders import get_decoder, parse_decoder_args
from decoders.base import reserve_positions
from harness.options import TimeOptions



@dataclass
class Setup:
    """Everything a process needs before its first timed leg: both decoders prepared on the model
    and sized for the longest decode (``positions``), the prompts with their warm-up prompts, and
    the run's clock and integrity watch."""

    control: object
    candidate: object
    decoder_kwargs: dict
    model: object
    dev: object
    max_new_tokens: int
    prompts: list
    prompt_info: dict
    warmups: dict  # prompt id -> warm-up token ids
    resident: dict
    positions: int  # the longest len(prompt) + max_new_tokens, reserved in both decoders before timing
    clock: object
    watch: object
    violations: list = field(default_factory=list)  # found after prepare()
    control_code: dict | None = None  # core.provenance's check of the control's code, before anything ran


def prepare_run(opts: TimeOptions, settings: dict, log=None) -> Setup:
    """Load the model, prepare both decoders, then load the prompts (the same on every rank).
    The clock and the integrity watch start first, before a plug-in decoder's module is imported."""
    import torch  # heavy: loads only when a command runs

    from core.models import load_model  # imports torch: loads only when a command runs
    from core.prompts import load_prompts  # imports torch: loads only when a command runs
    from harness.clock import Clock
    from harness.timing import warmup_ids  # imports torch: loads only when a command runs
    from harness.watch import Watch

    log = log or (lambda message: click.echo(message, err=True))
    check_prompt_set(opts.prompts)
    control_code, checked_modules, code_notes = check_control_code(log)
    clock = Clock.start()
    watch = Watch(settings, clock)
    control = get_decoder(opts.control)
    watch.watch_control(control)
    kwargs = parse_decoder_args(opts.decoder_args)
    candidate = get_decoder(opts.decoder, **kwargs)
    check_sampling({"control": control, "candidate": candidate}, opts.sampler)
    log(f"loading model {opts.model} ...")
    model = load_model(opts.model, opts.device)
    dev = model.device
    max_new_tokens = opts.max_new_tokens or (512 if dev.type == "cuda" else 64)
    # both decoders are prepared before the prompt set is loaded, so prepare() cannot find the
    # run's prompts in this process; then each is sized for the longest decode, a number only
    roles = {"control": control, "candidate": candidate}
    resident = {role: allocated_by(lambda d=dec: d.prepare(model), dev) for role, dec in roles.items()}
    prompts, prompt_info = load_prompts(opts.prompts, model, opts.limit)
    longest = max(prompts, key=lambda p: len(p.token_ids))
    positions = len(longest.token_ids) + max_new_tokens
    model.check_fits(positions, f"prompt {longest.id!r} of {len(longest.token_ids)} tokens + N {max_new_tokens}")
    for role, dec in roles.items():
        grown = allocated_by(lambda d=dec: reserve_positions(d, positions), dev)
        resident[role] = None if grown is None else max(0, resident[role] + grown)
    # notes wait until every input is accepted, so that a mistake in one is still a lone `error:` line
    for line in code_notes:
        log(line)
    check_loaded_here(control_code, checked_modules, log)
    violations = watch.check("after prepare")
    warmups = {p.id: warmup_ids(opts.seed, i, len(p.token_ids), model.vocab_size, p.token_ids)
               for i, p in enumerate(prompts)}
    torch.manual_seed(opts.seed)
    return Setup(control, candidate, kwargs, model, dev, max_new_tokens, prompts, prompt_info, warmups, resident,
                 positions, clock, watch, violations, control_code)


def check_sampling(decoders: dict, sampler) -> None:
    """A sampled run needs both sides to sample (``sampling = True``): refused before the model loads."""
    if sampler.greedy:
        return
    for role, dec in decoders.items():
        if getattr(dec, "sampling", False) is not True:
            raise UserError(f"the {role} {getattr(dec, 'name', type(dec).__name__)} does not sample "
                            f"(no sampling = True), so it cannot decode with --sampling {sampler.describe()}")


def check_control_code(log) -> tuple[dict, dict[str, str], list[str]]:
    """The control's import closure against git HEAD and the libraries' RECORDs, before any decoder
    is imported. A changed file is named at once, since the run will fail its audit, and recorded
    in the header. Returns the header's summary, the closure's module files
    (``check_loaded_here``) and a line per note (a finding that fails nothing), to say later."""
    from core.provenance import PROCESS_PYCACHE, control_code_header  # runs a fresh interpreter: only when a command runs

    # this process imports the control from the interpreter's own pycache, on its own import path
    # (a PYTHONPATH, the current directory): so does the closure
    summary, findings, modules = control_code_header(pycache=PROCESS_PYCACHE, sys_path=list(sys.path))
    for f in findings:
        if f["severity"] == "fail":
            log(f"WARNING: {f['check']}: {f['message']}")
    return summary, modules, [f"note: {f['check']}: {f['message']}" for f in findings if f["severity"] != "fail"]


def check_loaded_here(summary: dict, modules: dict[str, str], log) -> None:
    """Once both decoders are prepared (the control's modules imported in this process): a module
    of the checked closure that this process loaded from another file joins the header's
    ``modified`` list, which fails the audit, since the control here did not run the checked code."""
    from core.provenance import loaded_elsewhere

    elsewhere = loaded_elsewhere(modules)
    if elsewhere:
        log(f"WARNING: control-code-modified: {len(elsewhere)} module(s) of the control were imported here from "
            f"other files than the check read (e.g. {elsewhere[0]['path']}, checked as {elsewhere[0]['expected']})")
    summary["modified"].extend(elsewhere)


def check_prompt_set(spec: str | None) -> None:
    """A prompt set that cannot exist is refused before the model loads and the decoders are
    prepared; the set itself is loaded after them."""
    from core.prompts import BUILTIN_PROMPTS, parse_corpus_spec  # imports torch: loads only when a command runs

    if spec is None or spec in BUILTIN_PROMPTS or parse_corpus_spec(spec) is not None or Path(spec).is_file():
        return
    if Path(spec).exists():
        raise UserError(f"prompt file {spec!r} is not a regular file (a jsonl of prompts, or a built-in set: "
                        f"{', '.join(BUILTIN_PROMPTS)})")
    raise UserError(f"prompt file {spec!r} not found, and {spec!r} is not a built-in prompt set "
                    f"({', '.join(BUILTIN_PROMPTS)}; corpus sets also as NAME:N, e.g. stdlib-train:2048)")


def allocated_by(action, dev):
    """Run ``action()`` (a decoder's prepare or reserve) and return the device memory it left
    allocated, in bytes, negative where it freed more (None off CUDA)."""
    import torch  # heavy: loads only when a command runs

    if dev.type != "cuda":
        action()
        return None
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    action()
    torch.cuda.synchronize(dev)
    return torch.cuda.memory_allocated(dev) - before
