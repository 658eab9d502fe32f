"""RMSNorm with its residual add, in Triton: the GPU's version of model.add_rms_norm (fused.py).

One program per row, its reduction the same whatever the number of rows. That is the point: a verification
normalises T tokens per sequence where a decode step normalises one, and greedy speculation equals greedy decode
only if each row comes out bitwise the same either way. torch.compile'd RMSNorm is compiled per shape and summed
in another order for 1 row than for 4 (SmolLM2: greedy outputs parted at token 27 of 128; results/quant).

Set TRITON_INTERPRET=1 before import to run it on the CPU (the tests do).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(X, DELTA, W, SUM_OUT, NORM_OUT, stride_x, stride_d, dim, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        # rounded to the stream's dtype before it is normalised, as the plain x + delta is
        x = (x.to(tl.float32) + tl.load(DELTA + row * stride_d + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(SUM_OUT.dtype.element_ty)
        tl.store(SUM_OUT + row * dim + cols, x, mask=ok)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / dim + eps)
    w = tl.load(W + cols, mask=ok, other=0.0)
    out = w.to(tl.float32) * h.to(NORM_OUT.dtype.element_ty).to(tl.float32)  # scaled in the input dtype
    tl.store(NORM_OUT + row * dim + cols, out.to(NORM_OUT.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """model.add_rms_norm's contract: (x + delta, RMSNorm(x + delta)); x [..., dim], each row's last dim contiguous."""
    dim = x.shape[-1]
    rows_x = x.reshape(-1, dim)  # a view for the model's inputs, a sliced last position included
    rows_d = delta.reshape(-1, dim) if delta is not None else rows_x
    n = rows_x.shape[0]
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if delta is not None else x
    normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n:
        _add_rms_norm_kernel[(n,)](rows_x, rows_d, weight, total, normed, rows_x.stride(0), rows_d.stride(0), dim, eps,
                                   HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(dim),
                                   num_warps=4 if dim <= 4096 else 8)
    return total, normed
