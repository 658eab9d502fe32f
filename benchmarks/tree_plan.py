"""Predicted, not measured: the best chain against the best token tree (MagicDec's "adaptive Sequoia trees") per
batch size and context, from the cost model on a committed device profile (its verification cost fitted to
measured chains of 1-64 tokens, results/trees) and an acceptance vector (per sibling rank, as a real run's
per_rank_acceptance gives it). A tree is drafted level by level (D draft steps, each costing a chain's draft step:
optimistic for wide levels) and verified over all its nodes; the chain is the same draft at gamma = D with one
candidate per level.

    python benchmarks/tree_plan.py --rates 0.85 0.61 0.64 --output results/trees/plan_h100.json
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from magicdec.analysis import cost_model as cm
from magicdec import files
from magicdec.analysis.cost_model import PROFILES, load_profile
from magicdec.config import ModelArgs
from magicdec.analysis.planner import best_tree
from magicdec.model.tree import Tree


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_name", default="meta-llama/Meta-Llama-3.1-8B")
    p.add_argument("--profile", type=Path, default=PROFILES / "h100.json")
    p.add_argument("--rates", type=float, nargs="+", required=True, help="acceptance per sibling rank")
    p.add_argument("--prefix_lens", type=int, nargs="+", default=[32768, 100000])
    p.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 4, 13, 32])
    p.add_argument("--budget", type=int, default=512, help="the self-draft's StreamingLLM budget")
    p.add_argument("--draft_weights", default="bf16")
    p.add_argument("--output", type=Path, required=True)
    a = p.parse_args(argv)
    c, (device, overheads, profile) = ModelArgs.from_name(a.model_name), load_profile(a.profile)
    device = replace(device, verify_overhead_s=overheads.get("selfspec", 0.0))
    rates, rows = tuple(a.rates), []
    for prefix in a.prefix_lens:
        for B in a.batch_sizes:
            def predict(tree: Tree):
                return cm.predict(c, device, B, prefix, tree.depth, rates[0], a.budget + 64,
                                  draft_weights=a.draft_weights, tree=tree, sibling_rates=rates[1:])
            chains = {g: predict(Tree.chain(g)) for g in range(1, 9)}
            g = max(chains, key=lambda k: chains[k]["speedup"])
            tree, pt, scored = best_tree(predict, rates)
            rows.append({"prefix": prefix, "B": B, "chain_gamma": g, "chain_speedup": chains[g]["speedup"],
                         "chain_omega": chains[g]["omega"], "tree_nodes": tree.size, "tree_depth": tree.depth,
                         "tree_parents": list(tree.parents), "tree_speedup": pt["speedup"], "tree_omega": pt["omega"],
                         "tree_T_V_over_T_T": pt["T_V_over_T_T"], "tree_over_chain": pt["speedup"] / chains[g]["speedup"]})
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()
                              if k != "tree_parents"}))
    a.output.parent.mkdir(parents=True, exist_ok=True)
    files.write_json(a.output, {"prediction": True, "model": c.name, "profile": str(a.profile),
                                "device": profile.get("device"), "rates": rates, "budget": a.budget,
                                "draft_weights": a.draft_weights, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
