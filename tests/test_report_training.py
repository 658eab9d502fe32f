"""`magicdec report heads-data` (magicdec/harness/report_training.py): two train-head logs, one on the books' text
and one on generated data, read into the table by hand's numbers, the figure written; a file that is no train-head
log is one line."""
from __future__ import annotations

import json

import pytest

from magicdec.cli import main as cli_main


def log(family: str, evals: list[tuple[int, float]], data: dict | None, own: float | None = None) -> dict:
    out = {"options": {"family": family, "batch_size": 2, "seq_len": 100},
           "corpus": {"train_tokens": 2_500_000},
           "evals": [{"step": s, "loss": 1.0, "acceptance": [a, a / 2]} | ({"own_text_acceptance": [own + a, 0.1]}
                                                                          if own is not None else {})
                     for s, a in evals]}
    return out | ({"data": data} if data else {})


def test_each_log_is_one_row_at_its_tokens_read(tmp_path, capsys):
    books = tmp_path / "books.json"
    books.write_text(json.dumps(log("eagle", [(0, 0.0), (10, 0.3), (20, 0.4), (30, 0.45)], None)))
    generated = tmp_path / "generated.json"
    generated.write_text(json.dumps(log("hydra", [(0, 0.0), (50, 0.5)],
                                        {"kind": "generated", "generated_tokens": 10_000_000}, own=0.1)))
    out = tmp_path / "page"
    assert cli_main(["report", "heads-data", str(books), str(generated), "--output", str(out)]) == 0
    rows = [r for r in out.with_suffix(".md").read_text().splitlines() if r.startswith("| eagle") or
            r.startswith("| hydra")]
    # tokens read = step x 2 x 100; the middle evaluation is the (count // 2)-th
    assert rows[0] == "| eagle | corpus | 2.50M | 0.0M | 0.450 | 0.400 at 0.0M | not evaluated |"
    assert rows[1] == "| hydra | generated | 10.00M | 0.0M | 0.500 | 0.500 at 0.0M | 0.600 |"
    assert out.with_suffix(".png").stat().st_size > 1000


def test_exact_tokens_read(tmp_path):
    from magicdec.harness.report_training import curve

    c = curve(log("medusa", [(0, 0.1), (400, 0.2)], None))
    assert c["points"] == [(0, 0.1), (400 * 2 * 100, 0.2)] and c["own"] == []
    assert curve(log("medusa", [(400, 0.2)], None, own=0.3))["own"] == [(400 * 2 * 100, 0.5)]
    assert (c["data"], c["distinct_tokens"]) == ("corpus", 2_500_000)


def test_a_file_that_is_no_training_log_is_one_line(tmp_path, capsys):
    bad = tmp_path / "record.json"
    bad.write_text(json.dumps({"metrics": {}}))
    with pytest.raises(SystemExit):
        cli_main(["report", "heads-data", str(bad), "--output", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a train-head log" in err[0], err
