"""The cost model against a sweep's measured head drafters: for each EAGLE / Medusa / Hydra record of the sweeps
given, the drafter's own prediction (DrafterKind.predict) at the record's measured α and γ, on the device the sweep
measured (the `device_model` its other records carry), beside what was measured: T_D/T_T and the speedup. The
error is the prediction at the measured Ω_eff (tokens per verification of the whole batch, stragglers included),
which the all-reach speedup follows, against that speedup; the prediction at Ω (the mean) is shown beside it.

    python benchmarks/head_cost_check.py results/heads/sweep_llama31_8b results/heads/sweep_smollm2_shape \
        --output results/heads/cost_check

Each sweep's points are rebuilt from the sweep.toml it keeps (matched to records by label, prefix and B). T_O (a
verification's fixed cost beyond its steps) is the recorded device's, which a sweep fits for the drafters it plans;
the heads' fixed costs (Device.head_level_s, pick_s) are the committed profile's of that GPU where the record has
none.

`--fit PROFILES` first fits those fixed costs to benchmarks/head_proposal_profile.py's output and writes them into
`--profile` (a device profile, magicdec/analysis/profiles/h100.json): per drafted level, the graphed proposal's time beyond
the model's count of its work, less its sampled pick (the pick's kernels in the eager profile); the pick per level,
whole vocabulary and candidates. Fitted at the profile's shapes, checked at the sweeps' others.

    python benchmarks/head_cost_check.py --fit results/heads/proposal_profile.json \
        results/heads/proposal_profile_candidates.json --profile magicdec/analysis/profiles/h100.json SWEEPS... --output ...
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

from magicdec.analysis import cost_model as cm
from magicdec import drafters, files
from magicdec.harness import sweep_grid
from magicdec.config import ModelArgs
from magicdec.harness.run_config import RunConfig

HEADS = tuple(drafters.owners("head"))  # the drafters that draft with a trained head
PICK_GROUPS = ("sort / scan (top-p)", "softmax / draw", "reduce")  # head_proposal_profile's groups of the pick


def device_of(records: list[dict]) -> cm.Device:
    """The device the sweep measured: any record's cost model device (the self-draft's carries one), with the
    committed profile's head costs for its GPU where it has none."""
    for r in records:
        dm = ((r.get("metrics") or {}).get("cost_model") or {}).get("device_model")
        if dm:
            gpu = (r.get("environment") or {}).get("gpu")
            return cm.Device(**(cm.head_costs_of(cm.device_profile(gpu)) | {k: v for k, v in dm.items() if v}))
    raise SystemExit("no record of these sweeps carries the measured device (cost_model.device_model)")


def profile_config(row: dict) -> RunConfig:
    """The run a head_proposal_profile row timed, as the cost model reads it (shapes only)."""
    head = {"eagle_window": {"drafter": "eagle", "head_kv": "window"}}.get(row["head"], {"drafter": row["head"]})
    return RunConfig.from_options({
        "random_weights": True, "model_name": row["model"], "B": row["B"], "prefix_len": row["prefix_len"],
        "gen_len": 64, "gamma": [row["gamma"]], "temperature": 0.6, "top_p": 0.9, "device": "cpu",
        "dataset": "stdlib", "head_candidates": row.get("head_candidates", 0)} | head, strict=False)


def fit(profiles: list[Path], device: cm.Device) -> tuple[dict, dict, list[dict]]:
    """(head_level_s by drafter, pick_s, the rows): each profiled proposal (graphed) against the model's count of
    its work on `device` with no fixed head costs."""
    bare = replace(device, head_level_s={}, pick_s={}, sampling_s_per_logit=0.0)
    rows = []
    for path in profiles:
        for r in json.loads(path.read_text())["rows"]:
            cfg, g = profile_config(r), r["gamma"]
            work = cfg.drafter.predict(cfg, ModelArgs.from_name(r["model"]), {}, bare, 0.5, g, cfg.lookahead)["T_D"]
            measured = r["cuda_graphs"]["graphed_us_median"] * 1e-6
            pick = sum(v["us_per_proposal"] for k, v in r["eager"]["groups"].items() if k in PICK_GROUPS) * 1e-6 / g
            rows.append({"shape": r["shape"], "head": r["head"], "drafter": cfg.drafter.name,
                         "candidates": r.get("head_candidates", 0), "measured_us": measured * 1e6,
                         "work_us": work * g * 1e6, "pick_us_per_level": pick * 1e6,
                         "level_us": ((measured - work * g) / g - pick) * 1e6})
    levels = seconds_by(rows, lambda r: r["drafter"], "level_us")
    picks = seconds_by(rows, lambda r: "candidates" if r["candidates"] else "vocabulary", "pick_us_per_level")
    return levels, picks, rows


def seconds_by(rows: list[dict], key, field: str) -> dict:
    """The mean of the rows' `field` (microseconds) per key(row), in seconds."""
    groups = defaultdict(list)
    for r in rows:
        groups[key(r)].append(r[field] * 1e-6)
    return {k: sum(v) / len(v) for k, v in groups.items()}


def points_by_name(d: Path) -> dict:
    cfg = sweep_grid.load_config(d / "sweep.toml")
    cfg["step_mode"] = "eager"  # what a prediction reads does not depend on it; a CPU refuses graphs
    points, _ = sweep_grid.points_of(cfg, str(d))
    return {(p.cfg.describe(), p.cfg.workload.prefix_len, p.cfg.workload.B): p for p in points}


def check(d: Path) -> list[dict]:
    records = [json.loads(f.read_text()) for f in sorted(d.glob("*.json"))]
    device, points, rows = device_of(records), points_by_name(d), []
    for r in records:
        if r.get("method") not in HEADS or "skipped" in r:
            continue
        m = r["metrics"]
        cfg = points[(r["label"], r["prefix_len"], r["B"])].cfg
        if "head_candidates" not in r["config"]:  # recorded before heads drew among candidates: the whole vocabulary
            cfg = RunConfig.from_options(cfg.options() | {"head_candidates": 0}, strict=False)
        target = ModelArgs(**r["model_config"])
        pred = cfg.drafter.predict(cfg, target, {}, device, m["alpha"], r["gamma"], cfg.lookahead)
        s = m["speculation"]
        steps = s["draft_steps"] / s["iterations"]
        # all reach waits for the batch's slowest sequences: Omega_eff (tokens per verification of the whole batch,
        # stragglers included) is what its throughput follows, as the sweep's own speedup_effective
        effective = m["omega_effective"] / (steps * pred["T_D_over_T_T"] + pred["T_V_over_T_T"] + pred["T_O_over_T_T"])
        rows.append({"sweep": d.name, "label": r["label"], "prefix_len": r["prefix_len"], "B": r["B"],
                     "gamma": r["gamma"], "alpha": m["alpha"], "acceptance_length": m["acceptance_length"],
                     "T_D_over_T_T": m["T_D_over_T_T"], "predicted_T_D_over_T_T": pred["T_D_over_T_T"],
                     "T_V_over_T_T": m["T_V_over_T_T"], "predicted_T_V_over_T_T": pred["T_V_over_T_T"],
                     "omega_effective": m["omega_effective"], "measured_speedup": m["measured_speedup"],
                     "predicted_speedup": pred["speedup"], "predicted_speedup_effective": effective,
                     "speedup_error": effective / m["measured_speedup"] - 1})
    return rows


def table(rows: list[dict]) -> str:
    head = ("| sweep | drafter | prefix × B | α | Ω | Ω_eff | T_D/T_T measured | predicted | T_V/T_T measured | "
            "predicted | speedup (all reach) measured | predicted at Ω_eff | error | predicted at Ω |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [f"| {r['sweep']} | {r['label']} | {r['prefix_len']} × {r['B']} | {r['alpha']:.3f} | "
             f"{r['acceptance_length']:.2f} | {r['omega_effective']:.2f} | {r['T_D_over_T_T']:.3f} | "
             f"{r['predicted_T_D_over_T_T']:.3f} | {r['T_V_over_T_T']:.3f} | {r['predicted_T_V_over_T_T']:.3f} | "
             f"{r['measured_speedup']:.3f} | {r['predicted_speedup_effective']:.3f} | "
             f"{100 * r['speedup_error']:+.0f}% | {r['predicted_speedup']:.3f} |" for r in rows]
    return "\n".join([head, *lines])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweeps", type=Path, nargs="+", help="sweep output folders (each keeps its sweep.toml)")
    p.add_argument("--output", type=Path, help="write OUTPUT.json and OUTPUT.md")
    p.add_argument("--fit", type=Path, nargs="*", default=[], help="head_proposal_profile outputs to fit to first")
    p.add_argument("--profile", type=Path, default=cm.PROFILES / "h100.json",
                   help="the device profile --fit writes into (and its device model)")
    a = p.parse_args(argv)
    fitted = ""
    if a.fit:
        levels, picks, fit_rows = fit(a.fit, cm.load_profile(a.profile)[0])
        prof = json.loads(a.profile.read_text())
        prof["head_level_s"], prof["pick_s"] = levels, picks
        prof["head_costs_source"] = ("benchmarks/head_cost_check.py --fit " + " ".join(str(f) for f in a.fit) +
                                     ": per drafted level, the graphed proposal beyond the model's count of its work, "
                                     "less its pick; the pick's kernels per level (means over the profiled shapes)")
        files.write_text(a.profile, json.dumps(prof, indent=1) + "\n")  # the committed profile: whole or as it was
        fitted = "\n".join(["| shape | head | candidates | proposal measured (us) | work counted (us) | "
                             "pick per level (us) | fixed per level (us) |", "|---|---|---|---|---|---|---|"] +
                            [f"| {r['shape']} | {r['head']} | {r['candidates']} | {r['measured_us']:.0f} | "
                             f"{r['work_us']:.0f} | {r['pick_us_per_level']:.0f} | {r['level_us']:.0f} |"
                             for r in fit_rows]) + "\n\n"
        print(fitted)
    rows = [row for d in a.sweeps for row in check(d)]
    text = fitted + table(rows)
    print(text)
    if a.output:
        a.output.parent.mkdir(parents=True, exist_ok=True)
        files.write_json(a.output.with_suffix(".json"), rows)
        files.write_text(a.output.with_suffix(".md"), text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
