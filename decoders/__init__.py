"""Decoders behind one protocol (``decoders.base.Decoder``) and a registry.

``get_decoder("serial")`` builds a registered decoder; ``get_decoder("pkg.module:attr")``
imports ``attr`` (a class or a zero-argument factory) so any decoder can be plugged in.
"""
from __future__ import annotations

import importlib
import inspect
from typing import NamedTuple

from core.errors import UserError

class Registered(NamedTuple):
    target: str  # "module:attr"
    description: str  # one line
    # the --decoder-arg names its constructor takes, listed here so that `harness list` needs no
    # torch (tests/test_registry.py holds them to the constructors' signatures)
    args: tuple[str, ...] = ()


SPEC_ARGS = ("max_depth", "depth", "stop", "shortlist", "head", "explore_every", "online_costs", "coupled",
             "lazy_rows", "capacity")
REGISTRY: dict[str, Registered] = {
    "serial": Registered("decoders.serial:SerialDecoder",
                         "the pristine control: HF forward + DynamicCache, one token per forward"),
    "spec-naive": Registered("decoders.spec_naive:SpecNaiveDecoder",
                             "baseline MTP speculation: fixed k=3 drafts, batched HF verify, repair by re-running",
                             ("k",)),
    "fast-serial": Registered("decoders.fast_serial:FastSerialDecoder",
                              "exact serial decoding on the fast runtime: static state, CUDA-graphed steps",
                              ("capacity", "stack_gate_up", "read_ahead")),
    "spec": Registered("decoders.spec:SpecDecoder",
                       "exact MTP speculation: persistent head cache, adaptive depth, bit-exact verify windows, "
                       "rollback from captured state", SPEC_ARGS),
    "spec-instrument": Registered("decoders.spec:InstrumentedSpecDecoder",
                                  "benchmark instrument: spec with drafts replaced by the control's token with "
                                  "probability alpha, or where a recorded acceptance trace says (trace=FILE from "
                                  "python -m decoders.trace); never scored by the audit",
                                  ("alpha", "trace", "seed", *SPEC_ARGS)),
}
# the fastest decoder the audit gates as exact (.ci/run); spec-naive stays as a baseline only
DEFAULT_DECODER = "spec"
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


def parse_decoder_args(pairs) -> dict:
    """``KEY=VALUE`` strings to keyword arguments; values are read as int, float, true/false/none,
    else kept as strings."""
    out = {}
    for pair in pairs or ():
        key, sep, raw = pair.partition("=")
        if not sep or not key.isidentifier():
            raise UserError(f"decoder argument {pair!r}: expected KEY=VALUE")
        low = raw.lower()
        if low in ("true", "false"):
            value = low == "true"
        elif low == "none":
            value = None
        else:
            try:
                value = int(raw)
            except ValueError:
                try:
                    value = float(raw)
                except ValueError:
                    value = raw
        out[key] = value
    return out


def get_decoder(spec: str, **kwargs):
    """A fresh decoder object for a registered name or a ``module:attr`` reference; ``kwargs``
    (from ``--decoder-arg``) go to its constructor."""
    if spec in REGISTRY:
        factory = _import(REGISTRY[spec].target)
    elif ":" in spec:
        factory = _import(spec)
    else:
        known = ", ".join(sorted(REGISTRY))
        raise UserError(f"unknown decoder {spec!r}; registered: {known}; or give 'package.module:attr'")
    # a class or factory function is called; an already-built decoder object is used as it is
    if kwargs and not callable(factory):
        raise UserError(f"decoder {spec!r} is a built object and takes no arguments")
    try:
        decoder = factory(**kwargs) if callable(factory) else factory
    except (TypeError, ValueError) as exc:
        if not kwargs:
            raise UserError(f"decoder {spec!r} could not be built with no arguments ({type(exc).__name__}: {exc}); "
                            "a plug-in is a decoder class or a zero-argument factory") from None
        # name the arguments the constructor takes rather than Python's TypeError
        takes, open_ended, readable = constructor_args(factory)
        listing = (", ".join(takes.values()) or "none") if readable else "unknown (no readable signature)"
        given = " ".join(f"{k}={v!r}" for k, v in kwargs.items())
        unknown = [k for k in kwargs if k not in takes]
        if unknown and readable and not open_ended:
            raise UserError(f"decoder {spec!r} takes no argument {', '.join(map(repr, unknown))} "
                            f"(given: {given}); its arguments: {listing}") from None
        raise UserError(f"decoder {spec!r} rejected {given}: {exc}; its arguments: {listing}") from None
    for attr in ("name", "prepare", "decode", "config"):
        if not hasattr(decoder, attr):
            raise UserError(f"decoder {spec!r} does not follow the protocol: it has no {attr!r}")
    return decoder


def constructor_args(factory) -> tuple[dict[str, str], bool, bool]:
    """The keyword arguments ``factory`` takes, from its signature and its bases' where it passes
    ``**kwargs`` on: name -> "name" or "name=default"; whether it still takes any keyword (a
    ``**kwargs`` nothing names); whether every signature could be read."""
    targets = [k for k in factory.__mro__[:-1] if "__init__" in vars(k)] if isinstance(factory, type) else [factory]
    takes, open_ended = {}, True
    for target in targets:
        if not open_ended:
            break
        try:
            params = inspect.signature(target).parameters.values()
        except (TypeError, ValueError):  # no readable signature: name nothing
            return takes, open_ended, False
        for p in params:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in takes:
                takes[p.name] = p.name if p.default is p.empty else f"{p.name}={p.default!r}"
        open_ended = any(p.kind is p.VAR_KEYWORD for p in params)
    return takes, open_ended, True
