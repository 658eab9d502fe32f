"""magicdec/harness/report_tp.py (`magicdec report tp-tables`) on the committed 4 x H200 records: tables and plot are written, a TP=4 record moved to
TP=4 reproduces its own cost-model prediction, and moving it to 8 ranks shrinks every step (bytes divide)."""
import json
import shutil
from pathlib import Path

import pytest

from magicdec.harness import report_tp as tp_report
RESULTS = Path(__file__).resolve().parents[1] / "results" / "tp"


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


def as_new_record(rec: dict) -> dict:
    """A committed record (its options under "args") as `magicdec run` writes one today: the options under
    "config", the draft's budget as draft_budget, gamma a list, the standalone draft by today's name."""
    rec = json.loads(json.dumps(rec))
    if "args" not in rec:  # device.json
        return rec
    a = rec.pop("args")
    a["draft_budget"] = a.pop("streamingllm_budget", None)
    a["gamma"] = a["gamma"] if isinstance(a.get("gamma"), list) else [a.get("gamma", 3)]
    rec["config"] = a
    rec["method"] = {"longspec": "standalone"}.get(rec["method"], rec["method"])
    return rec


def test_new_records_read_as_the_committed_ones(tmp_path):
    """Records in today's format (config, draft_budget, standalone) give the same keys, predictions and tables."""
    recs, d = tp_report.load(RESULTS)
    for name in ("tp4_selfspec_B32_100k", "l2_tp4_tinyllama_B32_P8192"):
        old, new = recs[name], as_new_record(recs[name])
        assert "args" not in new and tp_report.key(new) == tp_report.key(old)
        assert tp_report.predict_tp8(new, d) == tp_report.predict_tp8(old, d)
    committed, converted = tmp_path / "committed", tmp_path / "converted"
    for folder in (committed, converted):
        folder.mkdir()
    for f in RESULTS.glob("*.json"):
        shutil.copy(f, committed)
        (converted / f.name).write_text(json.dumps(as_new_record(json.loads(f.read_text()))))
    tp_report.main([str(committed)])
    tp_report.main([str(converted)])
    assert (converted / "tables.md").read_text() == (committed / "tables.md").read_text()
    assert "LLaMA-2-7B-32K + TinyLlama (4 draft ranks), 8K × 32" in (converted / "tables.md").read_text()
