"""The cost model against a sweep's measured head drafters: for each EAGLE / Medusa / Hydra record of the sweeps
given, the drafter's own prediction (DrafterKind.predict) at the record's measured α and γ, on the device the sweep
measured (the `device_model` its other records carry), beside what was measured: T_D/T_T and the speedup. The
error is the prediction at the measured Ω_eff (tokens per verification of the whole batch, stragglers included),
which the all-reach speedup follows, against that speedup; the prediction at Ω (the mean) is shown beside it.

    python benchmarks/head_cost_check.py results/heads/sweep_llama31_8b results/heads/sweep_smollm2_shape \
        --output results/heads/cost_check

Each sweep's points are rebuilt from the sweep.toml it keeps (matched to records by label, prefix and B). T_O (a
verification's fixed cost beyond its steps) is the recorded device's, which a sweep fits for the drafters it plans.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from magicdec import cost_model as cm
from magicdec import sweep
from magicdec.config import ModelArgs

HEADS = ("eagle", "hydra", "medusa")


def device_of(records: list[dict]) -> cm.Device:
    """The device the sweep measured: any record's cost model device (the self-draft's carries one)."""
    for r in records:
        dm = ((r.get("metrics") or {}).get("cost_model") or {}).get("device_model")
        if dm:
            return cm.Device(**dm)
    raise SystemExit("no record of these sweeps carries the measured device (cost_model.device_model)")


def points_by_name(d: Path) -> dict:
    cfg = sweep.load_config(d / "sweep.toml")
    cfg["step_mode"] = "eager"  # what a prediction reads does not depend on it; a CPU refuses graphs
    points, _ = sweep.points_of(cfg, str(d))
    return {(p.cfg.describe(), p.cfg.workload.prefix_len, p.cfg.workload.B): p for p in points}


def check(d: Path) -> list[dict]:
    records = [json.loads(f.read_text()) for f in sorted(d.glob("*.json"))]
    device, points, rows = device_of(records), points_by_name(d), []
    for r in records:
        if r.get("method") not in HEADS or "skipped" in r:
            continue
        m = r["metrics"]
        cfg = points[(r["label"], r["prefix_len"], r["B"])].cfg
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
    a = p.parse_args(argv)
    rows = [row for d in a.sweeps for row in check(d)]
    text = table(rows)
    print(text)
    if a.output:
        a.output.parent.mkdir(parents=True, exist_ok=True)
        a.output.with_suffix(".json").write_text(json.dumps(rows, indent=1))
        a.output.with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
