"""The steps of an audit that the one-process and the sharded (torchrun) audit share: choosing the
replay device, loading the replay model, every replay-free finding, and writing audit.json.
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import click
import torch
import transformers

from core import determinism
from core.devices import check_device
from core.errors import UserError
from core.models import device_name, load_model
from core.paths import check_output_file, nearest_existing, try_new_file
from core.prompts import load_prompts, parse_corpus_spec

from audit import checks
from audit.report import build_document, printable, render_table, write_document
from audit.stream import BadInput

EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2


def log(message: str) -> None:
    click.echo(printable(message), err=True)


def model_spec_from_header(header: dict) -> str:
    """Built-ins by name; checkpoints by the path recorded (pass --model when it moved)."""
    name = header["model"].get("name")
    if not isinstance(name, str) or not name:
        raise BadInput("header model has no name; pass --model")
    return name


def choose_device(requested: str | None, recorded: dict) -> str:
    """``--device`` (checked: cpu, cuda, cuda:N where present), else the recording device's type
    where this machine has it, else cpu."""
    if requested:
        return check_device(requested)
    if recorded.get("type") == "cuda" and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def check_prompt_ids(run, vocab_size: int, context: int | None = None) -> None:
    """Every prompt id inside the vocabulary, every prompt inside the model's context (a longer
    one would cost a replay out of proportion to anything the model can run)."""
    for p in run.prompts:
        bad = [t for t in p.token_ids if not 0 <= t < vocab_size]
        if bad:
            raise BadInput(f"prompt {p.id!r}: token id {bad[0]} outside the model's vocabulary (0..{vocab_size - 1})")
        if context is not None and len(p.token_ids) > context:
            raise BadInput(f"prompt {p.id!r} has {len(p.token_ids)} tokens, beyond the model's context of {context}")


def replay_device_json(dev: str) -> dict:
    d = torch.device(dev)
    return {"type": d.type, "name": device_name(d)}


def load_replay_model(run, model_spec: str | None, dev: str):
    """The model to replay with, checked against the prompts' token ids."""
    spec = model_spec or model_spec_from_header(run.header)
    try:
        model = load_model(spec, dev)
    except UserError as exc:
        hint = ("; if that checkpoint has moved, give its directory now with --model DIR"
                if model_spec is None and not Path(spec).exists() and ("/" in spec or "\\" in spec) else "")
        raise UserError(f"cannot load model {spec!r} to replay with: {exc}{hint}") from None
    if model_spec is not None:
        refuse_another_model(run.header["model"], model.identity, model_spec)
    check_prompt_ids(run, model.vocab_size, getattr(model.text_config, "max_position_embeddings", None))
    return model


def refuse_another_model(recorded: dict, replayed: dict, model_spec: str) -> None:
    """A ``--model`` the caller named that is not the model the stream records is the caller's
    mistake, not a finding about the stream: refused before anything is replayed or written.
    (The header's own model failing its identity check is a finding: ``file_findings``.)"""
    failing = [f for f in checks.check_model_identity(recorded, replayed) if f["severity"] == "fail"]
    if failing:
        keys = " and ".join(failing[0]["mismatched"])
        raise BadInput(f"--model {model_spec!r} is not the model that recorded the stream ({recorded.get('name')!r}; "
                       f"{keys} differ): leave --model out to replay with the stream's own model")


# snippets a corpus prompt set may ask to be cut again to check its sha256 (stdlib-train:N with a
# larger N is left unchecked, with a warning, rather than costing work the file does not bound)
MAX_REBUILT_PROMPTS = 1 << 14


def prompt_set_spec(source: str) -> str:
    """The ``--prompts`` value that produced a header's prompt source."""
    return source[len("builtin:"):] if source.startswith("builtin:") else source


def reference_prompts(header: dict, model, count: int):
    """The header's prompt set rebuilt here through ``core.prompts.load_prompts`` (the harness's
    own loader), its first ``count`` prompts: ((id, token_ids) per prompt, info); or a string
    saying why it cannot be rebuilt (``checks.check_prompt_set`` turns that into a warning)."""
    info = header.get("prompts")
    source = info.get("source") if isinstance(info, dict) else None
    if not isinstance(source, str) or not source:
        return "the header names no prompt source: the prompt set's sha256 is not checked"
    spec = prompt_set_spec(source)
    try:
        corpus = parse_corpus_spec(spec)
        if corpus is not None and corpus[1] > MAX_REBUILT_PROMPTS:
            return f"prompt set {source!r} has more than {MAX_REBUILT_PROMPTS} prompts: its sha256 is not checked"
        versions = header.get("versions")
        recorded = versions.get("python") if isinstance(versions, dict) else None
        if corpus is not None and recorded != platform.python_version():
            # the snippets are cut from the running Python's standard library, which differs between versions
            return (f"prompt set {source!r} is cut from the Python standard library, recorded under Python "
                    f"{recorded}, here {platform.python_version()}: its sha256 is not checked")
        if not source.startswith("builtin:") and not Path(spec).is_file():
            return f"prompt file {source!r} is not on this machine: its sha256 is not checked"
        prompts, rebuilt = load_prompts(spec, model, count)
    except UserError as exc:
        return f"prompt set {source!r} cannot be rebuilt here ({exc}): its sha256 is not checked"
    return [(p.id, p.token_ids) for p in prompts], rebuilt


def file_findings(run, model) -> tuple[list[dict], list[dict]]:
    """Every finding that needs no replay: (all of them, the failing model-identity ones alone:
    with another model a replay would only report noise)."""
    findings = checks.check_header(run.header, {"torch": torch.__version__, "transformers": transformers.__version__})
    findings += checks.check_determinism(run.header.get("determinism"), determinism.differences)
    model_findings = checks.check_model_identity(run.header["model"], model.identity)
    findings += model_findings
    model_findings = [f for f in model_findings if f["severity"] == "fail"]  # a warning still replays
    findings += checks.check_instrument(run.header)
    findings += checks.check_control_code(run.header)
    findings += checks.check_reference(run.header)
    # another model's tokenizer would cut other prompts: that would repeat the model's finding
    reference = ("the prompt set is not rebuilt: the replayed model is not the one that recorded the stream"
                 if model_findings else reference_prompts(run.header, model, len(run.prompts)))
    findings += checks.check_prompt_set(run.header, run.prompts, reference)
    findings += checks.run_checks(run)
    return findings, model_findings


def check_out_path(out_path: Path, stream: Path, name: str = "audit.json") -> Path:
    """Where the document (``name`` by default) goes, refused before any work when it names a
    directory, the stream, or ``-`` (this document goes to a file, never to stdout)."""
    if str(out_path) == "-":
        raise BadInput(f"--out -: the {name} document is written to a file; name one (e.g. {name})")
    if out_path.is_dir():
        raise BadInput(f"--out {out_path} is a directory; name the file to write (e.g. {out_path / name})")
    if out_path.resolve() == stream.resolve():
        raise BadInput(f"--out {out_path} is the stream itself")
    check_replaceable(out_path)
    return out_path


AUDIT_SCHEMAS = ("qwen35-exact/audit/", "qwen35-exact/retime/", "qwen35-exact/tokens-audit/")


def check_replaceable(out_path: Path) -> None:
    """An existing ``out_path`` is replaced only when it is an audit's own document (an earlier
    audit.json, retime.json or tokens audit): anything else, a stream included, is the user's."""
    try:
        check_output_file(out_path)
    except UserError as exc:
        raise BadInput(str(exc)) from None
    if not out_path.exists():
        return
    try:
        with open(out_path, encoding="utf-8") as fh:
            doc = json.loads(fh.read(64 << 20))
        schema = doc.get("schema") if isinstance(doc, dict) else None
    except (OSError, ValueError):
        schema = None
    if not (isinstance(schema, str) and schema.startswith(AUDIT_SCHEMAS)):
        raise BadInput(f"--out {out_path} exists and is not an audit document: it is not replaced; "
                       "choose another --out, or move it away first")


def check_writable(out_path: Path) -> None:
    """Refused before the replay when ``out_path`` cannot be written (its directory, or the
    nearest one that exists when it is still to be made, refuses a new file), so a long replay
    never ends in an unwritable path. Tried with a probe file, not asked of ``os.access`` (which
    says yes to root on a read-only mount or a kernel file system); leaves nothing behind."""
    existing = nearest_existing(Path(out_path).parent)
    if not existing.is_dir():
        raise BadInput(f"cannot write {out_path}: {existing} is not a directory")
    try:
        try_new_file(existing, Path(out_path).name)
    except OSError as exc:
        raise BadInput(f"cannot write {out_path}: {exc.strerror or exc}") from None


def replay_info(devices: list[dict], tokens: int, seconds: float, workers: int = 1) -> dict:
    """audit.json ``replay``: how the tokens were replayed, and where (one entry per rank; ``workers``
    processes on each rank's device, ``audit.pool``: 1 is the audit's own process, 0 no replay).
    ``ms_per_token`` is the wall time over every token replayed, so with several workers it is the
    pool's throughput, not one walk's pace; the workers' start is not in it."""
    return {"path": "pristine-serial", "device": devices[0]["name"], "tokens_replayed": tokens,
            "seconds": seconds, "ms_per_token": 1000 * seconds / tokens if tokens else None,
            "world_size": len(devices), "ranks": [{"rank": r, "device": d} for r, d in enumerate(devices)],
            "workers": workers}


def finish(run, path: Path, out_path: Path, findings, replayed, info: dict, model_identity: dict,
           params: dict) -> int:
    """Build, write and print audit.json; the exit code from its verdict."""
    doc = build_document(run, run.sha256, findings, replayed, info, model_identity, params)
    write_document(out_path, doc, render_table(doc))
    refresh_report(path, out_path)
    return EXIT_PASS if doc["verdict"] == "pass" else EXIT_FAIL


REPORT_NAME = "report.md"  # what `reports render DIR` writes beside the stream
REPORT_TIMEOUT_S = 600


def refresh_report(stream: Path, out_path: Path) -> None:
    """Re-render the report beside the stream, when there is one and it reads this audit.json, so
    it shows the verdict without a second command. ``python -m reports`` in a subprocess: the audit
    never imports the reports package. A failure is a warning; the audit's own result stands."""
    report = stream.parent / REPORT_NAME
    if not report.is_file() or out_path.resolve() != (stream.parent / "audit.json").resolve():
        return
    try:
        proc = subprocess.run([sys.executable, "-m", "reports", "render", str(stream.parent)],
                              capture_output=True, text=True, timeout=REPORT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        click.echo(f"warning: {report} not refreshed ({exc})", err=True)
        return
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        click.echo(f"warning: {report} not refreshed: {why}", err=True)
    else:
        click.echo(f"refreshed {report}")


def pin_replay_environment() -> None:
    determinism.pin()  # before anything can touch CUDA, as the harness does
    transformers.logging.set_verbosity_error()  # expected "no fast kernel" notices
