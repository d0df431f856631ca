"""Decoders behind one protocol (``decoders.base.Decoder``) and a registry.

``get_decoder("serial")`` builds a registered decoder; ``get_decoder("pkg.module:attr")``
imports ``attr`` (a class or a zero-argument factory) so any decoder can be plugged in.
"""
from __future__ import annotations

import importlib

from harness.errors import UserError

REGISTRY: dict[str, tuple[str, str]] = {
    # name: ("module:attr", one-line description)
    "serial": ("decoders.serial:SerialDecoder", "the pristine control: HF forward + DynamicCache, one token per forward"),
    "spec-naive": ("decoders.spec_naive:SpecNaiveDecoder",
                   "baseline MTP speculation: fixed k=3 drafts, batched HF verify, repair by re-running"),
    "fast-serial": ("decoders.fast_serial:FastSerialDecoder",
                    "exact serial decoding on the fast runtime: static state, CUDA-graphed steps"),
}
DEFAULT_DECODER = "spec-naive"
CONTROL = "serial"


def _import(target: str):
    mod_name, _, attr = target.partition(":")
    if not mod_name or not attr:
        raise UserError(f"decoder {target!r}: expected a registered name or 'package.module:attr'")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as exc:
        raise UserError(f"decoder {target!r}: cannot import {mod_name} ({exc})") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UserError(f"decoder {target!r}: {mod_name} has no attribute {attr!r}") from None


def get_decoder(spec: str):
    """A fresh decoder object for a registered name or a ``module:attr`` reference."""
    if spec in REGISTRY:
        factory = _import(REGISTRY[spec][0])
    elif ":" in spec:
        factory = _import(spec)
    else:
        known = ", ".join(sorted(REGISTRY))
        raise UserError(f"unknown decoder {spec!r}; registered: {known}; or give 'package.module:attr'")
    # a class or factory function is called; an already-built decoder object is used as it is
    decoder = factory() if callable(factory) else factory
    for attr in ("name", "prepare", "decode", "config"):
        if not hasattr(decoder, attr):
            raise UserError(f"decoder {spec!r} does not follow the protocol: it has no {attr!r}")
    return decoder
