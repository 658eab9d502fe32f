"""Claims as experiments (magicdec/reproduce.py): every committed experiment file is a valid run config citing a
record that holds its metric within its tolerance; PASS and FAIL by hand; the README's headline table written from the
files between its markers; a run refused on another device class."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from magicdec import reproduce
from magicdec.errors import MagicDecError
from magicdec.run_config import RunConfig

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted((REPO / "experiments").glob("*.toml"))


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[p.stem for p in EXPERIMENTS])
def test_each_experiment_is_a_run_and_its_record_holds_the_claim(path):
    exp = reproduce.load(path)
    RunConfig.from_options(dict(exp["run"]) | {"device": "cpu", "step_mode": "eager"})  # a valid run config
    value, record = reproduce.cited(exp, REPO)
    assert record is not None, f"{exp['record']} is not committed"
    ok, line = reproduce.verdict(exp, value)
    assert ok, line  # the README states what the record holds


def test_verdict_by_hand():
    exp = {"metric": "metrics.x", "expected": 2.0, "tolerance": 0.05}
    assert reproduce.verdict(exp, 2.09)[0] and not reproduce.verdict(exp, 2.11)[0]
    assert reproduce.verdict(exp, None) == (False, "FAIL: metrics.x is missing from the record")
    assert reproduce.metric({"metrics": {"x": 1.5}}, "metrics.x") == 1.5 and reproduce.metric({}, "a.b") is None


def test_the_headline_table_is_written_between_markers(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"metrics": {"x": 1.5}, "environment": {"gpu": "NVIDIA H100"}}))
    (tmp_path / "experiments").mkdir()
    exp_file = tmp_path / "experiments" / "e.toml"
    exp_file.write_text('claim = "a claim"\ndevice = "H100"\nrecord = "r.json"\nmetric = "metrics.x"\n'
                        'expected = 1.5\ntolerance = 0.05\nweights = "random"\n[run]\ndrafter = "lookup"\n')
    start, end = reproduce.README_MARKERS
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{start}\nold\n{end}\n\nafter\n")
    reproduce.write_table(readme, [reproduce.load(exp_file)])
    text = readme.read_text()
    assert "old" not in text and text.endswith("after\n")
    assert "| a claim | — | **1.500×** | single run, not interleaved | NVIDIA H100 | random | — | greedy | — | PASS" in text
    rounds = {"metrics": {"x": 1.5, "x_rounds": [1.4, 1.5, 1.6]}, "environment": {"gpu": "NVIDIA H100"},
              "config": {"temperature": 0.6, "top_p": 0.9, "gen_len": 256}}
    (tmp_path / "r.json").write_text(json.dumps(rounds))
    reproduce.write_table(readme, [reproduce.load(exp_file)])
    assert "| **1.500×** | 1.400–1.600 (3 interleaved rounds) | NVIDIA H100 | random | — | sampled, T 0.6, top-p 0.9, " \
           "256 tokens |" in readme.read_text()
    # the record's own rerun verdict, against the claim of its time: named when the claim has changed since
    for expected, shown in (("1.5", "PASS (± 5% of 1.5) · rerun: PASS |"),
                            ("2.3", "PASS (± 5% of 1.5) · rerun against the earlier claim 2.3: FAIL |")):
        verdict = f"{'PASS' if expected == '1.5' else 'FAIL'}: metrics.x = 1.5, expected {expected} ± 5% (...)"
        (tmp_path / "r.json").write_text(json.dumps(rounds | {"reproduce": {"verdict": verdict}}))
        reproduce.write_table(readme, [reproduce.load(exp_file)])
        assert shown in readme.read_text(), readme.read_text()
    readme.write_text("no markers")
    with pytest.raises(MagicDecError, match="no headline-table markers"):
        reproduce.write_table(readme, [reproduce.load(exp_file)])


def test_an_experiment_runs_on_its_device_class_only():
    exp = reproduce.load(EXPERIMENTS[0])
    if exp["device"].lower() in reproduce.device_name().lower():
        pytest.skip("this machine is of the experiment's class")
    with pytest.raises(MagicDecError, match="--anywhere runs it regardless"):
        reproduce.reproduce(exp, None)


def test_output_dir_skips_experiments_of_another_device_class(tmp_path, capsys):
    """--output_dir reruns the experiments of this machine's class and lists the others as skipped; on a machine of
    no experiment's class (CPU) nothing runs and nothing is written."""
    if not reproduce.device_name().startswith("CPU"):
        pytest.skip("a GPU machine would run them")
    assert reproduce.main([*map(str, EXPERIMENTS[:3]), "--output_dir", str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all("skipped, measured on" in line for line in lines)
    assert not list((tmp_path / "out").glob("*.json"))


def test_bad_experiment_files_are_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('claim = "x"\n')
    with pytest.raises(MagicDecError, match="missing"):
        reproduce.load(bad)
    bad.write_text('claim = "x"\ncolour = 1\n')
    with pytest.raises(MagicDecError, match="missing"):
        reproduce.load(bad)


def test_the_readme_table_is_the_experiments(tmp_path):
    """The README's headline table is what `magicdec reproduce --table` writes from the committed experiments."""
    readme = tmp_path / "README.md"
    readme.write_text((REPO / "README.md").read_text())
    import os

    here = os.getcwd()
    os.chdir(REPO)  # the table's links and records are relative to the repository
    try:
        reproduce.main(["--table", "--readme", str(readme)])
    finally:
        os.chdir(here)
    assert readme.read_text() == (REPO / "README.md").read_text(), "run: magicdec reproduce --table"
