"""The decoder protocol and registry: registered names, ``module:attr`` plug-ins, clear errors."""
from __future__ import annotations

import pytest

import decoders
from decoders import CONTROL, DEFAULT_DECODER, REGISTRY, get_decoder
from decoders.base import DecodeResult, Decoder, DecodeStats
from core.errors import UserError

PROMPT = [319, 284, 75, 404, 289, 345, 456, 284]


def test_registry_contents():
    assert {"serial", "spec-naive"} <= set(REGISTRY)
    assert CONTROL == "serial"
    assert DEFAULT_DECODER in REGISTRY
    for name, (target, desc, _) in REGISTRY.items():
        assert ":" in target and desc, name


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_harness_lists_exactly_the_arguments_each_constructor_takes(name):
    """`harness list` names the --decoder-arg keys from the registry (no torch import there):
    they must be the constructor's own, all of them."""
    takes, open_ended, readable = decoders.constructor_args(decoders._import(REGISTRY[name].target))
    assert readable and not open_ended
    assert sorted(REGISTRY[name].args) == sorted(takes)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_registered_decoder_follows_protocol_and_decodes(tiny, name):
    dec = get_decoder(name)
    assert isinstance(dec, Decoder)
    assert dec.name == name
    assert get_decoder(name) is not dec  # a fresh object each time
    dec.prepare(tiny)
    cfg = dec.config()
    assert isinstance(cfg, dict)
    result = dec.decode(PROMPT, 10)
    assert isinstance(result, DecodeResult) and isinstance(result.stats, DecodeStats)
    assert 1 <= len(result.tokens) <= 10
    assert all(isinstance(t, int) and 0 <= t < tiny.vocab_size for t in result.tokens)
    assert not any(t in tiny.eos_token_ids for t in result.tokens[:-1])
    stats = result.stats.to_json()
    assert stats["forwards"] >= 1
    assert stats["accepted"] <= stats["drafted"]
    # N = 1 gives exactly one token
    assert len(dec.decode(PROMPT, 1).tokens) == 1


def test_spec_naive_records_rounds(tiny):
    dec = get_decoder("spec-naive")
    dec.prepare(tiny)
    stats = dec.decode(PROMPT, 12).stats.to_json()
    rounds = sum(stats["accept_hist"].values())
    assert rounds >= 1 and stats["drafted"] == 3 * rounds
    assert sum(stats["drafted_by_depth"]) == stats["drafted"]
    assert sum(stats["accepted_by_depth"]) == stats["accepted"]
    assert dec.config()["k"] == 3


def test_spec_naive_refuses_model_without_mtp(tiny):
    import dataclasses

    no_head = dataclasses.replace(tiny, mtp=None, mtp_missing="the checkpoint has no mtp.* weights")
    with pytest.raises(UserError, match=r"spec-naive.*MTP head.*no mtp"):
        get_decoder("spec-naive").prepare(no_head)
    get_decoder("serial").prepare(no_head)  # the control needs no head


@pytest.mark.parametrize("attr,tag", [("WrappedSerial", "class"), ("make_wrapped_serial", "factory"),
                                      ("INSTANCE", "instance")])
def test_plugin_by_module_attr(tiny, attr, tag):
    import plugin_decoders

    dec = get_decoder(f"plugin_decoders:{attr}")
    assert isinstance(dec, Decoder)
    assert isinstance(dec, plugin_decoders.WrappedSerial)
    assert dec.config() == {"tag": tag}
    if attr == "INSTANCE":
        assert dec is plugin_decoders.INSTANCE
    dec.prepare(tiny)
    serial = get_decoder("serial")
    serial.prepare(tiny)
    assert dec.decode(PROMPT, 6).tokens == serial.decode(PROMPT, 6).tokens


def test_registered_target_by_module_attr():
    from decoders.serial import SerialDecoder

    assert isinstance(get_decoder("decoders.serial:SerialDecoder"), SerialDecoder)


@pytest.mark.parametrize("spec,needles", [
    ("no-such-decoder", ("unknown decoder", "'no-such-decoder'", "serial", "spec-naive", "module:attr")),
    ("decoders.serial", ("unknown decoder",)),
    ("no_such_module_xyz:Thing", ("cannot import", "no_such_module_xyz")),
    ("plugin_decoders:Missing", ("plugin_decoders", "no attribute", "'Missing'")),
    (":Thing", ("expected a registered name",)),
    ("plugin_decoders:", ("expected a registered name",)),
    ("plugin_decoders:LacksDecode", ("does not follow the protocol", "'decode'")),
    ("plugin_decoders:LacksName", ("does not follow the protocol", "'name'")),
    ("plugin_decoders:NOT_A_DECODER", ("does not follow the protocol",)),
    ("plugin_decoders:make_nothing", ("does not follow the protocol",)),
])
def test_bad_decoder_specs_are_user_errors(spec, needles):
    with pytest.raises(UserError) as info:
        get_decoder(spec)
    msg = str(info.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, (needle, msg)


@pytest.mark.parametrize("args,needle", [
    ({"depth": 20}, "rejected depth=20: depth must be within 0..15"),
    ({"max_depth": 2, "depth": 5}, "rejected max_depth=2 depth=5: depth 5 exceeds max_depth 2"),
    ({"max_depth": 99}, "rejected max_depth=99: max_depth must be within 0..15"),
])
def test_spec_depth_errors_name_the_argument(args, needle):
    with pytest.raises(UserError) as info:
        get_decoder("spec", **args)
    msg = str(info.value)
    assert "\n" not in msg and needle in msg, msg


def test_bad_decoder_via_cli(tmp_path):
    from click.testing import CliRunner

    from harness.cli import main

    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["time", "--decoder", "plugin_decoders:LacksDecode", "--out", str(out)])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "error: decoder 'plugin_decoders:LacksDecode' does not follow the protocol: it has no 'decode'"]
    assert not out.exists()


def test_protocol_is_runtime_checkable():
    import plugin_decoders

    assert isinstance(plugin_decoders.INSTANCE, Decoder)
    assert not isinstance(plugin_decoders.LacksDecode(), Decoder)
    assert not isinstance(object(), Decoder)
    assert decoders.base.Decoder is Decoder
