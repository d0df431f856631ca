"""Static state sized once, before timing (CPU, tiny): ``reserve`` makes room for the longest
decode, a decode within it builds nothing, one past the old default of 4096 positions is exact,
and ``harness time`` flags a leg whose decode built a runtime."""
from __future__ import annotations

import copy
import dataclasses
import random

import pytest
from click.testing import CliRunner

from audit import checks
from audit.stream import load_run
from core.errors import UserError
from core.schema import read_stream
from decoders.api import ExactDecoder, open_decoder
from decoders.base import reserve_positions
from decoders.fast_serial import FastSerialDecoder
from decoders.runtime import sizing
from decoders.serial import SerialDecoder
from decoders.spec import InstrumentedSpecDecoder, SpecDecoder
from harness.cli import main

LONG_PROMPT, LONG_N = 4000, 200  # 4200 positions: past the default capacity of 4096


@pytest.fixture(scope="module")
def endless(tiny):
    """tiny with an EOS it never emits, so a long decode runs its whole length."""
    return dataclasses.replace(tiny, eos_token_ids=(tiny.vocab_size + 7,))


@pytest.fixture(scope="module")
def long_case(endless):
    rng = random.Random(0)
    prompt = [rng.randrange(3, endless.vocab_size) for _ in range(LONG_PROMPT)]
    serial = SerialDecoder()
    serial.prepare(endless)
    want = serial.decode(prompt, LONG_N).tokens
    assert len(want) == LONG_N
    return prompt, want


def test_capacity_rounds_up_by_steps_not_doubling():
    assert sizing.capacity_for(1) == 256 and sizing.capacity_for(256) == 256
    assert sizing.capacity_for(4097) == 4352
    assert sizing.capacity_for(17_000) == 17_152  # not 32768
    assert sizing.capacity_for(300, floor=4096) == 4096


@pytest.mark.parametrize("make", [FastSerialDecoder, lambda: SpecDecoder(max_depth=3),
                                  lambda: InstrumentedSpecDecoder(alpha=0.8, max_depth=3)],
                         ids=["fast-serial", "spec", "spec-instrument"])
def test_reserved_up_front_a_long_decode_builds_nothing_and_is_exact(endless, long_case, make):
    prompt, want = long_case
    dec = make()
    dec.prepare(endless)
    reserve_positions(dec, len(prompt) + LONG_N)
    sizing_cfg = dec.config()["sizing"]
    assert sizing_cfg["capacity"] >= len(prompt) + LONG_N + dec.margin
    assert sizing_cfg["capacity"] % sizing.STEP == 0
    assert sizing_cfg["static_bytes"] == dec.runtime.nbytes() > 0
    if isinstance(dec, SpecDecoder):
        assert sizing_cfg["drafter_capacity"] == sizing_cfg["capacity"]
        assert sizing_cfg["drafter_bytes"] == dec.drafter.nbytes()
    built = sizing.builds()
    if hasattr(dec, "prepare_prompt"):  # the instrument's untimed preparation fits the reservation too
        dec.prepare_prompt(prompt, LONG_N)
    assert dec.decode(prompt, LONG_N).tokens == want
    assert sizing.builds() == built


def test_a_decode_past_the_reservation_still_grows_and_stays_exact(endless, long_case):
    prompt, want = long_case
    dec = FastSerialDecoder(capacity=64)
    dec.prepare(endless)
    built = sizing.builds()
    assert dec.decode(prompt, LONG_N).tokens == want
    assert sizing.builds() == built + 1
    assert dec.runtime.capacity == sizing.capacity_for(len(prompt) + LONG_N + 1)


def test_reserve_never_shrinks(tiny):
    dec = FastSerialDecoder()
    dec.prepare(tiny)
    built = sizing.builds()
    dec.reserve(100)
    assert dec.runtime.capacity == sizing.DEFAULT_CAPACITY and sizing.builds() == built


def test_a_decoder_without_reserve_is_left_alone(tiny):
    serial = SerialDecoder()
    serial.prepare(tiny)
    reserve_positions(serial, 10_000)  # nothing to size: no error


# --------------------------------------------------------------------------- harness time


def run_time(out, decoder: str, n: int) -> list[dict]:
    # no warm-up: the first timed leg is the first decode of the prompt's length
    args = ["time", "--decoder", decoder, "--model", "tiny", "--device", "cpu", "--limit", "1", "-n", str(n),
            "--legs", "1", "--warmup-tokens", "0", "--out", str(out)]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    records, _ = read_stream(out / "stream.jsonl")
    return records


def test_harness_time_reserves_before_timing(tmp_path):
    records = run_time(tmp_path / "run", "fast-serial", 40)
    header = records[0]
    prompt = next(r for r in records if r["type"] == "prompt")
    assert header["reserved_positions"] == len(prompt["token_ids"]) + 40
    assert header["candidate"]["config"]["sizing"]["capacity"] >= header["reserved_positions"]
    assert not [r for r in records if r["type"] == "violation"]


def test_harness_time_flags_a_runtime_built_inside_a_timed_leg(tmp_path):
    out = tmp_path / "run"
    records = run_time(out, "plugin_decoders:Unreserved", 40)
    violations = [r for r in records if r["type"] == "violation"]
    assert [v["at"] for v in violations] == ["in leg candidate#0 of prompt " + records[1]["id"]]
    assert "built 1 runtime(s)" in violations[0]["problem"]
    found = checks.check_violations(load_run(out / "stream.jsonl"))
    assert [f["severity"] for f in found] == ["fail"] and "inside this timed leg" in found[0]["message"]


# --------------------------------------------------------------------------- the API, the retime worker


def test_the_api_grows_a_decoder_before_the_generation_clock_starts(endless, long_case):
    prompt, want = long_case
    # the API refuses positions past the model's context (tiny's: 4096): this one declares 8192
    config = copy.copy(endless.text_config)
    config.max_position_embeddings = 8192
    endless = dataclasses.replace(endless, text_config=config)
    fast = FastSerialDecoder()
    fast.prepare(endless)
    seen = []  # the runtimes built so far, at each read of the generation's clock

    def clock() -> float:
        seen.append(sizing.builds())
        return float(len(seen))

    dec = ExactDecoder(fast, endless, clock=clock)
    built = sizing.builds()
    assert dec.generate(prompt, LONG_N).token_ids == want
    assert sizing.builds() == built + 1 and seen and set(seen) == {built + 1}
    assert dec.generate(prompt, LONG_N).token_ids == want  # room reserved by the first: no build
    assert sizing.builds() == built + 1


def test_open_decoder_sizes_for_max_positions():
    dec = open_decoder("tiny", "fast-serial", device="cpu", max_positions=4096)  # tiny's whole context
    assert dec.decoder.runtime.capacity == sizing.capacity_for(4097) > sizing.DEFAULT_CAPACITY
    with pytest.raises(UserError, match="max_positions"):
        open_decoder("tiny", "fast-serial", device="cpu", max_positions=0)


def test_the_retime_worker_reserves_its_positions():
    from harness.worker import setup

    _, dec = setup("tiny", "cpu", "fast-serial", {}, positions=5000)
    assert dec.runtime.capacity == sizing.capacity_for(5001)


def test_retime_sizes_workers_for_the_longest_fresh_request_and_ignores_sizing_in_configs():
    from audit.retime.command import longest_request
    from audit.retime.fresh import Draw, FreshPrompt
    from audit.retime.judge import settled
    from audit.retime.workers import recorded_sides, worker_command

    fp = lambda n, spare=None: FreshPrompt(f"f{n}", [5] * n, [6] * n, "p", spare)  # noqa: E731
    draw = Draw([fp(10), fp(30, spare=fp(70))], [fp(50)], {})
    assert longest_request(draw, 8) == 78
    header = {"control": {"name": "serial"}, "candidate": {"name": "fast-serial", "spec": "fast-serial", "args": {}}}
    command = worker_command(recorded_sides(header, False)[1], "tiny", "cpu", 78)
    assert command[command.index("--positions") + 1] == "78"
    config = {"sizing": {"capacity": 4096}, "graphs": False, "costs_s": {"step": 1.0}}
    assert settled(config) == {"graphs": False}
