"""Where a self-draft's decode step spends its time, kernel by kernel, beside the target's step, on one GPU.

Self-speculation's draft is the target's own layers (bf16, or its own copy in --draft_weights) over a StreamingLLM
ring of --budget slots (plus the spare slots a run's ring holds for what generation writes ahead: --gen_len and the
largest of --gammas), the target the same layers over its full --prefix_len cache. The self-draft is built as a
run builds it, by the engine (magicdec/harness/engine.py: --drafter selfspec, random weights, --skip_prefill: random
KV in both caches), and one step of each, the decoder's own draft step (through the drafter's own model: the
quantized copy where --draft_weights asks for one) over the draft's ring and its target step over the full cache, at
B x prefix_len, runs under torch.profiler: every GPU kernel's time per step, by kernel and by group (matmuls,
attention, the fused RMSNorm/RoPE/SwiGLU kernels, the rest), beside the step's weight and KV bytes over the copy
bandwidth measured here (cost_model.measure_device). That says how far a draft step is from its byte limit and what the remainder is: the
floor on T_D/T_T, and so on the speedup, that weights and KV alone do not explain. The profile launches eagerly (the
kernels' own times); each step is then also timed as the runs time it, replayed in one CUDA graph
(`graphed_step_us`, and `bytes_over_step`: the byte limit over that time). The fused kernels (fused.py) are on, as
in every run. `--attention_sweep` also times the split-KV kernel alone over block sizes and split counts, on the
draft's ring and on a full cache. `--device cpu --model_name JackFram/llama-68m --prefix_len 1024 --B 2` is a smoke
test of the script (CPU ops, not kernels: no speed claim).

    python benchmarks/draft_step_profile.py --attention_sweep --output results/quant/draft_step_profile.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from magicdec.analysis import cost_model as cm
from magicdec import device as dev
from magicdec import files
from magicdec.harness.trial import build
from magicdec.errors import one_line_errors
from magicdec.model import draft_weights
from magicdec.model.forward_plan import LAST_LOGITS, PLAIN
from magicdec.harness.run_config import RunConfig

SINKS = 16  # the StreamingLLM sinks of the draft's ring (the runs' default)

KERNEL_GROUPS = (("matmul (cuBLAS, gemlite, tinygemm)", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "splitk",
                                                         "tinygemm", "int4pack")),
                 ("attention", ("attn", "attention", "_decode", "split_kv")),  # split_kv: magicdec's Triton kernel
                 # fused.py's ops: Inductor's kernels (triton_*) and the hand-written row-wise reductions
                 ("norm / RoPE / SwiGLU / KV store / merge (fused)", ("triton_", "_add_rms_norm", "_merge_kernel")))


def kernel_group(name: str) -> str:
    low = name.lower()
    return next((g for g, keys in KERNEL_GROUPS if any(k in low for k in keys)), "other")


def self_draft_config(a) -> RunConfig:
    """The self-draft as a run configures it at B x prefix_len: random weights, random KV in the target's cache and in
    the draft's ring (--skip_prefill), the Triton decode kernel on a GPU."""
    return RunConfig.from_options({
        "model_name": a.model_name, "random_weights": True, "skip_prefill": True, "B": a.B, "prefix_len": a.prefix_len,
        "gen_len": a.gen_len, "drafter": "selfspec", "gamma": a.gammas, "draft_budget": a.budget, "sinks": SINKS,
        "draft_weights": a.draft_weights,
        "device": a.device, "dtype": "bfloat16", "attn_backend": "triton" if a.device.startswith("cuda") else "sdpa",
        "progress": False})


def profile_steps(a, built, cfg: RunConfig, copy_bw: float, steps: int = 10) -> dict:
    """One decode step of the draft (the target's weights over the StreamingLLM ring of the run's budget) and one of
    the target (its full cache), each at B x prefix_len over random KV, `steps` times under torch.profiler: every
    kernel's time per step, by kernel and by group, beside the weight and KV bytes over the copy bandwidth. The steps
    are the decoder's own (Decoder.draft_step, Decoder.verify_step of one token: the baseline's decode step)."""
    from torch.profiler import ProfilerActivity, profile

    engine, drafter = built.engine, built.drafter
    device, cuda = engine.device, engine.device.type == "cuda"
    c, model = engine.target_config, engine.target
    draft = drafter.model  # the target itself (bf16) or its quantized copy (--draft_weights)
    # a quantized copy's bytes are its linear layers' and LM head's in the format (the norms' few are left out)
    draft_bytes = draft_weights.copy_bytes(c, a.draft_weights, cfg.options()["draft_group"]) or model.weight_bytes()
    eager = engine.decoder(cfg, drafter, max(a.gammas))
    graphed = engine.decoder(RunConfig.from_options(cfg.options() | {"step_mode": "cuda_graphs"}), drafter,
                             max(a.gammas)) if cuda else None
    token = torch.zeros(a.B, 1, dtype=torch.long, device=device)
    ring, full = drafter.cache, built.batch.cache
    cases = {"draft": (lambda d: lambda: d.draft_step(draft, token, ring, LAST_LOGITS), ring.max_len, a.budget,
                       draft_bytes),
             "target": (lambda d: lambda: d.verify_step(token, full, PLAIN), a.prefix_len, a.prefix_len,
                        model.weight_bytes())}
    out = {}
    for label, (step_of, slots, visible, weight_bytes) in cases.items():
        step = step_of(eager)
        with torch.inference_mode():
            for _ in range(3):
                step()
            dev.sync(device)
            with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    step()
                dev.sync(device)
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
               "cache_slots": slots, "weights_at_copy_us": weight_bytes / copy_bw * 1e6,
               # the byte limit counts what a query may see: the budget's slots of the ring, not those written ahead
               "kv_at_copy_us": a.B * visible * cm.kv_bytes_per_token(c) / copy_bw * 1e6,
               "top_kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us_per_step"])[:15])}
        if graphed is not None:  # the step as runs time it: one CUDA graph (--step_mode cuda_graphs), no launches
            step = step_of(graphed)
            with torch.inference_mode():
                row["graphed_step_us"] = cm.seconds_per_call(step, device, repeats=50) * 1e6
            row["bytes_over_step"] = (row["weights_at_copy_us"] + row["kv_at_copy_us"]) / row["graphed_step_us"]
        out[label] = row
        print(f"{label}: {row['kernel_us_per_step']:.0f} us of kernels per step (eager), "
              f"{row.get('graphed_step_us', float('nan')):.0f} us per graphed step; weights at copy bandwidth "
              f"{row['weights_at_copy_us']:.0f} us, KV {row['kv_at_copy_us']:.0f} us: "
              f"{row.get('bytes_over_step', float('nan')):.2f} of the byte limit", flush=True)
        for g, v in sorted(groups.items(), key=lambda kv: -kv[1]["us_per_step"]):
            print(f"   {g:32s} {v['us_per_step']:8.0f} us  {v['calls_per_step']:6.0f} kernels", flush=True)
    del eager, graphed, step
    dev.release_memory(device)  # the graphs' pools
    return out


def attention_sweep(a, built, copy_bw: float) -> list[dict]:
    """The split-KV kernel and its merge alone, replayed in a CUDA graph, one query token, at the draft's ring (layer
    0 of the self-draft's StreamingLLM cache as the engine filled it: sinks, the window, the slots written ahead
    empty) and at a full cache of random KV: microseconds per layer against the visible KV bytes at the copy
    bandwidth, for the default split (choose_splits) and a grid of block sizes and split counts."""
    import triton

    from magicdec.model.triton_attention import split_kv_attention

    c, rows, device = built.engine.target_config, [], built.engine.device
    ring = built.drafter.cache
    q_pos = ring.positions(1)
    ring.attend(1)  # claims the query's own slot, as a forward does
    q = torch.randn(a.B, c.n_heads, 1, c.head_dim, device=device, dtype=torch.bfloat16)
    cases = [("draft", ring.k[0], ring.v[0], q_pos, ring.key_pos, a.budget)]
    full = torch.randn(2, a.B, c.n_kv_heads, a.prefix_len, c.head_dim, device=device, dtype=torch.bfloat16)
    cases.append(("target", full[0], full[1], torch.full((a.B, 1), a.prefix_len - 1, device=device), None,
                  a.prefix_len))
    for label, k, v, pos, key_pos, visible in cases:
        slots = k.shape[2]
        grid = [(128, None)] + [(bn, n) for bn in (32, 64, 128) for n in (1, 2, 3, 4, 6, 8, 12, 16)
                                if n * bn <= slots and (label == "draft" or n >= 4)]
        kv_us = 2 * a.B * c.n_kv_heads * visible * c.head_dim * 2 / copy_bw * 1e6
        for bn, n in grid:
            window = a.budget - SINKS if key_pos is not None else 0
            fn = lambda: split_kv_attention(q, k, v, pos, key_pos, SINKS if window else 0, window, n, bn)  # noqa: E731
            us = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
            rows.append({"cache": label, "slots": slots, "visible_slots": visible, "block_n": bn,
                         "n_splits": n or "default", "us": us, "visible_kv_at_copy_us": kv_us})
            print(f"attention {label:6s} {slots:6d} slots  block {bn:3d} splits {str(n or 'default'):7s} "
                  f"{us:7.1f} us  (visible KV at copy {kv_us:.1f})", flush=True)
    del full
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
    p.add_argument("--draft_weights", default="bf16", help="the draft's weight format (bf16, int8, fp8, int4)")
    p.add_argument("--attention_sweep", action="store_true",
                   help="also time the split-KV kernel alone over a grid of block sizes and split counts")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (no speed claim)")
    p.add_argument("--output", type=Path, required=True)
    a = p.parse_args(argv)
    with one_line_errors():
        cfg = self_draft_config(a)
        cfg.check()
        copy_bw = cm.measure_device(cfg.runtime.torch_device).bandwidth  # before the caches take the memory
        dev.release_memory(cfg.runtime.torch_device)
        built = build(cfg)  # the engine's: checked (context, memory) before anything large is allocated; fused ops on
    device = built.engine.device
    result = {"command": "python benchmarks/draft_step_profile.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": a.model_name, "random_weights": True,
              "setup": {"prefix_len": a.prefix_len, "B": a.B, "budget": a.budget, "gen_len": a.gen_len,
                        "gammas": a.gammas, "dtype": "bfloat16", "draft_weights": a.draft_weights},
              "environment": dev.environment(device)}
    result["copy_bandwidth_GBps"] = copy_bw / 1e9
    if a.attention_sweep and device.type == "cuda":
        with torch.inference_mode():  # the engine's caches are inference tensors
            result["attention_sweep"] = attention_sweep(a, built, copy_bw)
    result["profile"] = profile_steps(a, built, cfg, copy_bw)
    del built
    dev.release_memory(device)
    a.output.parent.mkdir(parents=True, exist_ok=True)
    files.write_json(a.output, result)
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
