"""Small functions that run as one fused kernel each on the GPU: RMSNorm with its residual add, RoPE, SwiGLU, the KV
store, the split-KV merge.

Eagerly each is 2-10 small kernels per layer. A decode step's matmuls read the weights in a few microseconds per
layer, so those launches and round trips through memory are a visible part of it even inside a CUDA graph (an 8B
self-draft at 32K x 11: results/quant; SmolLM2's 30 narrow layers: results/issue5). `fuse()` compiles each once for
all shapes (dynamic=True). Whole-model torch.compile (--compile) fuses more but compiles again for every batch size
and token count, and it traces the plain functions (fuse() is not called then).
"""
from __future__ import annotations

import functools

import torch

_plain: dict[str, object] = {}
_active: dict[str, object] = {}  # what a call runs: the plain function, or its compiled version
_fusing = False


def _compiled(fn):
    return torch.compile(fn, dynamic=True) if _fusing else fn


def op(fn):
    """Register `fn` as fusable; calls go to its compiled version while fusing is on (fuse() may run before the
    module that defines fn is imported: attention's kernel module is imported on first use)."""
    name = f"{fn.__module__}.{fn.__qualname__}"
    _plain[name], _active[name] = fn, _compiled(fn)

    @functools.wraps(fn)
    def call(*args):
        return _active[name](*args)

    return call


def fuse(enabled: bool = True) -> None:
    # dynamic=True still guards on strides (a sliced last position is not contiguous): one process running many
    # batch sizes and token counts (a sweep) would pass the default limit of 8 graphs and fall back to eager.
    global _fusing
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    _fusing = enabled
    for name, fn in _plain.items():
        _active[name] = _compiled(fn)
