"""The cost model's predictions of a sweep's records again, with its fixed cost per layer fitted to the sweep's own
B = 1 baseline at the shortest prefix (cost_model.fit_layer_overhead) instead of the one each run recorded.

Sweeps made before 2026-11-22 03:00 measured that cost by counting a step's kernels and timing a tiny one, which
gave 23 to 124 us per layer on the same H100 from call to call; the sweep now fits it to a timed step. This script
shows what the committed records' predictions become with the fitted cost (every measured number stays as recorded:
bandwidth and matmul rate of the calibration record, alpha, Omega_eff, speedups), with and without a fixed cost
T_O per verification fitted to each method's B = 1 point at the shortest prefix (cost_model.fit_verify_overhead), the
draft's StreamingLLM ring read whole (sweeps made before 2026-11-23 13:00 modelled neither), and sampled points with
the seconds per logit of sampling fitted to the sweep's sampled and greedy baselines at its largest batch (the
difference of their steps over B * vocab_size logits; sweeps made before commit 0240841, 2026-11-23 14:00, left sampling out):

    python benchmarks/planner/refit_cost_model.py results/issue5/llama31_8b results/issue5/llama2_7b_32k \
        results/issue5/smollm2 --output results/issue5/cost_model_refit.json --markdown results/issue5/cost_model_refit.md
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere
from magicdec import cost_model as cm  # noqa: E402
from magicdec.config import ModelArgs  # noqa: E402
from magicdec.errors import MagicDecError, one_line_errors  # noqa: E402
from magicdec.runs import ring_extra_for  # noqa: E402

TOL = 0.10


def config_of(rec: dict, key: str, aliases: dict[str, str], sweep: str) -> ModelArgs | None:
    given = rec.get(f"{key}_config" if key == "draft" else "model_config")
    if given:
        return ModelArgs(**given)
    name = rec.get("draft_model" if key == "draft" else "model")
    if name is None:
        return None
    try:
        return ModelArgs.from_name(aliases.get(sweep) if key == "model" and sweep in aliases else name)
    except MagicDecError:
        raise MagicDecError(f"{sweep}: records name model {name!r}, not a known shape; add --as_model {sweep}=KNOWN_NAME") from None


def fit_sampling(bases: list[dict], vocab_size: int) -> tuple[float | None, list[str]]:
    """Seconds per logit of sampled decoding: at the largest batch with sampled and greedy baselines, the median over
    prefixes of (sampled step - greedy step) / (B * vocab_size); None where a sweep has no such pair."""
    step = {(r["prefix_len"], r["B"], r["decoding"]): r["metrics"]["ms_per_step"] / 1e3 for r in bases}
    pairs = [(P, B) for P, B, mode in step if mode == "sampled" and (P, B, "greedy") in step]
    if not pairs:
        return None, []
    B = max(b for _, b in pairs)
    per_logit = [(step[P, B, "sampled"] - step[P, B, "greedy"]) / (B * vocab_size) for P, b in pairs if b == B]
    return max(statistics.median(per_logit), 0.0), [f"baseline_P{P}_B{B}" for P, b in sorted(pairs) if b == B]


def refit(d: Path, aliases: dict[str, str]) -> dict:
    recs = [json.loads(f.read_text()) for f in sorted(d.glob("*.json"))]
    recs = [r for r in recs if "metrics" in r]
    bases = [r for r in recs if r["method"] == "baseline"]
    if not bases:
        raise MagicDecError(f"{d}: no baseline records to fit the fixed cost to")
    cal = min(bases, key=lambda r: (r["B"], r["prefix_len"], r["decoding"] != "greedy"))
    target, draft = config_of(cal, "model", aliases, d.name), config_of(cal, "draft", aliases, d.name)
    dm = cal["device_model"]
    device = cm.Device(dm["bandwidth"], dm["matmul_flops"], 0.0, dm.get("ranks", 1))
    step_s = cal["metrics"]["ms_per_step"] / 1e3
    per_layer = cm.fit_layer_overhead(target, device, cal["B"], cal["prefix_len"] + cal["gen_len"] // 2, step_s)
    fitted = replace(device, layer_overhead_s=per_layer)
    spec = [r for r in recs if r["method"] in ("selfspec", "longspec") and r["metrics"].get("measured_speedup")
            and r["metrics"].get("alpha") is not None]

    max_gamma = max(r["gamma"] for r in spec) if spec else 1  # the sweep's rings hold what its longest gamma writes

    def shape(r):  # B, context, gamma, budget, draft, ring slots: what predict and fit_verify_overhead take
        return (r["B"], r["prefix_len"] + r["gen_len"] // 2, r["gamma"], r["budget"] or r["prefix_len"],
                draft if r["method"] == "longspec" else None, ring_extra_for(r["gen_len"], max_gamma) if r["budget"] else 0)

    def predict(r, dev):
        B, ctx, gamma, budget, drafter, ring = shape(r)
        return cm.predict(target, dev, B, ctx, gamma, r["metrics"]["alpha"], budget, drafter, ring,
                          r["decoding"] == "sampled")  # sampling counts only where dev has a cost for it

    # T_O per method, fitted where it weighs most: the B = 1 point at the shortest prefix, greedy, smallest budget and
    # gamma. Its measured speedup gives the verification's seconds, Omega_eff / speedup target steps.
    verify_overhead, calibration = {}, {}
    for method in sorted({r["method"] for r in spec}):
        c = min((r for r in spec if r["method"] == method),
                key=lambda r: (r["B"], r["prefix_len"], r["decoding"] != "greedy", r["budget"], r["gamma"]))
        B, ctx, gamma, budget, drafter, ring = shape(c)
        verification_s = c["metrics"]["omega_effective"] / c["metrics"]["measured_speedup"] * predict(c, fitted)["T_T"]
        verify_overhead[method] = cm.fit_verify_overhead(target, fitted, B, ctx, gamma, budget, drafter, verification_s, ring)
        calibration[method] = c["point"]
    per_logit, sampling_points = fit_sampling(bases, target.vocab_size)
    points = []
    for r in spec:
        m = r["metrics"]
        with_o = replace(fitted, verify_overhead_s=verify_overhead[r["method"]])
        sampled = replace(with_o, sampling_s_per_logit=per_logit or 0.0)
        recorded = (m.get("cost_model") or {}).get("speedup_effective")
        points.append({"point": r["point"], "decoding": r["decoding"], "B": r["B"], "measured": m["measured_speedup"],
                       "recorded_prediction": recorded,
                       "refitted_without_T_O_prediction": m["omega_effective"] / cm.verification_cost(predict(r, fitted), r["gamma"]),
                       "refitted_without_sampling_prediction": m["omega_effective"] / cm.verification_cost(predict(r, with_o), r["gamma"]),
                       "refitted_prediction": m["omega_effective"] / cm.verification_cost(predict(r, sampled), r["gamma"]),
                       "recorded_layer_overhead_us": 1e6 * (m.get("cost_model") or {}).get("device_model", {}).get("layer_overhead_s", float("nan"))})

    def score(key):
        errs = [q[key] / q["measured"] - 1 for q in points if q[key] is not None]
        return {"within_10pct": sum(abs(e) <= TOL for e in errs), "of": len(errs),
                "median_error": statistics.median(errs) if errs else None}

    recorded_us = sorted({round(q["recorded_layer_overhead_us"], 1) for q in points})
    return {"sweep": str(d), "calibration_point": cal["point"], "calibration_ms_per_step": 1e3 * step_s,
            "fitted_layer_overhead_us": 1e6 * per_layer, "recorded_layer_overhead_us": recorded_us,
            "fitted_verify_overhead_us": {k: 1e6 * v for k, v in verify_overhead.items()},
            "verify_overhead_calibration_point": calibration,
            "fitted_sampling_ps_per_logit": None if per_logit is None else 1e12 * per_logit,
            "sampling_calibration_points": sampling_points, "recorded": score("recorded_prediction"),
            "refitted_without_T_O": score("refitted_without_T_O_prediction"),
            "refitted_without_sampling": score("refitted_without_sampling_prediction"), "refitted": score("refitted_prediction"),
            "points": points}


def breakdown(results: list[dict]) -> list[str]:
    """A markdown table: per sweep, decoding and B, points within 10% and the median error of the full model."""
    rows = ["| sweep | decoding | B | within 10% | median error |", "|---|---|---|---|---|"]
    for r in results:
        groups: dict[tuple[str, int], list[float]] = {}
        for q in r["points"]:
            groups.setdefault((q["decoding"], q["B"]), []).append(q["refitted_prediction"] / q["measured"] - 1)
        for (mode, B), errs in sorted(groups.items()):
            rows.append(f"| {Path(r['sweep']).name} | {mode} | {B} | {sum(abs(e) <= TOL for e in errs)}/{len(errs)} "
                        f"| {statistics.median(errs):+.1%} |")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sweeps", type=Path, nargs="+")
    p.add_argument("--as_model", action="append", default=[], metavar="SWEEP=NAME",
                   help="shapes for a sweep whose records name an unknown model (e.g. a GGUF's own name)")
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None, help="also write the table as a markdown section")
    a = p.parse_args(argv)
    with one_line_errors():
        aliases = dict(x.split("=", 1) for x in a.as_model)
        results = [refit(d, aliases) for d in a.sweeps]
    table = ["| sweep | fitted on | fixed cost per layer: recorded → fitted (µs) | T_O fitted (µs) | sampling (ps/logit) "
             "| within 10%: recorded | refitted, no T_O | + T_O | + sampling | median error: recorded → no T_O → + T_O "
             "→ + sampling |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        keys = ["recorded", "refitted_without_T_O", "refitted_without_sampling", "refitted"]
        ps = r["fitted_sampling_ps_per_logit"]
        table.append(f"| {Path(r['sweep']).name} | {r['calibration_point']} ({r['calibration_ms_per_step']:.2f} ms) "
                     f"| {', '.join(f'{x:.1f}' for x in r['recorded_layer_overhead_us'])} → {r['fitted_layer_overhead_us']:.1f} "
                     f"| {', '.join(f'{k} {v:.0f}' for k, v in r['fitted_verify_overhead_us'].items())} "
                     f"| {'—' if ps is None else f'{ps:.0f}'} | "
                     + " | ".join(f"{r[k]['within_10pct']}/{r[k]['of']}" for k in keys)
                     + " | " + " → ".join(f"{r[k]['median_error']:+.1%}" for k in keys) + " |")
    print("\n".join(table))
    if a.markdown:
        command = "python benchmarks/planner/refit_cost_model.py " + " ".join(argv if argv is not None else sys.argv[1:])
        a.markdown.write_text("\n\n".join([
            "## The cost model refitted to the records",
            "Each sweep's predictions made again from its records' measured bandwidth, matmul rate, α and Ω_eff, with "
            "the fixed cost per layer fitted to its B = 1 baseline, T_O to each method's B = 1 point, the draft ring's "
            "real reads and, for sampled points, the cost of sampling fitted to its sampled and greedy baselines "
            "(CPU, from the committed records):", f"```bash\n{command}\n```", "\n".join(table),
            "Within 10% by decoding and batch size, the full model (refitted with T_O and sampling):",
            "\n".join(breakdown(results))]) + "\n")
        print(f"wrote {a.markdown}")
    if a.output:
        a.output.write_text(json.dumps(results, indent=1))
        print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
