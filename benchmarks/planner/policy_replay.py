"""Replay gamma policies on real batches: benchmarks/planner/acceptance_trace.py records, for each batch, where each draft
budget's drafts are kept position by position; a verification drafting gamma tokens keeps the leading run of them
(greedy exactly; sampled, each position kept with its recorded chance). So every fixed (budget, gamma) and the
runtime policy (planner.AutoGamma, as the decoder runs it: one verification stale, off for good) can be run on the
same batches, at the seconds per verification profiled on the device, without timing noise or machine drift.

Checked against the device: greedy, the replayed iterations of every fixed decoder must equal those its real run
took on that batch (recorded beside the traces), and the replayed policy must use the gammas the real auto
decoder used. Speedup: the baseline's time (one profiled plain step per token) over the replayed batch's time.

    python benchmarks/planner/policy_replay.py results/issue5/replay/traces_a.json results/issue5/replay/traces_b.json \
        --records results/issue5/smollm2 --output results/issue5/replay/replay.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from magicdec.errors import MagicDecError, one_line_errors  # noqa: E402
from magicdec.planner import AutoGamma  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from policy_simulation import batch_seconds  # noqa: E402


def traced_acceptance(trace: np.ndarray, rng: np.random.Generator):
    """accept(gamma, made) from a trace [n, L]: the chance that a drafted token for generated token i + 1 is kept
    (greedy 0 or 1). A verification from `made` tokens on drafts tokens made + 1 .. made + gamma: trace columns
    made .. made + gamma - 1, kept up to the first rejection."""
    n, L = trace.shape
    rows = np.arange(n)[:, None]

    def accept(g, made):
        cols = np.minimum(made[:, None] + np.arange(g), L - 1)
        return np.cumprod(rng.random((n, g)) < trace[rows, cols], axis=1).sum(1)

    return accept


def replay_batch(trace: np.ndarray, costs: dict, gammas: list[int], tokens: int, plan: dict | None, draws: int,
                 seed: int) -> dict:
    """Iterations and seconds of every fixed gamma and, with a `plan`, of the policy on one batch for one budget's
    trace, the mean of `draws` replays (1 for greedy: nothing is random)."""
    rng = np.random.default_rng(seed)
    n = trace.shape[0]
    out = {}
    for g in gammas:  # at one second per verification, a batch's seconds are its iterations
        its = [batch_seconds({g: 1.0}, traced_acceptance(trace, rng), n, tokens, gamma=g) for _ in range(draws)]
        out[f"gamma {g}"] = {"iterations": float(np.mean(its)), "seconds": float(np.mean(its)) * costs[g]}
    if plan is None:
        return out
    secs, uses = [], {}
    for _ in range(draws):
        policy = AutoGamma(gammas, plan["alpha"], spread=plan["spread"], margin=plan.get("margin", 0.03))
        policy.costs = dict(costs)
        secs.append(batch_seconds(costs, traced_acceptance(trace, rng), n, tokens, policy))
        for g in policy.history:
            uses[g] = uses.get(g, 0) + 1 / draws
    out["auto"] = {"iterations": sum(uses.values()), "seconds": float(np.mean(secs)), "gamma_use": uses}
    return out


def plan_of(records: Path, P: int, B: int, mode: str, budget: int | None = None) -> dict:
    """The budget, prior and spread the sweep's auto point at (P, B, mode) was planned with; `budget`: another of the
    sweep's budgets instead, with its prior and spread from the same plan."""
    f = records / f"auto_P{P}_B{B}_{mode}.json"
    if not f.is_file():
        raise MagicDecError(f"no auto record {f}: pass --records, the sweep's output directory with its auto points")
    p = json.loads(f.read_text())["planner"]
    if budget is None or budget == p["budget"]:
        return {"budget": p["budget"], "alpha": p["alpha"], "spread": p["spread"]}
    if str(budget) not in (p.get("alpha_by_budget") or {}):
        raise MagicDecError(f"--budget {budget}: the plan in {f} has no prior for it; choose one of "
                            f"{sorted(int(b) for b in p.get('alpha_by_budget') or {})}")
    return {"budget": budget, "alpha": p["alpha_by_budget"][str(budget)], "spread": p["spread_by_budget"][str(budget)]}


def replay(files: list[Path], records: Path, draws: int, seed: int, budget: int | None = None) -> dict:
    batches = []
    for f in files:
        d = json.loads(f.read_text())
        tokens, gammas = d["gen_len"] - 1, d["gammas"]
        for row in d["batches"]:
            mode = row["mode"]
            plan = plan_of(records, d["prefix_len"], d["B"], mode, budget)
            costs = {b: {int(g): s for g, s in c.items()} for b, c in d["costs_s"][mode].items()}
            base = tokens * float(np.mean([c[0] for c in costs.values()]))  # the plain step, as each budget profiled it
            out = {"file": f.name, "skip_tokens": row["skip_tokens"], "mode": mode, "plan": plan,
                   "baseline_s": base, "settings": {}, "checks": {}}
            for b, t in row["acceptance"].items():
                greedy = mode == "greedy"
                trace = np.asarray(t, dtype=np.float64) / (1 if greedy else 1000)  # sampled: per mille
                r = replay_batch(trace, costs[b], gammas, tokens, plan if int(b) == plan["budget"] else None,
                                 1 if greedy else draws, seed)
                for name, v in r.items():
                    key = "auto" if name == "auto" else f"b{b} g{name.split()[1]}"
                    out["settings"][key] = v | {"speedup": base / v["seconds"]}
            for name, run in (row.get("runs") or {}).items():  # what the decoder did on the device
                if name == "auto" and run.get("budget") != plan["budget"]:
                    continue  # the device's auto drafted with another budget
                replayed = out["settings"][name]
                check = {"device_iterations": run["iterations"], "replayed_iterations": replayed["iterations"]}
                if name == "auto":
                    check["device_gamma_use"] = run["policy"]["iterations_per_gamma"]
                    check["replayed_gamma_use"] = {str(g): round(u, 2) for g, u in sorted(replayed["gamma_use"].items())}
                out["checks"][name] = check
            batches.append(out)
    return {"batches": batches, "draws": draws, "seed": seed, "budget": budget}


def summary(result: dict) -> list[str]:
    lines = ["| mode | prompts from | best fixed (speedup) | auto (speedup, gammas) | auto / best |", "|---|---|---|---|---|"]
    by_mode: dict[str, list] = {}
    for r in result["batches"]:
        fixed = {k: v for k, v in r["settings"].items() if k != "auto"}
        best = max(fixed, key=lambda k: fixed[k]["speedup"])
        auto = r["settings"]["auto"]
        use = ", ".join(f"g{g}×{u:.0f}" for g, u in sorted(auto["gamma_use"].items()))
        lines.append(f"| {r['mode']} | {r['skip_tokens']} | {best} ({fixed[best]['speedup']:.3f}) | "
                     f"{auto['speedup']:.3f} ({use}) | {auto['speedup'] / fixed[best]['speedup']:.3f} |")
        by_mode.setdefault(r["mode"], []).append(r)
    lines += ["", "| mode | batches | setting | total speedup (all batches) | worst batch / that batch's best |",
              "|---|---|---|---|---|"]
    for mode, rows in by_mode.items():
        base = sum(r["baseline_s"] for r in rows)
        names = list(rows[0]["settings"])
        total = {k: base / sum(r["settings"][k]["seconds"] for r in rows) for k in names}
        top = sorted(names, key=lambda k: -total[k])[:6]
        for k in top + ([] if "auto" in top else ["auto"]):
            worst = min(r["settings"][k]["speedup"] / max(v["speedup"] for n, v in r["settings"].items() if n != "auto")
                        for r in rows)
            lines.append(f"| {mode} | {len(rows)} | {k} | {total[k]:.3f} | {worst:.3f} |")
    for mode, rows in by_mode.items():
        lo, hi = bootstrap(rows)
        lines.append(f"{mode}: auto's total over the best fixed setting's total, 5-95% over batches resampled: "
                     f"{lo:.3f}-{hi:.3f}")
    return lines


def bootstrap(rows: list[dict], n: int = 5000, seed: int = 0) -> tuple[float, float]:
    """5th and 95th percentiles of auto's total speedup over the best fixed setting's (chosen again in each
    resample, in hindsight) when the batches are drawn again with replacement."""
    rng = np.random.default_rng(seed)
    names = list(rows[0]["settings"])
    base = np.array([r["baseline_s"] for r in rows])
    secs = {k: np.array([r["settings"][k]["seconds"] for r in rows]) for k in names}
    ratios = []
    for _ in range(n):
        i = rng.integers(0, len(rows), len(rows))
        total = {k: base[i].sum() / secs[k][i].sum() for k in names}
        ratios.append(total["auto"] / max(v for k, v in total.items() if k != "auto"))
    return tuple(float(x) for x in np.percentile(ratios, [5, 95]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", type=Path, nargs="+", help="outputs of benchmarks/planner/acceptance_trace.py")
    p.add_argument("--records", type=Path, required=True, help="the sweep's records (its auto points' plans)")
    p.add_argument("--draws", type=int, default=200, help="replays per sampled batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=int, default=None, help="replay auto at this budget instead of the plan's")
    p.add_argument("--output", type=Path, default=None)
    a = p.parse_args(argv)
    with one_line_errors():
        missing = [f for f in a.traces if not f.is_file()]
        if missing:
            raise MagicDecError(f"no trace at {missing[0]}: pass outputs of benchmarks/planner/acceptance_trace.py")
        if a.draws < 1:
            raise MagicDecError(f"--draws {a.draws}: replay each sampled batch at least once")
        result = replay(a.traces, a.records, a.draws, a.seed, a.budget)
    result["command"] = "python benchmarks/planner/policy_replay.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print("\n".join(summary(result)))
    checks = [(r["skip_tokens"], k, c) for r in result["batches"] for k, c in r["checks"].items()]
    bad = [x for x in checks if x[2]["device_iterations"] != x[2]["replayed_iterations"]]
    print(f"replayed iterations equal the device's for {len(checks) - len(bad)} of {len(checks)} runs"
          + "".join(f"\n  differs: {b}" for b in bad))
    if a.output:
        a.output.write_text(json.dumps(result, indent=1))
        print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
