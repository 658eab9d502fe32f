"""The sweep report: hand-written records with chosen numbers (so every expected value is known without the report's
code) through `magicdec report`: best fixed setting, cost-model errors, planner PASS/FAIL, every drafter at its best
γ, figures, RESULTS.md with commands and links, updated in place, skipped points; bad records and folders; then one
real tiny sweep, to prove its record format is read."""
from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import pytest

from conftest import TINY_SWEEP
from magicdec import cli
from magicdec.harness import report
from magicdec.errors import MagicDecError

ENV = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.13.0", "python": "3.11.7", "device": "cuda"}
COMMAND = "python -m magicdec sweep benchmarks/sweeps/llama.toml --output_dir results/planner_sweeps/llama  # NVIDIA H100 80GB HBM3, 2026-01-02 03:04"
# (prefix, B) -> {(budget, gamma): (speedup all reach, speedup first done)}, and the auto point's speedup
SPEEDUPS = {
    (4096, 8): {(256, 2): (1.20, 1.90), (256, 3): (1.50, 1.60), (512, 2): (1.10, 1.30), (512, 3): (1.30, 1.50)},
    (4096, 1): {(256, 2): (0.90, 1.00), (256, 3): (0.80, 0.90), (512, 2): (0.85, 0.95), (512, 3): (0.70, 0.75)},
    (16384, 8): {(256, 2): (1.60, 2.10), (256, 3): (2.00, 2.40), (512, 2): (1.50, 1.80), (512, 3): (1.70, 2.00)},
    (16384, 1): {(256, 2): (0.99, 1.40), (256, 3): (0.90, 1.20), (512, 2): (0.95, 1.30), (512, 3): (0.85, 1.10)},
}
AUTO = {(4096, 8): 1.48, (4096, 1): 0.93, (16384, 8): 1.85, (16384, 1): 0.98}
# expected checks: (auto >= 0.97 x baseline, auto >= 0.95 x best fixed); at (4096, 1) every speculative setting is
# slower than the baseline, which is then the best fixed setting (0.93 < 0.95 x 1, though >= 0.95 x 0.90); 0.98 at
# (16384, 1) is below the baseline but within 3%
CHECKS = {(4096, 8): (True, True), (4096, 1): (False, False), (16384, 8): (True, False), (16384, 1): (True, True)}


def meta(P, B):
    return dict(prefix_len=P, B=B, model="meta-llama/Meta-Llama-3.1-8B", draft_model=None, random_weights=True,
                synthetic_acceptance=0.8, gen_len=64, sinks=16, cuda_graphs=True, environment=ENV)


def records() -> dict[str, dict]:
    out = {}
    for (P, B), settings in SPEEDUPS.items():
        base_tok_s = 100.0 * B
        out[f"baseline_P{P}_B{B}_greedy"] = {
            "method": "baseline", "decoding": "greedy", "budget": None, "gamma": None, **meta(P, B),
            "device_model": {"bandwidth": 2.9e12, "matmul_flops": 6.5e14, "layer_overhead_s": 2e-6, "ranks": 1},
            "metrics": {"decode_tokens_per_s": base_tok_s, "ms_per_step": 1e3 * B / base_tok_s, "cost_model": {"T_T_s": 0.01}}}
        for (budget, gamma), (s_all, s_first) in settings.items():
            # cost model: Omega_eff form 5% high everywhere; Omega form 5% low at B=8, 20% low at B=1
            cm = {"speedup_effective": 1.05 * s_all, "speedup": (0.95 if B == 8 else 0.8) * s_first,
                  "T_D_over_T_T": budget / P, "T_V_over_T_T": 1.0 + 0.01 * gamma}
            if (P, B, budget, gamma) == (4096, 8, 256, 3):  # the best fixed setting of that point: +12% and +25%
                cm |= {"speedup_effective": 1.68, "speedup": 2.0}
            out[f"selfspec_P{P}_B{B}_greedy_b{budget}_g{gamma}"] = {
                "method": "selfspec", "decoding": "greedy", "budget": budget, "gamma": gamma, **meta(P, B), "planner": None,
                "metrics": {"decode_tokens_per_s": base_tok_s * s_all, "measured_speedup": s_all,
                            "measured_speedup_first_done": s_first, "alpha": 0.7 + budget / 5120,
                            "T_D_over_T_T": 1.1 * budget / P, "T_V_over_T_T": 1.1, "predicted_speedup": s_first,
                            "predicted_speedup_effective": 1.01 * s_all, "cost_model": cm}}
        out[f"auto_P{P}_B{B}_greedy"] = {
            "method": "auto", "decoding": "greedy", "budget": 256, "gamma": None, **meta(P, B),
            "planner": {"predicted_best": {"method": "selfspec", "budget": 256, "gamma": 3, "speedup": 1.4}, "budget": 256},
            "metrics": {"decode_tokens_per_s": base_tok_s * AUTO[P, B], "measured_speedup": AUTO[P, B],
                        "measured_speedup_first_done": AUTO[P, B], "alpha": 0.8, "cost_model": None,
                        "speculation": {"auto_gamma": {"iterations_per_gamma": {"2": 5, "3": 11}, "switched_off": False}}}}
    out["baseline_P16384_B64_greedy"] = {"skipped": "B=64 x prefix 16384 does not fit in memory", **meta(16384, 64)}
    return out


def write_sweep(d: Path) -> Path:
    d.mkdir(parents=True)
    for name, rec in records().items():
        (d / f"{name}.json").write_text(json.dumps({"point": name, **rec}))
    (d / "commands.txt").write_text(COMMAND + "\n")
    return d


def row_of(md: str, P: int, B: int) -> list[str]:
    line = next(x for x in md.splitlines() if x.startswith(f"| {P} | {B} | greedy |"))
    return [c.strip() for c in line.strip("|").split("|")]


def every_drafter(md: str, P: int, B: int) -> list[list[str]]:
    """The cells after (prefix, B, decoding) of the every-drafter table's rows at one greedy point."""
    part = md.split("Every drafter at each point")[1].split("\n\n")[1]
    return [x.split(" | ")[3:] for x in part.splitlines() if x.startswith(f"| {P} | {B} | greedy | ")]


def test_report_from_hand_written_records(tmp_path, capsys):
    sweep = write_sweep(tmp_path / "sweeps" / "llama")
    extra = tmp_path / "side_by_side.md"
    extra.write_text("## transformers side by side\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
                     "[log](sbs/log.txt), [docs](https://example.org/a_b), [top](#results), ![plot](sbs/p.svg)\n")
    results_md, out = tmp_path / "results" / "RESULTS.md", tmp_path / "results" / "issue5"
    assert report.main([str(sweep), "--out", str(out), "--results_md", str(results_md), "--include", str(extra)]) == 0
    md = results_md.read_text()

    # the best fixed setting is the maximum (all reach); first done names its own best where that differs
    rows = {(r["P"], r["B"]): r for r in report.rows(report.load(sweep)[0])}
    for key, settings in SPEEDUPS.items():
        budget, gamma = max(settings, key=lambda s: settings[s][0])
        assert (rows[key]["best"]["budget"], rows[key]["best"]["gamma"]) == (budget, gamma)
        assert rows[key]["s_all"] == settings[budget, gamma][0]
    cells = row_of(md, 4096, 8)
    assert cells[3:7] == ["800.0", "selfspec b256 γ3", "1.50", "1.60 (best 1.90: selfspec b256 γ2)"]

    # relative error = predicted / measured - 1, Omega_eff vs all reach, Omega vs first done
    assert rows[4096, 8]["err_eff"] == pytest.approx(1.68 / 1.50 - 1) and rows[4096, 8]["err"] == pytest.approx(2.0 / 1.6 - 1)
    assert cells[8:10] == ["1.68 (+12.0%)", "2.00 (+25.0%)"]
    assert rows[16384, 1]["err"] == pytest.approx(-0.2)  # best there: b256 γ2, Omega form 20% low

    # planner checks flip where the numbers say so
    for key, (ok_base, ok_best) in CHECKS.items():
        assert (rows[key]["ok_base"], rows[key]["ok_best"]) == (ok_base, ok_best), key
        cells = row_of(md, *key)
        assert cells[10] == f"{AUTO[key]:.2f}" and cells[11] == "b256, γ 2:5 3:11"
        assert cells[12:] == ["PASS" if ok_base else "**FAIL**", "PASS" if ok_best else "**FAIL**"]

    # every drafter at its best γ, fastest first (auto among them); records before labels: method and budget
    assert every_drafter(md, 4096, 8) == [["selfspec b256", "3", "1.50", "1.60", "0.750", "—", "0.069", "1.100", "—", "1.68 (+12.0%)",
                      "2.00 (+25.0%) |"],
                     ["auto", "b256, γ 2:5 3:11", "1.48", "1.48", "0.800", "—", "—", "—", "—", "—", "— |"],
                     ["selfspec b512", "3", "1.30", "1.50", "0.800", "—", "0.138", "1.100", "—", "1.37 (+5.0%)",
                      "1.42 (-5.0%) |"]]  # 0.95 x 1.50, rounded

    # summary: 15 of 16 points within 10% (Omega_eff), 7 of 16 (Omega: B=8 points but the +25% one), 16 of 16 (ratios)
    assert "cost model Ω_eff vs all reach: 15/16; cost model Ω vs first done: 7/16;" in md
    assert "measured T_D/T_T, T_V/T_T, Ω_eff vs all reach: 16/16" in md
    assert "Planner: 2/4 points pass both checks (≥ 0.97 × baseline: 3/4, ≥ 0.95 × best fixed: 2/4)" in md

    # figures: valid PNGs, embedded in RESULTS.md with links relative to it; the commands; skipped points; includes
    links = re.findall(r"!\[[^]]*\]\(([^)]+\.png)\)", md)
    assert sorted(Path(x).name for x in links) == sorted(f"llama_{k}.png" for k in
                                                         ("speedup", "drafters", "predicted", "ratios", "alpha"))
    for link in links:
        assert not Path(link).is_absolute()
        assert (results_md.parent / link).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"```bash\n{COMMAND}\n```" in md
    assert "`baseline_P16384_B64_greedy`: B=64 x prefix 16384 does not fit in memory" in md
    assert "NVIDIA H100 80GB HBM3" in md and "random weights, synthetic α 0.80" in md
    # an included file's relative links still lead to the files beside it; URLs and anchors stay as written
    assert md.rstrip().endswith("| 1 | 2 |\n\n[log](../sbs/log.txt), [docs](https://example.org/a_b), [top](#results), "
                                "![plot](../sbs/p.svg)\n\n<!-- /include ../side_by_side.md -->")
    assert (out / "llama.md").read_text().count("](llama_") == 5  # the per-sweep file links beside its PNGs
    assert "selfspec b256 γ3" in capsys.readouterr().out


def test_report_skips_missing_dimensions(tmp_path):
    """One prefix, one batch size, one budget: only the measured-vs-predicted figure can be drawn."""
    sweep = tmp_path / "one"
    sweep.mkdir()
    for name, rec in records().items():
        if rec.get("prefix_len") == 4096 and rec.get("B") == 8 and rec.get("budget") in (256, None):
            (sweep / f"{name}.json").write_text(json.dumps({"point": name, **rec}))
    results_md = tmp_path / "RESULTS.md"
    report.main([str(sweep), "--out", str(tmp_path / "png"), "--results_md", str(results_md)])
    assert sorted(p.name for p in (tmp_path / "png").glob("*.png")) == ["one_predicted.png"]
    assert "(no commands.txt)" in results_md.read_text()


TINY = TINY_SWEEP + """
gammas = [1]
methods = ["baseline", "selfspec", "lookup"]
synthetic_acceptance = 0.8
"""


def test_report_reads_a_real_sweep(tmp_path, monkeypatch):
    """A real sweep's records (a drafter with a budget, one without) through the report. The sweep's probes of
    this device's step times only calibrate its cost model; stubbed, they keep this test fast on a CPU."""

    from magicdec.harness import sweep
    monkeypatch.setattr(sweep.Sweep, "probe", lambda self, cfg: 0.02)
    (tmp_path / "t.toml").write_text(TINY)
    out = tmp_path / "tiny"
    assert sweep.Sweep(sweep.load_config(tmp_path / "t.toml"), out, "cpu", False).run(None) == 0
    (out / "commands.txt").write_text("magicdec sweep t.toml --output_dir tiny  # cpu, today\n")
    results_md = tmp_path / "RESULTS.md"
    report.main([str(out), "--out", str(tmp_path / "png"), "--results_md", str(results_md)])
    md = results_md.read_text()
    recs = {r["method"]: r for r in map(json.loads, map(Path.read_text, out.glob("*.json")))}
    assert recs["lookup"]["budget"] is None  # the point of having it here: a drafter without a draft budget
    best = max((recs["selfspec"], recs["lookup"]), key=lambda r: r["metrics"]["measured_speedup"])
    cells = row_of(md, 48, 2)
    assert cells[4:6] == [f"{best['label']} γ1", f"{best['metrics']['measured_speedup']:.2f}"]
    every = {row[0]: row[1:] for row in every_drafter(md, 48, 2)}
    for r in (recs["selfspec"], recs["lookup"]):  # every drafter's row: its γ, speedup, the cost model's view
        m, cm = r["metrics"], r["metrics"]["cost_model"]
        assert every[r["label"]][:2] == ["1", f"{m['measured_speedup']:.2f}"]
        error = "none" not in cm and cm["speedup_effective"] / m["measured_speedup"] - 1
        assert every[r["label"]][8] == (f"no model: {cm['none']}" if "none" in cm else
                                        f"{cm['speedup_effective']:.2f} ({error:+.1%})")
    assert "synthetic α 0.80" in md and "# cpu, today" in md


def test_points_timed_on_several_batches_get_a_row_per_batch():
    """Per batch: the fixed setting fastest on that batch and auto against it (a baseline of 1 when every setting
    loses there); groups timed on one batch get no such table."""
    def rec(method, budget, gamma, speedups):
        return {"method": method, "budget": budget, "gamma": gamma, "prefix_len": 8000, "B": 128, "decoding": "greedy",
                "batches": [{"skip_tokens": k, "measured_speedup": s, "gamma_use": {"1": 30} if method == "auto" else None}
                            for k, s in zip((11000, 15000), speedups)]}
    recs = [rec("selfspec", 512, 1, (1.20, 0.90)), rec("selfspec", 1024, 2, (1.10, 0.95)), rec("auto", 512, None, (1.14, 0.97))]
    lines = report.batch_table(recs).splitlines()
    assert lines[2].split(" | ")[3:] == ["11000", "selfspec b512 γ1", "1.20", "1.14", "1:30", "0.950 |"]
    assert lines[3].split(" | ")[3:] == ["15000", "selfspec b1024 γ2", "0.95", "0.97", "1:30", "0.970 |"]
    assert report.batch_table([dict(r, batches=r["batches"][:1]) for r in recs]) is None
    assert report.batch_table(recs[2:]) is None  # auto alone: nothing to rank the batches by


def test_auto_without_fixed_settings_is_not_checked_against_them():
    """A sweep of baseline and auto only (another auto setting, say) leaves the best-fixed check empty instead of
    passing it against the baseline's 1.0."""
    recs = [r for r in records().values() if r.get("method") in ("baseline", "auto")]
    rows = report.rows(recs)
    assert [(r["ok_base"], r["ok_best"]) for r in rows] == [(False, None), (True, None), (True, None), (True, None)]
    assert row_of(report.table(rows), 4096, 8)[12:] == ["PASS", "—"]
    assert "Planner: 0/0 points pass both checks (≥ 0.97 × baseline: 3/4, ≥ 0.95 × best fixed: 0/0)" in report.summary(recs, rows)


def test_results_md_opens_with_one_row_per_sweep(tmp_path):
    """The summary table after the title: per sweep its model, weights, device, points, best fixed speedups with their
    points, the cost model's count within 10% and the planner's checks, the numbers the sweep's own section shows."""
    full = write_sweep(tmp_path / "sweeps" / "llama")
    auto_only = tmp_path / "sweeps" / "llama_auto"
    auto_only.mkdir()
    for name, rec in records().items():  # baseline and auto only, each point timed on two batches
        if rec.get("method") in ("baseline", "auto"):
            rec = rec | {"batches": [{"skip_tokens": k, "measured_speedup": 1.0} for k in (11000, 15000)]}
            (auto_only / f"{name}.json").write_text(json.dumps({"point": name, **rec}))
    results_md, out = tmp_path / "results" / "RESULTS.md", tmp_path / "results" / "issue5"
    report.main([str(full), str(auto_only), "--out", str(out), "--results_md", str(results_md)])
    md = results_md.read_text()
    lines = md.splitlines()
    head = next(i for i, x in enumerate(lines) if x.startswith("| sweep | model |"))
    assert lines[0] == "# Results" and lines[2:5] == ["<!-- head -->", "", f"Last updated by `magicdec report {full} "
                                                      f"{auto_only} --out {out} --results_md {results_md}`; a run "
                                                      "replaces the sections of the sweeps it names and keeps every "
                                                      "other section (between `<!-- sweep NAME -->` markers)."]
    assert head < next(i for i, x in enumerate(lines) if x.startswith("How to read these tables"))
    cells = [[c.strip() for c in x.strip("|").split("|")] for x in lines[head + 2:head + 4]]
    # best all reach: 16384 x 8, b256 γ3 (2.00); best first done: the same setting (2.40); cost model as in the
    # sweep's own summary (15/16, 7/16); planner: 3/4 above 0.97 x baseline, 2/4 above 0.95 x best fixed
    assert cells[0] == ["[llama](issue5/llama.md)", "meta-llama/Meta-Llama-3.1-8B", "random weights, synthetic α 0.80",
                        "NVIDIA H100 80GB HBM3", "4", "2.00 (16384 × 8 greedy, selfspec b256 γ3)",
                        "2.40 (16384 × 8 greedy, selfspec b256 γ3)", "Ω_eff vs all reach: 15/16; Ω vs first done: 7/16",
                        "3/4", "2/4"]
    assert "cost model Ω_eff vs all reach: 15/16; cost model Ω vs first done: 7/16;" in md
    # no fixed settings: nothing to compare auto with, only its check against the baseline
    assert cells[1] == ["[llama_auto](issue5/llama_auto.md)", "meta-llama/Meta-Llama-3.1-8B",
                        "random weights, synthetic α 0.80", "NVIDIA H100 80GB HBM3", "4, each timed on 2 batches",
                        "— (no fixed settings)", "—", "—", "3/4", "—"]
    assert (out / "llama.md").exists() and (out / "llama_auto.md").exists()  # where the links lead


def test_draft_policies_are_named_in_tables_and_the_alpha_plot(tmp_path, monkeypatch):
    """A SnapKV twin of every selfspec point, 10% faster with α 0.05 lower: the best setting names its policy,
    and the α-vs-budget plot draws a line per (prefix, method, policy)."""
    recs = {k: r for k, r in records().items() if "skipped" not in r}
    for name, r in list(recs.items()):
        if r["method"] == "selfspec":
            twin = json.loads(json.dumps(r)) | {"draft_policy": "snapkv"}
            twin["metrics"]["measured_speedup"] *= 1.1
            twin["metrics"]["alpha"] -= 0.05
            recs[name + "_snapkv"] = twin
    rows = {(r["P"], r["B"]): r for r in report.rows(list(recs.values()))}
    assert report.setting(rows[4096, 8]["best"]) == "selfspec snapkv b256 γ3"
    assert report.setting(recs["selfspec_P4096_B8_greedy_b256_g3"]) == "selfspec b256 γ3"
    drawn = {}
    monkeypatch.setattr(report, "line", lambda ax, pts, *a, **kw: drawn.setdefault(kw.get("label"), pts))
    report.fig_alpha(list(recs.values()), tmp_path / "a.png", "t")
    assert drawn["prefix 4096, selfspec"] == [(0, pytest.approx(0.75)), (1, pytest.approx(0.8))]
    assert drawn["prefix 4096, selfspec snapkv"] == [(0, pytest.approx(0.70)), (1, pytest.approx(0.75))]


# Records as sweeps write them now: every drafter with its label, budget None where it has none, the cost model's
# prediction or why there is none. (label, method, budget, policy) -> {gamma: speedup all reach at B=1, at B=8}
DRAFTERS = {
    ("selfspec snapkv b512 refresh 4", "selfspec", 512, "snapkv"): {2: (0.90, 1.30), 3: (0.80, 1.50)},
    ("lookup n3", "lookup", None, None): {2: (1.05, 1.10), 4: (0.95, 1.20)},
    ("hierarchy lookup>selfspec retrieval b1024", "hierarchy", 1024, "retrieval"): {2: (0.70, 1.60)},
    ("standalone llama-68m b512", "standalone", 512, "streaming"): {2: (0.85, 1.00)},
}
NO_MODEL = "the cost model has no model of drafter hierarchy here"


def labeled(tag: str, method: str, B: int, **fields) -> dict:
    return {"point": f"{tag.replace(' ', '-')}_P4096_B{B}_greedy", "method": method, "label": tag, "decoding": "greedy",
            "prefix_len": 4096, "B": B, "gen_len": 64, "config": {"drafter": method}, "config_hash": "0123abcd",
            "model": "meta-llama/Meta-Llama-3.1-8B", "random_weights": True, "synthetic_acceptance": 0.8,
            "environment": ENV | {"code": {"commit": "28fc535856177ff1167dca157b1e80fb44dcc30e", "dirty": True}},
            **fields}


def labeled_records() -> list[dict]:
    """Per drafter and gamma: α 0.6 + budget/4096 (lookup 0.5), prefill 0.25 s, the cost model 10% above all reach
    and first done (first done = all reach + 0.1); auto at 1.0 and 1.55."""
    out = []
    for B, i in ((1, 0), (8, 1)):
        out.append(labeled("baseline", "baseline", B, gamma=None, budget=None, draft_policy=None,
                           metrics={"decode_tokens_per_s": 100.0 * B, "cost_model": {"T_T_s": 0.01}}))
        for (tag, method, budget, policy), by_gamma in DRAFTERS.items():
            for gamma, s in by_gamma.items():
                cm = {"none": NO_MODEL} if method == "hierarchy" else {
                    "speedup_effective": 1.1 * s[i], "speedup": 1.1 * (s[i] + 0.1), "T_D_over_T_T": 0.1, "T_V_over_T_T": 1.0}
                out.append(labeled(f"{tag}_g{gamma}", method, B, label=tag, gamma=gamma, budget=budget,
                                   draft_policy=policy, metrics={
                                       "measured_speedup": s[i], "measured_speedup_first_done": s[i] + 0.1,
                                       "alpha": 0.6 + budget / 4096 if budget else 0.5, "acceptance_length": 1 + gamma / 2,
                                       "T_D_over_T_T": 0.2, "T_V_over_T_T": 1.05, "draft_prefill_s": 0.25,
                                       "cost_model": cm}))
        out.append(labeled("auto", "auto", B, gamma=None, budget=512, draft_policy="streaming", metrics={
            "measured_speedup": (1.0, 1.55)[i], "measured_speedup_first_done": (1.0, 1.55)[i], "alpha": None,
            "cost_model": {"none": "no fixed gamma or no acceptance measured (--gamma auto predicts per verification)"},
            "speculation": {"auto_gamma": {"iterations_per_gamma": {"0": 63}, "switched_off": True}}}))
    return out


def write_records(d: Path, recs: list[dict]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for r in recs:
        (d / f"{r['point']}.json").write_text(json.dumps(r))
    return d


def test_every_drafter_at_its_best_gamma(tmp_path, monkeypatch):
    """Every drafter of a sweep, whatever its name, in the table at its best γ; auto beside them; `no model` with the
    record's reason; the best fixed setting over all of them; a drafter without a budget draws no α-vs-budget line."""
    sweep = write_records(tmp_path / "all", labeled_records())
    assert report.main([str(sweep), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "all.md").read_text()
    assert [r[:5] for r in every_drafter(md, 4096, 8)] == [
        ["hierarchy lookup>selfspec retrieval b1024", "2", "1.60", "1.70", "0.850"],
        ["auto", "b512, γ 0:63 (off)", "1.55", "1.55", "—"],
        ["selfspec snapkv b512 refresh 4", "3", "1.50", "1.60", "0.725"],
        ["lookup n3", "4", "1.20", "1.30", "0.500"],
        ["standalone llama-68m b512", "2", "1.00", "1.10", "0.725"]]
    rows = {r[0]: r[5:] for r in every_drafter(md, 4096, 1)}
    assert rows["lookup n3"] == ["2.00", "0.200", "1.050", "0.25", "1.16 (+10.0%)", "1.27 (+10.0%) |"]
    assert rows["hierarchy lookup>selfspec retrieval b1024"][4:] == [f"no model: {NO_MODEL}", "— |"]
    assert rows["auto"][4:] == ["no model: no fixed gamma or no acceptance measured (--gamma auto predicts per "
                                "verification)", "— |"]
    # the best fixed setting is over every drafter; auto is checked against it (1.55 >= 0.95 x 1.60, 1.0 >= 0.95 x 1.05)
    assert row_of(md, 4096, 8)[4:6] == ["hierarchy lookup>selfspec retrieval b1024 γ2", "1.60"]
    assert row_of(md, 4096, 1)[4:6] == ["lookup n3 γ2", "1.05"]
    assert row_of(md, 4096, 8)[12:] == ["PASS", "PASS"] and row_of(md, 4096, 1)[12:] == ["PASS", "PASS"]
    assert "code 28fc53585617 with uncommitted changes" in md and "sink tokens" not in md  # no record has sinks
    assert sorted(p.name for p in (tmp_path / "out").glob("*.png")) == ["all_alpha.png", "all_drafters.png",
                                                                        "all_predicted.png", "all_speedup.png"]

    drawn = {}
    monkeypatch.setattr(report, "line", lambda ax, pts, *a, **kw: drawn.setdefault(kw.get("label"), list(pts)))
    recs = report.load(sweep)[0]
    report.fig_drafters(recs, tmp_path / "d.png", "t")  # a line per drafter at its best γ, auto's too
    assert drawn.pop("lookup n3") == [(1, 1.05), (8, 1.20)] and drawn.pop("auto") == [(1, 1.0), (8, 1.55)]
    assert sorted(drawn) == ["hierarchy lookup>selfspec retrieval b1024", "selfspec snapkv b512 refresh 4",
                             "standalone llama-68m b512"]
    drawn.clear()
    report.fig_alpha(recs, tmp_path / "a.png", "t")  # the label less its budget; lookup has no budget to sit at
    assert drawn == {"prefix 4096, hierarchy lookup>selfspec retrieval": [(1, pytest.approx(0.85))],
                     "prefix 4096, selfspec snapkv refresh 4": [(0, pytest.approx(0.725))],
                     "prefix 4096, standalone llama-68m": [(0, pytest.approx(0.725))]}


def test_labels_and_the_names_of_records_before_labels():
    """A record's own label; before labels, method, draft policy (when it selects its cache) and budget."""
    old = {"method": "longspec", "budget": 512, "gamma": 4, "draft_policy": None}
    assert (report.label(old), report.setting(old), report.drafter(old)) == ("longspec b512", "longspec b512 γ4", "longspec")
    old_snapkv = old | {"method": "selfspec", "draft_policy": "snapkv"}
    assert (report.label(old_snapkv), report.drafter(old_snapkv)) == ("selfspec snapkv b512", "selfspec snapkv")
    assert report.label({"method": "auto", "budget": 512}) == "auto"
    new = {"method": "selfspec", "label": "selfspec snapkv b512 refresh 4", "budget": 512, "gamma": 2}
    assert (report.label(new), report.setting(new), report.drafter(new)) == (
        "selfspec snapkv b512 refresh 4", "selfspec snapkv b512 refresh 4 γ2", "selfspec snapkv refresh 4")
    assert report.drafter({"method": "standalone", "label": "standalone llama-68m b24", "budget": 2}) == \
        "standalone llama-68m b24"  # budget 2: " b2" is not cut out of " b24"
    assert report.drafter({"method": "lookup", "label": "lookup n3", "budget": None}) == "lookup n3"


def test_bad_records_are_skipped_with_a_warning(tmp_path, capsys):
    """Bad JSON, Latin-1 bytes, a JSON list, a record without its point's keys: one line on stderr each, naming the
    file; the report goes on without them. Another tool's JSON object (no `point`) is not a record, skipped quietly."""
    sweep = write_records(tmp_path / "s", labeled_records())
    (sweep / "cut.json").write_text('{"point": "x", "method": ')
    (sweep / "latin1.json").write_bytes('{"point": "café"}'.encode("latin-1"))
    (sweep / "list.json").write_text("[1, 2]")
    (sweep / "keys.json").write_text('{"point": "p", "metrics": {}}')
    (sweep / "summary.json").write_text('{"rows": []}')
    assert report.main([str(sweep), "--out", str(tmp_path / "out")]) == 0
    warnings = capsys.readouterr().err.splitlines()
    assert [w.split(":")[:2] for w in warnings] == [["warning", f" {sweep / f}.json"]
                                                   for f in ("cut", "keys", "latin1", "list")]
    assert "without method, prefix_len, B, decoding" in warnings[1] and "a JSON list" in warnings[3]
    assert "| 4096 | 8 | greedy |" in (tmp_path / "out" / "s.md").read_text()


def test_missing_or_empty_folders_are_errors(tmp_path, capsys):
    """No such folder, a folder without records, a folder of other JSON: `error: ...` naming it, exit status 2, and
    nothing written."""
    from magicdec import cli
    empty, other = tmp_path / "empty", tmp_path / "other"
    empty.mkdir()
    write_records(other, [])
    (other / "speed.json").write_text('{"policies": []}')
    for folder, words in ((tmp_path / "nope", "no such folder"), (empty, "no sweep records"),
                          (other, "no sweep records in it (1 JSON file(s)")):
        with pytest.raises(MagicDecError, match=re.escape(f"{folder}: {words}")):
            report.main([str(folder), "--out", str(tmp_path / "out")])
        with pytest.raises(SystemExit) as e:
            cli.main(["report", str(folder), "--out", str(tmp_path / "out")])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {folder}: {words}") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def page_sweeps(tmp_path, monkeypatch) -> tuple[Path, Path, Path]:
    """Two sweeps of hand-written records (old style and labeled) and a third, to add later; no figures drawn (the
    tests above check them), which keeps these tests fast."""
    for fig in ("fig_speedup", "fig_drafters", "fig_predicted", "fig_ratios", "fig_alpha"):
        monkeypatch.setattr(report, fig, lambda *a: None)
    old = write_sweep(tmp_path / "sweeps" / "llama")
    new = write_records(tmp_path / "sweeps" / "drafters", labeled_records())
    third = write_records(tmp_path / "sweeps" / "third", [r for r in labeled_records() if r["B"] == 8])
    return old, new, third


def sections(md: str) -> dict[str, str]:
    return dict(re.findall(r"^<!-- sweep (.+?) -->\n(.*?)<!-- /sweep \1 -->$", md, re.DOTALL | re.MULTILINE))


def test_results_page_is_updated_in_place(tmp_path, monkeypatch):
    """A report over one sweep replaces that sweep's section and its row at the top, and keeps every other section,
    the included files and text written by hand outside the markers; a new sweep's section goes after the others,
    before the included files."""
    old, new, third = page_sweeps(tmp_path, monkeypatch)
    extra = tmp_path / "notes.md"
    extra.write_text("## Notes\n\n[log](sbs/log.txt)\n")
    results_md, out = tmp_path / "results" / "RESULTS.md", tmp_path / "results" / "png"
    report.main([str(old), str(new), "--out", str(out), "--results_md", str(results_md), "--include", str(extra)])
    first = results_md.read_text()
    results_md.write_text(first + "\nA note by hand.\n")
    changed = labeled_records()
    for r in changed:
        if (r["label"], r["B"], r["gamma"]) == ("lookup n3", 8, 4):
            r["metrics"]["measured_speedup"] = 3.0  # now the best fixed setting there
    write_records(new, changed)
    report.main([str(new), "--out", str(out), "--results_md", str(results_md)])
    md = results_md.read_text()
    assert sections(md)["llama"] == sections(first)["llama"]
    assert "| 4096 | 8 | greedy | lookup n3 | 4 | 3.00 |" in sections(md)["drafters"]
    assert "<!-- include ../notes.md -->\n\n## Notes\n\n[log](../sbs/log.txt)\n\n<!-- /include ../notes.md -->" in md
    assert md.endswith("A note by hand.\n")
    overview = [x for x in md.splitlines() if x.startswith("| [")]
    assert [x.split("]")[0] for x in overview] == ["| [llama", "| [drafters"]
    assert overview[0] in first and "3.00 (4096 × 8 greedy, lookup n3 γ4)" in overview[1]
    assert f"Last updated by `magicdec report {new} --out" in md

    report.main([str(third), "--out", str(out), "--results_md", str(results_md)])
    md = results_md.read_text()
    assert list(sections(md)) == ["llama", "drafters", "third"]
    assert md.index("<!-- /sweep third -->") < md.index("<!-- include ../notes.md -->")
    assert [x.split("]")[0] for x in md.splitlines() if x.startswith("| [")] == ["| [llama", "| [drafters", "| [third"]


def test_a_page_without_markers_is_refused_until_rebuilt(tmp_path, monkeypatch):
    """A page written whole before sections had markers would lose every sweep not named: refused, naming --rebuild
    and the command that made it, before anything is written; --rebuild writes it whole from the sweeps named."""
    old, new, _ = page_sweeps(tmp_path, monkeypatch)
    results_md, out = tmp_path / "RESULTS.md", tmp_path / "png"
    legacy = "# Results\n\nMade by `python -m magicdec report a b --out c`.\n\n## a: ...\n\n## b: ...\n"
    results_md.write_text(legacy)
    with pytest.raises(MagicDecError, match=r"no `<!-- sweep NAME -->` markers.*--rebuild.*made by: python -m "
                                            r"magicdec report a b --out c\)$"):
        report.main([str(old), "--out", str(out), "--results_md", str(results_md)])
    assert results_md.read_text() == legacy and not out.exists()
    report.main([str(old), str(new), "--out", str(out), "--results_md", str(results_md), "--rebuild"])
    md = results_md.read_text()
    assert list(sections(md)) == ["llama", "drafters"] and "## a: ..." not in md


def test_results_md_only_when_asked(tmp_path, monkeypatch):
    """A plain report writes OUT/NAME.md and its PNGs and no results page; --include and --rebuild need the page."""
    old, _, _ = page_sweeps(tmp_path, monkeypatch)
    monkeypatch.chdir(tmp_path)
    report.main([str(old), "--out", "out"])
    assert not (tmp_path / "results" / "RESULTS.md").exists() and (tmp_path / "out" / "llama.md").exists()
    assert sorted(p.name for p in tmp_path.glob("*")) == ["out", "sweeps"]
    for flag in (["--include", str(old / "commands.txt")], ["--rebuild"]):
        with pytest.raises(MagicDecError, match=f"{flag[0]} applies to the results page: give --results_md too"):
            report.main([str(old), "--out", "out", *flag])


def test_help_describes_the_command_and_every_flag(capsys):
    with pytest.raises(SystemExit):
        report.main(["--help"])
    text = capsys.readouterr().out
    assert "keeps every other" in text and "skipped with a warning naming its file" in text  # not cut at line one
    assert all(a.help for a in report.parser()._actions)


# ------------------------------------------------------------------ faults: pages it did not make, broken markers,
# a read-only or full disk, two reports into one page at once

def no_drawing(monkeypatch):
    monkeypatch.setattr(report, "section", lambda *a: pytest.fail("drew a section before refusing"))


def test_a_page_the_report_did_not_make_is_never_replaced(tmp_path, monkeypatch):
    """A sweep folder named RESULTS reported into --out results would write results/RESULTS.md: the committed
    results page is refused (one line, before anything is drawn), untouched; a page an earlier report made is
    replaced, and says so on its first line."""
    _, new, _ = page_sweeps(tmp_path, monkeypatch)
    results = tmp_path / "results"
    results.mkdir()
    (results / "RESULTS.md").write_text("# Results\n\n2,241 lines of a page made by hand\n")
    named = new.rename(tmp_path / "sweeps" / "RESULTS")
    with monkeypatch.context() as m:
        no_drawing(m)
        with pytest.raises(MagicDecError) as e:
            report.main([str(named), "--out", str(results)])
    assert str(e.value).startswith(f"--out: {results / 'RESULTS.md'} exists and was not made by magicdec report")
    assert "choose another --out, or move that file away" in str(e.value) and "\n" not in str(e.value)
    assert (results / "RESULTS.md").read_text() == "# Results\n\n2,241 lines of a page made by hand\n"
    assert sorted(p.name for p in results.iterdir()) == ["RESULTS.md"]
    with pytest.raises(MagicDecError, match="the page of sweep .* would be .*RESULTS.md, the --results_md page itself"):
        report.main([str(named), "--out", str(tmp_path / "out"), "--results_md", str(tmp_path / "out" / "RESULTS.md")])
    report.main([str(named), "--out", str(tmp_path / "out")])
    made = (tmp_path / "out" / "RESULTS.md").read_text()
    assert made.splitlines()[0] == f"<!-- made by magicdec report from {named}: the next report of that folder " \
                                   "replaces this page -->"
    report.main([str(named), "--out", str(tmp_path / "out")])  # its own page: replaced
    assert (tmp_path / "out" / "RESULTS.md").read_text() == made


@pytest.mark.parametrize("damage, said", [
    (lambda md: md.replace("<!-- /sweep llama -->\n", "", 1), "`<!-- /sweep llama -->` 0 time(s)"),
    (lambda md: md.replace("<!-- sweep drafters -->", "<!-- sweep drafters -->\n<!-- sweep drafters -->", 1),
     "`<!-- sweep drafters -->` appears 2 time(s)"),
    (lambda md: md.replace("<!-- /head -->\n", "", 1), "`<!-- /head -->` 0 time(s)"),
])
def test_a_lost_or_doubled_marker_is_refused(damage, said, tmp_path, monkeypatch):
    """Updating a page whose markers are broken put a second copy of a section and a doubled overview row on it,
    silently: refused in one line naming the marker, the page untouched."""
    old, new, _ = page_sweeps(tmp_path, monkeypatch)
    results_md = tmp_path / "RESULTS.md"
    report.main([str(old), str(new), "--out", str(tmp_path / "png"), "--results_md", str(results_md)])
    broken = damage(results_md.read_text())
    results_md.write_text(broken)
    no_drawing(monkeypatch)
    with pytest.raises(MagicDecError) as e:
        report.main([str(new), "--out", str(tmp_path / "png"), "--results_md", str(results_md)])
    assert said in str(e.value) and "restore the markers, or rewrite the page whole with --rebuild" in str(e.value)
    assert results_md.read_text() == broken


@pytest.mark.parametrize("where", ["--out", "--results_md"])
def test_a_read_only_folder_is_one_line_before_anything_is_drawn(where, tmp_path, monkeypatch):
    from test_files import faulty_disk

    old, _, _ = page_sweeps(tmp_path, monkeypatch)
    out, results = tmp_path / "out", tmp_path / "results"
    faulty_disk(monkeypatch, out if where == "--out" else results, errno.EROFS)
    no_drawing(monkeypatch)
    with pytest.raises(MagicDecError) as e:
        report.main([str(old), "--out", str(out), "--results_md", str(results / "RESULTS.md")])
    folder = out if where == "--out" else results
    assert str(e.value) == (f"{where}: cannot write to {folder} (the file system is read-only); choose a folder on a "
                            "writable disk")


def test_a_full_disk_leaves_the_pages_and_figures_as_they_were(tmp_path, monkeypatch):
    """A disk that fills while the report writes: one line naming the file; every page and figure already there is
    whole (the old one), none partial, and no temporary file is left."""
    import matplotlib.pyplot as plt

    from test_files import faulty_disk, temporaries

    old, new, _ = page_sweeps(tmp_path, monkeypatch)
    monkeypatch.setattr(report, "fig_speedup", lambda rs, path, title: report.save(plt.figure(), path))
    results_md, out = tmp_path / "results" / "RESULTS.md", tmp_path / "png"
    report.main([str(old), str(new), "--out", str(out), "--results_md", str(results_md)])
    written = lambda: {p: p.read_bytes() for d in (out, results_md.parent) for p in d.iterdir()}  # noqa: E731
    before = written()
    assert out / "llama_speedup.png" in before and results_md in before
    for full, first in ((out, out / "llama_speedup.png"), (results_md.parent, results_md)):
        with monkeypatch.context() as m:
            faulty_disk(m, full, errno.ENOSPC, room=100)
            with pytest.raises(MagicDecError, match=f"cannot write {first}: the disk is full"):
                report.main([str(old), str(new), "--out", str(out), "--results_md", str(results_md)])
        assert written() == before and temporaries(tmp_path) == []


REPORTER = """
import sys, time
from pathlib import Path
from magicdec.harness import report
for fig in ("fig_speedup", "fig_drafters", "fig_predicted", "fig_ratios", "fig_alpha"):
    setattr(report, fig, lambda *a: None)
write_page = report.write_page

def after_the_other_read(path, page, *rest):  # this report has read the page: let the other read it too, then write
    Path(sys.argv[1]).touch()
    for _ in range(50):
        if Path(sys.argv[2]).exists():
            break
        time.sleep(0.1)
    write_page(path, page, *rest)

report.write_page = after_the_other_read
sys.exit(report.main(sys.argv[3:]))
"""


def test_two_reports_into_one_results_page_at_once_lose_no_section(tmp_path, monkeypatch):
    """Each report reads the page, adds its section and writes it: two at once each said `wrote` and one section
    was lost. Here each waits, after reading, until the other has read too (or 5 s): without the page's lock both
    read the page without the other's section; with it the second reads the first's page."""
    import subprocess
    import sys

    from conftest import REPO

    old, new, _ = page_sweeps(tmp_path, monkeypatch)
    results_md = tmp_path / "RESULTS.md"
    procs = [subprocess.Popen([sys.executable, "-c", REPORTER, str(tmp_path / f"read{i}"),
                               str(tmp_path / f"read{1 - i}"), str(d), "--out", str(tmp_path / "png"),
                               "--results_md", str(results_md)], cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env=os.environ | {"PYTHONPATH": str(REPO)})
             for i, d in enumerate((old, new))]
    assert [p.wait() for p in procs] == [0, 0], [p.stderr.read() for p in procs]
    md = results_md.read_text()
    assert sorted(sections(md)) == ["drafters", "llama"]
    assert sorted(x.split("]")[0] for x in md.splitlines() if x.startswith("| [")) == ["| [drafters", "| [llama"]
    assert not list(tmp_path.glob(".RESULTS.md*"))


@pytest.mark.parametrize("name", sorted(report.REPORTS))
def test_magicdec_report_runs_each_report_module_by_name(name, capsys):
    """`magicdec report NAME ...` runs that report's module (its own flags), not a sweep folder called NAME."""
    with pytest.raises(SystemExit) as e:
        cli.main(["report", name, "--help"])
    assert e.value.code == 0 and f"usage: magicdec report {name} " in capsys.readouterr().out
