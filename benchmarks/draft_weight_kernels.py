"""The low-bit kernels behind --draft_weights (magicdec/draft_weights.py), one linear layer at a time: each kernel's
time against bf16 `F.linear` at a model's linear shapes and row counts M, replayed in a CUDA graph as a draft step
runs it, and its output against the reference (dequantize, then multiply in fp32). A layer's sum (qkv, o, gate, up,
down) per (format, kernel, M) is what the draft step's matmuls cost relative to bf16; KERNELS in draft_weights.py
is read off it.

    python benchmarks/draft_weight_kernels.py --output results/draft_weights/kernels_h100.json
    python benchmarks/draft_weight_kernels.py --autotune_from 32 ...   # gemlite autotunes M >= 32 instead of its
                                                                       # shipped configs (minutes)
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from magicdec import device as dev
from magicdec import draft_weights as dw
from magicdec.config import ModelArgs


def graphed_us(fn, rep_ms: int = 50) -> float:
    from triton.testing import do_bench_cudagraph

    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=rep_ms) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_name", default="meta-llama/Meta-Llama-3.1-8B", help="whose linear shapes")
    p.add_argument("--M", type=int, nargs="+", default=[1, 2, 4, 8, 13, 16, 26, 32, 52, 64])
    p.add_argument("--formats", nargs="+", default=["int8", "fp8", "int4"], choices=dw.FORMATS[1:])
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--layers", nargs="+", default=None, help="these linear layers only (default: all)")
    p.add_argument("--autotune_from", type=int, default=None,
                   help="gemlite autotunes each M from this one up (its shipped configs below it)")
    p.add_argument("--output", type=Path, required=True)
    a = p.parse_args(argv)
    c, device = ModelArgs.from_name(a.model_name), torch.device("cuda")
    torch.manual_seed(0)
    out = {"model": c.name, "group": a.group, "M": a.M, "environment": dev.environment(device),
           "copy_GBps": dev.copy_bandwidth(device) / 1e9, "autotune_from": a.autotune_from, "rows": []}
    if a.autotune_from is not None:
        import gemlite
        from gemlite.triton_kernels import utils as gl_utils

        shipped = gl_utils.get_closest_m
        gemlite.set_autotune_setting(lambda M: M if M >= a.autotune_from else shipped(M))
    start = time.time()
    for name, (N, K) in dw.linear_shapes(c).items():
        if a.layers and name not in a.layers:
            continue
        w = (torch.randn(N, K, device=device) * 0.02).to(torch.bfloat16)
        quantized = {fmt: dw.quantize(w, fmt, a.group) for fmt in a.formats}
        layers = {fmt: dw.QuantLinear(q, None, w) for fmt, q in quantized.items()}
        for fmt, layer in layers.items():  # every kernel of the format, whatever M the run's rule gives it
            for _, kernel in dw.KERNELS[fmt]:
                layer.kernel(kernel)
        for M in a.M:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            row = {"layer": name, "N": N, "K": K, "M": M, "bf16_us": graphed_us(lambda: F.linear(x, w))}
            for fmt, layer in layers.items():
                ref = F.linear(x.float(), dw.dequantize(quantized[fmt], torch.float32))
                for kernel, fn in layer.kernels.items():
                    y = fn(x).float()
                    us = graphed_us(lambda: fn(x))
                    row[f"{fmt}_{kernel}"] = {"us": us, "vs_bf16": us / row["bf16_us"],
                                              "rel_err": ((y - ref).norm() / ref.norm()).item(),
                                              "GBps": dw.format_bytes(N, K, fmt, a.group) / us / 1e3}
                for kernel, why in layer.unbuilt.items():
                    row[f"{fmt}_{kernel}"] = {"error": why}
            out["rows"].append(row)
            a.output.parent.mkdir(parents=True, exist_ok=True)
            a.output.write_text(json.dumps(out | {"partial": True}, indent=1))  # a time limit keeps what was done
            print(json.dumps({k: (round(v["vs_bf16"], 3) if isinstance(v, dict) and "vs_bf16" in v else v)
                              for k, v in row.items()}), flush=True)
    out["per_layer"] = per_layer(out["rows"])
    out["seconds"] = time.time() - start
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["per_layer"], indent=1))
    return 0


def per_layer(rows: list[dict]) -> dict:
    """Per M: a decoder layer's five matmuls summed, each (format, kernel) relative to bf16; and the LM head alone."""
    out = {}
    for M in sorted({r["M"] for r in rows}):
        at = [r for r in rows if r["M"] == M]
        block = [r for r in at if r["layer"] != "output"]
        bf16 = sum(r["bf16_us"] for r in block)
        keys = {k for r in at for k, v in r.items() if isinstance(v, dict) and "us" in v}
        out[str(M)] = {"bf16_layer_us": bf16}
        for k in sorted(keys):
            if all(k in r and "us" in r[k] for r in block):
                out[str(M)][k] = round(sum(r[k]["us"] for r in block) / bf16, 3)
            head = next((r for r in at if r["layer"] == "output"), None)
            if head and "us" in head.get(k, {}):
                out[str(M)][k + "_head"] = round(head[k]["vs_bf16"], 3)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
