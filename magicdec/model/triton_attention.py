"""Split-KV ("flash-decoding") attention for decode and verification, in Triton.

At long context a decode step is bound by reading the KV cache, and there are only B * n_kv_heads (head, sequence)
pairs — 64 for Llama-3-8B at B=8, fewer than an H100's 132 multiprocessors. So each pair's keys are cut into
`n_splits` ranges handled by separate programs, whose partial softmax results are merged afterwards. The G query
heads sharing a KV head and the T query tokens (T = 1 for decode, gamma + 1 for verification) become the rows of one
tile, so every K/V block is read from memory once for all of them: GQA keeps its bandwidth saving and verifying
several tokens costs about what one does.

K and V may also be quantized codes (QuantSpec's draft, magicdec/model/quant_kv.py): 8 bits, or 4 bits packed two to a
byte (dims j and j + D/2), each row (a token of one KV head) with a scale and zero point, x = code * scale + zero.
The codes enter the matmuls as they are and the scales are applied to the products: q . k = scale * (q . code) +
zero * sum(q), and p @ v = (p * scale) @ code + sum(p * zero), so dequantizing costs no pass over a [keys, D] tile.

Set TRITON_INTERPRET=1 before import to run it on the CPU (the tests do).
"""
from __future__ import annotations

import functools
import itertools
import math

import torch
import triton
import triton.language as tl

from magicdec.model import fused
NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": an empty split must give weight 0, not NaN
LN2 = tl.constexpr(0.6931471805599453)
MIN_KEYS_PER_ROW = 16  # a split's shortest length per query row of its program (choose_splits)
DECODE_ROWS = 16  # a program of at most this many query rows is bound by its K/V reads (choose_splits)
WAVE_FILL = 0.9  # the least share of the SMs a verification's last wave of programs keeps busy (choose_splits)
ROW_BLOCK = 128  # rows per program: more (a 64-node tree's) go to more programs, each reading its split's K/V


@triton.jit
def _halves(base, offs, stride, in_range, DH: tl.constexpr, KV_BITS: tl.constexpr):
    """The codes of BLOCK_N rows as two [BLOCK_N, D/2] halves (dims below D/2, dims from D/2): 8 bits as stored;
    4 bits from one byte per pair, dim j in its low and dim j + D/2 in its high nibble. Halves, not one tile: the
    nibbles come apart with no shuffle across the tile (joining them back cost more than the bytes saved)."""
    half = tl.arange(0, DH)
    at = base + offs[:, None] * stride + half[None, :]
    if KV_BITS == 4:
        byte = tl.load(at, mask=in_range[:, None], other=0)
        return byte & 15, byte >> 4
    return tl.load(at, mask=in_range[:, None], other=0), tl.load(at + DH, mask=in_range[:, None], other=0)


@triton.jit
def _store_scores(SCORES, s, pid_bh, rows, row_ok, offs, in_range, n_slots, T: tl.constexpr, ROWS: tl.constexpr):
    """The first query's scaled logits, one row per query head (rows h*G*T + g*T), for --refresh."""
    head = pid_bh * (ROWS // T) + rows // T
    first = row_ok & (rows % T == 0)
    tl.store(SCORES + head[:, None] * n_slots + offs[None, :], s, mask=first[:, None] & in_range[None, :])


@triton.jit
def _online_softmax(s, m_i, l_i, SCALE_LOG2: tl.constexpr):
    """One KV block's step of the running softmax over raw scores s [rows, keys]: the new maximum (log2 units) and
    sum, the factor that rescales what was accumulated, and the block's weights p (one multiply-add and exp2 each)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * SCALE_LOG2)
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s * SCALE_LOG2 - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def _split_kv_kernel(Q, K, V, QPOS, KPOS, ACC, M_OUT, L_OUT, SCORES, KSZ, VSZ, TREE_BITS, TREE_BASE,
                     stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                     stride_zb, stride_zh, n_kv_heads, n_slots, split_len, sinks, window, n_tree,
                     SCALE: tl.constexpr, SCALE_LOG2: tl.constexpr, T: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KPOS: tl.constexpr, N_SPLITS: tl.constexpr,
                     HAS_SCORES: tl.constexpr, KV_BITS: tl.constexpr, TREE: tl.constexpr, HAS_WINDOW: tl.constexpr):
    # the row blocks of one (sequence, head, split) are neighbours in the launch order, so they run together and
    # the second reads its K/V from L2, not from memory
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # this program's block of the G * T rows
    split = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // n_kv_heads
    h = pid_bh % n_kv_heads
    dims = tl.arange(0, D)
    DH: tl.constexpr = D // 2
    half = tl.arange(0, DH)
    row_ok = rows < ROWS
    # Row r is query head (h * G + r // T) at token r % T. q is read through its strides: the model's q is a
    # transposed slice of the rotated q and k heads, which a contiguous copy would cost a kernel per layer.
    q_pos = tl.load(QPOS + b * T + rows % T, mask=row_ok, other=-1)
    q_row = b * stride_qb + (h * (ROWS // T) + rows // T) * stride_qh + (rows % T) * stride_qt
    if KV_BITS == 16:
        q = tl.load(Q + q_row[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
    else:  # codes: q and the output in halves of the head dimension
        q_a = tl.load(Q + q_row[:, None] + half[None, :], mask=row_ok[:, None], other=0.0)
        q_b = tl.load(Q + q_row[:, None] + DH + half[None, :], mask=row_ok[:, None], other=0.0)
        q_sum = tl.sum(q_a.to(tl.float32), axis=1) + tl.sum(q_b.to(tl.float32), axis=1)  # a zero point's weight
        acc_a = tl.zeros([BLOCK_M, DH], tl.float32)
        acc_b = tl.zeros([BLOCK_M, DH], tl.float32)

    start = split * split_len
    end = tl.minimum(start + split_len, n_slots)
    if TREE:  # a token tree's node j sits in the slot of position base + j (base: the root's position)
        base = tl.load(TREE_BASE + b)
        bits = tl.load(TREE_BITS + rows % T, mask=row_ok, other=0)  # each row's ancestors, one bit per node
        if not HAS_KPOS:  # a full cache: slot = position, nothing past the tree's last node
            end = tl.minimum(end, base + n_tree)
    elif not HAS_KPOS:  # full cache: slots past the last query position are never visible
        end = tl.minimum(end, tl.load(QPOS + b * T + T - 1) + 1)

    m_i = tl.full([BLOCK_M], NEG, tl.float32)  # the running maximum, in log2 units (scores * SCALE * log2 e)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    z_base = b * stride_zb + h * stride_zh  # scale and zero point of slot s at 2s, 2s + 1
    clear = start  # the blocks before `clear` are whole and visible to every row: no mask, no bounds, no where
    if KV_BITS == 16 and not HAS_KPOS and not HAS_WINDOW:
        if TREE:
            shown = base  # the committed slots before the tree's root
        else:
            shown = tl.load(QPOS + b * T)  # the slots before the first query's position
        clear = start + tl.maximum(tl.minimum(end, shown) - start, 0) // BLOCK_N * BLOCK_N
        for n in range(start, clear, BLOCK_N):
            offs = n + tl.arange(0, BLOCK_N)
            k = tl.load(k_base + offs[:, None] * stride_ks + dims[None, :])
            s = tl.dot(q, tl.trans(k))
            if HAS_SCORES:
                _store_scores(SCORES, s * SCALE, pid_bh, rows, row_ok, offs, offs < end, n_slots, T, ROWS)
            m_i, l_i, alpha, p = _online_softmax(s, m_i, l_i, SCALE_LOG2)
            v = tl.load(v_base + offs[:, None] * stride_vs + dims[None, :])
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    for n in range(clear, end, BLOCK_N):
        offs = n + tl.arange(0, BLOCK_N)
        in_range = offs < end
        if KV_BITS == 16:
            k = tl.load(k_base + offs[:, None] * stride_ks + dims[None, :], mask=in_range[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k))
        else:
            k_a, k_b = _halves(k_base, offs, stride_ks, in_range, DH, KV_BITS)
            s = tl.dot(q_a, tl.trans(k_a.to(q_a.dtype))) + tl.dot(q_b, tl.trans(k_b.to(q_b.dtype)))
            k_scale = tl.load(KSZ + z_base + 2 * offs, mask=in_range, other=0.0).to(tl.float32)
            k_zero = tl.load(KSZ + z_base + 2 * offs + 1, mask=in_range, other=0.0).to(tl.float32)
            s = s * k_scale[None, :] + q_sum[:, None] * k_zero[None, :]
        if HAS_KPOS:
            k_pos = tl.load(KPOS + b * n_slots + offs, mask=in_range, other=0)
        else:
            k_pos = offs
        if TREE:
            rel = k_pos - base
            node = tl.where((rel >= 0) & (rel < n_tree), rel, 0)
            if HAS_KPOS:  # a ring: the tree's slots are wherever their positions map
                ancestor = ((bits[:, None] >> node[None, :].to(tl.int64)) & 1) != 0
                visible = in_range[None, :] & ((rel[None, :] < 0) | ((rel[None, :] < n_tree) & ancestor))
            elif n + BLOCK_N > base:  # a block reaching the tree's slots: each row's ancestors among them
                ancestor = ((bits[:, None] >> node[None, :].to(tl.int64)) & 1) != 0
                visible = in_range[None, :] & ((rel[None, :] < 0) | ((rel[None, :] < n_tree) & ancestor))
            else:  # committed slots only: all visible (no per-element mask work on the long part of the cache)
                visible = in_range[None, :] & (rows[:, None] >= 0)
        else:
            visible = in_range[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:  # StreamingLLM: sink tokens plus the most recent `window` positions
            visible = visible & ((k_pos[None, :] < sinks) | (k_pos[None, :] > q_pos[:, None] - window))
        s = tl.where(visible, s, float("-inf"))
        if HAS_SCORES:
            _store_scores(SCORES, s * SCALE, pid_bh, rows, row_ok, offs, in_range, n_slots, T, ROWS)
        m_i, l_i, alpha, p = _online_softmax(s, m_i, l_i, SCALE_LOG2)
        if KV_BITS == 16:
            v = tl.load(v_base + offs[:, None] * stride_vs + dims[None, :], mask=in_range[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            v_a, v_b = _halves(v_base, offs, stride_vs, in_range, DH, KV_BITS)
            v_scale = tl.load(VSZ + z_base + 2 * offs, mask=in_range, other=0.0).to(tl.float32)
            v_zero = tl.load(VSZ + z_base + 2 * offs + 1, mask=in_range, other=0.0).to(tl.float32)
            pv = (p * v_scale[None, :]).to(q_a.dtype)
            shift = tl.sum(p * v_zero[None, :], axis=1)[:, None]
            acc_a = acc_a * alpha[:, None] + tl.dot(pv, v_a.to(q_a.dtype)) + shift
            acc_b = acc_b * alpha[:, None] + tl.dot(pv, v_b.to(q_a.dtype)) + shift
    m_i = m_i * LN2  # the merge takes natural-log maxima

    out = (pid_bh * N_SPLITS + split) * ROWS + rows
    if KV_BITS == 16:
        tl.store(ACC + out[:, None] * D + dims[None, :], acc, mask=row_ok[:, None])
    else:
        tl.store(ACC + out[:, None] * D + half[None, :], acc_a, mask=row_ok[:, None])
        tl.store(ACC + out[:, None] * D + DH + half[None, :], acc_b, mask=row_ok[:, None])
    tl.store(M_OUT + out, m_i, mask=row_ok)
    tl.store(L_OUT + out, l_i, mask=row_ok)


def row_tile(rows: int, row_block: int = ROW_BLOCK) -> int:
    """A program's query rows (BLOCK_M): the rows padded to a power of two, at least 16 (a tensor-core dot's least)
    and at most `row_block`; more rows go to more programs."""
    return min(max(16, triton.next_power_of_2(rows)), row_block)


def choose_splits(pairs: int, rows: int, n_slots: int, block_n: int, device, row_block: int = ROW_BLOCK) -> int:
    """Splits of the cache for `pairs` (sequence, KV head) pairs of `rows` query rows each, every split one program
    per pair and row tile. A decode's few rows (at most DECODE_ROWS), bound by reading K/V, take two waves of
    programs over the SMs; a verification's tile, bound by its dots, the fewest waves that keep WAVE_FILL of the SMs
    busy (each program's share of the work is fixed, so a wave's idle SMs are lost time). Of the split counts timed
    in turns on an H200 (results/verify_attention/split_factors_*), this rule's was the fastest or within 3% of it
    at every B x S x T where it was among them. Never a split shorter than two blocks, nor than MIN_KEYS_PER_ROW
    keys per row of a program (a split's fp32 partial, rows x D, is written and read again by the merge: a 128-row
    tile's is 64 KB, the K and V of 496 keys at head dim 128 254 KB). A short cache is split too: one program
    walking an 8B self-draft's ring alone is bound by its loads' latency, and splitting it was faster
    (results/quant/README.md)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    tile = row_tile(rows, row_block)
    per_split = pairs * -(-rows // tile)  # programs
    if rows <= DECODE_ROWS:
        want = 2 * sms // per_split
    else:
        want = next(w * sms // per_split for w in itertools.count(1)
                    if w * sms // per_split * per_split >= WAVE_FILL * w * sms)
    return max(1, min(want, n_slots // max(2 * block_n, MIN_KEYS_PER_ROW * min(rows, tile))))


def launch_settings(rows: int) -> tuple[int, int, int]:
    """(KV block, warps, pipeline stages) for a program's query rows (query heads per KV head x tokens): a decode's
    few rows keep the small tile; more rows (a verification's, a token tree's) take three stages, and a 128-row tile
    eight warps (the fastest of 16 settings timed in the same rounds, results/verify_attention)."""
    if rows > 64:
        return 128, 8, 3
    return (64, 4, 3) if rows > 32 else (128, 4, 2)


def shared_memory(device) -> int:
    """A block's shared memory on this GPU (opt-in), in bytes: what Triton checks a launch against."""
    return _shared_memory(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _shared_memory(index: int) -> int:  # asked at every eager launch: the driver once per GPU
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def fitting_stages(stages: int, block_m: int, block_n: int, key_bytes: int, query_bytes: int, device) -> int:
    """The most pipeline stages, up to `stages` and at least 2, whose K and V blocks (`key_bytes` a row) and q tile
    (`query_bytes` a row) fit the GPU's shared memory: three 128-key stages at head dim 128 take 224 KB, which a
    Hopper has and an A100 (164 KB) has not."""
    if device.type != "cuda":
        return stages
    room = shared_memory(device)
    while stages > 2 and stages * 2 * block_n * key_bytes + block_m * query_bytes > room:
        stages -= 1
    return stages


def split_kv_attention(q, k, v, q_pos, key_pos=None, sinks: int = 0, window: int = 0, n_splits: int | None = None,
                       block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                       scores=None,
                       k_scale_zero=None, v_scale_zero=None, kv_bits: int = 16, tree=None, row_block: int = ROW_BLOCK):
    """q [B, H, T, D]; k, v [B, Hkv, S, D] (each last dim contiguous); q_pos [B, T] (increasing in T);
    key_pos [B, S] or None (slot s holds position s); window > 0 limits each query to the `sinks` first positions
    plus its `window` most recent ones. Returns [B, H, T, D] in q's dtype. `scores` [B, H, S] fp32 (contiguous):
    also each head's scaled logits of the first query, -inf where it may not look. With kv_bits 8 or 4, k and v are
    uint8 codes ([B, Hkv, S, D * kv_bits / 8]) and k_scale_zero, v_scale_zero [B, Hkv, S, 2] (contiguous) each
    row's scale and zero point. `tree` (tree.TreeMask): the T queries are nodes of a token tree whose node j sits in
    the slot of position base + j, query t seeing the committed positions before base (a ring's: those its window
    shows) and the nodes set in its bits."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rows = H // Hkv * T
    tuned_block, tuned_warps, tuned_stages = launch_settings(rows)
    block_n, num_warps = block_n or tuned_block, num_warps or tuned_warps
    assert q.stride(3) == 1 and k.stride(3) == 1 and v.stride(3) == 1
    assert kv_bits == 16 or (k.shape[3] * 8 == D * kv_bits and k_scale_zero.is_contiguous()
                             and v_scale_zero.is_contiguous())
    zeros = (k_scale_zero, v_scale_zero) if kv_bits < 16 else (q_pos, q_pos)  # (unread)
    q_pos = q_pos.contiguous()  # read as [B, T] rows (a no-op for the caches' own positions)
    block_m = row_tile(rows, row_block)
    if n_splits is None:
        n_splits = choose_splits(B * Hkv, rows, S, block_n, q.device, row_block)
    split_len = -(-(-(-S // n_splits)) // block_n) * block_n  # ceil(S / splits) rounded up to whole blocks
    n_splits = -(-S // split_len)  # rounding up may leave the last splits empty: no program for them
    acc = torch.empty(B, Hkv, n_splits, rows, D, dtype=torch.float32, device=q.device)
    m = torch.empty(B, Hkv, n_splits, rows, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    if scores is not None:
        scores.fill_(float("-inf"))  # a full cache's blocks past the last query are never read
    num_stages = num_stages or fitting_stages(tuned_stages, block_m, block_n, k.shape[3] * k.element_size(),
                                              D * q.element_size(), q.device)
    _split_kv_kernel[(-(-rows // block_m), n_splits, B * Hkv)](
        q, k, v, q_pos, key_pos if key_pos is not None else q_pos, acc, m, l, scores if scores is not None else m,
        *zeros, *((tree.bits, tree.base) if tree is not None else (q_pos, q_pos)), q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), zeros[0].stride(0), zeros[0].stride(1), Hkv, S, split_len, sinks, window,
        tree.size if tree is not None else 0,
        SCALE=D ** -0.5, SCALE_LOG2=D ** -0.5 * math.log2(math.e), T=T, ROWS=rows, D=D, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_KPOS=key_pos is not None, N_SPLITS=n_splits, HAS_SCORES=scores is not None, KV_BITS=kv_bits,
        TREE=tree is not None, HAS_WINDOW=window > 0,
        num_warps=num_warps,
        num_stages=num_stages)
    return merge_splits(acc, m, l, q.dtype, T)


@triton.jit
def _merge_kernel(ACC, M, L, OUT, n_kv_heads, n_splits, T: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                  SPLITS: tl.constexpr):
    # One program per (sequence, KV head, row): the same sum over the splits however many rows a call has, so a
    # verification's tokens merge bitwise as a decode step's token does (see merge_splits).
    pid = tl.program_id(0)
    r = pid % ROWS
    bh = pid // ROWS
    b, h = bh // n_kv_heads, bh % n_kv_heads
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, D)
    ok = splits < n_splits
    at = (bh * n_splits + splits) * ROWS + r
    m = tl.load(M + at, mask=ok, other=NEG)
    w = tl.where(ok, tl.exp(m - tl.max(m, axis=0)), 0.0)
    denom = tl.sum(tl.load(L + at, mask=ok, other=0.0) * w, axis=0)
    acc = tl.load(ACC + at[:, None] * D + dims[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / denom
    # out is [B, T, H, D]: row r is query head h * G + r // T at token r % T
    head = h * (ROWS // T) + r // T
    tl.store(OUT + ((b * T + r % T) * n_kv_heads * (ROWS // T) + head) * D + dims, out.to(OUT.dtype.element_ty))


def merge_kernel(acc, m, l, dtype: torch.dtype, T: int):
    """merge_splits in one Triton kernel (what fused.fuse() runs on the GPU)."""
    B, Hkv, n_splits, rows, D = acc.shape
    out = torch.empty(B, T, Hkv * rows // T, D, dtype=dtype, device=acc.device)
    _merge_kernel[(B * Hkv * rows,)](acc, m, l, out, Hkv, n_splits, T=T, ROWS=rows, D=D,
                                     SPLITS=max(2, triton.next_power_of_2(n_splits)))
    return out.transpose(1, 2)


@fused.op(kernel="magicdec.model.triton_attention.merge_kernel")
def merge_splits(acc, m, l, dtype: torch.dtype, T: int):
    """Softmax over all keys = the per-split softmaxes weighted by exp(split max - global max) and their sums.
    acc [B, Hkv, splits, G * T, D] -> [B, H, T, D] in `dtype`, laid out as [B, T, H, D] (a transposed view), so the
    model's transpose back to tokens-first costs no copy."""
    B, Hkv, _, rows, D = acc.shape
    m_all = m.amax(dim=2, keepdim=True)
    w = torch.exp(m - m_all)
    out = ((acc * w[..., None]).sum(2) / (l * w).sum(2)[..., None]).to(dtype)  # [B, Hkv, G * T, D]
    by_token = out.view(B, Hkv, rows // T, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hkv * rows // T, D)
    return by_token.transpose(1, 2)
