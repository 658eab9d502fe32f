"""Quantized draft weights for self-speculation (`--draft_weights int8 | fp8`): the draft runs a copy of the
target's linear layers stored in one byte per weight with one scale per output channel, so a draft step reads about
half the weight bytes. The target keeps its own weights, so speculation stays lossless whatever the draft proposes.

A draft step multiplies a few rows of activations (M = B, or 2B for the re-feed) by each weight matrix: it is bound
by reading the weights. Quantizing the activations too, for torch._scaled_mm's FP8 matmul, left 0.77-0.80 of bf16's
time on the H100 at M = 1-64 (issue #23): the extra small kernels and cuBLAS's skinny FP8 kernels ate the halving.
So the weights are dequantized inside one Triton kernel (bf16 activations, fp32 accumulation, the scale applied to
each output column at the end); int8 and FP8 e4m3 differ only in how the byte is read. Without CUDA the same
arithmetic runs as torch ops (the reference the tests hold the kernel to); TRITON_INTERPRET=1 runs the kernel on CPU.
"""
from __future__ import annotations

import copy
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}  # storage dtype, largest magnitude


def quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] in the format's dtype, scale [N] fp32) with w ~ q * scale[:, None]: each output
    channel scaled so its largest |w| lands on the format's largest value (int8: rounded to the nearest integer;
    fp8 e4m3: to the nearest representable value)."""
    dtype, top = FORMATS[fmt]
    w = w.float()
    scale = (w.abs().amax(1) / top).clamp(min=torch.finfo(torch.float32).tiny)  # an all-zero row stays zero
    x = w / scale[:, None]
    q = x.round().clamp(-top, top).to(dtype) if fmt == "int8" else x.clamp(-top, top).to(dtype)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


TUNING = [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": sk}, num_warps=4, num_stages=st)
          for n in (64, 128) for k in (128, 256) for sk in (1, 2, 4, 8) for st in (3,)]
INTERPRETED = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1}  # Triton's CPU interpreter: one config, no tuning


@triton.jit
def _weight_only_kernel(X, W, S, BIAS, Y, PART, M, N, K, stride_xm, stride_wn, stride_ym, M_BUCKET,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr):
    """Program (n, k, m): output columns n*BLOCK_N.., rows m*BLOCK_M.., over the k-th of SPLIT_K ranges of K. A
    draft step has a few rows, so its columns alone give too few programs to keep every SM reading (Llama-3.1-8B's
    o projection: 32 to 64 of them on 132 SMs); splitting K gives more, for a sum of the partial results after."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(pid_k * per_split, tl.minimum((pid_k + 1) * per_split, K), BLOCK_K):
        kk = k + rk
        x = tl.load(X + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w_ok = (rn[None, :] < N) & (kk[:, None] < K)
        w = tl.load(W + rn[None, :] * stride_wn + kk[:, None], mask=w_ok)  # [BLOCK_K, BLOCK_N], one byte each
        acc += tl.dot(x, tl.where(w_ok, w.to(x.dtype), 0.0))  # widened in registers only (fp8 has no integer 0)
    acc *= tl.load(S + rn, mask=rn < N, other=0.0)[None, :]  # one scale per column: partial sums take it too
    ok = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty), mask=ok)
    else:
        tl.store(PART + (pid_k * M + rm[:, None]) * N + rn[None, :], acc, mask=ok)


_tuned = triton.autotune(configs=TUNING, key=["M_BUCKET", "N", "K"])(_weight_only_kernel)


def weight_only_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                       kernel: bool | None = None, config: dict | None = None) -> torch.Tensor:
    """x [..., K] @ (q * scale[:, None]).T (+ bias), without materializing the dequantized weight. `kernel`: the
    Triton kernel (default on CUDA) or the torch-op reference (the scale applied after the matmul, as the kernel);
    `config` (BLOCK_N, BLOCK_K, SPLIT_K) fixes the kernel's tiling instead of tuning it per shape."""
    if not (x.is_cuda if kernel is None else kernel):
        y = F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)
        return y if bias is None else y + bias
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, N = x2.shape[0], q.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_m = min(max(triton.next_power_of_2(M), 16), 64)  # tl.dot needs 16 rows; a draft step has B or 2B
    config = config or (INTERPRETED if os.environ.get("TRITON_INTERPRET") == "1" else None)
    most = config["SPLIT_K"] if config else max(c.kwargs["SPLIT_K"] for c in TUNING)
    part = torch.empty(most, M, N, dtype=torch.float32, device=x.device) if most > 1 else y
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"], triton.cdiv(M, block_m))  # noqa: E731
    args = (x2, q, scale, bias if bias is not None else scale, y, part, M, N, K, x2.stride(0), q.stride(0), y.stride(0),
            block_m)
    if config:
        _weight_only_kernel[grid](*args, HAS_BIAS=bias is not None, BLOCK_M=block_m, **config)
        split = config["SPLIT_K"]
    else:
        _tuned[grid](*args, HAS_BIAS=bias is not None, BLOCK_M=block_m)
        split = _tuned.best_config.kwargs["SPLIT_K"]
    if split > 1:
        y = part[:split].sum(0).to(x.dtype)
        if bias is not None:
            y += bias
    return y.view(*lead, N)


class QuantLinear(nn.Module):
    """An nn.Linear's weight in one byte per element and a scale per output channel."""

    def __init__(self, linear: nn.Linear, fmt: str):
        super().__init__()
        q, scale = quantize(linear.weight, fmt)
        self.fmt = fmt
        # Parameters (frozen), so Transformer.weight_bytes counts them as what a step reads
        self.q = nn.Parameter(q, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return weight_only_linear(x, self.q, self.scale, self.bias)


def quantized_copy(model: nn.Module, fmt: str) -> nn.Module:
    """The draft of `--draft_weights fmt`: `model` with every nn.Linear (q/k/v, o, gate, up, down, LM head) replaced
    by a QuantLinear of it, sharing everything else (embeddings, norms, RoPE frequencies) with the target. Under
    tensor parallelism `model` is this rank's shard, so each rank quantizes its own slice."""
    def clone(module: nn.Module) -> nn.Module:  # new module objects around the same tensors (and the same TP shard)
        new = copy.copy(module)
        new._modules = {name: QuantLinear(child, fmt) if isinstance(child, nn.Linear) else clone(child)
                        for name, child in module._modules.items()}
        return new

    return clone(model)


def copy_bytes(c) -> int:
    """Bytes of a quantized copy of config c's linears (the weights a quantized draft step reads, less the norms):
    one per weight and a 4-byte scale per output channel, the LM head included."""
    h, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    weights = c.n_layers * (c.dim * (h + 2 * kv) + h * c.dim + 3 * c.dim * c.intermediate_size) + c.vocab_size * c.dim
    rows = c.n_layers * (h + 2 * kv + 2 * c.dim + 2 * c.intermediate_size) + c.vocab_size  # qkv, o, gate, up, down
    return weights + 4 * rows


def fp8_supported(device: torch.device) -> bool:
    """FP8 e4m3 needs compute capability 8.9 (Ada) or 9.0 (Hopper) for the kernel's conversion."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)
