"""benchmarks/tp_report.py on the committed 4 x H200 records: tables and plot are written, a TP=4 record moved to
TP=4 reproduces its own cost-model prediction, and moving it to 8 ranks shrinks every step (bytes divide)."""
import json
import shutil
from pathlib import Path

import pytest

from conftest import benchmark_script

RESULTS = Path(__file__).resolve().parents[1] / "results" / "tp"
tp_report = benchmark_script("tp_report")


def test_report_from_records(tmp_path):
    for name in ("device", "tp1_baseline_B8_32k", "tp2_baseline_B8_32k", "tp4_baseline_B8_32k",
                 "tp4_selfspec_B32_100k", "l31_tp4_selfspec_B64_32k"):
        shutil.copy(RESULTS / f"{name}.json", tmp_path)
    tp_report.main([str(tmp_path)])
    tables = (tmp_path / "tables.md").read_text()
    assert "| 2 | 0.795 | 0.158 | 1.018 |" in tables  # the 100K gamma sweep, from its record
    assert "Llama-3.1-8B self-spec, 32K × 128 | not run" in tables  # extrapolated from the B=64 row
    rows = json.loads((tmp_path / "tp8_predicted.json").read_text())
    assert {r["config"] for r in rows} >= {"Llama-3.1-8B self-spec, 100K × 32", "Llama-3.1-8B self-spec, 32K × 64"}
    assert (tmp_path / "speedups.png").stat().st_size > 10_000


def test_same_ranks_reproduce_the_measured_prediction(monkeypatch):
    recs, d = tp_report.load(RESULTS)
    rec = recs["tp4_selfspec_B32_100k"]
    monkeypatch.setattr(tp_report, "TO_RANKS", 4)
    best = tp_report.predict_tp8(rec, d)
    assert best["first_done"] == pytest.approx(rec["gamma_sweep"][str(best["gamma"])]["predicted_speedup"])
    assert best["first_done"] == pytest.approx(max(m["predicted_speedup"] for m in rec["gamma_sweep"].values()))
