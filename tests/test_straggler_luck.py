"""benchmarks/planner/straggler_luck.py: its simulated batches agree with the planner's exact expected verification counts
(an independent computation: sampling, not the planner's recursion), and on hand-written records it names the
gamma the model expects fastest from the measured step times, the measured fastest, and z-scores of the counts."""
import json

import numpy as np
import pytest

from conftest import benchmark_script

from magicdec.planner import finish_verifications, spread_alphas

straggler_luck = benchmark_script("planner/straggler_luck")


@pytest.mark.parametrize("gamma", [1, 2, 4])
def test_simulated_batches_match_the_planners_expected_count(gamma):
    alphas = spread_alphas(0.8, 0.05, 32)
    simulated = straggler_luck.simulate(alphas, gamma, 63, batches=3000, seed=gamma)
    expected = finish_verifications([gamma], alphas, np.full(32, 63))[0]
    assert simulated.mean() == pytest.approx(expected, rel=0.02)
    assert 0.5 < simulated.std() < 0.15 * expected  # the batch-to-batch luck the benchmark reports


def test_luck_on_hand_written_records(tmp_path, capsys):
    # gamma 1: 40 verifications of 10 ms; gamma 2: 30 of 14 ms (measured fastest: gamma 1, 400 vs 420 ms)
    for gamma, its, ms in ((1, 40, 10.0), (2, 30, 14.0)):
        rec = {"point": f"g{gamma}", "method": "selfspec", "prefix_len": 4096, "B": 16, "decoding": "greedy",
               "budget": 512, "gamma": gamma, "gen_len": 64, "metrics": {"alpha": 0.8, "iterations": its, "ms_per_step": ms}}
        (tmp_path / f"g{gamma}.json").write_text(json.dumps(rec))
    out = tmp_path / "luck.json"
    assert straggler_luck.main([str(tmp_path), "--batches", "500", "--output", str(out)]) == 0
    (row,) = json.loads(out.read_text())["groups"]
    by_gamma = {q["gamma"]: q for q in row["gammas"]}
    assert row["measured_fastest"] == 1
    mean = {g: by_gamma[g]["model_mean"] for g in (1, 2)}
    assert row["model_fastest"] == min((1, 2), key=lambda g: mean[g] * {1: 10.0, 2: 14.0}[g])
    for g in (1, 2):
        q = by_gamma[g]
        assert q["z"] == pytest.approx((q["measured"] - q["model_mean"]) / q["model_sd"])
    assert 0.0 <= row["p_other_gamma_faster"] <= 1.0
    assert "| 4096 | 16 | greedy | 512 |" in capsys.readouterr().out


def test_no_records_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        straggler_luck.main([str(tmp_path / "missing"), "--output", str(tmp_path / "luck.json")])
    assert e.value.code == 2 and "no fixed-gamma records" in capsys.readouterr().err
