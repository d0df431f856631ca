"""The package's version and the ``--version`` option every command carries."""
from __future__ import annotations

import configparser
from importlib import metadata
from pathlib import Path

import click

DISTRIBUTION = "qwen35-exact"


def package_version() -> str:
    """The installed distribution's version; from a source tree that is not installed, setup.cfg's."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        cfg = configparser.ConfigParser()
        cfg.read(Path(__file__).resolve().parent.parent / "setup.cfg")
        return cfg.get("metadata", "version", fallback="unknown")


def version_option(func):
    """``--version``: prints ``PROG, version X`` and exits, before any heavy import."""
    return click.version_option(package_version(), "--version", prog_name=DISTRIBUTION,
                                message="%(prog)s %(version)s")(func)
