"""The low-bit kernels behind --draft_weights (magicdec/model/draft_weights.py), one linear layer at a time: each kernel's
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
from magicdec.model import draft_weights as dw
from magicdec import files
from magicdec.analysis import cost_model as cm
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
    p.add_argument("--layers", nargs="+", default=None,
                   help="these linear layers only (default: all; without w3, w1's times count for it: same shape)")
    p.add_argument("--autotune_from", type=int, default=None,
                   help="gemlite autotunes each M from this one up (its shipped configs below it)")
    p.add_argument("--output", type=Path, help="the probe's JSON")
    p.add_argument("--profile", type=Path, help="write the draft step's table (step_table) into this device profile")
    p.add_argument("--from_probe", type=Path, nargs="+",
                   help="time nothing: the rows of these probe outputs (with --profile)")
    a = p.parse_args(argv)
    if a.from_probe:
        if not a.profile:
            p.error("--from_probe writes a profile's table: give --profile")
        probes = [json.loads(f.read_text()) for f in a.from_probe]
        return write_profile(a.profile, [r for pr in probes for r in pr["rows"]], probes[0]["model"],
                             [str(f) for f in a.from_probe], probes[0]["group"])
    if not a.output:
        p.error("give --output (or --from_probe with --profile)")
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
            files.write_json(a.output, out | {"partial": True})  # a time limit keeps what was done
            print(json.dumps({k: (round(v["vs_bf16"], 3) if isinstance(v, dict) and "vs_bf16" in v else v)
                              for k, v in row.items()} | {"elapsed_s": round(time.time() - start)}), flush=True)
    out["per_layer"] = per_layer(out["rows"])
    out["seconds"] = time.time() - start
    a.output.parent.mkdir(parents=True, exist_ok=True)
    files.write_json(a.output, out)
    print(json.dumps(out["per_layer"], indent=1))
    if a.profile:
        write_profile(a.profile, out["rows"], c.name, [str(a.output)], a.group)
    return 0


def step_table(rows: list[dict], n_layers: int) -> dict:
    """Per format and M: a draft step's matmuls (n_layers decoder layers and the LM head) with the kernel the run
    picks at M (draft_weights.kernel_choices), over bf16's; only the M at which every layer was timed."""
    out = {}
    for M in sorted({r["M"] for r in rows}):
        at = {r["layer"]: r for r in rows if r["M"] == M}
        at.setdefault("w3", at.get("w1"))  # same shape
        if any(at.get(name) is None for name in dw.LINEARS):
            continue
        weight = {name: 1 if name == "output" else n_layers for name in dw.LINEARS}
        bf16 = sum(weight[n] * at[n]["bf16_us"] for n in dw.LINEARS)
        for fmt in dw.FORMATS[1:]:
            kernel = dw.kernel_choices(fmt, M)[0]
            if kernel == "full":
                continue
            times = [at[n].get(f"{fmt}_{kernel}", {}).get("us") for n in dw.LINEARS]
            if None not in times:
                out.setdefault(fmt, {})[str(M)] = round(sum(weight[n] * t for n, t in zip(dw.LINEARS, times)) / bf16, 3)
    return out


def write_profile(path: Path, rows: list[dict], model: str, sources: list[str], group: int) -> int:
    """The step table into a device profile's weight_kernels (the cost model's weight_time_ratio reads it)."""
    profile = json.loads(path.read_text())
    profile["weight_kernels"] = {
        "source": sources, "model_shapes": model, "int4_group": group,
        "note": "a draft step's linear layers and LM head at M rows, each with the kernel the run picks at M, "
                "timed in CUDA graphs, over bf16 F.linear at the same M (benchmarks/draft_weight_kernels.py)",
        "matmul_time_vs_bf16": step_table(rows, ModelArgs.from_name(model).n_layers)}
    profile = cm.measured_here(profile, ["weight_kernels"])
    files.write_text(path, json.dumps(profile, indent=1) + "\n")
    print(json.dumps(profile["weight_kernels"]["matmul_time_vs_bf16"], indent=1))
    return 0


def per_layer(rows: list[dict]) -> dict:
    """Per M: a decoder layer's five matmuls summed, each (format, kernel) relative to bf16; and the LM head alone."""
    out = {}
    for M in sorted({r["M"] for r in rows}):
        at = [r for r in rows if r["M"] == M]
        block = [r for r in at if r["layer"] != "output"]
        if not any(r["layer"] == "w3" for r in block):  # w3 has w1's shape: timed once (--layers), counted twice
            block += [r for r in block if r["layer"] == "w1"]
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
