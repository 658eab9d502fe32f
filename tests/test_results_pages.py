"""The results pages' figures come from their records (magicdec/harness/pages.py): every committed page, the README's own
figures beside its generated table, each headline row's details page stating that row's figure; and the checker
itself on hand-made records, whose medians and ranges are worked out here by hand."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from magicdec.harness import pages, reproduce
REPO = Path(__file__).resolve().parents[1]
PAGES = sorted((REPO / "results").glob("*/README.md"))


@pytest.mark.parametrize("page", PAGES, ids=[p.parent.name for p in PAGES])
def test_each_results_page_figure_comes_from_its_records(page):
    bad = pages.unbacked(page, REPO)
    assert not bad, "\n".join(f"{figure}: {line[:200]}" for figure, line in bad)


def test_the_readme_figures_beside_its_table_come_from_the_records_it_links():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start, end = reproduce.README_MARKERS
    before, rest = text.split(start, 1)
    lines = (before + rest.split(end, 1)[1]).splitlines()
    assert sum(len(pages.FIGURE.findall(line)) for line in lines) >= 5  # the check sees the README's figures
    bad = pages.unbacked(REPO / "README.md", REPO, lines)
    assert not bad, "\n".join(f"{figure}: {line[:200]}" for figure, line in bad)


def test_the_results_page_opening_comes_from_the_records_it_links():
    """results/RESULTS.md: its sections are `magicdec report`'s; what is written above them by hand is checked."""
    page = REPO / "results" / "RESULTS.md"
    opening = page.read_text(encoding="utf-8").split("<!-- head -->", 1)[0].splitlines()
    assert sum(len(pages.FIGURE.findall(line)) for line in opening) >= 2
    bad = pages.unbacked(page, REPO, opening)
    assert not bad, "\n".join(f"{figure}: {line[:200]}" for figure, line in bad)


EXPERIMENTS = [reproduce.load(p) for p in sorted((REPO / "experiments").glob("*.toml"))]


@pytest.mark.parametrize("exp", [e for e in EXPERIMENTS if e.get("details")], ids=lambda e: e["path"].stem)
def test_each_details_page_states_its_headline_row(exp):
    """The page a headline row links as its details names the row's record and states its figure as the table does
    (reproduce.value_of: the median of the rounds' ratios)."""
    value, _ = reproduce.cited(exp, REPO)
    text = (REPO / exp["details"]).read_text(encoding="utf-8")
    assert Path(exp["record"]).name in text, f"{exp['details']} does not link {exp['record']}"
    assert f"{value:.3f}×" in text, f"{exp['details']} does not state {exp['path'].stem}'s {value:.3f}×"


def page_with(tmp_path, records: dict[str, dict], table: str, link: str = "") -> list[str]:
    """The figures pages.unbacked finds unbacked on a page of `table` beside `records` (name: record)."""
    folder = tmp_path / "results" / "p"
    folder.mkdir(parents=True, exist_ok=True)
    for name, record in records.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps(record))
    page = folder / "README.md"
    page.write_text(f"# p\n\n| finding | numbers |\n|---|---|\n{table}\n\n{link}\n")
    return [figure for figure, _ in pages.unbacked(page, tmp_path)]


def test_a_range_is_one_measurements_rounds_and_the_figure_before_it_their_median(tmp_path):
    rec = {"results/p/r.json": {"metrics": {"measured_speedup_rounds": [1.0, 1.2, 1.1]}}}
    assert page_with(tmp_path, rec, "| a | **1.100×** [1.000–1.200] |") == []
    assert page_with(tmp_path, rec, "| a | 1.20× [1.00–1.20] |") == ["1.20 [1.00–1.20]"]  # the max is no median
    assert page_with(tmp_path, rec, "| a | [1.000–1.150] |") == ["[1.000–1.150]"]
    two = {"results/p/r.json": {"metrics": {"measured_speedup_rounds": [1.0, 1.1, 1.4]}},
           "results/p/s.json": {"metrics": {"measured_speedup_rounds": [1.2, 1.3, 1.5]}}}
    assert page_with(tmp_path, two, "| a | [1.0–1.5] |") == ["[1.0–1.5]"]  # ends of two measurements


def test_rounds_paired_with_the_baselines_rounds(tmp_path):
    """Each round's ratio: the baseline's seconds over the run's (rounds of the same tokens), or the run's rate over
    the baseline's; by hand: 2.0 / 1.0, 2.2 / 2.0, 2.1 / 1.5 = 2.0, 1.1, 1.4."""
    seconds = {"results/p/r.json": {"metrics": {"round_s": [1.0, 2.0, 1.5], "measured_speedup": 1.6},
                                    "baseline_metrics": {"round_s": [2.0, 2.2, 2.1]}}}
    assert page_with(tmp_path, seconds, "| a | 1.40× [1.10–2.00]; 1.6× |") == []
    assert page_with(tmp_path, seconds, "| a | 1.60× [1.10–2.00] |") == ["1.60 [1.10–2.00]"]
    rates = {"results/p/r.json": {"metrics": {"round_tokens_per_s": [30.0, 22.0, 21.0]},
                                  "baseline_metrics": {"round_tokens_per_s": [15.0, 20.0, 15.0]}}}
    assert page_with(tmp_path, rates, "| a | 1.4× [1.1–2.0] |") == []
    interleaved = {"results/p/r.json": {"methods": {"a": {"tokens_per_s": [30.0, 22.0, 21.0]},
                                                    "b": {"tokens_per_s": [15.0, 20.0, 15.0]}}}}
    assert page_with(tmp_path, interleaved, "| a | 1.4× [1.1–2.0]; 0.71× [0.50–0.91]; 22.0 [21.0–30.0] |") == []
    stored = {"results/p/r.json": {"a_over_b": {"per_round": [1.1, 1.4, 2.0], "median": 1.4}}}
    assert page_with(tmp_path, stored, "| a | 1.4× [1.1–2.0] |") == []
    assert page_with(tmp_path, {"results/p/r.json": {"a_and_b": {"per_round": [1.1, 1.4, 2.0]}}},
                     "| a | 1.4× [1.1–2.0] |") == ["1.4 [1.1–2.0]"]  # rounds under a key that names no ratio
    beside = {"results/p/r.json": {"points": [{"T_V_over_T_T": 1.4, "rounds": [1.1, 1.4, 2.0], "tokens": 16}]}}
    assert page_with(tmp_path, beside, "| a | 1.4× [1.1–2.0] |") == []  # a verification's cost beside its rounds
    assert page_with(tmp_path, {"results/p/r.json": {"points": [{"tokens": 16, "rounds": [1.1, 1.4, 2.0]}]}},
                     "| a | 1.4× [1.1–2.0] |") == ["1.4 [1.1–2.0]"]  # rounds beside no ratio


def test_a_figure_is_a_stored_speedup_at_its_printed_precision(tmp_path):
    rec = {"results/p/r.json": {"metrics": {"measured_speedup": 1.2346, "predicted_speedup": 1.5, "alpha": 0.8},
                                "cost_model": {"speedup": 1.7}}}
    assert page_with(tmp_path, rec, "| a | 1.23×, 1.2×, 1.235× |") == []
    unbacked = page_with(tmp_path, rec, "| a | 1.24×; 1.50×; 0.80×; 1.70×; 1.2–1.9× |")
    assert unbacked == ["1.24", "1.50", "0.80", "1.70", "1.9"]  # not a prediction, α or the cost model; a span's ends


def test_only_named_sources_models_and_bounds_are_exempt(tmp_path):
    rec = {"results/p/r.json": {"metrics": {"measured_speedup": 1.0}}}
    exempt = "| a | MagicDec: 1.84× (A100); QuantSpec ≈ 2.5×; the paper's 2.2×; predicted 1.73×; goal ≥ 1.8× |"
    assert page_with(tmp_path, rec, exempt) == []
    assert page_with(tmp_path, rec, "| MagicDec's convention | 1.84× |") == ["1.84"]
    assert page_with(tmp_path, rec, "| a | Hydra: 1.84× |") == ["1.84"]  # a drafter's name is no source
    assert page_with(tmp_path, rec, "| a | 1.84× (as the paper's 2.2×) |") == ["1.84"]  # ours, before the source
    assert page_with(tmp_path, rec, "| a | ≈ 1.84× |") == ["1.84"]


def test_a_page_counts_the_records_it_links_and_no_others(tmp_path):
    elsewhere = {"results/q/r.json": {"metrics": {"measured_speedup_rounds": [1.0, 1.2, 1.1]}}}
    assert page_with(tmp_path, elsewhere, "| a | 1.100× [1.000–1.200] |") == ["1.100 [1.000–1.200]"]
    assert page_with(tmp_path, elsewhere, "| a | 1.100× [1.000–1.200] |", "[r](../q/r.json)") == []
    assert page_with(tmp_path, elsewhere, "| a | 1.100× [1.000–1.200] |", "`results/q/`") == []
