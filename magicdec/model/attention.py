"""Attention backends behind one interface.

`make_attend(backend, q_pos, key_pos, n_slots, sinks, window, scores)` is called once per forward pass and returns
`attend(q [B, H, T, D], k [B, Hkv, S, D], v, layer) -> [B, H, T, D]`, used by every layer. With `scores` (one
[B, H, S] fp32 buffer per layer) it also writes each head's scaled logits of the forward's first query over every
slot, -inf where that query may not look: what a draft's `--refresh` re-selects from (the Triton kernel writes them
as it reads K; the other backends take a pass of their own). The mask is the same for every
kind of cache: query t of sequence b (at absolute position qp = q_pos[b, t]) sees slot s, holding position
kp = key_pos[b, s], iff kp <= qp and, when window > 0, (kp < sinks or kp > qp - window): StreamingLLM's sink
tokens plus a recent window. key_pos=None means slot s holds position s (the full cache); empty slots carry a huge
key_pos.

GQA is never expanded in memory: the G query heads that share a KV head are folded into the query-length axis
(sdpa) or handled by the kernel (flex `enable_gqa`, flash-attn), so K/V are read once per KV head.
"""
from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F

from magicdec.errors import INSTALL, installed, require

Attend = Callable[..., torch.Tensor]  # (q, k, v, layer=None) -> out
BACKENDS = ("auto", "sdpa", "flex", "triton", "flash")
TRITON_MAX_T = 64  # decode and verification (a 64-node tree); longer chunks (prefill) go to flex/sdpa
KV_BLOCK = 128
Q_BLOCK = 128


def flash_attn_available() -> bool:
    return installed("flash_attn")


TRITON_INSTALL = INSTALL["triton"]


def resolve_backend(name: str, device: torch.device) -> str:
    from magicdec.errors import MagicDecError

    if name not in BACKENDS:
        raise MagicDecError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        if device.type != "cuda" or not installed("triton"):  # the kernels below are Triton's
            return "sdpa" if device.type != "cuda" else "flex"
        return "flash" if flash_attn_available() else "triton"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise MagicDecError("--attn_backend triton needs a CUDA device (or TRITON_INTERPRET=1 to interpret it on the CPU)")
    if name in ("triton", "flash") and not installed("triton"):
        raise MagicDecError(f"--attn_backend {name} runs the split-KV Triton kernel, and triton is not installed: "
                            f"{TRITON_INSTALL}, or pass --attn_backend sdpa")
    if name == "flash" and not (device.type == "cuda" and flash_attn_available()):
        raise MagicDecError("--attn_backend flash needs a CUDA device and the flash-attn package: "
                            f"{INSTALL['flash_attn']}")
    return name


def _visible(q_pos, key_pos, n_slots, sinks=0, window=0, tree=None) -> torch.Tensor:
    """Boolean [B, T, S] mask of the slots each query may attend to."""
    if tree is not None:
        from magicdec.model.tree import visible

        return visible(tree, n_slots, q_pos, key_pos, sinks, window)
    if key_pos is None:
        key_pos = torch.arange(n_slots, device=q_pos.device)[None, :]
    kp, qp = key_pos[:, None, :], q_pos[:, :, None]
    visible = kp <= qp
    if window:
        visible = visible & ((kp < sinks) | (kp > qp - window))
    return visible


def first_query_logits(out: torch.Tensor, q, k, visible) -> None:
    """Each head's scaled logits of the first query over every slot into out [B, H, S], -inf where not visible."""
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    s = torch.einsum("bhgd,bhsd->bhgs", q[:, :, 0].float().view(B, Hkv, H // Hkv, D), k.float()) * D ** -0.5
    out.copy_(s.reshape(B, H, -1).masked_fill(~visible[:, None, 0], float("-inf")))


def sdpa_attend(q_pos, key_pos, n_slots, sinks=0, window=0, scores=None, tree=None) -> Attend:
    """Plain PyTorch (scaled_dot_product_attention with a boolean mask): the reference, and the CPU path."""
    visible = _visible(q_pos, key_pos, n_slots, sinks, window, tree)

    def attend(q, k, v, layer=None):
        if scores is not None:
            first_query_logits(scores[layer], q, k, visible)
        B, H, T, D = q.shape
        Hkv = k.shape[1]
        G = H // Hkv
        # Heads h = g_kv * G + i share KV head g_kv: fold them into the query axis, keep K/V unexpanded.
        q = q.reshape(B, Hkv, G * T, D)
        mask = visible[:, None, None].expand(B, 1, G, T, n_slots).reshape(B, 1, G * T, n_slots)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).reshape(B, H, T, D)

    return attend


_compiled_flex = None


def _flex():
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled_flex is None:
        # flex_attention is only fast compiled; eager (CPU tests) it runs a reference implementation.
        _compiled_flex = torch.compile(flex_attention, dynamic=False) if torch.cuda.is_available() else flex_attention
    return _compiled_flex


def flex_attend(q_pos, key_pos, n_slots, sinks=0, window=0, scores=None, tree=None) -> Attend:
    """torch FlexAttention with a block mask that skips the KV blocks past each sequence's end."""
    from torch.nn.attention.flex_attention import BlockMask

    B, T = q_pos.shape
    n_kv_blocks = -(-n_slots // KV_BLOCK)
    n_q_blocks = -(-T // Q_BLOCK)
    if key_pos is None and window and tree is None:
        key_pos = torch.arange(n_slots, device=q_pos.device).expand(B, n_slots)
    if tree is not None:  # the committed positions, then the tree's node j at position base + j: ancestors only
        base, anc, N = tree.base, tree.ancestors, tree.size

        def mask_mod(b, h, q_idx, kv_idx):
            kp = kv_idx if key_pos is None else key_pos[b, kv_idx]
            rel = kp - base[b]
            seen = (rel < 0) | ((rel < N) & anc[q_idx, rel.clamp(0, N - 1)])
            return seen & ((kp < sinks) | (kp > q_pos[b, q_idx] - window)) if window else seen
        if key_pos is None:
            kv_num_blocks = torch.clamp((base + N - 1) // KV_BLOCK + 1, max=n_kv_blocks).to(torch.int32)
            kv_num_blocks = kv_num_blocks[:, None].expand(B, n_q_blocks).contiguous()
        else:
            kv_num_blocks = torch.full((B, n_q_blocks), n_kv_blocks, dtype=torch.int32, device=q_pos.device)
    elif key_pos is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_pos[b, q_idx]
        # Last position queried inside each Q block bounds the KV blocks it needs.
        last_q = torch.clamp(torch.arange(1, n_q_blocks + 1, device=q_pos.device) * Q_BLOCK, max=T) - 1
        needed = q_pos[:, last_q] // KV_BLOCK + 1  # [B, n_q_blocks]
        kv_num_blocks = torch.clamp(needed, max=n_kv_blocks).to(torch.int32)
    elif not window:
        def mask_mod(b, h, q_idx, kv_idx):
            return key_pos[b, kv_idx] <= q_pos[b, q_idx]
        kv_num_blocks = torch.full((B, n_q_blocks), n_kv_blocks, dtype=torch.int32, device=q_pos.device)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            kp, qp = key_pos[b, kv_idx], q_pos[b, q_idx]
            return (kp <= qp) & ((kp < sinks) | (kp > qp - window))
        kv_num_blocks = torch.full((B, n_q_blocks), n_kv_blocks, dtype=torch.int32, device=q_pos.device)
    kv_indices = torch.arange(n_kv_blocks, dtype=torch.int32, device=q_pos.device).expand(B, 1, n_q_blocks, n_kv_blocks)
    block_mask = BlockMask.from_kv_blocks(kv_num_blocks[:, None], kv_indices, BLOCK_SIZE=(Q_BLOCK, KV_BLOCK),
                                          mask_mod=mask_mod, seq_lengths=(T, n_slots))

    visible = _visible(q_pos, key_pos, n_slots, sinks, window, tree) if scores is not None else None

    def attend(q, k, v, layer=None):
        if scores is not None:
            first_query_logits(scores[layer], q, k, visible)
        return _flex()(q, k, v, block_mask=block_mask, enable_gqa=True)

    return attend


def flash_attend(q_pos, key_pos, n_slots, sinks=0, window=0, scores=None, tree=None) -> Attend:
    """flash-attn's flash_attn_with_kvcache (when importable) for the full cache; other caches, scores and token
    trees use the Triton kernel, whose mask handles scattered slots."""
    if key_pos is not None or scores is not None or tree is not None:
        return triton_attend(q_pos, key_pos, n_slots, sinks, window, scores, tree)
    flash_attn_with_kvcache = require("flash_attn", "--attn_backend flash").flash_attn_with_kvcache

    seqlens = (q_pos[:, -1] + 1).to(torch.int32)  # keys 0..last query position; causal aligns queries at the end

    def attend(q, k, v, layer=None):
        out = flash_attn_with_kvcache(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                      cache_seqlens=seqlens, causal=True)
        return out.transpose(1, 2)

    return attend


def triton_attend(q_pos, key_pos, n_slots, sinks=0, window=0, scores=None, tree=None) -> Attend:
    """Split-KV Triton kernel for decode/verify (few query tokens); flex (GPU) or sdpa (CPU) for prefill chunks."""
    if q_pos.shape[1] > TRITON_MAX_T:
        return (flex_attend if q_pos.is_cuda else sdpa_attend)(q_pos, key_pos, n_slots, sinks, window, scores, tree)
    split_kv_attention = require("magicdec.model.triton_attention", "--attn_backend triton").split_kv_attention

    def attend(q, k, v, layer=None):
        return split_kv_attention(q, k, v, q_pos, key_pos, sinks=sinks, window=window,
                                  scores=None if scores is None else scores[layer],
                                  tree=tree)

    return attend


MAKERS = {"sdpa": sdpa_attend, "flex": flex_attend, "triton": triton_attend, "flash": flash_attend}


def make_attend(backend: str, q_pos, key_pos, n_slots, sinks: int = 0, window: int = 0, scores=None,
                tree=None) -> Attend:
    """`tree` (tree.TreeMask): the forward's T tokens are nodes of a token tree whose node j is in the slot of
    position tree.base + j, each seeing the committed positions and its ancestors' only."""
    return MAKERS[backend](q_pos, key_pos, n_slots, sinks, window, scores, tree)
