"""benchmarks/planner/policy_simulation.py: its batches against counts by hand and against the planner's exact model of
the verifications a batch needs, the policy as the decoder runs it, and bad input in one line."""
import json

import numpy as np
import pytest

from conftest import benchmark_script

from magicdec.planner import AutoGamma, finish_verifications

policy_simulation = benchmark_script("planner/policy_simulation")

COSTS = {0: 1.0, 1: 1.4, 2: 1.8, 3: 2.2}
drawn = policy_simulation.drawn_acceptance


def test_fixed_gamma_batches_by_hand():
    rng = np.random.default_rng(0)
    # every draft kept: 63 tokens in ceil(63 / 3) = 21 gamma-2 verifications; every draft rejected: 63 verifications
    assert policy_simulation.batch_seconds(COSTS, drawn(np.ones(4), rng), 4, 63, gamma=2) == pytest.approx(21 * 1.8)
    assert policy_simulation.batch_seconds(COSTS, drawn(np.zeros(4), rng), 4, 63, gamma=3) == pytest.approx(63 * 2.2)
    assert policy_simulation.batch_seconds(COSTS, drawn(np.full(4, 0.8), rng), 4, 63, gamma=0) == pytest.approx(63 * 1.0)


def test_simulated_batches_need_what_the_planner_computes():
    """The mean verifications of simulated 8-sequence batches at 0.8 and gamma 2 (2000 batches) equal the planner's
    expected maximum over sequences (planner.finish_verifications) within 2%."""
    rng = np.random.default_rng(1)
    alphas = np.full(8, 0.8)
    seconds = [policy_simulation.batch_seconds({2: 1.0}, drawn(alphas, rng), 8, 63, gamma=2) for _ in range(2000)]
    expected = finish_verifications([2], alphas, np.full(8, 63))[0]
    assert np.mean(seconds) == pytest.approx(expected, rel=0.02)


def test_a_policy_that_never_pays_runs_the_plain_steps():
    """Speculation predicted 3x slower per token: the policy stays off, and the batch takes one plain step a token."""
    policy = AutoGamma([1, 2], 0.5)
    policy.costs = {0: 1.0, 1: 5.0, 2: 9.0}
    rng = np.random.default_rng(2)
    assert policy_simulation.batch_seconds(policy.costs, drawn(np.full(4, 0.5), rng), 4, 63, policy) == pytest.approx(63.0)
    assert policy.history == [0] * 63


def test_simulate_an_auto_record(tmp_path, capsys):
    record = {"point": "auto_P4096_B4_greedy", "method": "auto", "B": 4, "gen_len": 64, "synthetic_acceptance": 0.9,
              "planner": {"alpha": 0.9, "spread": 0.0},
              "metrics": {"speculation": {"auto_gamma": {"candidates": [1, 2, 3],
                                                         "seconds_per_verification": {str(g): c for g, c in COSTS.items()}}}}}
    f = tmp_path / "auto_P4096_B4_greedy.json"
    f.write_text(json.dumps(record))
    out = tmp_path / "sim.json"
    assert policy_simulation.main([str(f), "--spread", "recorded", "unknown", "--batches", "50", "--output", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert set(r["rows"]) == {"auto, spread recorded (0.0)", "auto, spread unknown (None)", "fixed gamma 1",
                              "fixed gamma 2", "fixed gamma 3"}
    # at 0.9 every gamma pays here (gamma 3: Omega 3.44 tokens for 2.2 steps), and so does the policy
    assert all(row["mean"] > 1.2 for row in r["rows"].values())
    assert "| auto_P4096_B4_greedy.json | fixed gamma 3 |" in capsys.readouterr().out


def test_not_an_auto_record_is_one_line(tmp_path, capsys):
    f = tmp_path / "baseline.json"
    f.write_text(json.dumps({"point": "baseline_P4096_B4_greedy", "method": "baseline"}))
    for argv in ([str(f)], [str(tmp_path / "missing.json")], [str(f), "--batches", "0"]):
        with pytest.raises(SystemExit) as e:
            policy_simulation.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ")
