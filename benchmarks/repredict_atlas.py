"""The planner of this checkout against an atlas's measurements: each timed candidate of each plan record predicted
again (its option at its timed gamma, at the record's point and tensor-parallel ranks, with the acceptance file and
device profile given), beside what the record predicted when it ran and what it measured. Shows what a change to
the cost model or the planner does to its error on records already made, without a GPU; a profile term fitted to
the same records is no out-of-sample check (say so where it is quoted).

    python benchmarks/repredict_atlas.py results/atlas/h100_greedy results/atlas/tp4_greedy \
        --acceptance results/atlas/acceptance_smollm2_8k_greedy.json --output results/atlas/repredicted.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from magicdec import files  # noqa: E402
from magicdec.analysis import cost_model as cm  # noqa: E402
from magicdec.harness.plan_command import Inputs, Planner  # noqa: E402
from magicdec.harness.report_atlas import load  # noqa: E402

WITHIN = 0.10  # the atlas's goal: the cost model within 10% of measurement


def repredict(record: dict, acceptance: Path, profile: Path) -> list[dict]:
    """One row per timed candidate: (label, gamma, predicted then, predicted now, measured all reach)."""
    world = (record.get("tensor_parallel") or {}).get("world", 1)
    point = {"random_weights": True, "model_name": record["model"], "B": record["B"],
             "prefix_len": record["prefix_len"], "gen_len": record["gen_len"], "device": "cpu", "dtype": "bfloat16",
             "dataset": "stdlib"} | ({"temperature": 0.6, "top_p": 0.9} if record["decoding"] == "sampled" else {})
    if record.get("skipped") is not None:  # does not fit: nothing timed
        return []
    options = {r["label"]: r["config"] for r in record["plan"]["ranking"]}  # a candidate's own config is its run's
    rows = []
    for c in record.get("candidates") or []:
        measured = (c.get("metrics") or {}).get("measured_speedup")
        if not measured:
            continue
        # a timed candidate fit where it ran (its target's weights already loaded there): memory is not checked again
        planner = Planner(point, Inputs(profile, acceptance, gammas=(c["gamma"],), synthetic=True, ranks=world,
                                        memory_gib=1e6))
        ranked = planner.ranking([{"drafter": c["drafter"]} | options[c["label"]]])["ranking"]
        now = next((r["speedup"] for r in ranked if r["label"] == c["label"]), None)
        rows.append({"B": record["B"], "prefix_len": record["prefix_len"], "world": world, "label": c["label"],
                     "drafter": c["drafter"], "gamma": c["gamma"], "measured": measured,
                     "predicted_then": c["predicted_speedup"], "predicted_now": now,
                     "error_then": c["predicted_speedup"] / measured - 1,
                     "error_now": now / measured - 1 if now else None})
    return rows


def summary(rows: list[dict]) -> dict:
    """Per (world, drafter): how many candidates within WITHIN, then and now."""
    out = {}
    for r in rows:
        s = out.setdefault(f"TP {r['world']} {r['drafter']}", {"candidates": 0, "within_then": 0, "within_now": 0})
        s["candidates"] += 1
        s["within_then"] += abs(r["error_then"]) <= WITHIN
        s["within_now"] += r["error_now"] is not None and abs(r["error_now"]) <= WITHIN
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", type=Path, nargs="+", help="folders of plan records (magicdec report atlas reads the same)")
    p.add_argument("--acceptance", type=Path, required=True, help="the acceptance file the records ranked with")
    p.add_argument("--profile", type=Path, default=cm.PROFILES / "h100.json")
    p.add_argument("--output", type=Path, required=True)
    a = p.parse_args(argv)
    rows = [row for record in load(a.dirs) for row in repredict(record, a.acceptance, a.profile)]
    for r in rows:
        now = f"{r['predicted_now']:.3f} ({r['error_now']:+.1%})" if r["error_now"] is not None else "not ranked"
        print(f"TP {r['world']} {r['B']:>4} x {r['prefix_len']:>6}  {r['label'][:70]:70s} γ {r['gamma']}  measured "
              f"{r['measured']:.3f}  then {r['predicted_then']:.3f} ({r['error_then']:+.1%})  now {now}")
    result = {"command": " ".join(["python benchmarks/repredict_atlas.py", *map(str, a.dirs), "--acceptance",
                                   str(a.acceptance), "--profile", str(a.profile)]),
              "summary": summary(rows), "candidates": rows}
    for k, s in result["summary"].items():
        print(f"{k}: within {WITHIN:.0%} then {s['within_then']}/{s['candidates']}, now {s['within_now']}/{s['candidates']}")
    files.write_json(a.output, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
