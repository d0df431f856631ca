"""The audit's import rule: core only; never harness (timing, cli, the retime worker) or
decoders, so the code under audit cannot vouch for itself.
(tests/test_audit_replay.py checks the same after a whole audit run.)"""
import ast
import subprocess
import sys
from pathlib import Path

import torch

AUDIT_DIR = Path(__file__).resolve().parent.parent / "audit"
# core.dist is allowed because `audit replay` under torchrun shards the replay exactly as
# `harness time` shards the timing (prompt i -> rank i % world_size) and joins the same job the
# same way; dist.py holds only that plumbing (environment, process group, store, sharding) and
# imports no timing or decoder code, so it cannot vouch for what the audit judges.
ALLOWED_HARNESS = {"core.schema", "core.models", "core.determinism", "core.errors", "core.dist"}


def forbidden(name: str) -> bool:
    return name.split(".")[0] in ("decoders", "harness")


def test_import_audit_cli_pulls_in_nothing_forbidden():
    code = ("import sys, audit.cli, audit.replay_audit, audit.retime, audit.tokens\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('decoders', 'harness')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_audit_sources_import_only_allowed_harness_modules():
    """Static: every import statement in audit/ and its subpackages (commands/, retime/), lazy ones
    inside functions included."""
    paths = sorted(AUDIT_DIR.rglob("*.py"))
    assert {"commands", "retime"} <= {p.parent.name for p in paths}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                names = [base] + [f"{base}.{a.name}" for a in node.names if base == "harness"]
            else:
                continue
            for name in names:
                where = path.relative_to(AUDIT_DIR)
                assert not forbidden(name), f"{where} imports {name}"
                if name.startswith("harness."):
                    assert name in ALLOWED_HARNESS, f"{where} imports {name}"


def test_pristine_replay_matches_the_serial_control(tiny):
    """The audit's own serial path is bit-for-bit the control's (decoders.serial, imported here
    by the test only): same greedy tokens, and the control's stream replays as exact."""
    from audit.replay import PristineSerial, replay_prompt
    from decoders.serial import SerialDecoder

    control = SerialDecoder()
    control.prepare(tiny)
    prompt = list(range(40, 90))
    tokens = control.decode(prompt, 20).tokens
    result, greedy = replay_prompt(PristineSerial(tiny), prompt, [tuple(tokens)], 20, set(tiny.eos_token_ids))
    assert greedy == tokens and result[tuple(tokens)] is None
    assert torch.are_deterministic_algorithms_enabled()
