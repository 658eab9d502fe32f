"""benchmarks/repredict_atlas.py: a plan record made by this checkout's planner, predicted again from the record
alone (its point, each candidate's option and gamma, its ranks), gives the prediction the record holds; the summary
counts a candidate within 10% by its own error."""
from __future__ import annotations

import json

import pytest

from conftest import benchmark_script
from magicdec import cli
from magicdec.config import KNOWN_MODELS
from test_plan_run import CHAIN, SHAPES, TREE, acceptance_file

rp = benchmark_script("repredict_atlas")


def test_a_record_of_this_planner_is_predicted_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setitem(KNOWN_MODELS, "test/plan-small", SHAPES)
    rates = acceptance_file(tmp_path, {CHAIN: 0.8, TREE: {"alpha": 0.8, "siblings": [0.5]}})
    runs = tmp_path / "records"
    runs.mkdir()
    cli.run_record(["--random_weights", "--model_name", "test/plan-small", "--B", "2", "--prefix_len", "300",
                    "--gen_len", "10", "--device", "cpu", "--dtype", "float32", "--ignore_eos", "--no_progress",
                    "--plan", "confirm", "2", "--plan_acceptance", str(rates), "--repeats", "2",
                    "--output", str(runs / "plan.json")])
    out = tmp_path / "repredicted.json"
    assert rp.main([str(runs), "--acceptance", str(rates), "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["candidates"]
    assert len(rows) == 2 and {r["label"] for r in rows} == {CHAIN, TREE}
    for r in rows:
        assert r["predicted_now"] == pytest.approx(r["predicted_then"])
        assert r["error_now"] == pytest.approx(r["predicted_then"] / r["measured"] - 1)
    s = result["summary"]["TP 1 selfspec"]
    assert s["candidates"] == 2 and s["within_now"] == sum(abs(r["error_now"]) <= 0.10 for r in rows)
