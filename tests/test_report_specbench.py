"""magicdec/harness/report_specbench.py (`magicdec report specbench-table`): Spec-Bench's table from a sweep's records, with the trained heads' rows (EAGLE,
Hydra, Medusa) only for the heads named by --eagle_head / --hydra_head / --medusa_head; a fresh (untrained) head's
records are left out and the output says which head families have no rows and why. The sweep runs on the CPU over
stories260K (a real tiny model with its tokenizer) with heads saved by magicdec.model.heads at its shapes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import BOOKS, STORIES

from magicdec.model import heads

from magicdec.harness import sweep
from magicdec.harness import report_specbench as specbench_table
from magicdec.config import ModelArgs

pytestmark = pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file(), reason=f"no stories260K in {STORIES}")


@pytest.fixture(scope="module")
def head_sweep(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """(the records folder, the head directories): baseline, EAGLE (full and window), Hydra and Medusa with their
    saved heads, and Medusa with a fresh head too, at 64 × 2 on stories260K, greedy."""
    from magicdec.model.checkpoint import convert_llama2c

    root = tmp_path_factory.mktemp("specbench_heads")
    model = convert_llama2c(STORIES / "stories260K.bin", root / "stories", STORIES / "tok512.bin")
    args = ModelArgs.from_hf_config(json.loads((model.parent / "config.json").read_text()))
    dirs = {"eagle": root / "heads" / "tiny_eagle", "hydra": root / "heads" / "tiny_hydra",
            "medusa": root / "heads" / "tiny_medusa"}
    for family, d in dirs.items():
        heads.save(heads.new_head(family, args, num_heads=2, seed=1, init="identity"), d)
    book = root / "book.txt"  # a few pages: the pure-Python tokenizer cuts them in a moment, whole books in minutes
    book.write_text((BOOKS / "pg1342.txt").read_text(encoding="utf-8")[20_000:26_000])
    config = root / "sweep.toml"
    config.write_text(f"""
model = "{model}"
dataset = "{book}"
skip_tokens = 0
prefix_len = [64]
B = [2]
gen_len = 8
gamma = 2
decoding = ["greedy"]
methods = ["baseline", "eagle", "hydra", "medusa"]
[eagle]
head = "{dirs['eagle']}"
head_kv = ["full", "window"]
[hydra]
head = "{dirs['hydra']}"
[medusa]
head = ["{dirs['medusa']}", "none"]
""")
    out = root / "records"
    assert sweep.Sweep(sweep.load_config(config), out, "cpu", False).run(None) == 0
    return out, dirs


def rows(text: str) -> dict[str, str]:
    return {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}


def test_head_rows_show_for_the_heads_given(head_sweep, tmp_path, capsys):
    out, dirs = head_sweep
    records = [json.loads(f.read_text()) for f in out.glob("*.json")]
    assert {r["label"] for r in records} >= {"medusa fresh k4", "medusa tiny_medusa"}
    assert all("speedup" in r["metrics"]["cost_model"] for r in records if r["method"] != "baseline")

    argv = [str(out), "--output", str(tmp_path / "table")]
    assert specbench_table.main(argv + [x for f, d in dirs.items() for x in (f"--{f}_head", str(d))]) == 0
    printed = capsys.readouterr().out
    found = rows(printed)
    assert set(found) == {"drafter", "eagle tiny_eagle", "eagle tiny_eagle window 256", "hydra tiny_hydra",
                          "medusa tiny_medusa"}
    assert all("× (" in line for label, line in found.items() if label != "drafter")  # a greedy cell in each row
    assert f"Medusa: the rows of --head {dirs['medusa']}; 1 record of a fresh or another head left out" in printed
    assert "EAGLE" not in printed.split("|")[-1] and "Hydra" not in printed.split("|")[-1]  # no note: all their rows
    assert (tmp_path / "table.md").read_text().strip() == printed.strip() and (tmp_path / "table.png").is_file()


def test_without_head_directories_there_are_no_head_rows_and_the_output_says_so(head_sweep, tmp_path, capsys):
    out, dirs = head_sweep
    assert specbench_table.main([str(out), "--output", str(tmp_path / "table"), "--hydra_head", str(dirs["hydra"]),
                                 "--medusa_head", str(dirs["eagle"])]) == 0
    printed = capsys.readouterr().out
    assert set(rows(printed)) == {"drafter", "hydra tiny_hydra"}
    assert "EAGLE: no rows (no --eagle_head DIR given: a fresh head's rows would be an untrained head's); 2 records" \
        in printed
    assert f"Medusa: no rows (no record ran --head {dirs['eagle']}); 2 records" in printed


def test_a_head_is_matched_by_its_path_as_given_on_another_machine():
    assert specbench_table.same_dir("/root/repo/heads/smollm2_medusa", Path("heads/smollm2_medusa"))
    assert not specbench_table.same_dir("/root/repo/heads/smollm2_hydra", Path("heads/smollm2_medusa"))
    assert not specbench_table.same_dir(None, Path("heads/smollm2_medusa"))


def test_a_drafter_run_at_several_gammas_shows_its_best_and_names_it():
    """Two γ of one drafter at one point: the cell is the faster one, whichever record is read last, and names its γ;
    a drafter run at one γ names none."""
    def record(label, gamma, speedup, omega):
        return {"method": label.split()[0], "label": label, "prefix_len": 4096, "B": 1, "decoding": "greedy",
                "gamma": gamma, "metrics": {"measured_speedup": speedup, "acceptance_length": omega, "alpha": 0.5,
                                            "T_V_over_T_T": 1.0, "T_D_over_T_T": 0.1}}
    for order in (1, -1):
        found = specbench_table.cells([record("eagle h", 3, 1.14, 1.59), record("eagle h", 5, 0.98, 1.59),
                                       record("lookup n3", 4, 1.58, 2.0)][::order])
        text = rows(specbench_table.table(found))
        assert "1.14× (1.59) γ3 / —" in text["eagle h"] and "0.98" not in text["eagle h"]
        assert "1.58× (2.00) / —" in text["lookup n3"] and "γ" not in text["lookup n3"]


def test_a_best_gamma_from_another_code_version_is_marked():
    """The γ of a cell timed at two code versions (two calls): the best is not of the same rounds, and the cell
    says so; γ of one version are not marked."""
    def record(label, gamma, speedup, code):
        return {"method": label.split()[0], "label": label, "prefix_len": 8000, "B": 1, "decoding": "greedy",
                "gamma": gamma, "environment": {"code": {"commit": code}},
                "metrics": {"measured_speedup": speedup, "acceptance_length": 1.8, "alpha": 0.45,
                            "T_V_over_T_T": 1.0, "T_D_over_T_T": 0.1}}
    text = rows(specbench_table.table(specbench_table.cells([
        record("eagle h", 3, 1.34, "bdc86c5"), record("eagle h", 5, 1.12, "385413c"),
        record("eagle h dynamic", 3, 1.00, "385413c"), record("eagle h dynamic", 5, 0.88, "385413c")])))
    assert "1.34× (1.80) γ3† / —" in text["eagle h"]
    assert "1.00× (1.80) γ3 / —" in text["eagle h dynamic"] and "†" not in text["eagle h dynamic"]
