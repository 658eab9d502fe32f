"""Fit a device profile's attention dot rate (attention_flops) to measured verification costs, and write it into the
profile (temp file, then rename) with where it came from.

The cost model times a verification of T tokens as a decode step's reads plus T times its attention's dots at this
rate (cost_model.fit_attention_flops); the rate is the split-KV kernel's, so it changes with the kernel and the GPU.
The records are benchmarks/tree_verify_cost.py's outputs on the profile's GPU; the fit takes their chains past one
token at the kernel's full range (max_t 64) and prints each point's predicted T_V/T_T against the measured one.

    python benchmarks/fit_attention_rate.py results/verify_attention/verify_cost_h200_after.json \
        results/verify_attention/verify_cost_h200_100k_b4_after.json \
        --profile magicdec/analysis/profiles/h200.json --write
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from magicdec import files  # noqa: E402
from magicdec.analysis import cost_model as cm  # noqa: E402
from magicdec.config import ModelArgs  # noqa: E402
from magicdec.errors import MagicDecError, one_line_errors  # noqa: E402


def chain_points(paths: list[Path], gpu: str) -> tuple[str, list[tuple[int, int, int, float]], list[str]]:
    """(model, [(B, context, T, measured T_V/T_T)], the records' code commits) of the records' chains past one
    token at max_t 64; every record must come from `gpu` and one model."""
    models, points, codes = set(), [], []
    for path in paths:
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise MagicDecError(f"{path}: not a readable record ({type(e).__name__}); give tree_verify_cost.py's "
                                f"--output files") from None
        env = record.get("environment") or {}
        if "points" not in record or "model" not in record:
            raise MagicDecError(f"{path}: no `points` and `model`: not benchmarks/tree_verify_cost.py's output")
        if env.get("gpu") != gpu:
            raise MagicDecError(f"{path}: measured on {env.get('gpu')!r}, the profile is {gpu!r}'s; fit a profile "
                                f"to its own GPU's records")
        models.add(record["model"])
        codes.append((env.get("code") or {}).get("commit", "?"))
        points += [(p["B"], p["prefix"], p["tokens"], p["T_V_over_T_T"]) for p in record["points"]
                   if p["tree"] is None and p["max_t"] == 64 and p["tokens"] > 1]
    if len(models) != 1:
        raise MagicDecError(f"the records hold {len(models)} models ({', '.join(sorted(models))}); fit one at a time")
    if len(points) < 3:
        raise MagicDecError(f"{len(points)} chain points past one token in the records: too few to fit a rate (3+)")
    return models.pop(), points, sorted(set(codes))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records", nargs="+", type=Path, help="benchmarks/tree_verify_cost.py outputs on the profile's GPU")
    p.add_argument("--profile", type=Path, required=True, help="the device profile the rate is fitted under")
    p.add_argument("--write", action="store_true", help="write the fitted rate into the profile")
    a = p.parse_args(argv)
    with one_line_errors():
        device, _, profile = cm.load_profile(a.profile)
        model, points, codes = chain_points(a.records, profile.get("device"))
        c = ModelArgs.from_name(model)
        rate = cm.fit_attention_flops(c, device, points)
        fitted = replace(device, attention_flops=rate)
        worst = 0.0
        for B, ctx, T, measured in points:
            predicted = cm.step_time(c, fitted, B, ctx, T) / cm.step_time(c, fitted, B, ctx, 1)
            worst = max(worst, abs(predicted / measured - 1))
            print(f"B={B:3d} context={ctx:6d} T={T:2d} measured {measured:.3f} predicted {predicted:.3f}")
        print(f"attention_flops: {rate / 1e12:g} TFLOP/s (was {device.attention_flops / 1e12:g}); "
              f"within {worst:.0%} at every one of {len(points)} points")
        if a.write:
            where = ", ".join(str(path) for path in a.records)
            source = (f"{where}: the dot rate of the split-KV kernel (code {', '.join(codes)}) that best predicts "
                      f"{len(points)} chains of 2-64 verified tokens over a decode step (benchmarks/"
                      f"fit_attention_rate.py; within {worst:.0%} at every point)")
            files.write_json(a.profile, cm.measured_here(
                profile | {"attention_flops": rate, "attention_flops_source": source}, ["attention_flops"]))
            print(f"written into {a.profile}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
