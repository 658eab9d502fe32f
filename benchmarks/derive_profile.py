"""A device profile for a GPU that has none, from what its sweeps already measured: the copy bandwidth, the bf16
matmul rate and the fixed cost per layer that every sweep measures at its start (a baseline record's
`device_model`, on that GPU), every other term (the low-bit kernels' tables, the attention dot rate, the fixed
costs of trees, heads, all-reduces and each drafter's verification) copied from a base profile and labelled as the
base GPU's in `derived_from`. The planner reads it on that GPU (magicdec/analysis/profiles/: the profile whose
`device` is the GPU's name) instead of falling back to the H100's.

    python benchmarks/derive_profile.py results/planner_sweeps/tree_switching_h200 \
        --base magicdec/analysis/profiles/h100.json --output magicdec/analysis/profiles/h200.json

The copied terms are the base GPU's until measured on this one (benchmarks/draft_weight_kernels.py --profile,
benchmarks/fit_atlas_costs.py --write).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from magicdec import files  # noqa: E402
from magicdec.analysis import cost_model as cm  # noqa: E402
from magicdec.errors import MagicDecError  # noqa: E402
from magicdec.harness.sweep import read_object  # noqa: E402

MEASURED = ("bandwidth", "matmul_flops", "layer_overhead_s")  # what a sweep measures on its own GPU


def device_models(folders: list[Path]) -> list[tuple[Path, dict]]:
    """Every baseline record's (path, record) under `folders` that carries the device model its sweep measured."""
    found = []
    for folder in folders:
        if not folder.is_dir():
            raise MagicDecError(f"{folder}: no such folder; give folders of sweep records (a sweep's --output_dir)")
        for f in sorted(folder.glob("*.json")):
            r, _ = read_object(f)
            if r is not None and r.get("method") == "baseline" and isinstance(r.get("device_model"), dict):
                found.append((f, r))
    if not found:
        raise MagicDecError(f"{' '.join(map(str, folders))}: no baseline record with a device_model (a sweep's "
                            "baseline points carry one); give the output folder of a sweep run on the GPU")
    return found


def derive(folders: list[Path], base: dict, base_path: str) -> dict:
    records = device_models(folders)
    gpus = sorted({r.get("environment", {}).get("gpu") or "?" for _, r in records})
    if len(gpus) > 1:
        raise MagicDecError(f"the records come from several GPUs ({', '.join(gpus)}): give one GPU's sweeps")
    worlds = sorted({(r.get("device_model") or {}).get("ranks", 1) for _, r in records})
    if worlds != [1]:
        raise MagicDecError(f"the records' device models are of {worlds} ranks: give one-GPU sweeps (the profile's "
                            "per-layer cost is a single GPU's; all-reduces are fitted apart)")
    if gpus[0] == base.get("device"):
        raise MagicDecError(f"the records are of {gpus[0]}, the base profile's own GPU: nothing to derive")
    out = dict(base)
    # a sweep measures these once at its start (or its resume), and each of its baselines carries that measurement
    measured = {tuple(r["device_model"][k] for k in MEASURED) for _, r in records}
    for i, key in enumerate(MEASURED):
        out[key] = statistics.median(m[i] for m in measured)
    sources = sorted({str(p.parent) for p, _ in records})
    out |= {"device": gpus[0], "measured": max(r.get("recorded_at", "") for _, r in records),
            "source": f"{', '.join(sources)}: the sweeps' own measurement on this GPU at their start (copy "
                      "bandwidth, a large bf16 matmul, the fixed cost per layer fitted to a B = 1 step at "
                      "Llama-3.1-8B's shape), the median over their baseline records",
            "code": records[-1][1].get("environment", {}).get("code"),
            "derived_from": {"profile": base_path, "device": base.get("device"),
                             "terms": sorted(k for k in base if k not in MEASURED and k not in (
                                 "device", "measured", "source", "code", "note") and not k.endswith("_source")),
                             "note": "every term not in `source` is the base GPU's, not measured on this one"}}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path, help="output folders of sweeps run on the GPU (one GPU each)")
    p.add_argument("--base", type=Path, required=True, help="the profile whose other terms are copied")
    p.add_argument("--output", type=Path, required=True, help="the new profile (written to a temp file, renamed)")
    a = p.parse_args(argv)
    try:
        out = derive(a.folders, cm.load_profile(a.base, "--base")[2], str(a.base))
    except MagicDecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    files.write_text(a.output, json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.output}: {out['device']}, " + ", ".join(f"{k} {out[k]:.4g}" for k in MEASURED)
          + f"; {len(out['derived_from']['terms'])} terms from {a.base}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
