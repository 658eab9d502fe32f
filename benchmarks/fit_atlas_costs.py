"""Fit the device profile's fixed costs that the cost model cannot count from bytes and FLOPs to an atlas's timed
candidates, and write them into the profile (temp file, then rename) with where they came from:

- tree_verify_s[ranks]: a token tree's verification beyond a chain's of as many tokens (its mask and positions, the
  masked attention path): the median over each world size's width >= 2 lookup trees of (measured verification
  seconds per iteration - the cost model's step at the tree's size);
- verify_overhead_s.hierarchy: the hierarchy's fixed seconds per target verification (the middle's set-up): the
  median over its timed runs on one GPU of (draft seconds per iteration - the middle verifications the model
  predicts at the run's own bottom rate, times the middle's step);
- collective_s_per_layer[ranks]: a tensor-parallel step's all-reduces per layer: the median over the baselines of
  each world size of (measured step - the model's step without them) / layers.

A fitted term is in sample for the records it was fitted to: a check of the planner on them says so.

    python benchmarks/fit_atlas_costs.py results/atlas/h100_greedy results/atlas/tp4_greedy \
        --profile magicdec/analysis/profiles/h100.json --write
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from magicdec import files  # noqa: E402
from magicdec.analysis import cost_model as cm  # noqa: E402
from magicdec.analysis.planner import finish_verifications  # noqa: E402
from magicdec.config import ModelArgs  # noqa: E402
from magicdec.errors import one_line_errors  # noqa: E402
from magicdec.harness.report_atlas import load  # noqa: E402
from magicdec.harness.run_config import RunConfig  # noqa: E402


def world(record: dict) -> int:
    return (record.get("tensor_parallel") or {}).get("world", 1)


def timed(records):
    """(record, candidate, its run config, its metrics) for every timed candidate."""
    for r in records:
        for c in r.get("candidates") or []:
            m = c.get("metrics") or {}
            if m.get("speculation"):
                yield r, c, RunConfig.from_options(c["config"], strict=False), m


def context(cfg) -> int:
    return cfg.workload.prefix_len + cfg.workload.gen_len // 2


def tree_residuals(records, device) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for r, c, cfg, m in timed(records):
        if c["drafter"] != "lookup" or cfg.speculation.tree_width < 2:
            continue
        target = ModelArgs.from_name(r["model"])
        chain = cm.step_time(target, replace(device, ranks=world(r)), cfg.workload.B, context(cfg),
                             cfg.speculation.tree_width * c["gamma"] + 1)
        out.setdefault(world(r), []).append(m["time_split_s"]["verify"] / m["speculation"]["iterations"] - chain)
    return out


def hierarchy_residuals(records, device) -> list[float]:
    out = []
    for r, c, cfg, m in timed(records):
        if (world(r) != 1 or c["drafter"] != "hierarchy" or cfg.draft.draft != "ngram" or cfg.draft.quantized_kv
                or cfg.draft.draft_weights != "bf16"):
            continue
        d, w = cfg.draft, cfg.workload
        target, s = ModelArgs.from_name(r["model"]), m["speculation"]
        rate = s["drafter"]["alpha_bottom_to_middle"]
        runs = float(finish_verifications([d.gamma_bottom], np.full(w.B, rate), np.full(w.B, c["gamma"]))[0])
        middle = cm.step_time(target, device, w.B, d.read_slots(w.prefix_len, w.gen_len, cfg.lookahead),
                              d.gamma_bottom + 1)
        out.append(m["time_split_s"]["draft"] / s["iterations"] - runs * middle)
    return out


def collective_residuals(records, device) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for r in records:
        n = world(r)
        if n == 1 or not (r.get("baseline") or {}).get("ms_per_step"):
            continue
        target = ModelArgs.from_name(r["model"])
        alone = cm.step_time(target, replace(device, ranks=n, collective_s_per_layer={}), r["B"],
                             r["prefix_len"] + r["gen_len"] // 2, 1)
        out.setdefault(n, []).append((r["baseline"]["ms_per_step"] / 1e3 - alone) / target.n_layers)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="+", type=Path, help="folders of plan records")
    p.add_argument("--profile", type=Path, required=True, help="the device profile the terms are fitted under")
    p.add_argument("--write", action="store_true", help="write the fitted terms into the profile")
    a = p.parse_args(argv)
    with one_line_errors():
        # greedy records alone: the residuals are taken against bf16 steps without the sampler's rows
        records = [r for r in load(a.dirs) if r.get("skipped") is None and r.get("decoding") == "greedy"]
        device, overheads, profile = cm.load_profile(a.profile)
        where = ", ".join(map(str, a.dirs))
        fits = {}
        # the all-reduces first: a tree's residual at a world size is taken over its step with them, so one pass
        # gives what a second would (a profile without a world's figure gave that world's trees its all-reduces)
        coll = collective_residuals(records, replace(device, tree_verify_s={}))
        collectives = device.collective_s_per_layer | {n: statistics.median(v) for n, v in coll.items()}
        base = replace(device, tree_verify_s={}, collective_s_per_layer=collectives)
        if trees := tree_residuals(records, base):
            fits["tree_verify_s"] = (profile.get("tree_verify_s") or {}) | {
                str(n): statistics.median(v) for n, v in sorted(trees.items())}
            fits["tree_verify_source"] = (f"benchmarks/fit_atlas_costs.py over {where}: per world size, the median "
                                          "over its width >= 2 lookup trees of (verification seconds per iteration - "
                                          "the model's step at the tree's size) (" + ", ".join(
                                              f"{n} ranks: {len(v)}" for n, v in sorted(trees.items())) + ")")
        if hier := hierarchy_residuals(records, base):
            fits["verify_overhead_s"] = overheads | {"hierarchy": statistics.median(hier)}
            before = profile.get("verify_overhead_source", "").split("; hierarchy: benchmarks/fit_atlas_costs.py")[0]
            fits["verify_overhead_source"] = (before + f"; hierarchy: benchmarks/"
                                              f"fit_atlas_costs.py over {where}: the median over {len(hier)} runs on "
                                              "one GPU of (draft seconds per iteration - predicted middle "
                                              "verifications x the middle's step)")
        if coll:
            fits["collective_s_per_layer"] = (profile.get("collective_s_per_layer") or {}) | {
                str(n): collectives[n] for n in sorted(coll)}
            fits["collective_source"] = (f"benchmarks/fit_atlas_costs.py over {where}: per world size, the median "
                                         "over its baselines of (measured step - the model's step without "
                                         "all-reduces) / layers (" + ", ".join(f"{n} ranks: {len(v)}" for n, v in
                                                                              sorted(coll.items())) + ")")
        for k, v in fits.items():
            print(f"{k}: {v}")
        if a.write and fits:
            terms = [f"tree_verify_s[{n}]" for n in trees] + (["verify_overhead_s[hierarchy]"] if hier else []) + [
                f"collective_s_per_layer[{n}]" for n in coll]
            files.write_json(a.profile, cm.measured_here(profile | fits, terms))
            print(f"written into {a.profile}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
