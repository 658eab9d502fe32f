"""The default job (magicdec/compare.py): every registered drafter over one shared prefill of a book, on SmolLM2's
real weights: a row per drafter variant, greedy output equal to plain decoding's for each, the cost model's
prediction at the profiled device labelled as one, and a drafter that cannot run here saying why."""
from __future__ import annotations

import json

from conftest import BOOKS, needs_smollm2
from magicdec import compare, drafters


@needs_smollm2
def test_every_drafter_side_by_side(smol_dir, tmp_path, capsys):
    out = tmp_path / "compare.json"
    compare.main(["--model", str(smol_dir / "model.pth"), "--dataset", str(BOOKS), "--skip_tokens", "0",
                  "--prefix_len", "384", "--gen_len", "12", "--greedy_only", "--device", "cpu", "--output", str(out)])
    record = json.loads(out.read_text())
    rows = record["rows"]
    assert {r["drafter"] for r in rows} == set(drafters.names())
    ran = [r for r in rows if "skipped" not in r]
    assert {r["drafter"] for r in ran} >= {"selfspec", "lookup", "hierarchy"}
    assert all(r["equals_plain_decoding"] for r in ran)  # greedy speculation is lossless, drafter by drafter
    assert all(0 <= r["alpha"] <= 1 and r["acceptance_length"] >= 1 for r in ran)
    assert all(r["predicted"].get("speedup", 0) > 0 for r in ran if r["drafter"] == "selfspec")
    assert next(r for r in rows if r["drafter"] == "standalone")["skipped"].startswith("a standalone draft needs --draft")
    assert record["prediction"]["model"] == "meta-llama/Meta-Llama-3.1-8B" and record["prediction"]["profile"]["device"]
    printed = capsys.readouterr().out
    assert "a prediction, not a measurement" in printed and "no claim" in printed
