"""QuantSpec's draft KV: the target's whole KV cache read through a quantized copy instead of a small window.

Each row (one token of one KV head, K or V alike) is quantized asymmetrically to 8 bits, x ~ code * scale + zero with
the row's minimum as zero and (max - min) / 255 as scale, both kept in fp16 beside the codes. The 4-bit copy is the
upper nibble of those 8-bit codes (QuantSpec's hierarchical layout: the 8-bit code is upper * 16 + lower), read as
the middle of its 16 codes: x ~ upper * (16 scale) + (zero + 7.5 scale); two nibbles share a byte, dims j and j + D/2.
Rows, not channels (KIVI's and QuantSpec's keys are quantized per channel over groups of tokens): a row is complete
once its token is written, so no full-precision buffer of the latest tokens is needed.

The draft writes its own tokens' KV into the copy as it drafts (quantized as they are written), as every self-draft
here keeps its own KV for what it generated. The copy starts from the target's prefilled cache: no draft prefill.
Attention reads the codes in the split-KV Triton kernel (magicdec/model/triton_attention.py) on a GPU; elsewhere, and for
long chunks, it dequantizes the layer and runs the reference attention.
"""
from __future__ import annotations

import torch

from magicdec.model import fused
from magicdec.model.attention import TRITON_MAX_T, make_attend
from magicdec.errors import require
from magicdec.model.forward_plan import PLAIN, ForwardPlan
from magicdec.model.kv_cache import KVCache

FORMATS = ("bf16", "int8", "int4")
BITS = {"int8": 8, "int4": 4}


def row_bytes(head_dim: int, bits: int) -> int:
    """Bytes of one quantized row: its codes, and its scale and zero point in fp16."""
    return head_dim * bits // 8 + 4


def kv_bytes_per_token(c, fmt: str) -> int:
    """Bytes of one token's K and V over every layer in format `fmt` (bf16: the model's own cache)."""
    per_row = 2 * c.head_dim if fmt == "bf16" else row_bytes(c.head_dim, BITS[fmt])
    return 2 * c.n_layers * c.n_kv_heads * per_row


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (uint8 codes [..., D * bits / 8], fp16 [..., 2] scale and zero point per row)."""
    x = x.float()
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = ((hi - lo) / 255).clamp(min=1e-6).half().float()
    zero = lo.half().float()
    codes = torch.floor((x - zero) / scale + 0.5).clamp(0, 255)  # halves up, as the store kernel rounds
    if bits == 8:
        return codes.to(torch.uint8), torch.cat([scale, zero], -1).half()
    upper = codes.to(torch.uint8) >> 4
    D = x.shape[-1]
    packed = upper[..., :D // 2] | (upper[..., D // 2:] << 4)
    return packed, torch.cat([16 * scale, zero + 7.5 * scale], -1).half()


def dequantize(codes: torch.Tensor, scale_zero: torch.Tensor, bits: int, dtype=torch.float32) -> torch.Tensor:
    """The values [..., D] that codes and their rows' scale and zero point stand for."""
    if bits == 4:
        codes = torch.cat([codes & 15, codes >> 4], -1)
    sz = scale_zero.float()
    return (codes.float() * sz[..., :1] + sz[..., 1:]).to(dtype)


@fused.op(kernel="magicdec.model.triton_quant_kv.store_quantized_kernel")
def store_quantized(k_codes, v_codes, k_sz, v_sz, rows, slots, k, v, bits: int) -> None:
    """k, v [B, T, Hkv, D] quantized into the codes and scale buffers at each sequence's slots [B, T]. On a GPU one
    Triton kernel each (triton_quant_kv.store_quantized_kernel): eagerly a dozen small kernels per layer, compiled
    still several (results/quant_kv)."""
    (kc, ksz), (vc, vsz) = quantize(k, bits), quantize(v, bits)
    k_codes[rows, :, slots], v_codes[rows, :, slots] = kc, vc
    k_sz[rows, :, slots], v_sz[rows, :, slots] = ksz, vsz


class QuantizedKVCache(KVCache):
    """A full cache (slot s holds position s) whose K and V are kept as codes with a scale and zero point per row:
    `k[layer]`, `v[layer]` uint8 [B, Hkv, S, D * bits / 8], `k_sz[layer]`, `v_sz[layer]` fp16 [B, Hkv, S, 2]."""

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int, bits: int,
                 dtype: torch.dtype, device, backend: str = "sdpa"):
        self.bits, self.dtype = bits, dtype
        codes = (batch_size, n_kv_heads, max_len, head_dim * bits // 8)
        rows = (batch_size, n_kv_heads, max_len, 2)
        self.k = [torch.zeros(codes, dtype=torch.uint8, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(codes, dtype=torch.uint8, device=device) for _ in range(n_layers)]
        self.k_sz = [torch.zeros(rows, dtype=torch.float16, device=device) for _ in range(n_layers)]
        self.v_sz = [torch.zeros(rows, dtype=torch.float16, device=device) for _ in range(n_layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len, self.backend = max_len, backend
        self._rows = torch.arange(batch_size, device=device)[:, None]
        self._slots = None
        if self.lengths.is_cuda:
            for t in (*self.k, *self.v, *self.k_sz, *self.v_sz, self.lengths):
                torch._dynamo.mark_static_address(t)

    @classmethod
    def of(cls, target: KVCache, bits: int, max_len: int | None = None, chunk: int = 4096) -> "QuantizedKVCache":
        """The quantized copy of a prefilled cache (`chunk` positions at a time: the fp32 rows of a whole 100K
        layer would be gigabytes)."""
        B, Hkv, S, D = target.k[0].shape
        cache = cls(len(target.k), B, Hkv, max_len or S, D, bits, target.k[0].dtype, target.lengths.device,
                    target.backend)
        n = int(target.lengths.max())
        for layer in range(len(target.k)):
            k, v = target.layer_kv(layer)
            for start in range(0, n, chunk):
                part = slice(start, min(start + chunk, n))
                cache.k[layer][:, :, part], cache.k_sz[layer][:, :, part] = quantize(k[:, :, part], bits)
                cache.v[layer][:, :, part], cache.v_sz[layer][:, :, part] = quantize(v[:, :, part], bits)
        cache.lengths.copy_(target.lengths)
        return cache

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Quantize k, v [B, T, Hkv, D] into each sequence's next T slots; returns the layer's (codes, scale and
        zero) pairs for K and V, what this cache's attention reads."""
        store_quantized(self.k[layer], self.v[layer], self.k_sz[layer], self.v_sz[layer], self._rows,
                        self.write_slots(layer, k.shape[1]), k, v, self.bits)
        return (self.k[layer], self.k_sz[layer]), (self.v[layer], self.v_sz[layer])

    def take(self, source: KVCache, pos: torch.Tensor) -> None:
        """Each sequence's K and V at position pos [B], every layer, quantized from `source` (the target's cache,
        which verified them): what the hierarchy's middle level takes instead of a forward of its own."""
        for layer in range(len(self.k)):
            k, v = source.kv_at(layer, pos)  # [B, Hkv, D]
            store_quantized(self.k[layer], self.v[layer], self.k_sz[layer], self.v_sz[layer], self._rows,
                            pos[:, None], k[:, None], v[:, None], self.bits)

    def attend(self, T: int, plan: ForwardPlan = PLAIN):
        self.claim(self._next(T, plan))
        pos = self.positions(T, plan)
        if self.backend in ("triton", "flash") and T <= TRITON_MAX_T:
            split_kv_attention = require("magicdec.model.triton_attention", "a quantized cache's attention on a GPU"
                                         ).split_kv_attention

            def attend(q, k, v, layer=None):
                return split_kv_attention(q, k[0], v[0], pos, None, k_scale_zero=k[1], v_scale_zero=v[1],
                                          kv_bits=self.bits)
            return attend
        inner = make_attend("sdpa", pos, None, self.max_len)

        def attend(q, k, v, layer=None):  # the reference: the layer dequantized
            return inner(q, dequantize(*k, self.bits, q.dtype), dequantize(*v, self.bits, q.dtype), layer)
        return attend

    def layer_kv(self, layer: int):
        return dequantize(self.k[layer], self.k_sz[layer], self.bits, self.dtype), \
            dequantize(self.v[layer], self.v_sz[layer], self.bits, self.dtype)

    def kv_at(self, layer: int, pos: torch.Tensor):
        rows = self._rows[:, 0]
        return tuple(dequantize(c[layer][rows, :, pos], sz[layer][rows, :, pos], self.bits, self.dtype)
                     for c, sz in ((self.k, self.k_sz), (self.v, self.v_sz)))

    def fill_random(self, length: int, seed: int) -> None:
        """Random codes, and scales and zero points of rows drawn from a unit normal (random-weight speed runs)."""
        gen = torch.Generator(device=self.lengths.device).manual_seed(seed)
        for t in (*self.k, *self.v):
            t.copy_(torch.randint(0, 256, t.shape, generator=gen, device=t.device, dtype=torch.uint8))
        for t in (*self.k_sz, *self.v_sz):
            t[..., 0].fill_(6 / 255 * (16 if self.bits == 4 else 1))
            t[..., 1].fill_(-3)
        self.lengths.fill_(length)
