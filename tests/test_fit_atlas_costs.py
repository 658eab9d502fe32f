"""benchmarks/fit_atlas_costs.py: plan records made by hand whose timed candidates and baselines are the cost model's
own prediction plus known constants (a tree's verification + 1.2 ms, the hierarchy's draft + 2.5 ms per target
verification, a TP-4 step + 40 us of all-reduces per layer) give back those constants, written into a copy of the
committed profile beside its other keys; the profile then predicts the records' times, and a second fit changes
nothing."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from conftest import benchmark_script
from magicdec.analysis import cost_model as cm
from magicdec.config import ModelArgs
from magicdec.harness.run_config import RunConfig
from magicdec.model.tree import Tree

fit = benchmark_script("fit_atlas_costs")

MODEL = "meta-llama/Meta-Llama-3.1-8B"
L31 = ModelArgs.from_name(MODEL)
TREE_S, HIERARCHY_S, COLLECTIVE_S = 1.2e-3, 2.5e-3, 40e-6
ITERATIONS = 20
FITTED = {"tree_verify_s", "tree_verify_source", "verify_overhead_s", "verify_overhead_source",
          "collective_s_per_layer", "collective_source"}


def record(B, prefix, candidates, world=None, baseline_ms=7.0, gen_len=64):
    """The least a plan record holds for report_atlas.load (a choice that is off: no candidate need be it)."""
    return {"method": "plan", "point": f"plan_P{prefix}_B{B}", "B": B, "prefix_len": prefix, "gen_len": gen_len,
            "decoding": "greedy", "model": MODEL, "environment": {"gpu": "NVIDIA H100 80GB HBM3"},
            "tensor_parallel": None if world is None else {"world": world},
            "baseline": {"ms_per_step": baseline_ms}, "plan": {"ranking": []}, "candidates": candidates,
            "choice": {"label": "baseline", "off": True, "measured_speedup": 1.0,
                       "measured_speedup_first_done": 1.0},
            "planner_pick": {"label": "baseline", "predicted_speedup": 1.0}}


def options(B, prefix, drafter, gamma, **more):
    return {"random_weights": True, "model_name": MODEL, "drafter": drafter, "B": B, "prefix_len": prefix,
            "gen_len": 64, "gamma": [gamma], "device": "cpu"} | more


def candidate(label, drafter, gamma, config, verify_s=0.0, draft_s=0.0, drafter_summary=None):
    """A timed candidate: seconds per iteration of verification and draft, over ITERATIONS iterations."""
    spec = {"iterations": ITERATIONS} | ({"drafter": drafter_summary} if drafter_summary else {})
    return {"label": label, "drafter": drafter, "gamma": gamma, "config": config,
            "metrics": {"speculation": spec, "time_split_s": {"draft": draft_s * ITERATIONS,
                                                             "verify": verify_s * ITERATIONS, "other": 0.0}}}


def tree_step(base, B, prefix, gamma, width):
    """The cost model's step over a lookup tree (width branches of gamma tokens), mid-generation."""
    return cm.step_time(L31, base, B, prefix + 32, Tree.branches(gamma, width).size)


def hierarchy_draft(device, B, prefix, gamma, gamma_bottom, alpha_b):
    """The hierarchy's predicted draft seconds per target verification (TriForce.predict's T_D x gamma)."""
    cfg = RunConfig.from_options(options(B, prefix, "hierarchy", gamma, **HIERARCHY), strict=False)
    p = cfg.drafter.predict(cfg, L31, {}, device, 0.8, gamma, cfg.lookahead, {"alpha_bottom_to_middle": alpha_b})
    return p["T_D"] * gamma


HIERARCHY = {"draft": "ngram", "gamma_bottom": 2, "draft_policy": "streaming", "draft_budget": 1024}


@pytest.fixture
def atlas(tmp_path):
    """(record folders, the profile copy): one GPU (4096 x 4: three lookup trees at 1.2 ms +- whatever the median
    leaves out, a chain that must not count, a hierarchy at 2.5 ms, a candidate never timed) and TP = 4 (32K x 16:
    its baseline alone)."""
    profile = tmp_path / "h100.json"
    shutil.copy(cm.PROFILES / "h100.json", profile)
    device, _, _ = cm.load_profile(profile)
    base = replace(device, tree_verify_s={})
    B, P = 4, 4096
    one = [candidate(f"lookup tree {g}", "lookup", g, options(B, P, "lookup", g, tree_width=2,
                                                                synthetic_siblings=[0.2]),
                     verify_s=tree_step(base, B, P, g, 2) + extra)
           for g, extra in ((5, TREE_S), (3, 0.2e-3), (4, 9e-3))]  # their median: 1.2 ms
    one.append(candidate("lookup chain", "lookup", 7, options(B, P, "lookup", 7, tree_width=1),
                         verify_s=tree_step(base, B, P, 7, 1) + 0.05))  # a chain: no tree residual
    one.append(candidate("hierarchy", "hierarchy", 8, options(B, P, "hierarchy", 8, **HIERARCHY),
                         draft_s=hierarchy_draft(base, B, P, 8, 2, 0.6) + HIERARCHY_S, verify_s=0.01,
                         drafter_summary={"alpha_bottom_to_middle": 0.6}))
    one.append({"label": "untimed", "drafter": "lookup", "gamma": 3, "config": options(B, P, "lookup", 3),
                "metrics": {}})
    alone = cm.step_time(L31, replace(base, ranks=4, collective_s_per_layer={}), 16, 32768 + 32, 1)
    folders = []
    for name, r in (("one", record(B, P, one)),
                    ("tp4", record(16, 32768, [], world=4, baseline_ms=(alone + 32 * COLLECTIVE_S) * 1e3))):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{r['point']}.json").write_text(json.dumps(r))
        folders.append(str(tmp_path / name))
    return folders, profile


def test_the_fit_writes_back_the_constants_the_records_were_made_with(atlas, capsys):
    folders, profile = atlas
    raw = json.loads(profile.read_text())
    assert fit.main([*folders, "--profile", str(profile), "--write"]) == 0
    assert "written into" in capsys.readouterr().out
    out = json.loads(profile.read_text())
    assert set(out) == set(raw) | FITTED
    assert {k: out[k] for k in set(raw) - FITTED} == {k: raw[k] for k in set(raw) - FITTED}  # the rest kept
    assert out["tree_verify_s"]["1"] == pytest.approx(TREE_S, rel=1e-6)
    assert out["verify_overhead_s"]["hierarchy"] == pytest.approx(HIERARCHY_S, rel=1e-6)
    assert out["verify_overhead_s"] == raw["verify_overhead_s"] | {"hierarchy": out["verify_overhead_s"]["hierarchy"]}
    assert out["collective_s_per_layer"]["4"] == pytest.approx(COLLECTIVE_S, rel=1e-6)
    assert out["collective_s_per_layer"]["2"] == raw["collective_s_per_layer"]["2"]  # no TP-2 record: kept
    assert "1 ranks: 3" in out["tree_verify_source"] and "4 ranks: 1" in out["collective_source"]


def test_the_fitted_profile_predicts_the_records_it_was_fitted_to(atlas):
    folders, profile = atlas
    device, _, _ = cm.load_profile(profile)
    verify = tree_step(replace(device, tree_verify_s={}), 4, 4096, 5, 2) + TREE_S
    draft = hierarchy_draft(replace(device, tree_verify_s={}), 4, 4096, 8, 2, 0.6) + HIERARCHY_S
    tp4 = cm.step_time(L31, replace(device, ranks=4, collective_s_per_layer={}), 16, 32768 + 32, 1) + 32 * COLLECTIVE_S
    fit.main([*folders, "--profile", str(profile), "--write"])
    device, overheads, _ = cm.load_profile(profile)
    cfg = RunConfig.from_options(options(4, 4096, "lookup", 5, tree_width=2, synthetic_siblings=[0.2]), strict=False)
    assert cfg.drafter.predict(cfg, L31, {}, device, 0.7, 5, cfg.lookahead)["T_V"] == pytest.approx(verify)
    assert hierarchy_draft(replace(device, verify_overhead_s=overheads["hierarchy"]), 4, 4096, 8, 2,
                           0.6) == pytest.approx(draft)
    assert cm.step_time(L31, replace(device, ranks=4), 16, 32768 + 32, 1) == pytest.approx(tp4)


def test_a_second_fit_changes_nothing(atlas):
    folders, profile = atlas
    raw = profile.read_text()
    fit.main([*folders, "--profile", str(profile), "--write"])
    first = profile.read_text()
    fit.main([*folders, "--profile", str(profile), "--write"])
    assert profile.read_text() == first
    source, before = json.loads(first)["verify_overhead_source"], json.loads(raw)["verify_overhead_source"]
    assert source.count("; hierarchy:") == 1
    assert source.startswith(before.split("; hierarchy:")[0] + "; hierarchy: benchmarks/fit_atlas_costs.py over "
                             + ", ".join(folders) + ": the median over 1 runs")


def test_without_write_the_profile_is_left_alone(atlas, capsys):
    folders, profile = atlas
    before = profile.read_bytes()
    assert fit.main([*folders, "--profile", str(profile)]) == 0
    assert profile.read_bytes() == before
    printed = capsys.readouterr().out
    assert "tree_verify_s: {'1': " in printed and "written into" not in printed


def test_a_fit_without_tensor_parallel_trees_keeps_their_figures(atlas):
    folders, profile = atlas
    raw = json.loads(profile.read_text())
    fit.main([*folders, "--profile", str(profile), "--write"])  # trees on one GPU only
    out = json.loads(profile.read_text())
    assert {k: out["tree_verify_s"].get(k) for k in ("2", "4")} == {k: raw["tree_verify_s"][k] for k in ("2", "4")}
