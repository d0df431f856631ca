"""bench/policy_sim.py: the decode loop of ``spec`` on simulated time, with the real policy."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from decoders.policy import Costs

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("policy_sim", ROOT / "bench" / "policy_sim.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["policy_sim"] = module
    spec.loader.exec_module(module)
    return module


COSTS = Costs(step=1.0, draft=0.05, verify={w: 1 + 0.1 * (w - 1) for w in range(1, 8)})


def test_every_draft_right_settles_at_the_deepest_round(sim):
    """alpha 1: the policy goes to max_depth, and the ratio is what its rounds cost."""
    out = sim.simulate(sim.Alpha(1.0, seed=0), COSTS, 400, sim.Settings(max_depth=6, prompt_len=1))
    deepest = 7 / (6 * COSTS.draft + COSTS.verify[7])
    assert out.tokens == 400 and out.plain_steps == 0 and out.probes == 0
    assert 0.95 * deepest < COSTS.step * 1e3 / out.ms_per_token() <= deepest
    assert out.accepted / out.drafting_rounds > 5


def test_the_oracle_drafts_exactly_what_will_be_accepted(sim):
    """The bound: every round drafts its accepted run exactly (never a rejected draft), or steps."""
    out = sim.simulate(sim.Alpha(0.7, seed=1), COSTS, 300, sim.Settings(stop="oracle"))
    real = sim.simulate(sim.Alpha(0.7, seed=1), COSTS, 300, sim.Settings())
    assert out.tokens == 300 and out.accepted + out.drafting_rounds + out.plain_steps >= 299
    assert out.ms_per_token() < real.ms_per_token()


def test_nothing_right_settles_at_plain_steps(sim):
    for stop in ("depth", "confidence"):
        out = sim.simulate(sim.Alpha(0.0, seed=0), COSTS, 400, sim.Settings(stop=stop))
        assert out.accepted == 0 and out.plain_steps > 350 and out.drafting_rounds < 10
        assert COSTS.step * 1e3 / out.ms_per_token() > 0.95


def test_a_trace_is_walked_as_the_instrument_replays_it(sim, tmp_path):
    """A trace whose drafts are right exactly at even positions, to depth 2: every drafting round
    from an even position keeps what the bits say, and confidence stopping, told which drafts
    are right, never drafts past a doubted one."""
    from decoders import trace as T

    n = 64
    bits = ["11" if t % 2 == 0 else "00" for t in range(n - 2)] + ["1", ""]
    conf = [b.replace("1", "9") for b in bits]
    row = T.TraceRow("p", "0" * 64, list(range(n)), bits, conf=conf)
    for stop in ("depth", "confidence"):
        out = sim.simulate(sim.TraceAcceptance(row), COSTS, n, sim.Settings(max_depth=2, stop=stop))
        assert out.tokens == n and out.accepted <= 2 * out.drafting_rounds
    costs_file = tmp_path / "costs.json"
    costs_file.write_text(json.dumps({"configs": {"a": {}, "b": {"costs_s": {"step": 1.0, "draft": 0.05,
                                      "verify": {str(w): v for w, v in COSTS.verify.items()}}}}}))
    assert sim.costs_from(f"{costs_file}:b").verify == COSTS.verify
    assert sim.costs_from(str(costs_file)).step == 1.0  # the first config with costs
    cheaper = sim.scaled(COSTS, draft=0.5, rows=0.25)
    assert cheaper.draft == 0.025 and cheaper.verify[1] == 1.0 and cheaper.verify[5] == pytest.approx(1.1)


def test_cli_prints_one_table_row_per_setting_and_refuses_bad_input(sim, tmp_path, capsys):
    costs_file = tmp_path / "costs.json"
    costs_file.write_text(json.dumps({"costs_s": {"step": 1.0, "draft": 0.05,
                                                  "verify": {str(w): v for w, v in COSTS.verify.items()}}}))
    out = tmp_path / "sim.json"
    assert sim.main(["--costs", str(costs_file), "--alpha", "0.7", "--stop", "depth,confidence", "--prompts", "2",
                     "-n", "64", "--json", str(out)]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| alpha")]
    assert len(table) == 2 and len(json.loads(out.read_text())["rows"]) == 2
    with pytest.raises(SystemExit):
        sim.main(["--costs", str(costs_file), "--alpha", "0.7", "--stop", "never"])
    (tmp_path / "none.json").write_text("{}")
    for costs, needle in (("none.json", "no costs_s"), ("missing.json", "no such file")):
        with pytest.raises(SystemExit, match=needle):
            sim.main(["--costs", str(tmp_path / costs), "--alpha", "0.7"])


def test_one_decoder_carries_the_head_acceptance_from_decode_to_decode(sim):
    """As `spec`: a head that predicts nothing opens only the first decode with windows; with
    carry off every decode starts from the built-in prior and pays them again."""
    accs = [sim.Alpha(0.0, seed=s) for s in range(3)]
    carried = sim.decodes(accs, COSTS, 200, sim.Settings())
    fresh = sim.decodes([sim.Alpha(0.0, seed=s) for s in range(3)], COSTS, 200, sim.Settings(carry=False))
    assert carried[0] == fresh[0] and carried[0].drafting_rounds > 0 and carried[0].learnt < 0.3
    assert all(o.drafting_rounds == 0 for o in carried[1:])
    assert all(o.drafting_rounds == fresh[0].drafting_rounds for o in fresh)
    assert all(c.seconds <= f.seconds for c, f in zip(carried, fresh))
