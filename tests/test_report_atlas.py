"""magicdec/harness/report_atlas.py (`magicdec report atlas`): the speedup atlas's page, heat maps and README summary
from plan records. The records are made here with known numbers (two devices, a tensor-parallel one; an "off" point,
a point that did not fit, the planner's pick missing the best and the cost model missing by more than 10%), and every
expectation is computed here from those records by hand-written selections, not by the module."""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import numpy as np
import pytest

from magicdec import cli
from magicdec.errors import MagicDecError
from magicdec.harness import pages
from magicdec.harness import report_atlas as atlas

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
SOURCE = "SmolLM2-135M-Instruct real weights, 8K trace carried to the prefix"


def metrics(all_rounds, first_rounds) -> dict:
    """A candidate's metrics as Timed.metrics writes them: each speedup the median of its rounds, with their range."""
    out = {}
    for key, rounds in (("measured_speedup", all_rounds), ("measured_speedup_first_done", first_rounds)):
        out |= {key: statistics.median(rounds), f"{key}_range": [min(rounds), max(rounds)], f"{key}_rounds": rounds}
    return out | {"alpha": 0.8, "T_D_over_T_T": 0.2, "T_V_over_T_T": 1.2}


def candidate(drafter, config, rank, predicted, all_rounds, first_rounds=None, gamma=4) -> dict:
    label = f"{drafter} " + " ".join(f"--{k} {v}" for k, v in config.items())
    return {"label": label.strip(), "drafter": drafter, "options": label[len(drafter):].strip(), "config": config,
            "gamma": gamma, "rank": rank, "predicted_speedup": predicted, "acceptance_source": SOURCE,
            "metrics": metrics(all_rounds, first_rounds or all_rounds)}


def plan_record(B, L, gpu, world, decoding, candidates, mode="confirm", untimed=()) -> dict:
    """A plan record (atlas_schema.md section 2) of the candidates, its choice and pick as the schema defines them."""
    order = sorted(candidates, key=lambda c: c["rank"])
    ranking = [{"rank": c["rank"], "label": c["label"], "drafter": c["drafter"], "options": c["options"],
                "config": c["config"], "gamma": c["gamma"], "T_D_over_T_T": 0.2, "T_V_over_T_T": 1.2, "omega": 3.1,
                "speedup": c["predicted_speedup"], "acceptance": SOURCE} for c in [*order, *untimed]]
    ranking.append({"rank": len(ranking) + 1, "label": "baseline", "drafter": "baseline", "options": "", "config": {},
                    "gamma": 0, "T_D_over_T_T": 0.0, "T_V_over_T_T": 1.0, "omega": 1.0, "speedup": 1.0,
                    "acceptance": "-"})
    best = max(candidates, key=lambda c: c["metrics"]["measured_speedup"])
    off = best["metrics"]["measured_speedup"] < 1.0
    pick = order[0]
    m = pick["metrics"]["measured_speedup"]
    return {"point": f"plan_B{B}_P{L}_{decoding}", "method": "plan", "B": B, "prefix_len": L, "gen_len": 64,
            "decoding": decoding, "model": "meta-llama/Meta-Llama-3.1-8B", "random_weights": True,
            "environment": {"gpu": gpu, "device": "cuda:0"}, "tensor_parallel": {"world": world} if world > 1 else None,
            "plan": {"mode": mode, "confirm": len(candidates) if mode == "confirm" else None,
                     "selection": "best of K measured on the same rounds", "profile": "profiles/h100.json",
                     "acceptance": "acc/atlas.json", "ranking": ranking, "not_ranked": {}, "never_loses_margin": 1.02},
            "baseline": {"decode_tokens_per_s": 1000.0}, "candidates": order,
            "choice": ({"label": "baseline", "off": True, "why": "every confirmed candidate measured below 1",
                        "measured_speedup": 1.0, "measured_speedup_first_done": 1.0} if off else
                       {"label": best["label"], "off": False, "measured_speedup": best["metrics"]["measured_speedup"],
                        "measured_speedup_first_done": best["metrics"]["measured_speedup_first_done"]}),
            "planner_pick": {"label": pick["label"], "predicted_speedup": pick["predicted_speedup"],
                             "measured_speedup": m, "prediction_error": pick["predicted_speedup"] / m - 1}}


def skipped_record(B, L, gpu, decoding) -> dict:
    return {"point": f"plan_B{B}_P{L}_{decoding}", "method": "plan", "B": B, "prefix_len": L, "decoding": decoding,
            "environment": {"gpu": gpu}, "skipped": "does not fit in 80 GiB with its headroom"}


FP8_TREE = {"draft_policy": "snapkv", "draft_budget": 1024, "draft_weights": "fp8", "tree_width": 3}


def h100_records() -> dict[str, dict]:
    return {
        "p32k_b12": plan_record(12, 32768, H100, 1, "greedy", [
            candidate("selfspec", FP8_TREE, 1, 1.75, [1.60, 1.633, 1.66], [1.83, 1.864, 1.90]),
            candidate("selfspec", FP8_TREE | {"tree_width": 1}, 2, 1.60, [1.50, 1.528, 1.55])],
            untimed=[candidate("lookup", {"ngram_max": 3}, 3, 1.2, [1.0])]),
        # the pick (eagle, rank 1) measures far below the winner and the cost model misses it by +31%
        "p100k_b1": plan_record(1, 100000, H100, 1, "greedy", [
            candidate("eagle", {"tree_nodes": 32}, 1, 2.3, [1.70, 1.75, 1.80]),
            candidate("selfspec", {"draft_weights": "int4", "tree_width": 2}, 2, 2.0, [2.05, 2.09, 2.11])]),
        "p4k_b256": plan_record(256, 4096, H100, 1, "greedy", [  # nothing pays: off
            candidate("lookup", {"ngram_max": 3}, 1, 1.03, [0.95, 0.97, 0.99])]),
        "p128k_b256": skipped_record(256, 131072, H100, "greedy"),
    }


def h200_records() -> dict[str, dict]:
    return {
        "p100k_b32": plan_record(32, 100000, H200, 4, "greedy", [
            candidate("selfspec", FP8_TREE, 1, 2.4, [2.45, 2.52, 2.60], [2.90, 3.00, 3.10]),
            candidate("selfspec", {"draft_budget": 1024}, 2, 2.2, [2.30, 2.35, 2.40])]),
        "p4k_b64": plan_record(64, 4096, H200, 4, "sampled", [
            candidate("lookup", {"ngram_max": 3, "tree_width": 2}, 1, 1.10, [1.02, 1.05, 1.07])], mode="auto"),
    }


def write(folder: Path, records: dict[str, dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for stem, r in records.items():
        (folder / f"{stem}.json").write_text(json.dumps(r))
    return folder


README = ("# magicdec\r\n\nIntro — “quoted” text.\n\n" + atlas.START + "\nold table\n" + atlas.END
          + "\n\n## Install\n\nrest of the file, no newline at the end")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """One report over two sweep folders (with a sweep's other files beside the records), its page and README."""
    root = tmp_path_factory.mktemp("atlas")
    h100 = write(root / "h100", h100_records())
    h200 = write(root / "h200", h200_records())
    # what else a sweep folder holds: none of it is a plan record of this atlas
    baseline_point = {"point": "baseline_B12_P32768_greedy", "method": "baseline", "B": 12, "metrics": {}}
    (h100 / "baseline_B12_P32768_greedy.json").write_text(json.dumps(baseline_point))
    (h100 / "sweep.toml").write_text("methods = ['plan']\n")
    (h100 / "commands.txt").write_text("magicdec sweep ...\n")
    stray = plan_record(8, 8192, H100, 1, "greedy", [candidate("lookup", {}, 1, 1.5, [1.4, 1.45, 1.5])])
    for sub in ("stale", ".batches", "broken"):
        write(h100 / sub, {"p8k_b8": stray})
    readme = root / "README.md"
    readme.write_bytes(README.encode("utf-8"))
    out = root / "out"
    assert atlas.main([str(h100), str(h200), "--out", str(out), "--readme", str(readme),
                       "--show_ranking", "12,32K", "--show_ranking", "1,100000"]) == 0
    return {"root": root, "out": out, "page": (out / atlas.PAGE).read_text(encoding="utf-8"), "readme": readme,
            "records": {**{("h100", k): v for k, v in h100_records().items()},
                        **{("h200", k): v for k, v in h200_records().items()}}}


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the markdown tables in text (not their header rows)."""
    lines = text.splitlines()
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line, after in zip(lines, lines[1:] + [""])
            if line.startswith("| ") and not after.startswith("|---")]


def section(page: str, heading: str) -> str:
    """The text under a markdown heading, to the next heading of its level or above."""
    level = heading.split(" ")[0]
    start = page.index(heading + "\n")
    nxt = re.compile(rf"^#{{1,{len(level)}}} ", re.MULTILINE).search(page, start + len(heading))
    return page[start:nxt.start() if nxt else len(page)]


def span(m: dict, key: str) -> str:
    lo, hi = min(m[f"{key}_rounds"]), max(m[f"{key}_rounds"])
    return f"{statistics.median(m[f'{key}_rounds']):.3f}× [{lo:.3f}–{hi:.3f}]"


def title(r: dict) -> str:
    world = (r.get("tensor_parallel") or {}).get("world", 1)
    return f"{r['environment']['gpu']}, {'one GPU' if world == 1 else f'TP = {world}'}, {r['decoding']}"


def prefix(L: int) -> str:
    return {4096: "4K", 32768: "32K", 100000: "100K", 131072: "128K"}[L]


def timed(made) -> list[dict]:
    return [r for r in made["records"].values() if "skipped" not in r]


def test_every_point_row_equals_what_its_record_holds(made):
    """Per point: the winner is the candidate with the highest measured all-reach median (the baseline, 1, counted:
    "off" where none reaches it), its spans, the runner-up with its speedup, the pick with its prediction error."""
    for r in timed(made):
        rows = {(row[0], row[1]): row for row in table_rows(section(made["page"], f"### {title(r)}"))}
        row = rows[(str(r["B"]), prefix(r["prefix_len"]))]
        entries = [(c["metrics"]["measured_speedup"], c) for c in r["candidates"]] + [(1.0, None)]
        ordered = sorted(entries, key=lambda e: -e[0])
        (_, winner), (up_speed, runner_up) = ordered[0], ordered[1]
        if winner is None:
            assert row[2].startswith("off") and row[3] == row[4] == "—"
        else:
            assert row[2] == f"{winner['label']} (γ {winner['gamma']})"
            assert row[3] == span(winner["metrics"], "measured_speedup_first_done")
            assert row[4] == span(winner["metrics"], "measured_speedup")
        assert row[5] == ("baseline" if runner_up is None else f"{runner_up['label']} {up_speed:.3f}×")
        pick = r["planner_pick"]
        assert row[7] == (f"{pick['label']}: predicted {pick['predicted_speedup']:.2f}×, measured "
                          f"{pick['measured_speedup']:.3f}×, error {pick['prediction_error']:+.1%}")
        assert row[8:] == [SOURCE if winner else "acc/atlas.json", "64", r["decoding"]]
    skipped = made["records"][("h100", "p128k_b256")]
    rows = table_rows(section(made["page"], f"### {title(skipped)}"))
    assert ["256", "128K", f"does not fit: {skipped['skipped']}"] == rows[-1][:3]
    # the two hand-checked facts the selection above must reproduce
    assert "| 1 | 100K | selfspec --draft_weights int4 --tree_width 2 (γ 4) |" in made["page"]
    assert "| 256 | 4K | off: no option measured ≥ 1 |" in made["page"]


def test_findings_open_the_page_with_shares_and_misses(made):
    """The page opens with the findings: per device and decoding, the best point, the off points, the share of
    points where the pick is within 5% of the measured best (misses named) and where |prediction error| ≤ 10%."""
    page = made["page"]
    assert page.splitlines()[1] == "# The speedup atlas" and page.splitlines()[3] == "## Findings"
    rows = {(row[0], row[1]): row for row in table_rows(section(page, "## Findings"))}
    groups = {}
    for (folder, _), r in made["records"].items():
        world = (r.get("tensor_parallel") or {}).get("world", 1)
        device = r["environment"]["gpu"] + ("" if world == 1 else f", TP = {world}")
        groups.setdefault((device, r["decoding"]), []).append(r)
    assert set(rows) == set(groups)
    for key, recs in groups.items():
        row, t = rows[key], [r for r in recs if "skipped" not in r]
        assert row[2] == f"{len(t)}, {len(recs) - len(t)}"
        best = max(t, key=lambda r: r["choice"]["measured_speedup"])
        assert row[3].startswith(f"{prefix(best['prefix_len'])} × {best['B']}: "
                                 f"{best['choice']['measured_speedup']:.3f}× all reach")
        off = [f"{prefix(r['prefix_len'])} × {r['B']}" for r in t if r["choice"]["off"]]
        assert row[4] == f"{len(off)}" + (f": {', '.join(off)}" if off else "")
        within = [max(1.0, *(c["metrics"]["measured_speedup"] for c in r["candidates"])) * 0.95
                  <= r["planner_pick"]["measured_speedup"] for r in t]
        assert row[5].startswith(f"{sum(within)}/{len(within)} ({sum(within) / len(within):.0%})")
        model = [abs(r["planner_pick"]["prediction_error"]) <= 0.10 for r in t]
        assert row[6].startswith(f"{sum(model)}/{len(model)} ({sum(model) / len(model):.0%})")
    h100 = rows[(H100, "greedy")]
    assert h100[5] == "2/3 (67%); misses: 100K × 1 (pick 1.750× vs best 2.090×)"
    assert h100[6] == "2/3 (67%); misses: 100K × 1 (+31.4%)"


def test_goals_are_checked_from_the_records(made):
    """Each goal at its point, PASS or MISS from the plan's measured speedups; a goal at a point not in the records is
    "not measured", never a PASS."""
    rows = table_rows(section(made["page"], "## The goals"))
    verdict = {row[0][:30]: row[-1] for row in rows}
    r32 = made["records"][("h100", "p32k_b12")]["choice"]
    assert verdict["One H100, 32K × 12 (13 where i"] == (
        "PASS" if r32["measured_speedup"] >= 1.8 and r32["measured_speedup_first_done"] >= 2.1 else "**MISS**")
    assert verdict["One H100, 100K × 1: ≥ 2.5×"] == "**MISS**"  # 2.09 measured
    assert verdict["TP = 4 on 4 × H100, 100K × 16:"] == "not measured"
    assert verdict["TP = 4 on 4 × H200, 100K × 32:"] == "PASS"  # first done 3.00
    floor = [r["choice"]["measured_speedup"] >= 0.98 for r in timed(made)]
    assert verdict["Every point, 4K × 256 included"] == ("PASS" if all(floor) else "**MISS**")
    pick = next(row for row in rows if row[0].startswith("The planner's pick"))
    assert pick[2].startswith("4/5 (80%)") and pick[3] == "**MISS**"  # below 90%


def test_heat_map_grid_and_files(made):
    """The heat map's data: B and L as present, the plan's all-reach speedup per cell, NaN where no record or it did
    not fit, each cell's family or "off" / "does not fit"; one PNG per device and decoding."""
    points = [atlas.point(r) for (folder, _), r in made["records"].items() if folder == "h100"]
    g = atlas.grid(points)
    assert g["B"] == [1, 12, 256] and g["L"] == [4096, 32768, 100000, 131072]
    expected = np.full((4, 3), np.nan)
    text = np.full((4, 3), "", dtype=object)
    for r in (r for (folder, _), r in made["records"].items() if folder == "h100"):
        i, j = g["L"].index(r["prefix_len"]), g["B"].index(r["B"])
        if "skipped" in r:
            text[i, j] = "does not fit"
        else:
            expected[i, j] = r["choice"]["measured_speedup"]
    text[0, 2] = "off"
    text[1, 1] = f"{expected[1, 1]:.2f}×\nselfspec fp8 tree"
    text[2, 0] = f"{expected[2, 0]:.2f}×\nselfspec int4 tree"
    np.testing.assert_array_equal(g["speedup"], expected)
    assert g["text"].tolist() == text.tolist()
    pngs = sorted(made["out"].glob("atlas_*.png"))
    assert len(pngs) == 3 and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert all(f"]({p.name})" in made["page"] for p in pngs)


def test_every_figure_on_the_page_is_in_its_records(made):
    """magicdec.harness.pages (the project's checker of results pages) finds every speedup and [min–max] on the
    page in the records it links."""
    assert pages.unbacked(made["out"] / atlas.PAGE, made["root"]) == []


def test_ranking_beside_measurement(made):
    """The asked points' top-10 ranking rows, each timed option with its measured spans, the others "not timed"."""
    r = made["records"][("h100", "p32k_b12")]
    rows = table_rows(section(made["page"], f"### {title(r)}: 32K × 12"))
    assert [row[1] for row in rows] == [x["label"] for x in r["plan"]["ranking"]]
    timed_ = {c["label"]: c for c in r["candidates"]}
    for row, x in zip(rows, r["plan"]["ranking"]):
        assert row[6] == f"{x['speedup']:.3f}"
        m = timed_.get(x["label"])
        assert row[8] == (span(m["metrics"], "measured_speedup") if m else
                          "the baseline" if x["label"] == "baseline" else "not timed")
    assert f"### {H100}, one GPU, greedy: 100K × 1" in made["page"]
    assert made["page"].count("\n### ") == 3 + 2  # a section per group, and the two asked points
    # without --show_ranking: the smallest, middle and largest B × L timed
    points = [atlas.point(r) for r in made["records"].values()]
    assert atlas.ranking_points(points, []) == [(1, "100K"), (12, "32K"), (32, "100K")]


def test_readme_summary_replaces_only_its_block(made):
    """Between the markers: per device a table, rows L, columns B, cells "speedup× family" / "off" / "does not fit";
    every byte outside them as it was."""
    text = made["readme"].read_bytes().decode("utf-8")
    a, b = README.index(atlas.START) + len(atlas.START), README.index(atlas.END)
    assert text.startswith(README[:a]) and text.endswith(README[b:])
    block = text[a:len(text) - len(README) + b]
    assert "[its page](out/atlas.md)" in block
    h100 = table_rows(block.split(f"**{H100}, one GPU, greedy**")[1].split("**")[0])
    assert f"**{H100}, one GPU, greedy**\n\n| L \\ B | 1 | 12 | 256 |\n" in block
    assert h100 == [["4K", "", "", "off"], ["32K", "", "1.63× selfspec fp8 tree", ""],
                    ["100K", "2.09× selfspec int4 tree", "", ""], ["128K", "", "", "does not fit"]]
    assert f"**{H200}, TP = 4, sampled**" in block and "1.05× lookup tree" in block


def test_readme_without_markers_is_an_error_and_nothing_is_written(tmp_path):
    folder = write(tmp_path / "h100", h100_records())
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    with pytest.raises(MagicDecError, match="--readme .*needs the lines `<!-- atlas-summary:start -->` and "
                                            "`<!-- atlas-summary:end -->` once each.*found 0 and 0"):
        atlas.main([str(folder), "--out", str(tmp_path / "out"), "--readme", str(readme)])
    assert readme.read_text() == "# no markers\n" and not (tmp_path / "out").exists()


def test_bad_input_is_one_line(tmp_path):
    """A folder without plan records, a missing folder, --out that cannot be written, a --show_ranking point not in
    the records or not a point, two records of one point, a page at --out not made by this command."""
    good = write(tmp_path / "good", h100_records())
    other = write(tmp_path / "other", {"base": {"point": "b", "method": "baseline"}, "x": {"rows": []}})
    cases = [
        ([str(other), "--out", str(tmp_path / "o")], rf"{other}: no plan records in it \(of 2 JSON file\(s\)"),
        ([str(tmp_path / "nope"), "--out", str(tmp_path / "o")], "nope: no such folder"),
        ([str(good), "--out", str(good / "p4k_b256.json")], "--out .*p4k_b256.json is a file"),
        ([str(good), "--out", str(good / "p4k_b256.json" / "sub")], "--out: cannot write to"),
        ([str(good), "--out", str(tmp_path / "o"), "--show_ranking", "64,32K"],
         r"--show_ranking 64,32K: no timed plan record at B 64, prefix 32K .*give one of: 1,100K, 12,32K, 256,4K"),
        ([str(good), "--out", str(tmp_path / "o"), "--show_ranking", "256,128K"], "no timed plan record at B 256"),
        ([str(good), "--out", str(tmp_path / "o"), "--show_ranking", "32K"], r"--show_ranking '32K': give B,L"),
        ([str(good), str(good), "--out", str(tmp_path / "o")], "two plan records of one point"),
    ]
    for argv, message in cases:
        with pytest.raises(MagicDecError, match=message) as e:
            atlas.main(argv)
        assert "\n" not in str(e.value)
    assert not (tmp_path / "o").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / atlas.PAGE).write_text("# written by hand\n")
    with pytest.raises(MagicDecError, match="atlas.md exists and was not made by magicdec report atlas"):
        atlas.main([str(good), "--out", str(tmp_path / "mine")])
    assert (tmp_path / "mine" / atlas.PAGE).read_text() == "# written by hand\n"


def test_the_command_line_says_error_in_one_line(tmp_path, capsys):
    """`magicdec report atlas` through the CLI: bad input is `error: ...` on one line, exit status 2."""
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as e:
        cli.main(["report", "atlas", str(empty), "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {empty}: no plan records in it")


def test_malformed_records_are_skipped_with_a_warning(tmp_path, capsys, monkeypatch):
    """A cut file, a JSON list, a plan record without its choice, one whose choice is no timed candidate: a warning
    naming each file, and the rest of the atlas made without them."""
    folder = write(tmp_path / "h100", {k: v for k, v in h100_records().items() if k in ("p4k_b256", "p32k_b12")})
    (folder / "cut.json").write_text('{"point": "x", "method": "pl')
    (folder / "list.json").write_text("[1]")
    no_choice = h100_records()["p100k_b1"]
    del no_choice["choice"]
    (folder / "nochoice.json").write_text(json.dumps(no_choice))
    wrong = h100_records()["p128k_b256"] | {"skipped": None}
    (folder / "notskipped.json").write_text(json.dumps(wrong))
    other = h100_records()["p100k_b1"]
    other["choice"]["label"] = "selfspec --draft_weights int8"
    (folder / "unknownchoice.json").write_text(json.dumps(other))
    monkeypatch.setattr(atlas, "heat_map", lambda g, title, path: path)  # the figures are another test's
    assert atlas.main([str(folder), "--out", str(tmp_path / "out")]) == 0
    warnings = capsys.readouterr().err.splitlines()
    assert [w.split(": ")[:2] for w in warnings] == [["warning", str(folder / f"{f}.json")] for f in
                                                     ("cut", "list", "nochoice", "notskipped", "unknownchoice")]
    assert "without choice" in warnings[2] and "gen_len" in warnings[3] and "none of its timed" in warnings[4]
    page = (tmp_path / "out" / atlas.PAGE).read_text()
    assert "| 12 | 32K |" in page and "| 1 | 100K |" not in page


def test_family_names_the_drafter_its_weights_and_a_tree():
    family = atlas.family
    assert family({"label": "x", "drafter": "selfspec", "config": FP8_TREE}) == "selfspec fp8 tree"
    assert family({"label": "x", "drafter": "selfspec", "config": {"draft_weights": "bf16", "tree_width": 1}}) == "selfspec"
    assert family({"label": "x", "drafter": "eagle", "config": {"tree_nodes": 16}}) == "eagle tree"
    assert family({"label": "lookup --ngram_max 3", "drafter": "lookup", "config": {"ngram_max": 3}}) == "lookup"


def test_cost_model_per_drafter_counts_every_timed_candidate(made):
    """Per device, decoding and drafter: the timed candidates whose prediction is within 10% of their all-reach
    median (predicted / median of the rounds - 1, computed here from the rounds), and the errors' min and max."""
    rows = {tuple(r[:3]): r[3:] for r in table_rows(section(made["page"], "## The cost model per drafter"))}
    expected: dict[tuple, list[float]] = {}
    for r in timed(made):
        world = (r.get("tensor_parallel") or {}).get("world", 1)
        device = r["environment"]["gpu"] if world == 1 else f"{r['environment']['gpu']}, TP = {world}"
        for c in r["candidates"]:
            m = statistics.median(c["metrics"]["measured_speedup_rounds"])
            expected.setdefault((device, r["decoding"], c["drafter"]), []).append(c["predicted_speedup"] / m - 1)
    assert set(rows) == set(expected)
    for key, errors in expected.items():
        within = sum(abs(e) <= 0.10 for e in errors)
        assert rows[key][0].startswith(f"{within}/{len(errors)} ")
        low, _, high = rows[key][1].split(", ")
        assert (low, high) == (f"{min(errors):+.1%}", f"{max(errors):+.1%}")


def test_a_committed_profile_is_named_as_the_repository_names_it():
    """A record made on another machine holds its absolute path; the page names the committed profile by its path in
    the repository, and any other profile as the record gives it."""
    assert atlas.profile_name("/elsewhere/repo/magicdec/analysis/profiles/h200.json") == \
        "magicdec/analysis/profiles/h200.json"
    assert atlas.profile_name("/tmp/mine.json") == "/tmp/mine.json" and atlas.profile_name(None) is None
