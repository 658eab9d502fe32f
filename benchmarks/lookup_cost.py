"""Where a prompt-lookup verification's time goes on a GPU (issue #23): at SmolLM2-135M's shape (random weights: the
speed does not depend on them), the lookup's proposal alone (`propose_ngram` over the prompt and output, eager, with
and without the host read of its length that sizes the verification), then whole lookup and self-speculation runs
beside a baseline, each verification's seconds split into proposing, verifying and the loop's own work (the
record's time_s), per verification.

    python benchmarks/lookup_cost.py --output results/lookup/cost_smollm2_shape.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from magicdec import benchmark as bench  # noqa: E402
from magicdec import runs  # noqa: E402
from magicdec.lookup import propose_ngram  # noqa: E402


def time_proposal(B: int, L: int, gamma: int, ngram_max: int, dev, calls: int = 200) -> dict:
    gen = torch.Generator(device=dev).manual_seed(0)
    ctx = torch.randint(0, 1000, (B, L), generator=gen, device=dev)
    length = torch.full((B,), L - 8, device=dev)
    out = {}
    for label, read in (("propose_ngram", False), ("propose_ngram + host read", True)):
        def fn():
            tokens, proposed = propose_ngram(ctx, length, gamma, ngram_max)
            return int(proposed.max()) if read else tokens
        fn()
        out[label + " ms"] = bench.timed(lambda: [fn() for _ in range(calls)], dev)[1] / calls * 1e3
    return out


def per_verification(record: dict) -> dict:
    s = record["metrics"]["speculation"]
    n = s["verifications"] or 1
    return {"verifications": s["verifications"], "tokens_per_verification": record["metrics"].get("omega_effective"),
            "ms_per_verification": {k: v / n * 1e3 for k, v in (s["time_s"] or {}).items()},
            "decode_tokens_per_s": record["metrics"]["decode_tokens_per_s"],
            "baseline_ms_per_step": record["baseline_metrics"]["ms_per_step"],
            "measured_speedup": record["metrics"].get("measured_speedup")}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_name", default="HuggingFaceTB/SmolLM2-135M")
    p.add_argument("--prefix_len", type=int, default=4096)
    p.add_argument("--B", type=int, nargs="+", default=[1, 8])
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--gen_len", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--output", type=Path, required=True)
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    out = {"model": a.model_name, "random_weights": True, "prefix_len": a.prefix_len, "gamma": a.gamma,
           "environment": bench.environment(dev), "rows": []}
    graphs = ["--cuda_graphs"] if dev.type == "cuda" else []
    for B in a.B:
        row = {"B": B} | time_proposal(B, a.prefix_len + a.gen_len, a.gamma, 3, dev)
        for method, extra in (("lookup", []), ("selfspec", ["--draft_budget", "512"])):
            rec = runs.run(method, ["--random_weights", "--model_name", a.model_name, "--B", str(B), "--prefix_len",
                                    str(a.prefix_len), "--gen_len", str(a.gen_len), "--gamma", str(a.gamma),
                                    "--baseline", "--repeats", "3", "--no_progress", "--device", a.device, *graphs,
                                    *extra])
            bench.release_memory(dev)
            row[method] = per_verification(rec)
        out["rows"].append(row)
        a.output.parent.mkdir(parents=True, exist_ok=True)
        a.output.write_text(json.dumps(out, indent=1))
        print(json.dumps(row, indent=1), flush=True)
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
