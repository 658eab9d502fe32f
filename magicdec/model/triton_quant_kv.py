"""The Triton kernel that quantizes K and V rows into QuantizedKVCache's codes as they are written (quant_kv's
`store_quantized` on the GPU, swapped in by fused.fuse()). Its own module so that quant_kv, and every drafter that
uses it, imports without Triton: a CPU install has none."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _store_kernel(X, CODES, SZ, SLOTS, stride_xb, stride_xt, stride_xh, stride_cb, stride_ch, stride_cs,
                  stride_zb, stride_zh, T, n_kv_heads, D: tl.constexpr, BITS: tl.constexpr):
    """One row (token t of KV head h of sequence b) of x [B, T, Hkv, D] quantized into its slot: as `quantize`."""
    r = tl.program_id(0)
    b, t, h = r // (T * n_kv_heads), (r // n_kv_heads) % T, r % n_kv_heads
    DH: tl.constexpr = D // 2
    half = tl.arange(0, DH)
    x_at = X + b * stride_xb + t * stride_xt + h * stride_xh
    xa, xb = tl.load(x_at + half).to(tl.float32), tl.load(x_at + DH + half).to(tl.float32)
    lo = tl.minimum(tl.min(xa, 0), tl.min(xb, 0))
    hi = tl.maximum(tl.max(xa, 0), tl.max(xb, 0))
    scale = tl.maximum((hi - lo) / 255, 1e-6).to(tl.float16).to(tl.float32)
    zero = lo.to(tl.float16).to(tl.float32)
    ca = tl.minimum(tl.maximum(tl.floor((xa - zero) / scale + 0.5), 0), 255).to(tl.uint8)
    cb = tl.minimum(tl.maximum(tl.floor((xb - zero) / scale + 0.5), 0), 255).to(tl.uint8)
    slot = tl.load(SLOTS + b * T + t)
    c_at = CODES + b * stride_cb + h * stride_ch + slot * stride_cs
    z_at = SZ + b * stride_zb + h * stride_zh + 2 * slot
    if BITS == 8:
        tl.store(c_at + half, ca)
        tl.store(c_at + DH + half, cb)
        tl.store(z_at, scale.to(tl.float16))
        tl.store(z_at + 1, zero.to(tl.float16))
    else:
        tl.store(c_at + half, (ca >> 4) | ((cb >> 4) << 4))
        tl.store(z_at, (16 * scale).to(tl.float16))
        tl.store(z_at + 1, (zero + 7.5 * scale).to(tl.float16))


def store_quantized_kernel(k_codes, v_codes, k_sz, v_sz, rows, slots, k, v, bits: int) -> None:
    """store_quantized in one Triton launch per K and V (what fused.fuse() runs on the GPU)."""
    B, T, Hkv, D = k.shape
    slots = slots.contiguous()
    for x, codes, sz in ((k, k_codes, k_sz), (v, v_codes, v_sz)):
        assert x.stride(3) == 1 and codes.stride(3) == 1 and sz.is_contiguous()
        _store_kernel[(B * T * Hkv,)](x, codes, sz, slots, x.stride(0), x.stride(1), x.stride(2), codes.stride(0),
                                      codes.stride(1), codes.stride(2), sz.stride(0), sz.stride(1), T, Hkv, D=D,
                                      BITS=bits)
