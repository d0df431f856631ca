"""``harness generate``: one prompt through an exact decoder, its text streamed to stdout as the
decoder emits it, a stats line on stderr, optionally a line of `audit tokens` shape (a) appended
to a record file. Every user mistake that can be seen before the model loads is refused first.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from core.catalog import DEFAULT_MODEL
from core.errors import UserError
from decoders import DEFAULT_DECODER, parse_decoder_args


@dataclass(frozen=True)
class GenerateOptions:
    """Every ``harness generate`` option, named once."""

    prompt: str | None = None  # the prompt text; "-" reads stdin; None: --prompt-file, else stdin
    prompt_file: Path | None = None
    prompt_ids: Path | None = None  # a JSON list of token ids (models without a tokenizer, such as synthetic-9b)
    chat: bool = False  # apply the chat template to the prompt as one user message
    model: str = DEFAULT_MODEL
    decoder: str = DEFAULT_DECODER
    decoder_args: tuple[str, ...] = ()
    device: str | None = None
    max_new_tokens: int = 256
    json: bool = False  # one JSON object on stdout instead of streamed text
    record: Path | None = None  # append the prompt and output ids here (audit tokens shape (a))
    sampler: object = None  # a core.sampling.Sampler: what decides the tokens; None: greedy


def read_prompt_ids(path: Path) -> list[int]:
    """A JSON list of token ids from ``path``: non-negative integers (not booleans), at least one."""
    try:
        ids = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"--prompt-ids {str(path)!r}: cannot read a JSON list of token ids ({exc})") from None
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
        raise UserError(f"--prompt-ids {str(path)!r}: expected a non-empty JSON list of non-negative integers")
    return ids


def read_prompt(opts: GenerateOptions, stdin=None) -> str | list[int]:
    """The prompt: token ids from --prompt-ids, else text from the argument, --prompt-file or stdin;
    empty or unreadable is refused."""
    stdin = stdin if stdin is not None else sys.stdin
    given = [name for name, value in (("a PROMPT argument", opts.prompt), ("--prompt-file", opts.prompt_file),
                                      ("--prompt-ids", opts.prompt_ids)) if value is not None]
    if len(given) > 1:
        raise UserError(f"give the prompt one way, not both {' and '.join(given)}")
    if opts.prompt_ids is not None:
        if opts.chat:
            raise UserError("--chat applies a template to text; --prompt-ids are already token ids")
        return read_prompt_ids(opts.prompt_ids)
    if opts.prompt_file is not None:
        try:
            text = Path(opts.prompt_file).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise UserError(f"prompt file {str(opts.prompt_file)!r} is not UTF-8 text") from None
        except OSError as exc:
            raise UserError(f"cannot read prompt file {str(opts.prompt_file)!r}: {exc.strerror or exc}") from None
    elif (opts.prompt == "-" or opts.prompt is None) and stdin is None:
        raise UserError("no prompt: stdin is closed; give it as an argument or with --prompt-file FILE")
    elif opts.prompt == "-" or (opts.prompt is None and not stdin.isatty()):
        try:
            text = stdin.read()
        except UnicodeDecodeError:
            raise UserError("the prompt on stdin is not UTF-8 text") from None
    elif opts.prompt is None:
        raise UserError("no prompt: give it as an argument, with --prompt-file FILE, or on stdin")
    else:
        text = opts.prompt
    if not text:
        raise UserError("the prompt is empty")
    if isinstance(text, str) and not text.isascii():
        from core.prompts import is_unicode  # imports torch: only for a prompt that needs the check

        if not is_unicode(text):  # argv and stdin carry undecodable bytes as lone surrogates
            raise UserError("the prompt is not UTF-8 text")
    return text


def check_before_load(opts: GenerateOptions) -> dict:
    """What can be refused without the model: the record path, the device, the decoder's
    arguments, a model that is neither built in nor a directory. Returns the decoder's arguments."""
    from core.catalog import BUILTIN_MODELS
    from core.records import check_record_path
    from decoders.api import check_device  # imports torch

    if opts.record is not None:
        check_record_path(opts.record)
    check_device(opts.device)
    if opts.model not in BUILTIN_MODELS and not Path(opts.model).is_dir():
        raise UserError(f"model {opts.model!r} is neither a built-in ({', '.join(BUILTIN_MODELS)}) "
                        "nor an existing directory")
    return parse_decoder_args(opts.decoder_args)


def same_file(a, b) -> bool:
    """Whether two streams write to one file or pipe (``2>&1``): their text and lines interleave."""
    try:
        return os.path.samestat(os.fstat(a.fileno()), os.fstat(b.fileno()))
    except (AttributeError, OSError, ValueError):
        return False  # a stream with no file descriptor (io.StringIO) is a file of its own


def run_generate(opts: GenerateOptions, stdin=None, stdout=None, stderr=None) -> dict:
    """Decode the prompt, stream or print it, append the record; returns the JSON document."""
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    if stdout is None:
        raise UserError("stdout is closed: there is nowhere to write the text")
    text = read_prompt(opts, stdin)
    kwargs = check_before_load(opts)
    import transformers

    from decoders.api import open_decoder

    transformers.logging.set_verbosity_error()  # expected "no fast kernel" notices
    dec = open_decoder(opts.model, opts.decoder, device=opts.device, sampler=opts.sampler, **kwargs)
    if isinstance(text, list):
        ids = text
    else:
        ids = dec.encode_chat([{"role": "user", "content": text}]) if opts.chat else dec.encode(text)

    def stream(new_ids, new_text):
        if new_text:
            write_out(stdout, new_text)
    from core.sampling import GREEDY

    sampler = opts.sampler or GREEDY
    gen = dec.generate(ids, opts.max_new_tokens, on_token=None if opts.json else stream, sampler=sampler)
    doc = {"prompt_ids": gen.prompt_ids, "token_ids": gen.token_ids, "text": gen.text,
           "finish_reason": gen.finish_reason, "stats": dataclasses.asdict(gen.stats),
           "decoder": dec.name, "model": dec.model.identity["name"], "sampler": sampler.to_json()}
    if opts.record is not None:
        from core.records import append_record, generation_record

        append_record(opts.record, generation_record(f"generate-{uuid.uuid4().hex[:16]}", gen.prompt_ids,
                                                     gen.token_ids, opts.max_new_tokens, dec.name,
                                                     dec.model.identity["name"], sampler))
    if opts.json:
        write_out(stdout, json.dumps(doc) + "\n")
    elif stdout.isatty() or same_file(stdout, stderr):
        write_out(stdout, "\n")  # the stats line starts a line of its own where a reader sees both
    stderr.write(stats_line(gen) + "\n")
    stderr.flush()
    return doc


class StdoutLost(UserError):
    """The text could not be written to stdout: a full disk, a reader that closed the pipe, an
    encoding that cannot hold it."""


def write_out(stdout, text: str) -> None:
    """``text`` to stdout now, or ``StdoutLost`` saying why not (the decode stops there)."""
    try:
        stdout.write(text)
        stdout.flush()
    except UnicodeEncodeError as exc:
        raise StdoutLost(f"cannot write the text to stdout: its encoding {exc.encoding} cannot hold "
                         f"{exc.object[exc.start:exc.end]!r} (set PYTHONIOENCODING=utf-8)") from None
    except OSError as exc:
        discard_stdout(stdout)
        raise StdoutLost(f"cannot write the text to stdout ({exc.strerror or exc})") from None


def discard_stdout(stdout) -> None:
    """Point stdout's descriptor at /dev/null, so that the interpreter's flush at exit does not
    fail again on what is left in its buffer."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass


def stats_line(gen) -> str:
    s = gen.stats
    ttft = f"{s.time_to_first_token_s:.3f} s" if s.time_to_first_token_s is not None else "n/a"
    mal = f"{s.mean_accepted_length:.2f}" if s.mean_accepted_length is not None else "n/a"
    return (f"{s.new_tokens} tokens ({gen.finish_reason}) in {s.seconds:.2f} s, {s.tokens_per_s:.1f} tok/s, "
            f"TTFT {ttft}, mean accepted length {mal}, drafted {s.drafted}, accepted {s.accepted}")
