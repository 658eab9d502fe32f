"""The sweep report: hand-written records with chosen numbers (so every expected value is known without the report's
code) through `python -m magicdec.report`: best fixed setting, cost-model errors, planner PASS/FAIL, figures,
RESULTS.md with commands and links, skipped points; then one real tiny sweep, to prove its record format is read."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import TINY_SWEEP
from magicdec import report

ENV = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.13.0", "python": "3.11.7", "device": "cuda"}
COMMAND = "python -m magicdec.sweep benchmarks/sweeps/llama.toml --output_dir results/issue5/llama  # NVIDIA H100 80GB HBM3, 2026-01-02 03:04"
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

    # summary: 15 of 16 points within 10% (Omega_eff), 7 of 16 (Omega: B=8 points but the +25% one), 16 of 16 (ratios)
    assert "cost model Ω_eff vs all reach: 15/16; cost model Ω vs first done: 7/16;" in md
    assert "measured T_D/T_T, T_V/T_T, Ω_eff vs all reach: 16/16" in md
    assert "Planner: 2/4 points pass both checks (≥ 0.97 × baseline: 3/4, ≥ 0.95 × best fixed: 2/4)" in md

    # figures: valid PNGs, embedded in RESULTS.md with links relative to it; the commands; skipped points; includes
    links = re.findall(r"!\[[^]]*\]\(([^)]+\.png)\)", md)
    assert sorted(Path(x).name for x in links) == sorted(f"llama_{k}.png" for k in ("speedup", "predicted", "ratios", "alpha"))
    for link in links:
        assert not Path(link).is_absolute()
        assert (results_md.parent / link).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"```bash\n{COMMAND}\n```" in md
    assert "`baseline_P16384_B64_greedy`: B=64 x prefix 16384 does not fit in memory" in md
    assert "NVIDIA H100 80GB HBM3" in md and "random weights, synthetic α 0.80" in md
    # an included file's relative links still lead to the files beside it; URLs and anchors stay as written
    assert md.rstrip().endswith("| 1 | 2 |\n\n[log](../sbs/log.txt), [docs](https://example.org/a_b), [top](#results), "
                                "![plot](../sbs/p.svg)")
    assert (out / "llama.md").read_text().count("](llama_") == 4  # the per-sweep file links beside its PNGs
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
methods = ["baseline", "selfspec"]
synthetic_acceptance = 0.8
"""


def test_report_reads_a_real_sweep(tmp_path):
    import torch

    from magicdec import sweep

    (tmp_path / "t.toml").write_text(TINY)
    out = tmp_path / "tiny"
    assert sweep.Sweep(sweep.load_config(tmp_path / "t.toml"), out, torch.device("cpu"), False).run(None) == 0
    (out / "commands.txt").write_text("python -m magicdec.sweep t.toml --output_dir tiny  # cpu, today\n")
    results_md = tmp_path / "RESULTS.md"
    report.main([str(out), "--out", str(tmp_path / "png"), "--results_md", str(results_md)])
    spec = json.loads((out / "selfspec_P48_B2_greedy_b24_g1.json").read_text())["metrics"]
    cells = row_of(results_md.read_text(), 48, 2)
    assert cells[4:6] == ["selfspec b24 γ1", f"{spec['measured_speedup']:.2f}"]
    assert cells[8].startswith(f"{spec['cost_model']['speedup_effective']:.2f} (")
    assert "synthetic α 0.80" in results_md.read_text() and "# cpu, today" in results_md.read_text()


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
    assert lines[0] == "# Results" and lines[2].startswith("Made by `python -m magicdec.report ")
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
