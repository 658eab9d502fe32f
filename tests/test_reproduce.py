"""Claims as experiments (magicdec/harness/reproduce.py): every committed experiment file is a valid run config citing a
record that holds its metric within its tolerance; PASS and FAIL by hand; the README's headline table written from the
files between its markers; a run refused on another device class."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import STORIES
from magicdec.harness import reproduce
from magicdec.errors import MagicDecError
from magicdec.harness.run_config import RunConfig

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


def table_of(tmp_path, record: dict, metric: str = "metrics.x", extra: str = "") -> str:
    """The headline table written from one experiment citing `record`."""
    (tmp_path / "r.json").write_text(json.dumps(record))
    (tmp_path / "experiments").mkdir(exist_ok=True)
    exp_file = tmp_path / "experiments" / "e.toml"
    exp_file.write_text(f'claim = "a claim"\ndevice = "H100"\nrecord = "r.json"\nmetric = "{metric}"\n'
                        f'expected = 1.5\ntolerance = 0.05\n{extra}[run]\ndrafter = "lookup"\n')
    start, end = reproduce.README_MARKERS
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{start}\nold\n{end}\n\nafter\n")
    reproduce.write_table(readme, [reproduce.load(exp_file)])
    text = readme.read_text()
    assert "\nold\n" not in text and text.endswith("after\n")
    return text


def test_the_headline_table_is_written_between_markers(tmp_path):
    """A record that says nothing of its weights or acceptance: those cells say "not recorded", never a typed
    label; a record with rounds: their spread and the decoding its config names."""
    text = table_of(tmp_path, {"metrics": {"x": 1.5}, "environment": {"gpu": "NVIDIA H100"}})
    assert "| a claim | — | **1.500×** | single run, not interleaved | NVIDIA H100 | not recorded | not recorded " \
           "| greedy | — | PASS" in text
    rounds = {"metrics": {"x": 1.5, "x_rounds": [1.4, 1.5, 1.6]}, "environment": {"gpu": "NVIDIA H100"},
              "config": {"temperature": 0.6, "top_p": 0.9, "gen_len": 256}}
    assert "| **1.500×** | 1.400–1.600 (3 interleaved rounds) | NVIDIA H100 | not recorded | not recorded | sampled, " \
           "T 0.6, top-p 0.9, 256 tokens |" in table_of(tmp_path, rounds)
    # the record's own rerun verdict, against the claim of its time: named when the claim has changed since
    for expected, shown in (("1.5", "PASS (± 5% of 1.5) · rerun (date not recorded): PASS |"),
                            ("2.3", "PASS (± 5% of 1.5) · rerun (date not recorded) against the earlier claim 2.3: "
                                    "FAIL |")):
        verdict = f"{'PASS' if expected == '1.5' else 'FAIL'}: metrics.x = 1.5, expected {expected} ± 5% (...)"
        text = table_of(tmp_path, rounds | {"reproduce": {"verdict": verdict}})
        assert shown in text, text
    dated = rounds | {"reproduce": {"verdict": "PASS: ..."}, "environment": {"date": "2026-11-27T16:20:00Z"}}
    assert "· rerun (2026-11-27): PASS |" in table_of(tmp_path, dated)
    other = rounds | {"reproduce": {"verdict": "PASS: metrics.y = 1.5, expected 1.5 ± 5% (...)"}}
    assert "· rerun (date not recorded) of metrics.y: PASS |" in table_of(tmp_path, other)  # it judged another metric
    readme = tmp_path / "README.md"
    readme.write_text("no markers")
    with pytest.raises(MagicDecError, match="no headline-table markers"):
        reproduce.write_table(readme, [reproduce.load(tmp_path / "experiments" / "e.toml")])


def test_a_record_beyond_the_claims_tolerance_is_a_fail(tmp_path):
    """The check compares the cited record with the experiment's claim: a record remade 10% lower fails it."""
    assert "| PASS (± 5% of 1.5)" in table_of(tmp_path, {"metrics": {"x": 1.5}})
    assert "| FAIL (± 5% of 1.5)" in table_of(tmp_path, {"metrics": {"x": 1.35}})


def test_a_speedup_is_the_median_of_its_rounds_whatever_the_record_stored(tmp_path):
    """Records made before the paired rule stored the ratio of the runs kept by seconds (TriForce's int4 row:
    2.422, its rounds 2.262 / 2.422 / 2.280): the table reports the rounds' median, 2.280, and beside first done
    the same run's all reach with its spread and gamma."""
    record = {"metrics": {"measured_speedup": 2.422, "measured_speedup_rounds": [2.262, 2.422, 2.280]}}
    assert "| **2.280×** | 2.262–2.422 (3 interleaved rounds) |" in table_of(tmp_path, record,
                                                                              "metrics.measured_speedup")
    both = {"metrics": {"gamma": 3, "measured_speedup_first_done": 1.9, "measured_speedup_first_done_rounds":
                        [1.8, 1.9, 2.0], "measured_speedup": 1.5, "measured_speedup_rounds": [1.4, 1.6, 1.5]}}
    assert "| **1.900×** first done; all reach 1.500× [1.400–1.600] (γ 3) |" in \
        table_of(tmp_path, both, "metrics.measured_speedup_first_done")


def test_labels_are_read_from_the_record(tmp_path):
    """Weights, the kernels a quantized draft ran, the KV format and where α came from, each from the record; a
    figure in free text is filled from the record too."""
    record = {"metrics": {"x": 1.5, "T_D_over_T_T": 0.6412}, "random_weights": True,
              "model_config": {"name": "meta-llama/Meta-Llama-3.1-8B"},
              "config": {"synthetic_acceptance": 0.9, "synthetic_bottom": 0.6, "draft_weights": "int4",
                         "draft_kv": "int8"},
              "drafter_notes": {"draft_weights": {"kernels": [{"M": 1, "layers_by_kernel": {"tinygemm": 161}},
                                                              {"M": 2, "layers_by_kernel": {"tinygemm": 161}}]}},
              "draft_models": {"bottom": {"name": "JackFram/llama-68m"}}}
    text = table_of(tmp_path, record, extra='also = "T_D/T_T {metrics.T_D_over_T_T:.2f}, {metrics.nothing}"\n'
                                            'acceptance = "taken from a SmolLM2 run"\n')
    assert "**1.500×**; T_D/T_T 0.64, not recorded |" in text
    assert "| random, meta-llama/Meta-Llama-3.1-8B's and JackFram/llama-68m's shapes; the draft's weights int4 " \
           "(tinygemm on 161 layers); the draft's KV int8 |" in text
    assert "| synthetic, iid α 0.9 (middle → target), 0.6 (bottom → middle); taken from a SmolLM2 run |" in text
    (tmp_path / "pred.json").write_text(json.dumps([{"tp8": {"first_done": 1.7317}}]))
    text = table_of(tmp_path, record, extra='prediction = "{pred.json#0.tp8.first_done:.2f}× at TP = 8, '
                                            '{gone.json#0.x:.2f}"\n')
    assert "| 1.73× at TP = 8, not recorded |" in text
    measured = {"metrics": {"x": 1.5, "alpha": 0.9024}, "random_weights": False,
                "checkpoint": "/c/SmolLM2-135M-Instruct/model.pth", "prompt_source": "folder books (21 .txt books)"}
    text = table_of(tmp_path, measured)
    assert "| real: SmolLM2-135M-Instruct | measured: α 0.90 on folder books (21 .txt books) |" in text


def test_an_experiment_runs_on_its_device_class_only():
    exp = reproduce.load(EXPERIMENTS[0])
    if exp["device"].lower() in reproduce.device_name().lower():
        pytest.skip("this machine is of the experiment's class")
    with pytest.raises(MagicDecError, match="add --anywhere to run it here for a look"):
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


def tiny_experiment(tmp_path, run: str, record: str = "r.json") -> Path:
    (tmp_path / "experiments").mkdir(exist_ok=True)
    path = tmp_path / "experiments" / "e.toml"
    path.write_text(f'claim = "a claim"\ndevice = "H100"\nrecord = "{record}"\nmetric = "metrics.x"\nexpected = 1.5\n'
                    f'tolerance = 0.05\n[run]\n{run}')
    return path


def test_the_table_refuses_a_missing_or_unreadable_record(tmp_path):
    """A cited record that is missing (or unreadable, or without the metric) fails the table in one line naming it
    and how to get it back, and the README is left as it was: it wrote a "record … missing" row and exited 0."""
    start, end = reproduce.README_MARKERS
    readme = tmp_path / "README.md"
    readme.write_text(f"{start}\nthe table\n{end}\n")
    exp = reproduce.load(tiny_experiment(tmp_path, 'drafter = "lookup"\n', "results/r.json"))
    missing = "cites results/r.json, which is missing: restore it (git checkout -- results/r.json) or remake it on " \
              "H100 (magicdec reproduce "
    for content, needle in ((None, missing),
                            ("{not json", "which cannot be read as a JSON record"),
                            (json.dumps({"metrics": {"y": 1.5}}), "cites metrics.x of results/r.json, which holds no "
                                                                  "number there")):
        if content is not None:
            (tmp_path / "results").mkdir(exist_ok=True)
            (tmp_path / "results" / "r.json").write_text(content)
        with pytest.raises(MagicDecError) as e:
            reproduce.write_table(readme, [exp])
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert readme.read_text() == f"{start}\nthe table\n{end}\n"


@pytest.mark.parametrize("readme,needle", [
    ("missing.md", "does not exist: run from the repository's root (its README.md), or give --readme PATH"),
    ("latin1.md", "cannot read it (it is not UTF-8 text)"),
    (".", "cannot read it (Is a directory)"),
])
def test_a_readme_that_cannot_be_read_is_one_line(tmp_path, readme, needle):
    (tmp_path / "latin1.md").write_bytes("café\n".encode("latin-1"))
    exp = reproduce.load(tiny_experiment(tmp_path, 'drafter = "lookup"\n'))
    with pytest.raises(MagicDecError) as e:
        reproduce.write_table(tmp_path / readme, [exp])
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_no_experiment_is_no_table(tmp_path):
    with pytest.raises(MagicDecError, match="no experiment files"):
        reproduce.write_table(tmp_path / "README.md", [])


needs_cpu_only = pytest.mark.skipif(reproduce.device_name() != "CPU", reason="a machine without CUDA")


@needs_cpu_only
@pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file(), reason=f"no stories260K in {STORIES}")
def test_anywhere_runs_a_graphed_experiment_on_a_cpu_as_a_look(tmp_path, capsys):
    """Every experiment captures CUDA graphs, which a CPU has not: refused with a hint that works (--anywhere), which
    runs it on the CPU with eager steps and records the value as not comparable, with no PASS or FAIL."""
    from magicdec.model.checkpoint import convert_llama2c

    model = convert_llama2c(STORIES / "stories260K.bin", tmp_path / "stories", STORIES / "tok512.bin")
    exp = reproduce.load(tiny_experiment(tmp_path, f'model = "{model}"\ndataset = "stdlib"\nskip_tokens = 0\n'
                                                   'B = 1\nprefix_len = 32\ngen_len = 4\ndrafter = "lookup"\n'
                                                   'step_mode = "cuda_graphs"\nbaseline = true\nprogress = false\n'))
    with pytest.raises(MagicDecError) as e:
        reproduce.reproduce(exp, None)
    assert "add --anywhere to run it here for a look (no PASS or FAIL, on the CPU with eager steps)" in str(e.value)
    ok, record = reproduce.reproduce(exp, tmp_path / "out.json", anywhere=True)
    assert ok and record["config"]["step_mode"] == "eager" and record["config"]["device"] == "cpu"
    seen = record["reproduce"]
    assert seen["comparable"] is False and seen["pass"] is None
    assert seen["overrides"] == {"device": "cpu", "step_mode": "eager"}
    assert seen["verdict"].startswith("NOT COMPARABLE: metrics.x = missing on CPU, device cpu, step_mode eager; the "
                                      "claim (1.5 ± 5%) holds on H100 only")
    assert json.loads((tmp_path / "out.json").read_text())["reproduce"] == seen
    assert "NOT COMPARABLE" in capsys.readouterr().out


@needs_cpu_only
def test_an_experiment_too_big_for_this_machine_says_where_it_runs(monkeypatch):
    from magicdec import device as dev
    monkeypatch.setattr(dev, "memory", lambda device: (1 << 30, 1 << 30))
    exp = reproduce.load(REPO / "experiments" / "selfspec_llama31_8b_32k_b13.toml")
    with pytest.raises(MagicDecError) as e:
        reproduce.reproduce(exp, None, anywhere=True)
    assert str(e.value).startswith(f"{exp['path']} cannot run on this CPU: ") and "\n" not in str(e.value)
    assert str(e.value).endswith("the experiment fixes its [run] options: run it on H100, or time a smaller copy of "
                                 "them with magicdec run")


@pytest.mark.parametrize("line,needle", [
    ('expected = "abc"', "expected = 'abc': must be a number >= 0"),
    ("tolerance = -0.05", "tolerance = -0.05: must be a number >= 0"),
    ("device = 3", "device = 3: must be a string"),
    ("order = true", "order = True: must be a number >= 0"),
])
def test_an_experiment_value_of_the_wrong_type_is_one_line(tmp_path, line, needle):
    """Each was a traceback when the table or the verdict used it (after the run, for a verdict)."""
    path = tiny_experiment(tmp_path, 'drafter = "lookup"\n')
    key = line.split(" = ")[0]
    rows = [row for row in path.read_text().splitlines() if not row.startswith(f"{key} = ")]
    path.write_text("\n".join([line, *rows]) + "\n")  # before [run], so a top-level key
    with pytest.raises(MagicDecError) as e:
        reproduce.load(path)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
