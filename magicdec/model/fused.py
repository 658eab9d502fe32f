"""Small functions that run as one fused kernel each on the GPU: RMSNorm with its residual add, RoPE, SwiGLU, the KV
store, the split-KV merge.

Eagerly each is 2-10 small kernels per layer. A decode step's matmuls read the weights in a few microseconds per
layer, so those launches and round trips through memory are a visible part of it even inside a CUDA graph (an 8B
self-draft at 32K x 11: results/quant; SmolLM2's 30 narrow layers: results/planner_sweeps). `fuse()` compiles each once for
all shapes (dynamic=True), or swaps in a hand-written Triton kernel where the op reduces (RMSNorm, the merge).
Whole-model torch.compile (--compile) fuses more but compiles again for every batch size and token count, and it
traces the plain functions (fuse() is not called then).
"""
from __future__ import annotations

import functools

import torch

from magicdec.errors import require

_plain: dict[str, object] = {}
_kernels: dict[str, str | None] = {}  # a hand-written replacement's "module.function", imported when fusing
_active: dict[str, object] = {}  # what a call runs: the plain function, or its fused version
_fusing: set[str] | bool = False  # True: every op; a set: those ops alone (fuse's `only`)


def _fused(name: str):
    if _fusing is not True and name not in (_fusing or ()):
        return _plain[name]
    if _kernels[name] is not None:
        module, function = _kernels[name].rsplit(".", 1)
        return getattr(require(module, "the fused kernels on a GPU (--no_fuse runs without them)"), function)
    return torch.compile(_plain[name], dynamic=True)


def op(fn=None, *, kernel: str | None = None):
    """Register `fn` as fusable; calls go to its fused version while fusing is on: `kernel` (a hand-written
    replacement, named "module.function") or else fn compiled. Reductions take a kernel: torch.compile makes one
    per shape, whose summation order differs between 1 row and several, and a verification must round each token
    as a decode step does (results/quant). fuse() may run before the module that defines fn is imported."""
    def register(fn):
        name = f"{fn.__module__}.{fn.__qualname__}"
        _plain[name], _kernels[name] = fn, kernel
        _active[name] = _fused(name)

        @functools.wraps(fn)
        def call(*args):
            return _active[name](*args)

        return call

    return register(fn) if fn is not None else register


def names() -> dict[str, str]:
    """Every registered op's name ("module.function") and what fusing runs for it."""
    return {name: _kernels[name] or "compiled" for name in _plain}


def fuse(enabled: bool = True, only=None) -> None:
    """Fuse every op (enabled), none, or `only` the named ones, the rest plain (benchmarks/verify_agreement.py
    isolates each op this way)."""
    # dynamic=True still guards on strides (a sliced last position is not contiguous): one process running many
    # batch sizes and token counts (a sweep) would pass the default limit of 8 graphs and fall back to eager.
    global _fusing
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    _fusing = enabled and (True if only is None else set(only))
    for name in list(_plain):  # a kernel module imported here may register ops of its own
        _active[name] = _fused(name)
