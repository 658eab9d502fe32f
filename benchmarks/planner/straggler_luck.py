"""How much of a batch's verification count is luck: for every fixed-gamma group of a sweep (one prefix, B > 1,
decoding and budget), the planner's model of the batch (its measured alpha, the spread between sequences that
planner.fit_spread gives that budget's records, as the sweep's planner does) simulated many times: the mean and
standard deviation of the verifications until the slowest sequence is done, against the one count each fixed-gamma
run measured; and, with each gamma's measured seconds per verification, how often one batch drawn from the model
makes another gamma faster than the one the model expects to be fastest.

    python benchmarks/planner/straggler_luck.py results/issue5/smollm2 --output results/issue5/straggler_luck.json

A model computation on measured records (no timing): it runs anywhere.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from magicdec.errors import MagicDecError, one_line_errors  # noqa: E402
from magicdec.planner import spread_alphas  # noqa: E402
from magicdec.sweep import spread_of  # noqa: E402


def simulate(alphas: np.ndarray, gamma: int, tokens: int, batches: int, seed: int = 0) -> np.ndarray:
    """Verifications until every sequence has `tokens` more, for `batches` batches of len(alphas) sequences, each
    drafted token accepted with its sequence's rate independently (what the planner's model assumes)."""
    gen = torch.Generator().manual_seed(seed)
    alpha = torch.as_tensor(alphas, dtype=torch.float64)
    left = torch.full((batches, len(alpha)), tokens)
    count = torch.zeros(batches, dtype=torch.long)
    while (left > 0).any():
        count += (left > 0).any(1)  # a batch verifies while any of its sequences lacks tokens
        draws = torch.rand(batches, len(alpha), gamma, generator=gen, dtype=torch.float64) < alpha[:, None]
        left = left - (draws.long().cumprod(-1).sum(-1) + 1)  # drafts kept up to the first rejection, plus one
    return count.numpy()


def groups(records_dir: Path) -> dict:
    out = defaultdict(list)
    for f in sorted(records_dir.glob("*.json")):
        r = json.loads(f.read_text())
        if r.get("gamma") and r.get("B", 1) > 1 and "metrics" in r and r["metrics"].get("alpha") is not None:
            out[r["method"], r["prefix_len"], r["B"], r["decoding"], r["budget"]].append(r)
    return out


def luck(records_dir: Path, batches: int = 2000) -> list[dict]:
    rows, by_group = [], groups(records_dir)
    for (method, P, B, mode, budget), recs in sorted(by_group.items()):
        # as the sweep's planner fits it: that method's batches at this prefix, decoding and budget, any B
        spread = spread_of(r for (me, p, _, m, b), rs in by_group.items() if (me, p, m, b) == (method, P, mode, budget)
                           for r in rs)
        sims, per = {}, []  # sims: ms of each simulated batch, per gamma
        for r in sorted(recs, key=lambda r: r["gamma"]):
            g, m = r["gamma"], r["metrics"]
            n = simulate(spread_alphas(m["alpha"], spread, B), g, r["gen_len"] - 1, batches, seed=g)
            sims[g] = n * m["ms_per_step"]
            per.append({"gamma": g, "alpha": m["alpha"], "measured": m["iterations"], "model_mean": float(n.mean()),
                        "model_sd": float(n.std()), "z": float((m["iterations"] - n.mean()) / max(n.std(), 1e-9)),
                        "ms_per_verification": m["ms_per_step"], "measured_ms": m["iterations"] * m["ms_per_step"]})
        expected = min(sims, key=lambda g: sims[g].mean())
        fastest = min(per, key=lambda q: q["measured_ms"])["gamma"]
        others = np.min([sims[g] for g in sims if g != expected], axis=0) if len(sims) > 1 else np.full(batches, np.inf)
        rows.append({"method": method, "prefix_len": P, "B": B, "decoding": mode, "budget": budget, "spread": spread, "gammas": per,
                     "model_fastest": expected, "measured_fastest": fastest,
                     "measured_loss_of_model_choice": next(q["measured_ms"] for q in per if q["gamma"] == expected)
                     / min(q["measured_ms"] for q in per) - 1,
                     # batches drawn independently per gamma: an upper bound, since real gammas share the same text
                     "p_other_gamma_faster": float((others < sims[expected]).mean())})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("records", type=Path, help="a sweep's output directory")
    p.add_argument("--batches", type=int, default=2000, help="simulated batches per (group, gamma)")
    p.add_argument("--output", type=Path, required=True)
    a = p.parse_args(argv)
    with one_line_errors():
        if not any(groups(a.records).values()):
            raise MagicDecError(f"{a.records}: no fixed-gamma records with B > 1 (and a measured alpha); give a sweep's "
                                "output directory")
        rows = luck(a.records, a.batches)
    print("| prefix | B | decoding | budget | spread | verifications measured / model mean ± sd (z) per γ "
          "| model's γ | fastest measured | model's γ lost | P(another γ faster) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = ", ".join(f"γ{q['gamma']} {q['measured']} / {q['model_mean']:.1f} ± {q['model_sd']:.1f} ({q['z']:+.1f})"
                          for q in r["gammas"])
        print(f"| {r['prefix_len']} | {r['B']} | {r['decoding']} | {r['budget']} | {r['spread']:.3f} | {cells} "
              f"| γ{r['model_fastest']} | γ{r['measured_fastest']} | {r['measured_loss_of_model_choice']:.1%} "
              f"| {r['p_other_gamma_faster']:.2f} |")
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps({"command": "python benchmarks/planner/straggler_luck.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), "groups": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
