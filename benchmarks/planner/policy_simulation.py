"""The runtime policy (planner.AutoGamma) against fixed gammas on simulated batches: for one `auto` point of a sweep,
its profiled seconds per verification, its prior and the spread the planner gave it, many batches of B sequences
whose drafted tokens are each accepted independently at the sequence's rate (all at the synthetic rate on a
synthetic sweep; spread between sequences as planner.fit_spread says on real text). The policy runs as the decoder
runs it: one verification stale, switching off for good. Speedup is the baseline's time for the tokens (one profiled
plain step each) over the batch's time; per policy variant and fixed gamma, the mean, the 5th percentile and how
often a batch falls below 0.97x.

    python benchmarks/planner/policy_simulation.py results/issue5/policy_simulation/llama31_auto_P32768_B4_greedy_13h58.json \
        results/issue5/llama31_8b/auto_P32768_B4_greedy.json --spread recorded unknown \
        --output results/issue5/policy_simulation/policy_simulation.json

A model computation on a measured record (no timing): it runs anywhere.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from magicdec.errors import MagicDecError, one_line_errors  # noqa: E402
from magicdec.planner import AutoGamma, spread_alphas  # noqa: E402


def drawn_acceptance(alphas: np.ndarray, rng: np.random.Generator):
    """accept(gamma, made) for sequences whose drafted tokens are each kept independently at the sequence's rate."""
    return lambda g, made: np.cumprod(rng.random((len(alphas), g)) < alphas[:, None], axis=1).sum(1)


def batch_seconds(costs: dict[int, float], accept, n: int, tokens: int, policy: AutoGamma | None = None,
                  gamma: int = 0) -> float:
    """Seconds until each of n sequences has `tokens` more, `accept(gamma, made)` giving the drafted tokens each
    sequence keeps in a verification from `made` tokens on: with `policy`, gamma per verification as
    generate.Decoder asks it (each choice sees the numbers of the verification before the last); without, a fixed
    `gamma`."""
    made = np.zeros(n, dtype=np.int64)
    left = np.full(n, tokens)  # what the policy last read
    seen = last = None
    seconds = 0.0
    upcoming = policy.choose(left) if policy else gamma
    while True:
        if seen is not None:  # the loop's one sync reads the last iteration's numbers
            last, seen = seen, None
        if (made >= tokens).all():
            return seconds
        g = upcoming
        if policy:
            policy.used(g)
        active = made < tokens
        accepted = accept(g, made) if g else np.zeros(n, dtype=np.int64)
        made = np.where(active, made + accepted + 1, made)
        seconds += costs[g]
        if policy:
            if g:
                examined = np.where(active, np.minimum(accepted, g - 1) + 1, 0)
                seen = (np.maximum(tokens - made, 0), np.where(active, accepted, 0), examined)
            if last is not None:
                left, kept, reached = last
                policy.observe(kept, reached)
                last = None
            upcoming = policy.choose(left)


def simulate(record: dict, spreads: list[str], batches: int, seed: int) -> dict:
    m = record.get("metrics") or {}
    auto = (m.get("speculation") or {}).get("auto_gamma")
    if record.get("method") != "auto" or not auto:
        raise MagicDecError(f"{record.get('point')}: not an auto point with a profiled policy; pass an auto_*.json record")
    costs = {int(g): s for g, s in auto["seconds_per_verification"].items()}
    gammas, planner, B = auto["candidates"], record["planner"], record["B"]
    tokens = record["gen_len"] - 1
    synthetic = record.get("synthetic_acceptance")
    alpha = synthetic if synthetic is not None else planner["alpha"]
    true_spread = 0.0 if synthetic is not None else (planner["spread"] or 0.0)
    variants = {"recorded": planner["spread"], "unknown": None}
    out = {"point": record["point"], "B": B, "tokens": tokens, "costs_s": costs, "alpha": alpha,
           "sequences_spread": true_spread, "prior": planner["alpha"], "batches": batches, "seed": seed, "rows": {}}
    base = tokens * costs[0]
    rows = {f"auto, spread {s} ({variants[s]})": variants[s] for s in spreads}
    rows |= {f"fixed gamma {g}": g for g in gammas}
    for name, arg in tqdm(rows.items(), desc="policies", leave=False):
        rng = np.random.default_rng(seed)  # every row meets the same batches' rates (and its own draws)
        speedups = []
        for _ in range(batches):
            alphas = spread_alphas(alpha, true_spread, B)
            rng.shuffle(alphas)
            if name.startswith("auto"):
                policy = AutoGamma(gammas, planner["alpha"], spread=arg)
                policy.costs = dict(costs)
                speedups.append(base / batch_seconds(costs, drawn_acceptance(alphas, rng), B, tokens, policy))
            else:
                speedups.append(base / batch_seconds(costs, drawn_acceptance(alphas, rng), B, tokens, gamma=arg))
        s = np.array(speedups)
        out["rows"][name] = {"mean": float(s.mean()), "p5": float(np.percentile(s, 5)),
                             "below_0_97": float((s < 0.97).mean())}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("records", type=Path, nargs="+", help="auto_*.json records of a sweep")
    p.add_argument("--spread", nargs="+", choices=["recorded", "unknown"], default=["recorded"],
                   help="the policy's spread: the planner's (as the sweep ran it) or unknown (None)")
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None)
    a = p.parse_args(argv)
    with one_line_errors():
        if a.batches < 1:
            raise MagicDecError(f"--batches {a.batches}: simulate at least one batch")
        missing = [r for r in a.records if not r.is_file()]
        if missing:
            raise MagicDecError(f"no record at {missing[0]}: pass auto_*.json files of a sweep's output directory")
        results = [simulate(json.loads(r.read_text()), a.spread, a.batches, a.seed) | {"record": str(r)}
                   for r in a.records]
    print("| record | policy | mean speedup | 5th percentile | batches < 0.97x |")
    print("|---|---|---|---|---|")
    for r in results:
        for name, row in r["rows"].items():
            print(f"| {Path(r['record']).name} | {name} | {row['mean']:.3f} | {row['p5']:.3f} | {row['below_0_97']:.0%} |")
    if a.output:
        command = "python benchmarks/planner/policy_simulation.py " + " ".join(argv if argv is not None else sys.argv[1:])
        a.output.write_text(json.dumps({"command": command, "results": results}, indent=1))
        print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
