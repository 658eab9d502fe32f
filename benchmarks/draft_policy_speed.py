"""What each draft-cache policy costs and buys at a large model's shape, on one GPU: for StreamingLLM, SnapKV and
TriForce's retrieval cache (self-speculation, random weights at Llama-3.1-8B's shapes, random KV in place of a
prefill), the selection's time once, T_D/T_T, T_V/T_T and the measured speedup (every sequence to gen_len, and
first done), each beside the cost model's prediction. Random weights accept nothing real: each policy's acceptance
is simulated at the rate it reached on SmolLM2-135M (real weights, Gutenberg, sampled at T 0.6 / top-p 0.9) at 8K
and the same budget (results/draft_policies/smollm2.json): an acceptance borrowed from a small model, and the record
says so. `--parts standalone` is a standalone draft beyond its trained context: LLaMA-2-7B-32K drafted by TinyLlama-1.1B
(2K context) at 16K with --reindex, and the same run with absolute positions (random weights run either).

    python benchmarks/draft_policy_speed.py --output results/draft_policies/speed_llama31_8b.json --parts policies
    python benchmarks/draft_policy_speed.py --output results/draft_policies/speed_standalone.json --parts standalone
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from magicdec import benchmark as bench  # noqa: E402
from magicdec import cost_model as cm  # noqa: E402
from magicdec import runs  # noqa: E402
from magicdec.config import ModelArgs  # noqa: E402
from magicdec.draft_cache import POLICIES, WINDOW  # noqa: E402


def borrowed_alpha(path: Path, prefix: int, budget: int, mode: str = "sampled") -> dict[str, float]:
    """Each policy's generation acceptance in `path` (benchmarks/draft_policies.py's output) at this prefix and
    budget: kept over examined drafted tokens, summed over its batches."""
    rows = json.loads(path.read_text())["rows"]
    out = {}
    for policy in POLICIES:
        cells = [r for r in rows if r["policy"] == policy and r["prefix_len"] == prefix and r["budget"] == budget]
        if not cells:
            raise SystemExit(f"{path} has no {policy} rows at prefix {prefix}, budget {budget}")
        out[policy] = sum(r[mode]["kept"] for r in cells) / sum(r[mode]["examined"] for r in cells)
    return out


def common(a) -> list[str]:
    graphs = ["--cuda_graphs"] if a.device == "cuda" else []
    return ["--random_weights", "--skip_prefill", *graphs, "--no_progress", "--device", a.device, "--gen_len",
            str(a.gen_len), "--repeats", str(a.repeats)]


def device_model(a, config: ModelArgs) -> cm.Device:
    """The measured device (copy bandwidth, matmul rate) with its fixed cost per layer fitted to a plain B = 1 step
    over 256 cached tokens, as the sweeps fit it: a point far from the ones predicted."""
    device = cm.measure_device(a.device)
    probe = run("baseline", ["--model_name", a.model_name, *common(a), "--B", "1", "--prefix_len", "256",
                                  "--gen_len", "32", "--repeats", "3"], a.device)
    step_s = probe["metrics"]["ms_per_step"] / 1e3
    return replace(device, layer_overhead_s=cm.fit_layer_overhead(config, device, 1, 256 + 16, step_s))


def run(method: str, argv: list[str], device: str) -> dict:
    """One run in this process, its model, caches and CUDA graphs freed before the next one measures free memory."""
    record = runs.run(method, argv)
    bench.release_memory(__import__("torch").device(device))
    return record


def time_selections(a, config: ModelArgs, device: cm.Device) -> dict:
    """Each selection policy's build alone, 3 times, on a random prompt KV of the run's shape and random queries
    (the selection's cost does not depend on the values): the first call pays kernel loading, the later ones are
    what the cost model predicts."""
    import torch

    from magicdec.draft_cache import build, policy_for
    from magicdec.kv_cache import KVCache

    c, dev = config, torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cache = KVCache(c.n_layers, a.B, c.n_kv_heads, a.prefix_len, c.head_dim, dtype, dev, "sdpa")
    cache.fill_random(a.prefix_len, 0)
    gen = torch.Generator(device=dev).manual_seed(1)
    queries = [torch.randn(a.B, c.n_heads, WINDOW, c.head_dim, generator=gen, device=dev, dtype=dtype)
               for _ in range(c.n_layers)]
    out = {}
    for name in ("snapkv", "retrieval"):
        policy = policy_for(name, a.budget)
        seconds = []
        for _ in range(3):
            built, s = bench.timed(lambda: build(policy, cache, queries, runs.appended_for(a.gen_len, max(a.gammas))),
                                   dev)
            seconds.append(s)
            del built
        out[name] = {"seconds": seconds, "predicted_s": cm.selection_seconds(c, device, a.B, a.prefix_len, name, WINDOW)}
        print(f"{name} selection: {', '.join(f'{x:.3f}' for x in seconds)} s; cost model {out[name]['predicted_s']:.3f} s")
    cache = queries = None  # freed before the next part allocates
    bench.release_memory(dev)
    return out


def summary(record: dict) -> dict:
    m = record["metrics"]
    keys = ("gamma", "alpha", "omega", "omega_effective", "T_D_over_T_T", "T_V_over_T_T", "measured_speedup",
            "measured_speedup_first_done", "draft_prefill_s", "ms_per_step", "decode_tokens_per_s", "peak_memory_GiB")
    out = {k: m.get(k) for k in keys}
    out["baseline_ms_per_step"] = record["baseline_metrics"]["ms_per_step"]
    out["per_gamma"] = {g: {k: gm.get(k) for k in ("alpha", "T_D_over_T_T", "T_V_over_T_T", "measured_speedup",
                                                 "measured_speedup_first_done")}
                        for g, gm in (record.get("gamma_sweep") or {str(m["gamma"]): m}).items()}
    return out


def predicted(config, device, a, policy, gamma, alpha) -> dict:
    """The cost model at this point: the draft reads every slot of its cache (masked or not): StreamingLLM its
    budget plus the ring's spare slots, a selected cache its budget plus every position generation appends."""
    slots = a.budget + runs.slots_beyond_budget(policy, a.gen_len, max(a.gammas))
    p = cm.predict(config, device, a.B, a.prefix_len + a.gen_len // 2, gamma, alpha, slots)
    return {k: p[k] for k in ("T_D_over_T_T", "T_V_over_T_T", "speedup")} | {"draft_slots_read": slots}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_name", default="meta-llama/Meta-Llama-3.1-8B")
    p.add_argument("--prefix_len", type=int, default=32768)
    p.add_argument("--B", type=int, default=13, help="the largest batch one H100 holds at 32K with a 512 draft")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--gammas", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--gen_len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--alpha_from", type=Path, default=REPO / "results" / "draft_policies" / "smollm2.json")
    p.add_argument("--alpha_prefix", type=int, default=8000)
    p.add_argument("--parts", nargs="+", choices=["policies", "selection", "standalone"],
                   default=["policies", "selection", "standalone"],
                   help="policies: the timed runs; selection: each selection alone, timed 3 times on random KV; "
                        "standalone: LLaMA-2-7B-32K + TinyLlama at 16K, with --reindex and without")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                   help="which policies' runs (one process each keeps every run's free memory alike)")
    p.add_argument("--refresh", type=int, default=None, metavar="N",
                   help="snapkv / retrieval runs re-select every N verifications (recorded as POLICY_refreshN)")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (no speed claim)")
    p.add_argument("--output", type=Path, required=True)
    a = p.parse_args(argv)
    config = ModelArgs.from_name(a.model_name)
    alphas = borrowed_alpha(a.alpha_from, a.alpha_prefix, a.budget)
    device = device_model(a, config) if {"policies", "selection"} & set(a.parts) else None
    out = {"command": "python benchmarks/draft_policy_speed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "model": a.model_name, "random_weights": True, "prefix_len": a.prefix_len, "B": a.B, "budget": a.budget,
           "gammas": a.gammas, "gen_len": a.gen_len,
           "synthetic_acceptance": {k: round(v, 4) for k, v in alphas.items()},
           "acceptance_source": f"borrowed: SmolLM2-135M real weights, Gutenberg, prefix {a.alpha_prefix}, budget "
                                f"{a.budget}, sampled T 0.6 / top-p 0.9 generation alpha ({a.alpha_from.name})",
           "device_model": device and vars(device), "policies": {}}
    if a.output.exists():  # another part, or other policies, of the same measurement: merged
        old = json.loads(a.output.read_text())
        out = old | {k: v for k, v in out.items() if k not in ("policies", "device_model")}
        out["device_model"] = out.get("device_model") or (device and vars(device))
    if "selection" in a.parts:
        out["selection"] = time_selections(a, config, device)
        a.output.parent.mkdir(parents=True, exist_ok=True)
        a.output.write_text(json.dumps(out, indent=1))
    for policy in a.policies if "policies" in a.parts else []:
        argv_p = ["--model_name", a.model_name, *common(a), "--B", str(a.B), "--prefix_len", str(a.prefix_len),
                  "--draft_policy", policy, "--draft_budget", str(a.budget), "--gamma", *map(str, a.gammas),
                  "--synthetic_acceptance", str(round(alphas[policy], 4)), "--baseline"]
        if policy == "streaming":
            argv_p += ["--sinks", "16"]
        label = policy
        if a.refresh and policy != "streaming":
            argv_p += ["--refresh", str(a.refresh)]
            label = f"{policy}_refresh{a.refresh}"
        rec = run("selfspec", argv_p, a.device)
        got = summary(rec)
        got["predicted"] = predicted(config, device, a, policy, got["gamma"], got["alpha"])
        if policy != "streaming":
            got["predicted"]["selection_s"] = cm.selection_seconds(config, device, a.B, a.prefix_len, policy, WINDOW)
            context = a.prefix_len + runs.appended_for(a.gen_len, max(a.gammas))  # the target cache's slots
            got["predicted"]["refresh_s"] = cm.refresh_seconds(config, device, a.B, context, policy)
        got["environment"] = rec["environment"]
        got["time_split_s"] = rec["metrics"].get("time_split_s")
        got["iterations"] = rec["metrics"].get("iterations")
        got["draft_cache"] = rec["draft_cache"]
        out["policies"][label] = got
        a.output.parent.mkdir(parents=True, exist_ok=True)
        a.output.write_text(json.dumps(out, indent=1))
    if "standalone" in a.parts:
        out["standalone"] = {}
        for reindex in (True, False):
            argv_s = ["--model_name", "togethercomputer/LLaMA-2-7B-32K", "--draft_name", "TinyLlama/TinyLlama_v1.1",
                      *common(a), "--B", "6", "--prefix_len", "16384", "--streamingllm_budget", str(a.budget),
                      "--sinks", "16", "--gamma", *map(str, a.gammas), "--synthetic_acceptance", "0.7", "--baseline"]
            rec = run("longspec", argv_s + (["--reindex"] if reindex else []), a.device)
            out["standalone"]["reindex" if reindex else "absolute"] = summary(rec) | {"draft_cache": rec["draft_cache"]}
            a.output.write_text(json.dumps(out, indent=1))
    print(f"\n{'policy':18s} {'alpha':>6s} {'gamma':>5s} {'select s':>14s} {'T_D/T_T':>15s} {'T_V/T_T':>15s} "
          f"{'speedup':>15s} {'first done':>10s}   (measured / cost model)")
    for policy, g in out["policies"].items():
        pr = g["predicted"]
        sel = f"{g['draft_prefill_s'] or 0:.3f} / {pr.get('selection_s', 0):.3f}" if policy != "streaming" else "-"
        print(f"{policy:18s} {g['alpha']:6.3f} {g['gamma']:5d} {sel:>14s} {g['T_D_over_T_T']:.3f} / "
              f"{pr['T_D_over_T_T']:.3f} {g['T_V_over_T_T']:.3f} / {pr['T_V_over_T_T']:.3f} "
              f"{g['measured_speedup']:.3f} / {pr['speedup']:.3f} {g['measured_speedup_first_done'] or 0:10.3f}")
    for k, g in out.get("standalone", {}).items():
        print(f"standalone {k}: speedup {g['measured_speedup']:.3f} (first done {g['measured_speedup_first_done'] or 0:.3f}), "
              f"T_D/T_T {g['T_D_over_T_T']:.3f}, alpha {g['alpha']:.3f}")
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
