"""The split-KV kernel over a bf16 cache and over its 8- and 4-bit copies (magicdec/model/quant_kv.py), one layer at
Llama-3.1-8B's head shapes: milliseconds per call (each replayed in a CUDA graph, in turns, 3 rounds), bytes read,
the fraction of a device-to-device copy's bandwidth that is, and the output's error against bf16 attention over the
unquantized K and V; also one token's quantized store into a layer (what each draft step adds per layer). GPU only.

    python benchmarks/quant_kv_kernels.py --output results/quant_kv/kernels_h100.json
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton

from magicdec import files
from magicdec.model import fused, quant_kv
from magicdec.device import copy_bandwidth, environment
from magicdec.model.kv_cache import store_kv
from magicdec.model.triton_attention import split_kv_attention

SHAPES = [(1, 32768), (1, 100000), (13, 32768), (4, 100000)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--blocks", type=int, nargs="+", default=[64, 128], help="KV block sizes tried per format")
    p.add_argument("--T", type=int, nargs="+", default=[1, 2], help="query tokens (a draft step: 1; its re-feed: 2)")
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    fused.fuse()
    copy = copy_bandwidth(dev)
    H, Hkv, D = 32, 8, 128
    rows = []
    for B, S in SHAPES:
        torch.manual_seed(0)
        k = torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        codes = {bits: (quant_kv.quantize(k, bits), quant_kv.quantize(v, bits)) for bits in (8, 4)}
        for T in a.T:
            q = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16)
            q_pos = (S - T + torch.arange(T, device=dev))[None].expand(B, T).contiguous()
            ref = split_kv_attention(q, k, v, q_pos).float()
            calls = {}
            for bn in a.blocks:
                calls["bf16", bn] = (lambda bn=bn: split_kv_attention(q, k, v, q_pos, block_n=bn), 2 * k.nbytes)
                for bits, ((kc, ksz), (vc, vsz)) in codes.items():
                    calls[f"int{bits}", bn] = (lambda bn=bn, kc=kc, ksz=ksz, vc=vc, vsz=vsz, bits=bits:
                                               split_kv_attention(q, kc, vc, q_pos, block_n=bn, k_scale_zero=ksz,
                                                                  v_scale_zero=vsz, kv_bits=bits),
                                               2 * (kc.nbytes + ksz.nbytes))
            times = {key: [] for key in calls}
            for _ in range(3):
                for key, (fn, _) in calls.items():
                    times[key].append(triton.testing.do_bench_cudagraph(fn, rep=50))
            for (fmt, bn), (fn, nbytes) in calls.items():
                ms = sorted(times[fmt, bn])[1]
                err = ((fn().float() - ref).norm() / ref.norm()).item()
                rows.append({"B": B, "S": S, "T": T, "format": fmt, "block_n": bn, "ms": ms,
                             "ms_rounds": times[fmt, bn], "bytes": nbytes, "fraction_of_copy": nbytes / (ms * 1e-3) / copy, "rel_err": err})
                print(f"B={B:3d} S={S:6d} T={T} {fmt:5s} block {bn:3d} {ms:7.3f} ms "
                      f"{rows[-1]['fraction_of_copy']:.2f} of copy  err {err:.1e}", flush=True)
        del k, v, codes
    # one decode token's K and V stored into one layer (B = 13): bf16 as the target stores, or quantized
    B, S = 13, 4096
    stores = {}
    new = torch.randn(B, 1, Hkv, D, device=dev, dtype=torch.bfloat16)
    rows_idx, slots = torch.arange(B, device=dev)[:, None], torch.full((B, 1), 100, device=dev)
    kb = torch.zeros(B, Hkv, S, D, device=dev, dtype=torch.bfloat16)
    vb = torch.zeros_like(kb)
    stores["bf16"] = lambda: store_kv(kb, vb, rows_idx, slots, new, new)
    for bits in (8, 4):
        c = quant_kv.QuantizedKVCache(1, B, Hkv, S, D, bits, torch.bfloat16, dev, "triton")
        stores[f"int{bits}"] = (lambda c=c, bits=bits: quant_kv.store_quantized(c.k[0], c.v[0], c.k_sz[0], c.v_sz[0],
                                                                             rows_idx, slots, new, new, bits))
    store_us = {fmt: sorted(triton.testing.do_bench_cudagraph(fn, rep=50) for _ in range(3))[1] * 1e3
                for fmt, fn in stores.items()}
    print("one token's store into a layer (us):", store_us)
    record = {"environment": environment(dev), "copy_bandwidth_GBps": copy / 1e9, "rows": rows,
              "store_one_token_us": store_us, "heads": [H, Hkv, D],
              "note": "random K/V; bytes = codes + scales (or bf16 K + V) of the whole cache read once; median of 3 "
                      "rounds in turns, each a CUDA-graph replay timing"}
    if a.output:
        a.output.parent.mkdir(parents=True, exist_ok=True)
        files.write_json(a.output, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
