"""Before against after, for a change that must not change speed: the same `magicdec run` (the baseline and a drafter
timed in turns) launched from two checkouts of the package, in alternating rounds on one machine.

Each round runs every point once with each checkout, which one goes first alternating by round, each as its own
process (a point's KV cache does not fit twice on one GPU). Per point the figures are the medians of the rounds' own
after/before ratios, with their min-max: decode tokens/s of the speculation (all reach, first done) and of the
baseline, and the speedup. Both checkouts must also accept the same number of drafted tokens (same seeds, same
synthetic draws): a difference there is a change in behaviour, not in speed, and the record says so.

    python benchmarks/before_after.py --before OLD_CHECKOUT --after . --rounds 3 --output before_after.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from magicdec import files  # noqa: E402
from magicdec.errors import MagicDecError  # noqa: E402

LLAMA = "--random_weights --model_name meta-llama/Meta-Llama-3.1-8B --step_mode cuda_graphs --skip_prefill --baseline"
SMOLLM = "--random_weights --model_name HuggingFaceTB/SmolLM2-135M --step_mode cuda_graphs --skip_prefill --baseline"
# The points the forward-plan restructuring had to keep: a self-draft chain, a self-draft token tree, a trained-head
# family (a fresh EAGLE head: its acceptance synthetic, its forward and feature taps the real ones)
POINTS = {
    "selfspec_32k_b13": f"{LLAMA} --drafter selfspec --B 13 --prefix_len 32768 --gen_len 64 --gamma 3 "
                        "--draft_budget 512 --synthetic_acceptance 0.8",
    "tree_100k_b1": f"{LLAMA} --drafter selfspec --B 1 --prefix_len 100000 --gen_len 64 --gamma 5 --tree_width 2 "
                    "--draft_budget 512 --synthetic_acceptance 0.85 --synthetic_siblings 0.61 0.64",
    "eagle_smollm2_8000_b8": f"{SMOLLM} --drafter eagle --B 8 --prefix_len 8000 --gen_len 128 --gamma 3 "
                             "--synthetic_acceptance 0.6",
}
READ = {  # figure -> path in a run record
    "speculation_tokens_per_s": ("metrics", "decode_tokens_per_s"),
    "speculation_tokens_per_s_first_done": ("metrics", "decode_tokens_per_s_first_done"),
    "baseline_tokens_per_s": ("baseline_metrics", "decode_tokens_per_s"),
    "speedup": ("metrics", "measured_speedup"),
    "speedup_first_done": ("metrics", "measured_speedup_first_done"),
    "accepted_tokens": ("metrics", "speculation", "accepted_tokens"),
}


def read(record: dict, path: tuple):
    for key in path:
        record = record.get(key) if isinstance(record, dict) else None
    return record


def run_once(checkout: Path, args: str, out: Path, timeout: float) -> dict:
    """One `magicdec run` of `checkout`'s package (its folder first on the path: `python -m` puts the working
    folder there, so the process runs inside the checkout)."""
    cmd = [sys.executable, "-m", "magicdec", "run", *args.split(), "--repeats", "1", "--no_progress",
           "--output", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise MagicDecError(f"{checkout}: magicdec run failed ({done.returncode}): {' | '.join(tail)}")
    record = json.loads(out.read_text())
    got = {name: read(record, path) for name, path in READ.items()}
    got["process_s"] = time.perf_counter() - start
    got["gpu"] = read(record, ("environment", "gpu"))
    return got


def summary(rounds: list[dict]) -> dict:
    """Per figure, `NAME_ratio`: the rounds' own after/before ratios (`per_round`), their median and min-max."""
    out = {}
    for name in READ:
        if name == "accepted_tokens":
            continue
        ratios = [r["after"][name] / r["before"][name] for r in rounds
                  if r["after"].get(name) and r["before"].get(name)]
        if ratios:
            out[f"{name}_ratio"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                                    "per_round": ratios}
    out["same_acceptance"] = all(r["after"]["accepted_tokens"] == r["before"]["accepted_tokens"] for r in rounds)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, required=True, help="checkout holding the package before the change")
    p.add_argument("--after", type=Path, default=ROOT, help="checkout after it (default: this one)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--points", nargs="+", default=list(POINTS),
                   help=f"of {', '.join(POINTS)}, or NAME='RUN OPTIONS' for another point")
    p.add_argument("--timeout", type=float, default=300, help="seconds one run may take")
    p.add_argument("--output", type=Path, required=True)
    a = p.parse_args(argv)
    try:
        for side in (a.before, a.after):
            if not (side / "magicdec" / "__main__.py").is_file():
                raise MagicDecError(f"{side} holds no magicdec package: pass a checkout's root")
        points = dict(POINTS)
        points.update(n.split("=", 1) for n in a.points if "=" in n)
        a.points = [n.split("=", 1)[0] for n in a.points]
        unknown = [n for n in a.points if n not in points]
        if unknown:
            raise MagicDecError(f"unknown point {unknown[0]}: choose from {', '.join(POINTS)}, or give NAME='OPTIONS'")
        if a.rounds < 3:
            raise MagicDecError(f"--rounds {a.rounds}: a ratio needs at least 3 rounds")
        record = {"before": str(a.before.resolve()), "after": str(a.after.resolve()), "points": {},
                  "command": {n: points[n] for n in a.points}, "rounds": a.rounds}
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(a.rounds):
                for name in a.points:
                    order = ("before", "after") if r % 2 == 0 else ("after", "before")
                    got = {side: run_once(getattr(a, side).resolve(), points[name], Path(tmp) / f"{side}.json",
                                          a.timeout) for side in order}
                    got["first"] = order[0]
                    point = record["points"].setdefault(name, {"rounds": []})
                    point["rounds"].append(got)
                    point["summary"] = summary(point["rounds"])
                    s = point["summary"]
                    print(f"round {r} {name}: after/before speculation "
                          f"{s['speculation_tokens_per_s_ratio']['per_round'][-1]:.4f}, baseline "
                          f"{s['baseline_tokens_per_s_ratio']['per_round'][-1]:.4f}, same acceptance "
                          f"{s['same_acceptance']}", flush=True)
                    files.write_json(a.output, record, "the before/after record")
    except MagicDecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
