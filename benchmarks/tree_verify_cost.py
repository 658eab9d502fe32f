"""What a token tree's verification costs against a decode step, over the number of nodes, at a model's shape over a
long cache (random weights, random KV): the verification-cost curve the cost model and a tree's size are fitted to.

Each point is the target's forward over N tokens per sequence, as the decoding loop runs it (one CUDA graph per
shape, the argmax of every position's logits), replayed in turns with a 1-token decode step on the same cache, in
`--rounds` rounds: T_V/T_T = its median time over the step's. Shapes: a chain of N tokens (today's verification) and
a token tree of N nodes (the chain with siblings, as --tree_width drafts, and the tree's mask in the attention
kernel). `--max_t` sets where the attention leaves the split-KV kernel for flex (the kernel took up to 16 query
tokens before token trees; 64 now), so one call compares both.

    python benchmarks/tree_verify_cost.py --prefix_lens 32768 100000 --batch_sizes 1 4 --output results/trees/verify_cost_h100.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from magicdec.model import attention
from magicdec.model import fused
from magicdec import device as dev
from magicdec import files
from magicdec.model import tp
from magicdec.model import triton_attention
from magicdec.config import ModelArgs
from magicdec.model.forward_plan import PLAIN
from magicdec.decoding.generate import GraphedStep
from magicdec.model.kv_cache import KVCache
from magicdec.model.transformer import build_model
from magicdec.model.tree import Tree


def shapes(nodes: list[int]) -> list[tuple[str, int, Tree | None]]:
    """(label, tokens per sequence, tree or None for a chain) for every node count: a chain, and the tree of that
    many nodes that --tree_width drafts (its width the smallest that reaches the count at depth <= 8)."""
    out = []
    for n in nodes:
        out.append((f"chain {n}", n, None))
        width = next((w for w in range(2, 65) if (n - 1) % w == 0 and (n - 1) // w <= 8), None)
        if n > 2 and width:
            out.append((f"tree {n} ({(n - 1) // width} x {width})", n, Tree.chain_with_siblings((n - 1) // width,
                                                                                                  width)))
    return out


def fixed_launch(rows: int) -> tuple[int, int, int]:
    return 128, 4, 2  # (KV block, warps, stages): a decode's, for every tile (the kernel's setting before tuning)


LAUNCH = {"tuned": triton_attention.launch_settings, "fixed": fixed_launch}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_name", default="meta-llama/Meta-Llama-3.1-8B")
    p.add_argument("--prefix_lens", type=int, nargs="+", default=[32768, 100000])
    p.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 8, 16, 17, 25, 32, 33, 49, 64])
    p.add_argument("--max_t", type=int, nargs="+", default=[64, 16], help="split-KV kernel up to this many tokens")
    p.add_argument("--flex_nodes", type=int, nargs="+", default=[32],
                   help="node counts timed past a --max_t (through flex: compiled per shape, slow to start)")
    p.add_argument("--launch", nargs="+", choices=list(LAUNCH), default=["tuned"],
                   help="the split-KV kernel's launch settings, each timed in the same rounds: tuned per query rows "
                        "(triton_attention.launch_settings), or fixed at a decode's")
    p.add_argument("--no_fuse", action="store_true",
                   help="plain PyTorch ops instead of the fused kernels the engine runs (model/fused.py)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=20, help="graph replays per timing")
    p.add_argument("--output", type=Path, required=True, help="the JSON (with --plot: the PNG)")
    p.add_argument("--plot", type=Path, nargs="+", help="time nothing: plot these outputs' curves")
    p.add_argument("--breakdown", action="store_true",
                   help="time nothing in turns: profile one eager forward per chain of --nodes tokens and sum its GPU "
                        "time by kind of kernel (matmuls, attention, the rest)")
    a = p.parse_args(argv)
    if a.plot:
        return plot(a.plot, a.output)
    fused.fuse(not a.no_fuse)  # as engine.load_target does on a GPU
    if a.breakdown:
        return breakdown(a)
    device = torch.device("cuda")
    c = ModelArgs.from_name(a.model_name)
    model = build_model(c, device, torch.bfloat16, random_seed=0)
    out = {"model": c.name, "environment": dev.environment(device), "copy_GBps": dev.copy_bandwidth(device) / 1e9,
           "rounds": a.rounds, "reps": a.reps, "fused": not a.no_fuse, "points": []}
    def verify(tokens, cache, plan):
        return tp.vocab_argmax(model(tokens, cache, plan.sharded()), None)

    def timed(step, tokens, cache, tree) -> float:
        plan = PLAIN.with_tree(tree)
        step(tokens, cache, plan)  # captured at first use
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.reps):
            step(tokens, cache, plan)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / a.reps

    start = time.time()
    for prefix in a.prefix_lens:
        for B in a.batch_sizes:
            cache = KVCache(c.n_layers, B, c.n_kv_heads, prefix + max(a.nodes) + 8, c.head_dim, torch.bfloat16,
                            device, "triton")
            cache.fill_random(prefix, 0)
            one = torch.zeros(B, 1, dtype=torch.long, device=device)
            # graphs of their own per cache (a pool whose graphs were freed cannot take a new capture)
            step = GraphedStep(verify, key=lambda tokens, cache, plan: (attention.TRITON_MAX_T,  # and plan.key
                                                                        triton_attention.launch_settings))
            for max_t in a.max_t:
                attention.TRITON_MAX_T = max_t
                for label, n, tree in shapes(a.nodes):
                    if n > max_t and n not in a.flex_nodes or max_t < max(a.max_t) and n <= max_t:
                        continue  # the other --max_t times what this one would repeat
                    tokens = torch.randint(0, c.vocab_size, (B, n), device=device)
                    tree_dev = tree.on_device(device) if tree else None
                    rounds = {launch: [] for launch in a.launch}
                    for _ in range(a.rounds):  # in turns with the decode step
                        triton_attention.launch_settings = LAUNCH["tuned"]
                        t_step = timed(step, one, cache, None)
                        for launch in a.launch:
                            triton_attention.launch_settings = LAUNCH[launch]
                            rounds[launch].append(timed(step, tokens, cache, tree_dev) / t_step)
                    triton_attention.launch_settings = LAUNCH["tuned"]
                    for launch in a.launch:
                        row = {"prefix": prefix, "B": B, "max_t": max_t, "shape": label, "tokens": n,
                               "tree": list(tree.parents) if tree else None, "launch": launch,
                               "T_V_over_T_T": statistics.median(rounds[launch]), "rounds": rounds[launch],
                               "decode_step_ms": t_step * 1e3}
                        out["points"].append(row)
                        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                                          if k not in ("tree", "rounds")} | {"elapsed_s": round(time.time() - start)}),
                              flush=True)
                    a.output.parent.mkdir(parents=True, exist_ok=True)
                    files.write_json(a.output, out | {"partial": True})
            del cache, step
            torch.cuda.empty_cache()
    files.write_json(a.output, out)
    return 0


def kernel_kind(name: str) -> str:
    n = name.lower()
    if "split_kv" in n or "merge" in n:
        return "attention"
    if any(w in n for w in ("gemm", "gemv", "cutlass", "nvjet", "sm90_xmma", "cublas")):
        return "matmul"
    return "other"


def breakdown(a) -> int:
    """Where a verification's time goes: per (prefix, B, tokens), the GPU time of one eager forward by kind of
    kernel (the kernels a graph replays), from torch.profiler, the median of --rounds forwards."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda")
    c = ModelArgs.from_name(a.model_name)
    model = build_model(c, device, torch.bfloat16, random_seed=0)
    out = {"model": c.name, "environment": dev.environment(device), "breakdown": True, "fused": not a.no_fuse,
           "points": []}
    for prefix in a.prefix_lens:
        for B in a.batch_sizes:
            cache = KVCache(c.n_layers, B, c.n_kv_heads, prefix + max(a.nodes) + 8, c.head_dim, torch.bfloat16,
                            device, "triton")
            cache.fill_random(prefix, 0)
            for n in a.nodes:
                tokens = torch.randint(0, c.vocab_size, (B, n), device=device)
                model(tokens, cache)  # compiled and warm
                torch.cuda.synchronize()
                rounds = []
                for _ in range(a.rounds):
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        model(tokens, cache)
                        torch.cuda.synchronize()
                    kinds, names = {}, {}
                    for e in prof.key_averages():
                        if e.device_time_total > 0:
                            kind = kernel_kind(e.key)
                            kinds[kind] = kinds.get(kind, 0.0) + e.device_time_total / 1e3
                            names[e.key[:90]] = e.device_time_total / 1e3
                    rounds.append(kinds)
                row = {"prefix": prefix, "B": B, "tokens": n,
                       "ms": {k: statistics.median(r.get(k, 0.0) for r in rounds) for k in ("matmul", "attention", "other")},
                       "kernels_ms": dict(sorted(names.items(), key=lambda kv: -kv[1])[:12])}
                out["points"].append(row)
                print(json.dumps(row), flush=True)
            del cache
            torch.cuda.empty_cache()
    a.output.parent.mkdir(parents=True, exist_ok=True)
    files.write_json(a.output, out)
    return 0


def plot(paths: list[Path], out: Path) -> int:
    """T_V/T_T over tokens per sequence, one line per (prefix, B, chain or tree, kernel bound)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(f.read_text()) for f in paths]
    # each point's code commit and ops: outputs of several checkouts (a kernel's before and after), or of plain and
    # fused ops, draw as their own lines (records without "fused" were timed with the plain ops)
    points = [r | {"code": rec["environment"].get("code", {}).get("commit", "")
                   + ("" if rec.get("fused", False) else " plain ops")} for rec in records for r in rec["points"]]
    codes = list(dict.fromkeys(r["code"] for r in points))
    gpu = records[0]["environment"].get("gpu", "")
    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    key = lambda r: (r["prefix"], r["B"], r["tree"] is not None, r["max_t"], r.get("launch", "tuned"),  # noqa: E731
                     codes.index(r["code"]))
    keys = sorted({key(r) for r in points})
    groups = sorted({k[:2] for k in keys})
    for prefix, B, is_tree, max_t, launch, code in keys:
        at = sorted((r["tokens"], r["T_V_over_T_T"]) for r in points
                    if key(r) == (prefix, B, is_tree, max_t, launch, code))
        if len(at) < 2 and not max_t < 64:
            continue
        label = f"{prefix // 1000}K x {B}, {'tree' if is_tree else 'chain'}" + (f", flex past {max_t}" if max_t < 64
                                                                                 else "") + (
            ", decode's launch" if launch == "fixed" else "") + (f", code {codes[code]}" if len(codes) > 1 else "")
        style = ("s" if max_t < 64 else "x" if launch == "fixed" else "o") + (":" if launch == "fixed" or code
                                                                              else "--" if is_tree else "-")
        ax.plot(*zip(*at), style, color=f"C{groups.index((prefix, B))}", label=label,
                alpha=0.5 if code else 1.0)
    ax.set_xlabel("tokens verified per sequence (chain length or tree nodes)")
    ax.set_ylabel("verification / decode step")
    ax.set_yscale("log")
    ax.set_title(f"Verification cost, random-weight Llama-3.1-8B, {gpu}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the curves, never over them
    fig.tight_layout()
    files.save_figure(out, fig, dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
