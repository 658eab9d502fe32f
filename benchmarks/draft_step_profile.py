"""Where a self-draft's decode step spends its time, kernel by kernel, beside the target's step, on one GPU (issue #23).

Self-speculation's draft is the target's own layers (bf16) over a StreamingLLM ring of --budget slots (plus the
spare slots a run's ring holds for what generation writes ahead: --gen_len and the largest of --gammas), the
target the same layers over its full --prefix_len cache. One decode step of each, at B x prefix_len over random KV
and random weights, runs under torch.profiler: every GPU kernel's time per step, by kernel and by group (matmuls,
attention, the fused RMSNorm/RoPE/SwiGLU kernels, the rest), beside the step's weight and KV bytes over the copy
bandwidth measured here (cost_model.measure_device). That says how far a draft step is from its byte limit and what
the remainder is: the floor on T_D/T_T, and so on the speedup, that weights and KV alone do not explain. The profile
launches eagerly (the kernels' own times); each step is then also timed as the runs time it, replayed in one CUDA
graph (`graphed_step_us`, and `bytes_over_step`: the byte limit over that time). The fused kernels (fused.py) are on,
as in every benchmark. `--attention_sweep` also times the split-KV kernel alone over block sizes and split counts.
`--device cpu --model_name JackFram/llama-68m --prefix_len 2048 --B 2` is a smoke test of the script (CPU ops, not kernels: no speed claim).

    python benchmarks/draft_step_profile.py --attention_sweep --output results/quant/draft_step_profile.json
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
from magicdec import cost_model as cm  # noqa: E402
from magicdec import fused  # noqa: E402
from magicdec import runs  # noqa: E402
from magicdec.config import ModelArgs  # noqa: E402

KERNEL_GROUPS = (("matmul (cuBLAS)", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "splitk")),
                 ("attention", ("attn", "attention", "_decode", "split_kv")),  # split_kv: magicdec's Triton kernel
                 # fused.py's ops: Inductor's kernels (triton_*) and the hand-written row-wise reductions
                 ("norm / RoPE / SwiGLU / KV store / merge (fused)", ("triton_", "_add_rms_norm", "_merge_kernel")))


def kernel_group(name: str) -> str:
    low = name.lower()
    return next((g for g, keys in KERNEL_GROUPS if any(k in low for k in keys)), "other")


def profile_steps(a, config: ModelArgs, copy_bw: float, dev, steps: int = 10) -> dict:
    """One decode step of the draft (the target's weights over a StreamingLLM ring of the run's budget) and one of
    the target (its full cache), each at B x prefix_len over random KV, `steps` times under torch.profiler: every
    kernel's time per step, by kernel and by group, beside the weight and KV bytes over the copy bandwidth."""
    from torch.profiler import ProfilerActivity, profile

    from magicdec.generate import GraphedStep
    from magicdec.kv_cache import KVCache, StreamingCache
    from magicdec.model import build_model

    c, cuda = config, dev.type == "cuda"
    backend = "triton" if cuda else "sdpa"
    model = build_model(c, dev, torch.bfloat16, random_seed=0)
    ring_extra = runs.ring_extra_for(a.gen_len, max(a.gammas))
    out = {}
    for label, budget in (("draft", a.budget), ("target", 0)):
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
                model(token, cache, logits="last")
            bench.sync(dev)
            with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    model(token, cache, logits="last")
                bench.sync(dev)
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
        row = {"kernel_us_per_step": sum(k["us_per_step"] for k in kernels.values()), "groups": groups,
               "cache_slots": slots, "weights_at_copy_us": model.weight_bytes() / copy_bw * 1e6,
               # the byte limit counts what a query may see: the budget's slots of the ring, not those written ahead
               "kv_at_copy_us": a.B * (budget or slots) * cm.kv_bytes_per_token(c) / copy_bw * 1e6,
               "top_kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us_per_step"])[:15])}
        if cuda:  # the step as runs time it: one CUDA graph (--cuda_graphs), kernels back to back, no launches
            step = GraphedStep(lambda tokens, cache: model(tokens, cache, logits="last"))
            with torch.inference_mode():
                row["graphed_step_us"] = cm.seconds_per_call(lambda: step(token, cache), dev, repeats=50) * 1e6
            row["bytes_over_step"] = (row["weights_at_copy_us"] + row["kv_at_copy_us"]) / row["graphed_step_us"]
            step = None
        out[label] = row
        print(f"{label}: {row['kernel_us_per_step']:.0f} us of kernels per step (eager), "
              f"{row.get('graphed_step_us', float('nan')):.0f} us per graphed step; weights at copy bandwidth "
              f"{row['weights_at_copy_us']:.0f} us, KV {row['kv_at_copy_us']:.0f} us: "
              f"{row.get('bytes_over_step', float('nan')):.2f} of the byte limit", flush=True)
        for g, v in sorted(groups.items(), key=lambda kv: -kv[1]["us_per_step"]):
            print(f"   {g:32s} {v['us_per_step']:8.0f} us  {v['calls_per_step']:6.0f} kernels", flush=True)
        cache = None
        bench.release_memory(dev)
    return out


def attention_sweep(a, config: ModelArgs, copy_bw: float, dev) -> list[dict]:
    """The split-KV kernel and its merge alone, replayed in a CUDA graph, one query token, at the draft's ring (a
    StreamingLLM cache as profile_steps fills it: sinks, the window, the slots written ahead empty) and at the
    target's full cache: microseconds per layer against the visible KV bytes at the
    copy bandwidth, for the default split (choose_splits) and a grid of block sizes and split counts."""
    import triton

    from magicdec.kv_cache import StreamingCache
    from magicdec.triton_attention import split_kv_attention

    c, rows = config, []
    ring = StreamingCache(1, a.B, c.n_kv_heads, a.budget, 16, runs.ring_extra_for(a.gen_len, max(a.gammas)),
                          c.head_dim, torch.bfloat16, dev, "triton")
    ring.fill_random(a.prefix_len, 0)
    q_pos = ring.positions(1)
    ring.attend(1)  # claims the query's own slot, as a forward does
    q = torch.randn(a.B, c.n_heads, 1, c.head_dim, device=dev, dtype=torch.bfloat16)
    cases = [("draft", ring.k[0], ring.v[0], q_pos, ring.key_pos, a.budget)]
    full = torch.randn(2, a.B, c.n_kv_heads, a.prefix_len, c.head_dim, device=dev, dtype=torch.bfloat16)
    cases.append(("target", full[0], full[1], torch.full((a.B, 1), a.prefix_len - 1, device=dev), None, a.prefix_len))
    for label, k, v, pos, key_pos, visible in cases:
        slots = k.shape[2]
        grid = [(128, None)] + [(bn, n) for bn in (32, 64, 128) for n in (1, 2, 3, 4, 6, 8, 12, 16)
                                if n * bn <= slots and (label == "draft" or n >= 4)]
        kv_us = 2 * a.B * c.n_kv_heads * visible * c.head_dim * 2 / copy_bw * 1e6
        for bn, n in grid:
            window = a.budget - 16 if key_pos is not None else 0
            fn = lambda: split_kv_attention(q, k, v, pos, key_pos, 16 if window else 0, window, n, bn)  # noqa: E731
            us = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
            rows.append({"cache": label, "slots": slots, "visible_slots": visible, "block_n": bn,
                         "n_splits": n or "default", "us": us, "visible_kv_at_copy_us": kv_us})
            print(f"attention {label:6s} {slots:6d} slots  block {bn:3d} splits {str(n or 'default'):7s} "
                  f"{us:7.1f} us  (visible KV at copy {kv_us:.1f})", flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model_name", default="meta-llama/Meta-Llama-3.1-8B", help="the shapes (weights are random)")
    p.add_argument("--prefix_len", type=int, default=32768)
    p.add_argument("--B", type=int, default=11)
    p.add_argument("--budget", type=int, default=512, help="the draft's StreamingLLM budget")
    p.add_argument("--gen_len", type=int, default=64, help="with --gammas: the ring's spare slots")
    p.add_argument("--gammas", type=int, nargs="+", default=[2, 3, 4, 5], help="with --gen_len: the ring's spare slots")
    p.add_argument("--attention_sweep", action="store_true",
                   help="also time the split-KV kernel alone over a grid of block sizes and split counts")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (no speed claim)")
    p.add_argument("--output", type=Path, required=True)
    a = p.parse_args(argv)
    config = ModelArgs.from_name(a.model_name)
    dev = torch.device(a.device)
    result = {"command": "python benchmarks/draft_step_profile.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": a.model_name, "random_weights": True,
              "setup": {"prefix_len": a.prefix_len, "B": a.B, "budget": a.budget, "gen_len": a.gen_len,
                        "gammas": a.gammas, "dtype": "bfloat16"},
              "environment": bench.environment(dev)}
    if dev.type == "cuda":
        fused.fuse()  # as the benchmarks run
    copy_bw = cm.measure_device(dev).bandwidth
    result["copy_bandwidth_GBps"] = copy_bw / 1e9
    if a.attention_sweep and dev.type == "cuda":
        result["attention_sweep"] = attention_sweep(a, config, copy_bw, dev)
    result["profile"] = profile_steps(a, config, copy_bw, dev)
    bench.release_memory(dev)  # the model built inside is unreferenced now: give its memory back
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
