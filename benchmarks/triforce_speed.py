"""TriForce's runs on this engine, one GPU, random weights at Yarn-Llama-2-7b-128k's shapes (issue #24):

- `--parts on_chip` (an H200: the full cache at 124928 tokens is ~61 GiB): TriForce's headline command through
  tests/triforce_benchmark.py — the hierarchy (llama-68m's shapes over a 256-token StreamingLLM cache at the bottom,
  the target's weights over a 4096-token retrieval cache in the middle, gamma 6) — beside the same retrieval
  self-draft without the hierarchy and the baseline, each timed in turns with its baseline.
- `--parts offload` (an H100): the same shape at 130048 tokens with the target's cache on the host (TriForce's
  1 x RTX 4090 command: budget 8192, gamma 12), against the offloaded baseline, ms/token each, with the cost model's
  host-link-bound prediction.

Random weights accept nothing real, so acceptance is synthetic at `--alpha` (the target keeping the middle's tokens)
and `--alpha_bottom` (the middle keeping the bottom's), and the record says so. Greedy (synthetic acceptance takes
the target's argmax).

    python benchmarks/triforce_speed.py --parts on_chip --output results/triforce/on_chip.json
    python benchmarks/triforce_speed.py --parts offload --output results/triforce/offload.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402

import triforce_benchmark  # noqa: E402
from magicdec import benchmark as bench  # noqa: E402
from magicdec import cost_model as cm  # noqa: E402
from magicdec import runs  # noqa: E402
from magicdec.config import ModelArgs  # noqa: E402

MODEL, BOTTOM = "NousResearch/Yarn-Llama-2-7b-128k", "JackFram/llama-68m"


def summary(record: dict) -> dict:
    m = record["metrics"]
    keys = ("gamma", "alpha", "omega", "omega_effective", "T_D_over_T_T", "T_V_over_T_T", "measured_speedup",
            "measured_speedup_first_done", "ms_per_token", "ms_per_step", "decode_tokens_per_s", "peak_memory_GiB")
    out = {k: m.get(k) for k in keys}
    base = record.get("baseline_metrics") or {}
    out |= {"baseline_ms_per_token": base.get("ms_per_token"), "baseline_ms_per_step": base.get("ms_per_step"),
            "hierarchy": (m.get("speculation") or {}).get("hierarchy"), "offload": record.get("offload"),
            "environment": record["environment"]}
    return out


def run(method: str, argv: list[str], device: str) -> dict:
    rec = triforce_benchmark.run(argv) if method == "triforce" else runs.run(method, argv)
    bench.release_memory(torch.device(device))
    return rec


def overlap_probe(model_name: str, P: int, device: str, steps: int = 5) -> dict:
    """How much of the host-to-GPU copy an offloaded decode step hides behind compute: one step timed as it runs
    (copies overlapped), with the copies skipped (compute alone: the slots keep stale KV, the time is what counts),
    and the copies alone, all layers back to back. hidden_s = copy + compute - step: the overlap, where it exceeds
    the probe's run-to-run spread (at 128K on an H100 it did not: compute is 3% of the step, the spread ~4%)."""
    from magicdec.model import build_model
    from magicdec.offload import OffloadedCache

    c, dev = ModelArgs.from_name(model_name), torch.device(device)
    model = build_model(c, dev, torch.bfloat16, random_seed=0)
    cache = OffloadedCache(c.n_layers, 1, c.n_kv_heads, P + 8, c.head_dim, torch.bfloat16, dev, "triton"
                           if dev.type == "cuda" else "sdpa", 0, P)
    cache.fill_random(P, 0)
    token = torch.zeros(1, 1, dtype=torch.long, device=dev)

    def step_seconds():
        with torch.inference_mode():
            model(token, cache, logits="last")
            return bench.timed(lambda: [model(token, cache, logits="last") for _ in range(steps)], dev)[1] / steps

    step = step_seconds()
    real = OffloadedCache._prefetch
    OffloadedCache._prefetch = lambda self, layer: (self.fetched.__setitem__(layer % 2, layer),  # noqa: E731
                                                    self.ready[layer % 2] and self.ready[layer % 2].record())
    try:
        compute = step_seconds()
    finally:
        OffloadedCache._prefetch = real
    copy = bench.timed(lambda: [cache._prefetch(layer) for layer in range(c.n_layers)], dev)[1]
    return {"step_s": step, "compute_alone_s": compute, "copies_alone_s": copy,
            "hidden_s": copy + compute - step, "step_over_copies_alone": step / copy}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", nargs="+", choices=["on_chip", "offload"], required=True)
    p.add_argument("--alpha", type=float, default=0.9, help="synthetic: the target keeps each middle token")
    p.add_argument("--alpha_bottom", type=float, default=0.6, help="synthetic: the middle keeps each bottom token")
    p.add_argument("--gen_len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model_name", default=MODEL)
    p.add_argument("--prefill", type=int, default=None, help="default: 124928 on chip, 130048 offloaded")
    p.add_argument("--budget", type=int, default=None, help="default: 4096 on chip, 8192 offloaded (TriForce's)")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (no speed claim)")
    p.add_argument("--output", type=Path, required=True)
    a = p.parse_args(argv)
    graphs = ["--cuda_graphs"] if a.device == "cuda" else []
    common = ["--random_weights", "--model_name", a.model_name, "--skip_prefill", "--no_progress", "--device", a.device,
              "--gen_len", str(a.gen_len), "--repeats", str(a.repeats), "--temperature", "0", "--baseline"]
    rates = ["--synthetic_acceptance", str(a.alpha)]
    out = json.loads(a.output.read_text()) if a.output.exists() else {}
    out |= {"model": a.model_name, "random_weights": True,
            "acceptance": f"synthetic: target keeps middle tokens at {a.alpha}, middle keeps bottom tokens at "
                          f"{a.alpha_bottom}"}
    a.output.parent.mkdir(parents=True, exist_ok=True)

    def save(key, rec):
        out.setdefault(key[0], {})[key[1]] = summary(rec) | {"command": rec.get("args")}
        a.output.write_text(json.dumps(out, indent=1))
        s = out[key[0]][key[1]]
        print(f"{key[0]:8s} {key[1]:12s} ms/token {s['ms_per_token']:.2f} (baseline {s['baseline_ms_per_token']:.2f}) "
              f"speedup {s['measured_speedup']:.3f}", flush=True)

    if "on_chip" in a.parts:
        P = str(a.prefill or 124928)
        budget = str(a.budget or 4096)
        tri = ["--prefill", P, "--budget", budget, "--chunk_size", "8", "--gamma", "6", "--draft_name", BOTTOM]
        save(("on_chip", "hierarchy"), run("triforce", common + graphs + tri + rates +
                                           ["--synthetic_bottom", str(a.alpha_bottom)], a.device))
        save(("on_chip", "retrieval"), run("selfspec", common + graphs + rates + [
            "--prefix_len", P, "--draft_policy", "retrieval", "--draft_budget", budget, "--gamma", "6"], a.device))
    if "offload" in a.parts:
        P = a.prefill or 130048
        tri = ["--prefill", str(P), "--budget", str(a.budget or 8192), "--chunk_size", "8", "--gamma", "12",
               "--draft_name", BOTTOM,
               "--on_chip", "0"]
        rec = run("triforce", common + graphs + tri + rates + ["--synthetic_bottom", str(a.alpha_bottom)], a.device)
        save(("offload", "hierarchy"), rec)
        out["offload"]["overlap"] = overlap_probe(a.model_name, P, a.device)
        bench.release_memory(torch.device(a.device))
        a.output.write_text(json.dumps(out, indent=1))
        print("overlap:", out["offload"]["overlap"], flush=True)
        h2d = (rec.get("offload") or {}).get("host_to_device_GBps")
        if h2d:
            c = ModelArgs.from_name(a.model_name)
            d = cm.measure_device(a.device)
            out["offload"]["predicted_baseline_step_s"] = cm.offloaded_step_time(c, d, 1, P, 1, 0, h2d * 1e9, P)
            a.output.write_text(json.dumps(out, indent=1))
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
