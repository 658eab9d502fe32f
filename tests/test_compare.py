"""The default job (magicdec/harness/compare.py): every registered drafter over one shared prefill of a book, on SmolLM2's
real weights: a row per drafter variant, greedy output equal to plain decoding's for each, the cost model's
prediction at the profiled device labelled as one, a drafter that cannot run here saying why, a head drafter with
no trained head saying it has nothing to measure, and bad options refused before any model loads."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import BOOKS, needs_smollm2
from magicdec.harness import compare
from magicdec import drafters
from magicdec.errors import MagicDecError

HEADS = set(drafters.owners("head"))  # the registered drafters that draft with a trained head (their --head)


@pytest.fixture(scope="module")
def smol_trained_heads(smol_heads, tmp_path_factory) -> Path:
    """A folder of SmolLM2 heads, one per family (the suite's fitted heads, 3 heads or steps each), saved as
    train-head --out saves them."""
    from magicdec.model import heads
    folder = tmp_path_factory.mktemp("smol_heads")
    for family in sorted(HEADS):
        heads.save(smol_heads(family), folder / family)
    return folder


def run_compare(smol_dir, tmp_path, *extra: str) -> dict:
    out = tmp_path / "compare.json"
    compare.main(["--model", str(smol_dir / "model.pth"), "--dataset", str(BOOKS), "--skip_tokens", "0",
                  "--prefix_len", "384", "--gen_len", "12", "--greedy_only", "--device", "cpu", "--no_progress",
                  "--output", str(out), *extra])
    return json.loads(out.read_text())


@needs_smollm2
def test_every_drafter_side_by_side(smol_dir, tmp_path, capsys):
    """Every registered drafter has its rows; every one that drafts without a trained head runs (the standalone
    draft given one, REST over a datastore of the other books) and its greedy output equals plain decoding's; the
    head drafters given none say so, with no speed or prediction."""
    record = run_compare(smol_dir, tmp_path, "--draft", str(smol_dir / "model.pth"))
    rows = record["rows"]
    assert {r["drafter"] for r in rows} == set(drafters.names())
    ran = [r for r in rows if "alpha" in r]
    assert {r["drafter"] for r in ran} == set(drafters.names()) - HEADS
    assert not [r for r in rows if "skipped" in r]
    assert all(r["equals_plain_decoding"] for r in ran)  # greedy speculation is lossless, drafter by drafter
    assert all(r["acceptance_length"] >= 1 for r in ran)
    # REST read the other books, never the one the prompt was cut from
    rest = next(r for r in ran if r["drafter"] == "rest")
    sources = rest["preparation_notes"]["datastore"]["sources"]
    assert sources and sorted(BOOKS.glob("*.txt"))[0].name not in sources
    untrained = [r for r in rows if "untrained" in r]
    assert {r["drafter"] for r in untrained} == HEADS
    assert all("train-head" in r["untrained"] and "alpha" not in r and "predicted" not in r for r in untrained)
    kept = [r for r in ran if r["alpha"]]
    assert kept and all(r["predicted"].get("speedup", 0) > 1 for r in kept if r["drafter"] == "selfspec")
    assert record["prediction"]["model"] == "meta-llama/Meta-Llama-3.1-8B" and record["prediction"]["profile"]["device"]
    printed = capsys.readouterr().out
    assert "a prediction, not a measurement" in printed
    table = [line for line in printed.splitlines() if line.split()[:1] and line.split()[0] in drafters.names()]
    speed_cells = [line for line in table if "x (" in line]
    assert len(speed_cells) == len(ran) and all("(CPU: no claim)" in line for line in speed_cells)
    assert all("untrained: no alpha to measure" in line for line in table if line.split()[0] in HEADS)


@needs_smollm2
def test_heads_folder_runs_the_head_drafters(smol_dir, smol_trained_heads, tmp_path):
    """--heads DIR: each head drafter runs with the trained head of its family found there (lossless, greedy)."""
    record = run_compare(smol_dir, tmp_path, "--heads", str(smol_trained_heads))
    ran = {r["drafter"]: r for r in record["rows"] if "alpha" in r}
    assert HEADS <= set(ran)
    for name in HEADS:
        assert ran[name]["equals_plain_decoding"] and str(smol_trained_heads) in ran[name]["options"]["head"]


@pytest.mark.parametrize("flags,needle", [
    (["--gamma", "0"], "--gamma 0: give a positive count"),
    (["--repeats", "0"], "--repeats 0: give a positive count"),
    (["--repeats", "1000000000"], "at most 50 timed rounds"),
    (["--B", "0"], "--B 0"),
    (["--predict_B", "-1"], "--predict_B -1"),
    (["--predict_model", "nonsense"], "unknown model name 'nonsense'"),
    (["--predict_prefix", "100000000"], "lower --predict_prefix"),
    (["--skip_tokens", "-3"], "--skip_tokens -3"),
    (["--profile", "/nonexistent.json"], "cannot read it as a device profile"),
    (["--heads", "/nonexistent"], "--heads /nonexistent: no such folder"),
])
def test_bad_options_are_refused_before_anything_loads(flags, needle, monkeypatch):
    """Each bad option is one line naming it, before the engine is built (no model is converted or loaded)."""
    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built before the options were checked")

    monkeypatch.setattr(compare, "Engine", no_engine)
    with pytest.raises(MagicDecError, match=__import__("re").escape(needle)):
        compare.main(["--device", "cpu", *flags])


def test_a_huge_prefix_is_one_line_before_any_weight_loads(tmp_path):
    """--prefix_len beyond the model's context: one line from the command, naming the fix, no traceback."""
    import subprocess

    from conftest import one_line_error

    p = subprocess.run([sys.executable, "-m", "magicdec", "compare", "--device", "cpu", "--prefix_len", "100000000"],
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    one_line_error(p, "--prefix_len")
