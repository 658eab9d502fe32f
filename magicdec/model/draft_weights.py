"""Draft weight formats: a draft's own copy of its linear layers (the LM head included) in 8 or 4 bits, quantized once
from the model's weights, so each draft step reads fewer weight bytes. The target keeps its weights: verification,
and so the output, is unchanged whatever the draft reads.

    bf16  the model's own weights (no copy)
    int8  symmetric, one scale per output channel
    fp8   e4m3, one scale per output channel
    int4  asymmetric, a scale and a zero point per group of `group` input columns (w = (q - zero) * scale)

The kernels are libraries': gemlite's Triton weight-only kernels (8 and 4 bits) and PyTorch's tinygemm int4 matmul
on a GPU, chosen per row count M (KERNELS); on a CPU a reference that dequantizes and multiplies. Scales and zero
points are rounded to bf16 where a kernel stores them so, whatever the device, so every path multiplies by the same
numbers.
"""
from __future__ import annotations

import copy
import itertools
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from magicdec.errors import INSTALL, MagicDecError, installed, require

FORMATS = ("bf16", "int8", "fp8", "int4")
BITS = {"bf16": 16, "int8": 8, "fp8": 8, "int4": 4}
LINEARS = ("wqkv", "wo", "w1", "w3", "w2", "output")  # every matmul of a decode step
FP8 = torch.float8_e4m3fn
GEMLITE_INSTALL = INSTALL["gemlite"]
# The GPU kernel per format, by the largest row count M (batch x tokens) it runs, read off the probe in
# results/draft_weights/probe. Past a format's last bound its kernels no longer beat bf16 on an H100: such calls (a
# large batch, a prefill chunk) run the model's own weights, which also spares gemlite an autotune of its GEMM at
# each new shape.
KERNELS = {"int8": ((26, "gemlite"),), "fp8": ((32, "gemlite"),), "int4": ((4, "tinygemm"), (16, "gemlite"))}


@dataclass(frozen=True)
class Quantized:
    """One weight matrix [N, K] in a low-bit format: `data` int8 / float8 [N, K] or int4 values as uint8 0..15;
    `scale` [N, 1] (8-bit) or [N, K / group] (int4) and `zero` [N, K / group] (int4), float32."""
    fmt: str
    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    def to(self, device) -> "Quantized":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Quantized(self.fmt, move(self.data), move(self.scale), move(self.zero), self.group)


def quantize(w: torch.Tensor, fmt: str, group: int = 128, rows: int = 8192) -> Quantized:
    """w [N, K] in the format (per output channel, or per `group` input columns for int4), on w's device, `rows`
    rows at a time (an 8B model's LM head in fp32 at once would take 2 GB)."""
    parts = [quantize_rows(w[i:i + rows], fmt, group) for i in range(0, w.shape[0], rows)]
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
    return Quantized(fmt, cat([p.data for p in parts]), cat([p.scale for p in parts]), cat([p.zero for p in parts]),
                     parts[0].group)


def quantize_rows(w: torch.Tensor, fmt: str, group: int) -> Quantized:
    w = w.detach().float()
    if fmt == "int8":
        scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-8)
        return Quantized(fmt, (w / scale).round().clamp(-127, 127).to(torch.int8), scale, None, w.shape[1])
    if fmt == "fp8":
        scale = (w.abs().amax(1, keepdim=True) / torch.finfo(FP8).max).clamp(min=1e-12)
        return Quantized(fmt, (w / scale).to(FP8), scale, None, w.shape[1])
    if fmt == "int4":
        N, K = w.shape
        g = w.view(N, K // group, group)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = bf16_values(((hi - lo) / 15).clamp(min=1e-8))
        zero = bf16_values(-lo / scale)
        q = (g / scale[..., None] + zero[..., None]).round().clamp(0, 15).to(torch.uint8)
        return Quantized(fmt, q.view(N, K), scale, zero, group)
    raise MagicDecError(f"unknown draft weight format {fmt!r}: choose one of {', '.join(FORMATS)}")


def bf16_values(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def dequantize(q: Quantized, dtype) -> torch.Tensor:
    """The weight the format stands for, [N, K] in `dtype`: the reference every kernel computes with."""
    if q.fmt == "int4":
        N, K = q.shape
        g = q.data.view(N, K // q.group, q.group).float()
        return ((g - q.zero[..., None]) * q.scale[..., None]).view(N, K).to(dtype)
    return (q.data.float() * q.scale).to(dtype)


def format_bytes(N: int, K: int, fmt: str, group: int) -> int:
    """Bytes one [N, K] matrix takes (and a step reads) in the format, its scales and zero points included."""
    if fmt == "bf16":
        return 2 * N * K
    if fmt == "int4":
        return N * K // 2 + 2 * 2 * N * (K // group)
    return N * K + 4 * N


def check_format(fmt: str, group: int, dims: dict[str, int] | None = None, device=None) -> None:
    """One-line errors for a format this run cannot use, before anything is quantized: an unknown format, a group
    that does not divide a layer's input width (`dims`: name -> K), a device without the format's kernels."""
    if fmt not in FORMATS:
        raise MagicDecError(f"--draft_weights {fmt}: choose one of {', '.join(FORMATS)}")
    if fmt == "int4":
        if group < 2 or group % 2:
            raise MagicDecError(f"--draft_group {group}: must be an even number of input columns (e.g. 64 or 128)")
        for name, K in (dims or {}).items():
            if K % group:
                fits = [g for g in (128, 64, 32) if K % g == 0 and all(k % g == 0 for k in dims.values())]
                hint = f"--draft_group {fits[0]}" if fits else "a group dividing every layer's input width"
                raise MagicDecError(f"--draft_group {group} does not divide {name}'s input width {K}: use {hint}")
    if fmt == "bf16" or device is None or torch.device(device).type != "cuda":
        return
    if not installed("gemlite"):
        raise MagicDecError(f"--draft_weights {fmt} on a GPU needs gemlite, which is not installed: {GEMLITE_INSTALL}")
    major, minor = torch.cuda.get_device_capability(device)
    if fmt == "fp8" and (major, minor) < (8, 9):
        raise MagicDecError(f"--draft_weights fp8 needs a GPU with fp8 (compute capability 8.9+, Ada or Hopper); "
                            f"this one is {major}.{minor}: use int8")
    if (major, minor) < (8, 0):
        raise MagicDecError(f"--draft_weights {fmt}: its kernels need compute capability 8.0+ (Ampere or newer); "
                            f"this GPU is {major}.{minor}: use bf16")


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """Each quantized layer's weight shape [N, K] (a decoder layer's five, and the LM head)."""
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    return {"wqkv": (q + 2 * kv, config.dim), "wo": (config.dim, q), "w1": (config.intermediate_size, config.dim),
            "w3": (config.intermediate_size, config.dim), "w2": (config.dim, config.intermediate_size),
            "output": (config.vocab_size, config.dim)}


def input_widths(config) -> dict[str, int]:
    """Each quantized layer's input width K (what an int4 group must divide)."""
    return {name: K for name, (_, K) in linear_shapes(config).items()}


def copy_bytes(config, fmt: str, group: int) -> int:
    """Bytes of a model's quantized copy (its linear layers and LM head; 0 for bf16)."""
    if fmt == "bf16":
        return 0
    sizes = {name: format_bytes(N, K, fmt, group) for name, (N, K) in linear_shapes(config).items()}
    return config.n_layers * (sum(sizes.values()) - sizes["output"]) + sizes["output"]


def kernel_choices(fmt: str, M: int) -> list[str]:
    """The GPU kernels a call of M rows tries, in order (KERNELS); past the format's last bound the model's own
    weights ("full")."""
    return [kernel for most, kernel in KERNELS[fmt] if M <= most] or ["full"]


class QuantLinear(nn.Module):
    """A linear layer over a Quantized weight. On a GPU a call of a few rows (a draft step) runs the kernel KERNELS
    gives for its row count, built at its first use (a graph's eager warm-up) so that only the kernels a run needs
    hold packed weights, else the reference; a longer call (a prefill chunk, or a batch where no kernel of the
    format paid) runs the model's own weight `full`, shared with the model. On a CPU every call runs the reference,
    so the format is what its tests and acceptance runs see at any size. The quantized values stay on the host."""

    def __init__(self, q: Quantized, bias: torch.Tensor | None, full: torch.Tensor):
        super().__init__()
        self.q, self.bias, self.full = q.to("cpu"), bias, full
        self.out_features, self.in_features = q.shape
        self.kernels, self.unbuilt, self._dense = {}, {}, None

    def kernel_for(self, M: int) -> str:
        if self.full.device.type != "cuda":
            return "reference"
        return next((k for k in kernel_choices(self.q.fmt, M) if k not in self.unbuilt), "reference")

    def kernel(self, name: str):
        """The named kernel, built (from the quantized values, packed by its library) at its first use."""
        if name not in self.kernels:
            try:
                self.kernels[name] = BUILD[name](self.q.to(self.full.device), self.bias, self.full.dtype)
            except Exception as e:  # a shape the library does not take: the next kernel, or the reference
                self.unbuilt[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                return None
        return self.kernels[name]

    def dense(self, dtype) -> torch.Tensor:
        """The dequantized weight on the model's device, kept (the reference: a CPU's path, and a GPU's for a shape
        no library kernel takes)."""
        if self._dense is None or self._dense.dtype != dtype:
            self._dense = dequantize(self.q.to(self.full.device), dtype)
        return self._dense

    def resolve(self, M: int) -> str:
        """The kernel a call of M rows runs, built if it was not (one that cannot be: the next, or the reference)."""
        name = self.kernel_for(M)
        while name not in ("full", "reference") and self.kernel(name) is None:
            name = self.kernel_for(M)
        return name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        name = self.resolve(rows.shape[0])
        if name == "full":
            out = F.linear(rows, self.full, self.bias)
        elif name == "reference":
            out = F.linear(rows, self.dense(x.dtype), self.bias)
        else:
            out = self.kernels[name](rows)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        g = f", group {self.q.group}" if self.q.fmt == "int4" else ""
        return f"{self.in_features} -> {self.out_features}, {self.q.fmt}{g}"


def kernels_used(model: nn.Module, M: int) -> dict:
    """Which kernel each quantized layer runs at M rows, counted (and why a kernel could not be built): for the
    record. Builds what M needs, as the run's first call at M would."""
    used, unbuilt = {}, {}
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            k = m.resolve(M)
            used[k] = used.get(k, 0) + 1
            for kernel, why in m.unbuilt.items():
                unbuilt.setdefault(kernel, why)
    return {"M": M, "layers_by_kernel": used, **({"not_built": unbuilt} if unbuilt else {})}


def gemlite_kernel(q: Quantized, bias, dtype):
    N, K = q.shape
    # On SmolLM2's K = 576 its int8 kernel crashed (illegal memory access) and its int4 one (group 64) drafted
    # tokens the target never accepted; Llama's widths (multiples of 128, group 128) matched the reference.
    if K % 128 or N % 128 or (q.fmt == "int4" and q.group != 128):
        raise ValueError(f"gemlite is used here only where it was checked: widths that are multiples of 128 (this "
                         f"layer: {N} x {K}) and int4 groups of 128")
    helper = require("gemlite.helper", f"--draft_weights {q.fmt} on a GPU")
    A16W4_HQQ_INT, A16W8_FP8, A16W8_INT8 = helper.A16W4_HQQ_INT, helper.A16W8_FP8, helper.A16W8_INT8

    load_gemlite_config(q.data.device)
    dev = q.data.device
    if q.fmt == "int4":
        layer = A16W4_HQQ_INT(device=dev, dtype=dtype).from_weights(q.data, q.scale.to(dtype), q.zero.to(dtype), bias)
    else:
        maker = A16W8_FP8 if q.fmt == "fp8" else A16W8_INT8
        layer = maker(device=dev, dtype=dtype).from_weights(q.data, bias=bias, scales=q.scale)
    return layer


_configs_loaded: set = set()


def load_gemlite_config(device) -> None:
    """gemlite's shipped kernel configs for this GPU (a shape they lack is autotuned at its first use)."""
    import os

    gemlite = require("gemlite", "--draft_weights on a GPU")
    name = torch.cuda.get_device_name(device)
    shipped = {"H100": "h100", "H200": "h100", "H20": "h100", "A100": "a100", "L40S": "l40s", "L40": "l40",
               "A6000": "a6000", "4090": "4090", "5090": "5090", "L4": "l4", "A40": "a40"}
    key = next((v for k, v in shipped.items() if k in name), None)
    if key is None or key in _configs_loaded:
        return
    path = os.path.join(os.path.dirname(gemlite.__file__), "configs", f"{key}.json")
    if os.path.exists(path):
        gemlite.load_config(path)
    _configs_loaded.add(key)


def tinygemm_kernel(q: Quantized, bias, dtype):
    """PyTorch's int4 matmul (tinygemm): its weights packed by torch, its zero point around 8: w = (q - 8) * s + z'
    with z' = (8 - zero) * s."""
    if dtype != torch.bfloat16 or bias is not None:
        raise ValueError("tinygemm takes bf16 activations and no bias")
    N, K = q.shape
    packed = torch.ops.aten._convert_weight_to_int4pack((q.data[:, ::2] << 4 | q.data[:, 1::2]).contiguous(), 8)
    zero = (8 - q.zero) * q.scale
    scales_zeros = torch.stack([q.scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    group = q.group
    return lambda x: torch.ops.aten._weight_int4pack_mm(x.contiguous(), packed, group, scales_zeros)


BUILD = {"gemlite": gemlite_kernel, "tinygemm": tinygemm_kernel}

_copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def draft_copy(model: nn.Module, fmt: str, group: int) -> nn.Module:
    """`model` with its linear layers and LM head in `fmt`, everything else (embeddings, norms, RoPE) shared with it.
    A run's batches reuse it; one copy per model is kept, so a sweep over formats holds one at a time. bf16: the
    model itself."""
    if fmt == "bf16":
        return model
    key, made = _copies.get(model, (None, None))
    if key != (fmt, group):
        _copies.pop(model, None)
        made = None  # the last format's copy goes before the next one is made
        made = quantized_copy(model, fmt, group)
        _copies[model] = ((fmt, group), made)
    return made


def forget_copies() -> None:
    """Let go of the kept copies (a sweep's next group of points checks its memory without the last one's)."""
    _copies.clear()


def quantized_copy(model: nn.Module, fmt: str, group: int) -> nn.Module:
    # A deep copy of the module tree whose memo already holds every tensor (and the shard's process group): new
    # modules, the same parameters; then each linear layer swapped for its quantized one.
    shared = itertools.chain(model.parameters(), model.buffers(), [model.inv_freq])
    memo = {id(t): t for t in shared}
    for m in model.modules():
        if getattr(m, "shard", None) is not None:
            memo[id(m.shard)] = m.shard
    draft = copy.deepcopy(model, memo)
    for name, module in list(draft.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in LINEARS and isinstance(child, nn.Linear):
                setattr(module, child_name, QuantLinear(quantize(child.weight, fmt, group), child.bias, child.weight))
    return draft
