"""Replay gamma policies on real batches: benchmarks/acceptance_trace.py records, for each batch, where each draft
budget's drafts are kept position by position; a verification drafting gamma tokens keeps the leading run of them
(greedy exactly; sampled, each position kept with its recorded chance). So every fixed (budget, gamma) and the
runtime policy (planner.AutoGamma, as the decoder runs it: one verification stale, off for good) can be run on the
same batches, at the seconds per verification profiled on the device, without timing noise or machine drift.

Checked against the device: greedy, the replayed iterations of every fixed decoder must equal those its real run
took on that batch (recorded beside the traces), and the replayed policy must use the gammas the real auto
decoder used. Speedup: the baseline's time (one profiled plain step per token) over the replayed batch's time.

    python benchmarks/policy_replay.py results/issue5/replay/traces_a.json results/issue5/replay/traces_b.json \
        --records results/issue5/smollm2 --output results/issue5/replay/replay.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
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


class Counting(dict):
    """costs of 1 per verification: batch_seconds then counts iterations."""

    def __missing__(self, key):
        return 1.0


def replay_batch(trace: np.ndarray, costs: dict, gammas: list[int], tokens: int, plan: dict, draws: int,
                 seed: int) -> dict:
    """Iterations and seconds of every fixed gamma and of the policy on one batch for one budget's trace, the mean
    of `draws` replays (1 for greedy: nothing is random)."""
    greedy = bool(np.isin(trace, (0.0, 1.0)).all())
    draws = 1 if greedy else draws
    rng = np.random.default_rng(seed)
    n = trace.shape[0]
    out = {}
    for g in gammas:
        its = [batch_seconds(Counting(), traced_acceptance(trace, rng), n, tokens, gamma=g) for _ in range(draws)]
        out[f"gamma {g}"] = {"iterations": float(np.mean(its)), "seconds": float(np.mean(its)) * costs[g]}
    secs, uses = [], {}
    for _ in range(draws):
        policy = AutoGamma(gammas, plan["alpha"], spread=plan["spread"], margin=plan.get("margin", 0.03))
        policy.costs = dict(costs)
        secs.append(batch_seconds(costs, traced_acceptance(trace, rng), n, tokens, policy))
        for g in policy.history:
            uses[g] = uses.get(g, 0) + 1 / draws
    out["auto"] = {"iterations": sum(uses.values()), "seconds": float(np.mean(secs)), "gamma_use": uses}
    return out


def plan_of(records: Path, P: int, B: int, mode: str) -> dict:
    """The budget, prior and spread the sweep's auto point at (P, B, mode) was planned with."""
    f = records / f"auto_P{P}_B{B}_{mode}.json"
    if not f.is_file():
        raise MagicDecError(f"no auto record {f}: pass --records, the sweep's output directory with its auto points")
    p = json.loads(f.read_text())["planner"]
    return {"budget": p["budget"], "alpha": p["alpha"], "spread": p["spread"]}


def replay(files: list[Path], records: Path, draws: int, seed: int) -> dict:
    batches = []
    for f in files:
        d = json.loads(f.read_text())
        tokens, gammas = d["gen_len"] - 1, d["gammas"]
        for row in d["batches"]:
            mode = row["mode"]
            plan = plan_of(records, d["prefix_len"], d["B"], mode)
            costs = {b: {int(g): s for g, s in c.items()} for b, c in d["costs_s"][mode].items()}
            base = tokens * costs[str(plan["budget"])][0]
            out = {"file": f.name, "skip_tokens": row["skip_tokens"], "mode": mode, "plan": plan,
                   "baseline_s": base, "settings": {}, "checks": {}}
            for b, t in row["acceptance"].items():
                trace = np.asarray(t, dtype=np.float64) / (1 if mode == "greedy" else 1000)
                r = replay_batch(trace, costs[b], gammas, tokens, plan, draws, seed)
                for name, v in r.items():
                    if name == "auto" and int(b) != plan["budget"]:
                        continue
                    key = "auto" if name == "auto" else f"b{b} g{name.split()[1]}"
                    out["settings"][key] = v | {"speedup": base / v["seconds"]}
            for name, run in (row.get("runs") or {}).items():  # what the decoder did on the device
                replayed = out["settings"][name]
                check = {"device_iterations": run["iterations"], "replayed_iterations": replayed["iterations"]}
                if name == "auto":
                    check["device_gamma_use"] = run["policy"]["iterations_per_gamma"]
                    check["replayed_gamma_use"] = {str(g): round(u, 2) for g, u in sorted(replayed["gamma_use"].items())}
                out["checks"][name] = check
            batches.append(out)
    return {"batches": batches, "draws": draws, "seed": seed}


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
        for k in sorted(names, key=lambda k: -total[k])[:6] + (["auto"] if "auto" not in sorted(names, key=lambda k: -total[k])[:6] else []):
            worst = min(r["settings"][k]["speedup"] / max(v["speedup"] for n, v in r["settings"].items() if n != "auto")
                        for r in rows)
            lines.append(f"| {mode} | {len(rows)} | {k} | {total[k]:.3f} | {worst:.3f} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", type=Path, nargs="+", help="outputs of benchmarks/acceptance_trace.py")
    p.add_argument("--records", type=Path, required=True, help="the sweep's records (its auto points' plans)")
    p.add_argument("--draws", type=int, default=200, help="replays per sampled batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None)
    a = p.parse_args(argv)
    with one_line_errors():
        missing = [f for f in a.traces if not f.is_file()]
        if missing:
            raise MagicDecError(f"no trace at {missing[0]}: pass outputs of benchmarks/acceptance_trace.py")
        if a.draws < 1:
            raise MagicDecError(f"--draws {a.draws}: replay each sampled batch at least once")
        result = replay(a.traces, a.records, a.draws, a.seed)
    result["command"] = "python benchmarks/policy_replay.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print("\n".join(summary(result)))
    bad = [(r["skip_tokens"], k, c) for r in result["batches"] for k, c in r["checks"].items()
           if c["device_iterations"] != c["replayed_iterations"]]
    print(f"replayed iterations equal the device's for {sum(len(r['checks']) for r in result['batches']) - len(bad)} "
          f"of {sum(len(r['checks']) for r in result['batches'])} runs" + "".join(f"\n  differs: {b}" for b in bad))
    if a.output:
        a.output.write_text(json.dumps(result, indent=1))
        print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
