"""Decode/verify attention alone at Llama-3-8B head shapes: achieved bandwidth of each backend against a
device-to-device copy. GPU only. Writes a JSON record.

    python benchmarks/attention_kernels.py --output results/attention_kernels_h100.json
"""
import argparse
from pathlib import Path

import torch
import triton

from magicdec import files
from magicdec.model import fused
from magicdec.model.attention import make_attend
from magicdec.device import copy_bandwidth, environment
from magicdec.model.triton_attention import choose_splits, launch_settings, split_kv_attention

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--output", type=Path, default=None)
p.add_argument("--tune", action="store_true", help="also sweep the Triton kernel's block/warp/stage settings")
p.add_argument("--blocks", type=int, nargs="+", default=None,
               help="instead: the Triton kernel alone at these KV block sizes (its default split for each), in turns, "
                    "3 rounds, each replayed in a CUDA graph as the runs replay it")
p.add_argument("--tree_tiles", action="store_true",
               help="instead: the Triton kernel alone over a token tree's many query rows (16-64 nodes) at 32K x 1, "
                    "32K x 13 and 100K x 4, each launch setting (rows per program, warps, stages, KV block) in turns, 3 rounds, "
                    "in a CUDA graph, against the 1-token decode's time")
p.add_argument("--tile_shapes", nargs="+", default=["1x32768", "13x32768", "4x100000"],
               help="with --tree_tiles: the BxS points (batch x cached tokens)")
p.add_argument("--tile_tokens", type=int, nargs="+", default=[1, 16, 17, 24, 32, 64],
               help="with --tree_tiles: query tokens per sequence (17 and 24: rows 68 and 96 take a 128-row tile)")
p.add_argument("--split_factors", type=float, nargs="+", default=None,
               help="with --tree_tiles: instead of the launch settings, the tuned launch at these multiples of the "
                    "kernel's own split count (choose_splits), in turns")
p.add_argument("--no_fuse", action="store_true", help="the splits' merge as plain PyTorch ops, not its fused kernel")
args = p.parse_args()
fused.fuse(not args.no_fuse)  # the merge kernel, as the engine runs it on a GPU
dev = torch.device("cuda")
copy = copy_bandwidth(dev)
rows, H, Hkv, D = [], 32, 8, 128


def save(partial: bool) -> None:
    """The record so far (rewritten after each shape of --tree_tiles, so a call cut short keeps what it timed)."""
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        files.write_json(args.output, {"environment": environment(dev), "copy_bandwidth_GBps": copy / 1e9,
                                       "fused": not args.no_fuse, "rows": rows, "partial": partial,
                                       "note": "random inputs; bytes = K + V of the whole cache read once"})


def tree_tiles():
    from magicdec.model.tree import Tree, TreeMask
    settings = [(rb, nw, ns, bn) for rb in (64, 128) for nw in (4, 8) for ns in (2, 3) for bn in (64, 128)]
    for B, S in (tuple(int(x) for x in shape.split("x")) for shape in args.tile_shapes):
        k = torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for T in args.tile_tokens:
            q = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16)
            q_pos = (S - T + torch.arange(T, device=dev))[None].expand(B, T).contiguous()
            width = 3 if T == 16 else 1 if T == 1 else (T - 1) // 7 if T == 64 else 1
            tree = Tree.chain_with_siblings((T - 1) // width, width) if T > 1 else None
            mask = None if tree is None else TreeMask(tree.ancestors.to(dev), tree.ancestor_bits.to(dev), q_pos[:, 0])
            own = choose_splits(B * Hkv, H // Hkv * T, S, launch_settings(H // Hkv * T)[0], dev)
            splits = [max(1, round(own * f)) for f in args.split_factors or [1]]
            for r in range(3):
                for rb, nw, ns, bn in (settings if T > 1 and not args.split_factors else [(128, None, None, None)]):
                    for n_splits in dict.fromkeys(splits):
                        ms = triton.testing.do_bench_cudagraph(lambda: split_kv_attention(
                            q, k, v, q_pos, None, n_splits=n_splits if args.split_factors else None, block_n=bn,
                            num_warps=nw, num_stages=ns, tree=mask, row_block=rb), rep=50)
                        rows.append({"B": B, "S": S, "T": T, "tree": None if tree is None else list(tree.parents),
                                     "row_block": rb, "num_warps": nw, "num_stages": ns, "block_n": bn,
                                     "n_splits": n_splits, "own_splits": own, "round": r, "ms": ms})
                        print(f"B={B} S={S} T={T:2d} rows/program {rb:3d} warps {nw} stages {ns} block {bn} "
                              f"splits {n_splits:3d} (own {own}) round {r} {ms:8.3f} ms", flush=True)
        save(partial=True)


if args.tree_tiles:
    tree_tiles()
for B, S in [] if args.tree_tiles else [(8, 32768), (1, 131072), (32, 16384), (64, 4096), (13, 32768)]:
    for T in (1, 4, 8):
        torch.manual_seed(0)
        q = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q_pos = (S - T + torch.arange(T, device=dev))[None].expand(B, T).contiguous()
        nbytes = 2 * k.numel() * k.element_size()
        if args.blocks:
            for r in range(3):
                for bn in args.blocks:
                    ms = triton.testing.do_bench_cudagraph(
                        lambda: split_kv_attention(q, k, v, q_pos, None, block_n=bn), rep=50)
                    rows.append({"B": B, "S": S, "T": T, "backend": f"triton_bn{bn}", "round": r, "ms": ms,
                                 "fraction_of_copy": nbytes / ms / 1e-3 / copy})
                    print(f"B={B:3d} S={S:6d} T={T} block {bn:3d} round {r} {ms:8.3f} ms "
                          f"{rows[-1]['fraction_of_copy']:.2f} of copy", flush=True)
            continue
        ref = make_attend("sdpa", q_pos, None, S)(q, k, v).float()
        variants = {"sdpa": make_attend("sdpa", q_pos, None, S), "triton": make_attend("triton", q_pos, None, S)}
        if args.tune:
            for bn, nw, ns in [(32, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2), (64, 8, 3)]:
                variants[f"triton_bn{bn}_w{nw}_s{ns}"] = (lambda bn=bn, nw=nw, ns=ns: lambda q, k, v: split_kv_attention(
                    q, k, v, q_pos, None, block_n=bn, num_warps=nw, num_stages=ns))()
        for name, fn in variants.items():
            err = ((fn(q, k, v).float() - ref).norm() / ref.norm()).item()
            ms = triton.testing.do_bench(lambda: fn(q, k, v), warmup=25, rep=100, return_mode="median")
            row = {"B": B, "S": S, "T": T, "backend": name, "ms": ms, "GBps": nbytes / ms / 1e6,
                   "fraction_of_copy": nbytes / ms / 1e-3 / copy, "rel_err_vs_sdpa": err}
            rows.append(row)
            print(f"B={B:3d} S={S:6d} T={T} {name:24s} {ms:8.3f} ms {row['GBps']:7.0f} GB/s "
                  f"{row['fraction_of_copy']:.2f} of copy  err {err:.1e}", flush=True)
        del q, k, v
save(partial=False)
