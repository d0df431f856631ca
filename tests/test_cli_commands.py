"""Every command's front door: ``--version``, a fast start, and the harness's integrity watch
covering every module of the package, however its code is split."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from core.version import package_version

ROOT = Path(__file__).resolve().parent.parent


def groups():
    from audit.cli import main as audit_main
    from harness.cli import main as harness_main
    from reports.cli import main as reports_main

    return {"harness": harness_main, "audit": audit_main, "reports": reports_main}


@pytest.mark.parametrize("name", ["harness", "audit", "reports"])
def test_every_group_and_subcommand_prints_its_version(name):
    group = groups()[name]
    runner = CliRunner()
    for argv in [["--version"], *([sub, "--version"] for sub in group.commands)]:
        result = runner.invoke(group, argv)
        assert result.exit_code == 0, (argv, result.output)
        assert result.output.strip() == f"qwen35-exact {package_version()}", argv


def test_harness_list_and_help_start_without_torch():
    code = ("import sys\nfrom harness.cli import main\n"
            "try:\n    main(['list'])\nexcept SystemExit:\n    pass\n"
            "print('TORCH', 'torch' in sys.modules, 'TRANSFORMERS', 'transformers' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "TORCH False TRANSFORMERS False" in proc.stdout, proc.stdout + proc.stderr
    assert "synthetic-9b" in proc.stdout and "stdlib-heldout" in proc.stdout and "spec-instrument" in proc.stdout


@pytest.mark.parametrize("argv", [[], ["replay"], ["tokens"], ["retime"]])
def test_audit_help_starts_without_torch(argv):
    code = ("import sys\nfrom audit.cli import main\n"
            f"try:\n    main({argv + ['--help']!r})\nexcept SystemExit:\n    pass\n"
            "print('TORCH', 'torch' in sys.modules, 'TRANSFORMERS', 'transformers' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "TORCH False TRANSFORMERS False" in proc.stdout, proc.stdout + proc.stderr
    assert "Usage: " in proc.stdout


def test_the_watch_covers_every_module_of_the_harness_package():
    from harness.watch import WATCHED_MODULES

    on_disk = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "harness").rglob("*.py")}
    on_disk = {m.removesuffix(".__init__") for m in on_disk}
    assert on_disk <= set(WATCHED_MODULES)
    assert {"core.schema", "core.determinism"} <= set(WATCHED_MODULES)


def test_the_time_path_loads_its_modules_before_the_watch_begins():
    """A watched module first loaded after the run began would read as replaced: every module the
    time command runs on is imported with the command itself."""
    code = ("import sys\nimport harness.cli\n"
            "print(sorted(m for m in ('harness.run', 'harness.prepare', 'harness.header', 'harness.sharded', "
            "'harness.table', 'harness.timed', 'harness.progress', 'harness.load', 'harness.options') "
            "if m not in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


@pytest.mark.parametrize("name,argv,words", [
    ("harness", ["generate", "x", "-n", "0"], "'--max-new-tokens' / '-n': 0 is not in the range x>=1"),
    ("harness", ["serve", "--queue-size", "0"], "'--queue-size': 0 is not in the range x>=1"),
    ("harness", ["time", "--bogus"], "No such option '--bogus'"),
    ("harness", ["time", "--out", ""], "Invalid value for '--out': an empty path names no file"),
    ("audit", ["tokens", "x.jsonl", "--out", " "], "Invalid value for '--out': an empty path names no file"),
    ("audit", ["replay"], "Missing argument"),
    ("reports", ["render"], "Missing argument 'RUN_DIR'"),
])
def test_a_usage_error_is_one_error_line_naming_help(name, argv, words):
    result = CliRunner().invoke(groups()[name], argv, prog_name=name)
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], result.output
    assert lines[0].endswith(f"(see {name} {argv[0]} --help)")


@pytest.mark.parametrize("argv", [
    ["harness", "generate", "--model", "tiny", "-n", "2", "hi"],
    ["audit", "tokens", "--model", "tiny", "none.jsonl"],
    ["heads", "train", "--model", "tiny", "--prompts", "dev", "-n", "4", "--out", "h"],
    ["training", "--smoke", "--out", "t"],
    ["decoders.trace", "--model", "tiny", "--out", "t.json"],
    ["decoders.shortlist", "--model", "tiny", "--out", "s.json"],
], ids=lambda argv: argv[0])
def test_a_ctrl_c_while_a_command_imports_its_code_is_one_line(argv, tmp_path):
    """A Ctrl-C in the seconds a command spends importing torch and transformers: one ``error:``
    line and exit 130, as a Ctrl-C anywhere else; never a traceback, nothing left behind."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "interrupt_on_import.py"), *argv], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 130, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: interrupted"), proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_ctrl_c_after_the_command_is_done_changes_nothing():
    """A Ctrl-C in the shutdown after a command has written and said so (here: from an exit
    handler) neither prints a traceback nor turns its status into 130."""
    code = ("import atexit, os, signal\nfrom core.errors import run_cli\n"
            "def main():\n    print('wrote x', flush=True)\n"
            "    atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), print('shut down', flush=True)))\n"
            "    return 3\nrun_cli(main)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "wrote x\nshut down\n", "")
