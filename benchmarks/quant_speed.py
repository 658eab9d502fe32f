"""What a one-byte draft buys at a large model's shape, on one GPU (issue #23).

`--parts linears`: every linear of a Llama-3.1-8B layer and its LM head at the row counts a draft step multiplies
(M = B for a 1-token step, 2B for the re-feed, and 64), timed as bf16 `F.linear`, as the fused weight-only kernel
with int8 and with fp8 e4m3 weights (magicdec/quant.py), and as `torch._scaled_mm` with the activations quantized
per call (the FP8 route the issue measured at 0.77-0.80 of bf16); each beside its weight bytes over the measured copy
bandwidth. The fp8 kernel (which the CPU interpreter cannot run) is checked here against the torch-op reference.

`--parts e2e`: self-speculation at 32K x B with the draft's weights bf16 / int8 / fp8 (random weights, synthetic
acceptance: `--alphas`), each with its baseline timed in turns, T_D/T_T, T_V/T_T and the speedup beside the cost
model's prediction (which counts the copy's bytes).

    python benchmarks/quant_speed.py --parts linears e2e --output results/quant/speed_llama31_8b.json
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from magicdec import benchmark as bench  # noqa: E402
from magicdec import cost_model as cm  # noqa: E402
from magicdec import quant, runs  # noqa: E402
from magicdec.config import ModelArgs  # noqa: E402
import triton.testing  # noqa: E402


def linear_shapes(c: ModelArgs) -> dict[str, tuple[int, int]]:
    """(N, K) of each matrix a step reads, as the model holds them (q/k/v fused)."""
    h, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    return {"wqkv": (h + 2 * kv, c.dim), "wo": (c.dim, h), "w1 (gate)": (c.intermediate_size, c.dim),
            "w3 (up)": (c.intermediate_size, c.dim), "w2 (down)": (c.dim, c.intermediate_size),
            "output (LM head)": (c.vocab_size, c.dim)}


def scaled_mm(x, q8, w_scale):
    """FP8 through cuBLAS: the activations quantized per row on every call, then torch._scaled_mm."""
    x_scale = (x.abs().amax(1, keepdim=True).float() / 448.0).clamp(min=1e-12)
    xq = (x / x_scale).to(torch.float8_e4m3fn)
    return torch._scaled_mm(xq, q8.t(), scale_a=x_scale, scale_b=w_scale[None, :], out_dtype=torch.bfloat16)


def time_linears(c: ModelArgs, ms: list[int], copy_bw: float, device) -> dict:
    out = {}
    for name, (N, K) in linear_shapes(c).items():
        w = torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02
        q8, s8 = quant.quantize(w, "int8")
        qf, sf = quant.quantize(w, "fp8")
        for M in ms:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            ref = {fmt: quant.weight_only_linear(x, q, s, kernel=False).float() for fmt, q, s in
                   (("int8", q8, s8), ("fp8", qf, sf))}
            err = {fmt: float((quant.weight_only_linear(x, q, s).float() - ref[fmt]).abs().max() /
                              ref[fmt].abs().max()) for fmt, q, s in (("int8", q8, s8), ("fp8", qf, sf))}
            row = {"N": N, "K": K, "M": M, "kernel_vs_reference_rel_err": err}
            for label, fn, nbytes in (
                    ("bf16 F.linear", lambda: F.linear(x, w), 2 * N * K),
                    ("int8 weight-only", lambda: quant.weight_only_linear(x, q8, s8), N * K + 4 * N),
                    ("fp8 weight-only", lambda: quant.weight_only_linear(x, qf, sf), N * K + 4 * N),
                    ("fp8 _scaled_mm", lambda: scaled_mm(x, qf, sf), N * K + 4 * N)):
                try:  # inside a CUDA graph, as a draft step runs: Triton's host-side launch (~50 us) is not timed
                    fn()  # autotuning, before any capture
                    s = triton.testing.do_bench_cudagraph(fn, rep=50) / 1e3
                    row[label] = {"us": s * 1e6, "fraction_of_copy": nbytes / s / copy_bw}
                except Exception as e:  # _scaled_mm's shape rules: recorded, not fatal
                    row[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            out[f"{name} M={M}"] = row
            print(f"{name:18s} M={M:3d} " + " ".join(
                f"{k}: {v['us']:7.1f} us ({v['fraction_of_copy']:.2f})" if "us" in v else f"{k}: failed"
                for k, v in row.items() if isinstance(v, dict) and ("us" in v or "error" in v)), flush=True)
    per_step = {}  # one draft step's linears: every layer's once plus the head, at M = B
    for label in ("bf16 F.linear", "int8 weight-only", "fp8 weight-only", "fp8 _scaled_mm"):
        rows = [out[f"{n} M={ms[0]}"][label] for n in linear_shapes(c)]
        if all("us" in r for r in rows):
            layer = sum(r["us"] for r in rows[:-1])
            per_step[label] = {"us": c.n_layers * layer + rows[-1]["us"]}
    for label, v in per_step.items():
        v["vs_bf16"] = v["us"] / per_step["bf16 F.linear"]["us"]
    return {"per_linear": out, "per_step_at_M": ms[0], "per_step": per_step}


def e2e(a, config: ModelArgs, device: cm.Device) -> dict:
    out = {}
    for alpha in a.alphas:
        for weights in a.weights:
            argv = ["--model_name", a.model_name, *common(a), "--gen_len", str(a.gen_len), "--repeats", str(a.repeats), "--B", str(a.B),
                    "--prefix_len", str(a.prefix_len), "--draft_budget", str(a.budget), "--sinks", "16",
                    "--gamma", *map(str, a.gammas), "--synthetic_acceptance", str(alpha), "--baseline",
                    "--draft_weights", weights]
            rec = runs.run("selfspec", argv)
            bench.release_memory(torch.device(a.device))
            m = rec["metrics"]
            q = quant.copy_bytes(config) if weights != "bf16" else None
            slots = a.budget + runs.slots_beyond_budget("streaming", a.gen_len, max(a.gammas))
            p = cm.predict(config, device, a.B, a.prefix_len + a.gen_len // 2, m["gamma"], m["alpha"], slots,
                           draft_weights=q)
            row = {k: m.get(k) for k in ("gamma", "alpha", "omega", "T_D_over_T_T", "T_V_over_T_T", "measured_speedup",
                                         "measured_speedup_first_done", "ms_per_step", "peak_memory_GiB")}
            row |= {"baseline_ms_per_step": rec["baseline_metrics"]["ms_per_step"], "draft_weights": rec["draft_weights"],
                    "per_gamma": {g: {k: gm.get(k) for k in ("T_D_over_T_T", "T_V_over_T_T", "measured_speedup",
                                                           "measured_speedup_first_done")}
                                  for g, gm in (rec.get("gamma_sweep") or {str(m["gamma"]): m}).items()},
                    "predicted": {k: p[k] for k in ("T_D_over_T_T", "T_V_over_T_T", "speedup")},
                    "environment": rec["environment"]}
            out[f"{weights} alpha={alpha}"] = row
            print(f"{weights:5s} alpha {alpha}: gamma {row['gamma']} T_D/T_T {row['T_D_over_T_T']:.3f} "
                  f"(model {p['T_D_over_T_T']:.3f}) T_V/T_T {row['T_V_over_T_T']:.3f} speedup "
                  f"{row['measured_speedup']:.3f} (model {p['speedup']:.3f}) first done "
                  f"{row['measured_speedup_first_done']:.3f}", flush=True)
            yield out


KERNEL_GROUPS = (("matmul (weight-only kernel)", ("_weight_only_kernel",)),
                 ("matmul (cuBLAS)", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "splitk")),
                 ("attention", ("attn", "attention", "_decode")),
                 ("norm / RoPE / SwiGLU (fused)", ("triton_",)))


def kernel_group(name: str) -> str:
    low = name.lower()
    return next((g for g, keys in KERNEL_GROUPS if any(k in low for k in keys)), "other")


def profile_steps(a, config: ModelArgs, copy_bw: float, dev, steps: int = 10) -> dict:
    """Where a draft step's time goes (issue #23, item 3): one decode step of the draft (the target's weights, or
    their int8 copy, over a StreamingLLM ring of the run's budget) and one of the target (its full cache), each at
    B x prefix_len over random KV, under torch.profiler: every GPU kernel's time per step, by kernel and by group
    (matmuls, attention, the fused elementwise kernels, the rest), beside the weight and KV bytes over the copy
    bandwidth. Eager launches: the kernels' own times, which a CUDA graph replays back to back."""
    from torch.profiler import ProfilerActivity, profile

    from magicdec.kv_cache import KVCache, StreamingCache
    from magicdec.model import build_model

    c, cuda = config, dev.type == "cuda"
    backend, sync = ("triton", torch.cuda.synchronize) if cuda else ("sdpa", lambda d: None)
    model = build_model(c, dev, torch.bfloat16, random_seed=0)
    ring_extra = runs.ring_extra_for(a.gen_len, max(a.gammas))
    kv_token = 2 * c.n_layers * c.n_kv_heads * c.head_dim * 2  # K and V, bf16, every layer
    weight_bytes = 2 * sum(p.numel() for n, p in model.named_parameters() if "tok_embeddings" not in n)
    out = {}
    for label, fmt, budget in (("draft bf16", "bf16", a.budget), ("draft int8", "int8", a.budget),
                               ("target", "bf16", 0)):
        net = model if fmt == "bf16" else quant.quantized_copy(model, fmt)
        if budget:
            cache = StreamingCache(c.n_layers, a.B, c.n_kv_heads, budget, 16, ring_extra, c.head_dim, torch.bfloat16,
                                   dev, backend)
            slots = budget + ring_extra
        else:
            cache = KVCache(c.n_layers, a.B, c.n_kv_heads, a.prefix_len + 64, c.head_dim, torch.bfloat16, dev,
                            backend)
            slots = a.prefix_len
        cache.fill_random(a.prefix_len, 0)
        token = torch.zeros(a.B, 1, dtype=torch.long, device=dev)
        with torch.inference_mode():
            for _ in range(3):
                net(token, cache, logits="last")
            sync(dev)
            with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    net(token, cache, logits="last")
                sync(dev)
        kernels = {}
        for e in prof.key_averages():
            us = e.device_time_total if cuda else e.self_cpu_time_total  # CPU: a smoke test, ops not kernels
            if us > 0 and e.count:
                kernels[e.key] = {"us_per_step": us / steps, "calls_per_step": e.count / steps,
                                  "group": kernel_group(e.key)}
        groups = {}
        for k in kernels.values():
            g = groups.setdefault(k["group"], {"us_per_step": 0.0, "calls_per_step": 0.0})
            g["us_per_step"] += k["us_per_step"]
            g["calls_per_step"] += k["calls_per_step"]
        wbytes = weight_bytes if fmt == "bf16" else quant.copy_bytes(c)
        row = {"kernel_us_per_step": sum(k["us_per_step"] for k in kernels.values()), "groups": groups,
               "weights_at_copy_us": wbytes / copy_bw * 1e6,
               "kv_at_copy_us": a.B * slots * kv_token / copy_bw * 1e6,
               "top_kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us_per_step"])[:15])}
        out[label] = row
        print(f"{label}: {row['kernel_us_per_step']:.0f} us of kernels per step; weights at copy bandwidth "
              f"{row['weights_at_copy_us']:.0f} us, KV {row['kv_at_copy_us']:.0f} us", flush=True)
        for g, v in sorted(groups.items(), key=lambda kv: -kv[1]["us_per_step"]):
            print(f"   {g:32s} {v['us_per_step']:8.0f} us  {v['calls_per_step']:6.0f} kernels", flush=True)
        net = cache = None
        bench.release_memory(dev)
    return out


def common(a) -> list[str]:
    graphs = ["--cuda_graphs"] if a.device == "cuda" else []
    return ["--random_weights", "--skip_prefill", *graphs, "--no_progress", "--device", a.device]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_name", default="meta-llama/Meta-Llama-3.1-8B")
    p.add_argument("--parts", nargs="+", choices=["linears", "e2e", "profile"],
                   default=["linears", "e2e"], help="profile: where a draft step's time goes, kernel by kernel (GPU)")
    p.add_argument("--M", type=int, nargs="+", default=[13, 26, 64], help="rows multiplied (first: the per-step sum)")
    p.add_argument("--prefix_len", type=int, default=32768)
    p.add_argument("--B", type=int, default=11, help="the largest batch one H100 holds at 32K with an int8 copy")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--gammas", type=int, nargs="+", default=[2, 3, 4, 5])
    p.add_argument("--gen_len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--alphas", type=float, nargs="+", default=[0.8])
    p.add_argument("--weights", nargs="+", choices=["bf16", "int8", "fp8"], default=["bf16", "int8", "fp8"])
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (no speed claim)")
    p.add_argument("--output", type=Path, required=True)
    a = p.parse_args(argv)
    config = ModelArgs.from_name(a.model_name)
    dev = torch.device(a.device)
    result = json.loads(a.output.read_text()) if a.output.exists() else {}  # parts of one measurement merge
    result["command"] = result.get("command", []) + ["python benchmarks/quant_speed.py " + " ".join(
        argv if argv is not None else sys.argv[1:])]
    result |= {"model": a.model_name, "random_weights": True, "environment": bench.environment(dev)}
    device = cm.measure_device(dev)
    probe = runs.run("baseline", ["--model_name", a.model_name, *common(a), "--B", "1", "--prefix_len", "256", "--gen_len",
                                  "32", "--repeats", "3"])
    bench.release_memory(dev)
    device = replace(device, layer_overhead_s=cm.fit_layer_overhead(config, device, 1, 256 + 16,
                                                                     probe["metrics"]["ms_per_step"] / 1e3))
    result["device_model"] = vars(device)
    a.output.parent.mkdir(parents=True, exist_ok=True)
    if "linears" in a.parts:
        with torch.inference_mode():
            result["linears"] = time_linears(config, a.M, device.bandwidth, dev)
        a.output.write_text(json.dumps(result, indent=1))
        bench.release_memory(dev)  # the e2e runs check what is free
    if "profile" in a.parts:
        result["profile"] = profile_steps(a, config, device.bandwidth, dev)
        a.output.write_text(json.dumps(result, indent=1))
    if "e2e" in a.parts:
        result["e2e_setup"] = {"prefix_len": a.prefix_len, "B": a.B, "budget": a.budget, "gammas": a.gammas,
                               "gen_len": a.gen_len, "acceptance": "synthetic (random weights)"}
        result.setdefault("e2e", {})
        for got in e2e(a, config, device):
            result["e2e"].update(got)
            a.output.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
