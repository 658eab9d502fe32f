"""Verification attention alone: each candidate kernel's time for T query tokens per sequence over a long cache,
against one decode step's attention (T = 1) and against the byte and FLOP limits, at Llama-3.1-8B's head shapes.

A verification of T tokens reads the same KV as a decode step, so at the byte limit it costs one step; its work grows
with T (4 * B * H * T * S * D FLOPs), so past some T it is bound by the tensor cores instead. This probe shows where
each candidate stands between the two for every shape the atlas meets: T = 1-64 at 32K x 1, 32K x 13 and 100K x 4,
as a chain (causal) and as a token tree (its ancestors mask). Candidates, each where it runs: the attention backends
behind magicdec.model.attention (`triton`: the split-KV kernel; `flex`: FlexAttention with the block mask; `sdpa`:
PyTorch's attention with a boolean mask, also pinned to cuDNN's and to the memory-efficient kernel on a GPU; `flash`:
flash-attn, chains only) and flashinfer's prefill with a custom mask when the package imports. A candidate that fails
on a shape (its check or its graph's capture) is recorded with the error and not timed.

Each candidate's output for sequence 0 is checked against float64 attention over the same mask before it is timed.
Timing: each candidate replayed in a CUDA graph (triton.testing.do_bench_cudagraph), all candidates in turns with the
T = 1 split-KV step on the same cache, `--rounds` rounds; the figure is the median [min-max] of the rounds' own
ratios. The split-KV kernel's merge of its splits runs fused (one kernel, as the engine runs it on a GPU;
`--no_fuse`: as plain PyTorch ops, as this probe's records before 2026-11-28 did). On a CPU (tests) the shapes are
tiny, the Triton kernel interpreted and the times wall-clock: a check of the candidates, not a measurement.

    python benchmarks/verify_attention_probe.py --output results/verify_attention/probe_h100.json
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from magicdec import device as dev  # noqa: E402
from magicdec import files  # noqa: E402
from magicdec.analysis import cost_model as cm  # noqa: E402
from magicdec.errors import MagicDecError, installed  # noqa: E402
from magicdec.model import attention, fused  # noqa: E402
from magicdec.model.tree import Tree, TreeMask  # noqa: E402

H, HKV, D = 32, 8, 128  # Llama-3.1-8B's heads
SHAPES = ("1x32768", "13x32768", "4x100000")
TOKENS = (1, 2, 4, 8, 16, 17, 32, 64)


def tree_of(T: int) -> Tree:
    """A T-node tree: a chain whose every depth holds w candidates (the widest w <= 4 that divides T - 1)."""
    width = next(w for w in (4, 3, 2, 1) if (T - 1) % w == 0)
    return Tree.chain_with_siblings((T - 1) // width, width)


def inputs(B: int, S: int, T: int, device, dtype, seed: int = 0):
    """q [B, H, T, D], k, v [B, HKV, S, D], the queries' positions (the cache's last T slots)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, H, T, D, device=device, dtype=dtype, generator=g)
    k = torch.randn(B, HKV, S, D, device=device, dtype=dtype, generator=g)
    v = torch.randn(B, HKV, S, D, device=device, dtype=dtype, generator=g)
    q_pos = (S - T + torch.arange(T, device=device))[None].expand(B, T).contiguous()
    return q, k, v, q_pos


def tree_mask(tree: Tree, q_pos: torch.Tensor) -> TreeMask:
    return TreeMask(tree.ancestors.to(q_pos.device), tree.ancestor_bits.to(q_pos.device), q_pos[:, 0].contiguous())


def hand_mask(T: int, S: int, tree: Tree | None) -> torch.Tensor:
    """The mask [T, S] written out from its definition (not the backends' code): query t sits at slot S - T + t and
    sees every committed slot before S - T, then (a chain) the slots up to its own or (a tree) its own node and the
    nodes on its way to the root."""
    base = S - T
    visible = torch.zeros(T, S, dtype=torch.bool)
    visible[:, :base] = True
    for t in range(T):
        node = t
        while node >= 0:
            visible[t, base + node] = True
            node = (node - 1) if tree is None else tree.parents[node]
    return visible


def reference(q, k, v, visible) -> torch.Tensor:
    """Float64 attention of sequence 0 [H, T, D] over the boolean mask visible [T, S], written out in full."""
    q0, k0, v0 = q[0].double(), k[0].double(), v[0].double()
    g = H // HKV
    k0, v0 = k0.repeat_interleave(g, 0), v0.repeat_interleave(g, 0)
    s = torch.einsum("htd,hsd->hts", q0, k0) / math.sqrt(D)
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hts,hsd->htd", torch.softmax(s, -1), v0)


def flashinfer_candidate(q_pos, S: int, visible):
    """flashinfer's single-request prefill with a custom mask, per sequence (None where flashinfer does not import)."""
    if not installed("flashinfer"):
        return None
    import flashinfer

    def attend(q, k, v, layer=None):
        out = []
        for b in range(q.shape[0]):  # [T, H, D] queries over [S, HKV, D] keys, the tree's mask [T, S]
            out.append(flashinfer.single_prefill_with_kv_cache(
                q[b].transpose(0, 1), k[b].transpose(0, 1), v[b].transpose(0, 1), custom_mask=visible[b]))
        return torch.stack(out).transpose(1, 2)
    return attend


# PyTorch's SDPA pinned to one backend (GPU): cuDNN's fused attention takes the boolean mask, a library kernel that
# needs no wheel on the device; the memory-efficient kernel is what unpinned SDPA picks for a masked call
SDPA_PINNED = {"sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION"}
CANDIDATES = ("triton", "flex", "sdpa", *SDPA_PINNED, "flash", "flashinfer")
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # max |error| against float64 that counts as a match


def pinned_sdpa(q_pos, S: int, tree: TreeMask | None, backend: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    attend = attention.make_attend("sdpa", q_pos, None, S, tree=tree)

    def run(q, k, v, layer=None):
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return attend(q, k, v)
    return run


def runs_here(backend: str, device) -> bool:
    """Whether magicdec.model.attention's backend runs on this device (its own check)."""
    try:
        attention.resolve_backend(backend, device)
    except MagicDecError:
        return False
    return True


def load_before(root: Path):
    """The split-KV kernel module of another checkout (ROOT/magicdec/model/triton_attention.py), under its own name:
    a kernel change's before, timed in the same rounds as its after."""
    path = root / "magicdec" / "model" / "triton_attention.py"
    if not path.is_file():
        raise MagicDecError(f"--before {root}: no {path.relative_to(root)} there; give a checkout of magicdec")
    spec = importlib.util.spec_from_file_location("triton_attention_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def candidates(q_pos, S: int, tree: TreeMask | None, device, wanted=CANDIDATES, before=None) -> dict:
    """name -> attend(q, k, v) for every wanted candidate that runs here (`before`: load_before's module, as
    triton_before)."""
    out = {}
    if before is not None:
        out["triton_before"] = lambda q, k, v, layer=None: before.split_kv_attention(q, k, v, q_pos, None, tree=tree)
    for name in (n for n in ("triton", "flex", "sdpa", "flash") if n in wanted):
        if name == "flash" and tree is not None:
            continue  # flash-attn's kernel takes no tree mask
        if runs_here(name, device):
            out[name] = attention.make_attend(name, q_pos, None, S, tree=tree)
    for name, backend in SDPA_PINNED.items():
        if device.type == "cuda" and name in wanted:
            out[name] = pinned_sdpa(q_pos, S, tree, backend)
    if device.type == "cuda" and "flashinfer" in wanted:
        visible = attention._visible(q_pos, None, S, tree=tree)
        fi = flashinfer_candidate(q_pos, S, visible)
        if fi is not None:
            out["flashinfer"] = fi
    return out


def seconds(fn, device) -> float:
    """One call's time: replayed in a CUDA graph on a GPU; the wall clock elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench_cudagraph(fn, rep=50) / 1e3
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def probe_shape(B: int, S: int, tokens, layouts, rounds: int, device, dtype, limits, wanted=CANDIDATES,
                before=None) -> list[dict]:
    """Every (T, layout, candidate) at B x S: checked against float64, then timed in turns with the decode step."""
    rows = []
    q1, k, v, pos1 = inputs(B, S, 1, device, dtype)
    decode = attention.make_attend("triton" if runs_here("triton", device) else "sdpa", pos1, None, S)
    kv_bytes = 2 * k.numel() * k.element_size()
    for T in tokens:
        for layout in layouts if T > 1 else ("chain",):
            q, _, _, q_pos = inputs(B, S, T, device, dtype, seed=T)
            shape = tree_of(T) if layout == "tree" else None
            tree = tree_mask(shape, q_pos) if shape is not None else None
            found = candidates(q_pos, S, tree, device, wanted, before)
            want = reference(q, k, v, hand_mask(T, S, shape).to(device))
            errors, failed = {}, {}
            for n, f in found.items():
                try:
                    errors[n] = (f(q, k, v)[0].double() - want).abs().max().item()
                    if device.type == "cuda":  # a CUDA graph's capture, before the timed rounds
                        seconds(lambda f=f: f(q, k, v), device)
                except Exception as e:  # a kernel that cannot take this shape or mask here: recorded, not timed
                    failed[n] = f"{type(e).__name__}: {e}"[:400]
            for n, why in failed.items():
                del found[n]
                rows.append({"B": B, "S": S, "T": T, "layout": layout, "candidate": n, "error": why})
                print(f"B={B:3d} S={S:6d} T={T:2d} {layout:5s} {n:10s} failed: {why[:120]}", flush=True)
            ratios = {n: [] for n in found}
            times = {n: [] for n in found}
            for _ in range(rounds):
                step = seconds(lambda: decode(q1, k, v), device)
                for n, f in found.items():
                    t = seconds(lambda f=f: f(q, k, v), device)
                    times[n].append(t)
                    ratios[n].append(t / step)
            flops = 4 * B * H * T * S * D
            for n in found:
                t = statistics.median(times[n])
                rows.append({"B": B, "S": S, "T": T, "layout": layout, "candidate": n,
                             "tree": list(shape.parents) if shape is not None else None,
                             "max_abs_error": errors[n], "matches_float64": errors[n] <= TOLERANCE[dtype],
                             "seconds": t, "seconds_rounds": times[n],
                             "decode_steps": statistics.median(ratios[n]),
                             "decode_steps_min_max": [min(ratios[n]), max(ratios[n])],
                             "byte_limit_s": kv_bytes / limits.bandwidth, "flop_limit_s": flops / limits.matmul_flops,
                             "of_bound": max(kv_bytes / limits.bandwidth, flops / limits.matmul_flops) / t,
                             "tflops": flops / t / 1e12})
                r = rows[-1]
                print(f"B={B:3d} S={S:6d} T={T:2d} {layout:5s} {n:10s} {t * 1e6:9.1f} us  "
                      f"{r['decode_steps']:5.2f} decode steps  {r['of_bound']:4.2f} of its bound  "
                      f"err {r['max_abs_error']:.1e}", flush=True)
    return rows


def parse_shape(text: str) -> tuple[int, int]:
    try:
        B, S = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise MagicDecError(f"--shapes {text}: give BxS, e.g. 4x100000 (batch x cached tokens)") from None
    if B < 1 or S < 2:
        raise MagicDecError(f"--shapes {text}: batch >= 1 and at least 2 cached tokens")
    return B, S


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help="BxS: batch x cached tokens")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="query tokens per sequence (1-64)")
    p.add_argument("--layouts", nargs="+", default=["chain", "tree"], choices=["chain", "tree"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=CANDIDATES,
                   help="which kernels (flex compiles once per shape: minutes over the whole grid)")
    p.add_argument("--before", type=Path, metavar="CHECKOUT",
                   help="also time another checkout's split-KV kernel (triton_before) in the same rounds")
    p.add_argument("--no_fuse", action="store_true",
                   help="the split-KV merge as plain PyTorch ops instead of its fused kernel (the engine's on a GPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--output", type=Path, help="the probe's JSON (written to a temp file, renamed)")
    a = p.parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in a.shapes]
        if any(not 1 <= t <= 64 for t in a.tokens):
            raise MagicDecError(f"--tokens {a.tokens}: 1 to 64 query tokens (a token tree holds at most 64 nodes)")
        if a.rounds < 1:
            raise MagicDecError(f"--rounds {a.rounds}: at least 1")
        if a.output is not None:
            files.writable_folder(a.output.parent, "--output")
        before = load_before(a.before) if a.before is not None else None
    except MagicDecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    limits = cm.measure_device(device, dtype)
    fused.fuse(device.type == "cuda" and not a.no_fuse)  # the merge kernel, as engine.load_target does on a GPU
    rows = []
    for B, S in shapes:
        rows += probe_shape(B, S, a.tokens, a.layouts, a.rounds, device, dtype, limits, a.candidates, before)
        dev.release_memory(device)
    record = {"environment": dev.environment(device), "heads": {"H": H, "Hkv": HKV, "D": D},
              "copy_GBps": limits.bandwidth / 1e9, "matmul_TFLOPs": limits.matmul_flops / 1e12,
              "rounds": a.rounds, "fused": device.type == "cuda" and not a.no_fuse,
              "before": str(a.before) if a.before is not None else None,
              "timing": "cuda graph" if device.type == "cuda" else "wall clock (not a measurement)", "rows": rows}
    if a.output is not None:
        files.write_json(a.output, record)
        print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
