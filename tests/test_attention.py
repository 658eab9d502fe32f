"""Every attention backend against a float64 reference that expands GQA heads and masks by hand.

The Triton kernel runs through Triton's CPU interpreter (TRITON_INTERPRET=1, set before the kernel is imported).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from magicdec.model.attention import make_attend, resolve_backend  # noqa: E402
from magicdec.errors import MagicDecError  # noqa: E402

EMPTY = 2**40  # key position of an empty slot


def reference(q, k, v, q_pos, key_pos, sinks=0, window=0):
    """Plain softmax attention in float64, one (sequence, head, query) at a time; with a window, each query sees
    positions < sinks and the `window` most recent positions up to its own (StreamingLLM)."""
    B, H, T, D = q.shape
    S = k.shape[2]
    G = H // k.shape[1]
    key_pos = torch.arange(S).expand(B, S) if key_pos is None else key_pos
    out = torch.zeros(B, H, T, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            kh, vh = k[b, h // G].double(), v[b, h // G].double()
            for t in range(T):
                qp, kp = int(q_pos[b, t]), key_pos[b]
                visible = kp <= qp
                if window:
                    visible &= (kp < sinks) | (kp > qp - window)
                scores = (kh[visible] @ q[b, h, t].double()) / D ** 0.5
                out[b, h, t] = torch.softmax(scores, 0) @ vh[visible]
    return out


def case(B, H, Hkv, T, S, D, scattered, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, D, generator=g)
    if scattered:  # slots hold positions in any order, some slots empty (as in a rolling window cache)
        key_pos = torch.stack([torch.randperm(S, generator=g) for _ in range(B)])
        key_pos[:, -3:] = EMPTY
        q_pos = torch.randint(T, S - 3, (B, 1), generator=g) + torch.arange(T)
    else:  # full cache: ragged lengths, slot s = position s
        key_pos = None
        q_pos = torch.randint(0, S - T, (B, 1), generator=g) + torch.arange(T)
    return q, k, v, q_pos, key_pos


CASES = [  # B, H, Hkv, T, S, D, scattered, (sinks, window)
    (3, 8, 2, 1, 300, 16, False, (0, 0)),   # GQA decode, ragged
    (2, 4, 4, 4, 257, 32, False, (0, 0)),   # MHA verify of 4 tokens, S not a block multiple
    (2, 9, 3, 7, 200, 64, False, (0, 0)),   # SmolLM2 head layout, 7-token verify
    (2, 4, 1, 3, 150, 16, True, (0, 0)),    # MQA over a scattered cache
    (1, 8, 2, 24, 300, 16, False, (0, 0)),  # a prefill chunk (triton backend falls back to sdpa on CPU)
    (3, 8, 2, 4, 150, 16, True, (4, 40)),   # StreamingLLM window over a scattered ring, verify
    (2, 4, 2, 1, 300, 16, False, (16, 64)), # StreamingLLM window, decode
    (1, 8, 2, 24, 200, 16, False, (4, 30)), # StreamingLLM prefill chunk: each query its own window
]


@pytest.mark.parametrize("backend", ["sdpa", "flex", "triton"])
@pytest.mark.parametrize("shape", CASES)
def test_backend_matches_reference(backend, shape):
    *dims, scattered, (sinks, window) = shape
    q, k, v, q_pos, key_pos = case(*dims, scattered, seed=sum(dims))
    out = make_attend(backend, q_pos, key_pos, k.shape[2], sinks, window)(q, k, v)
    ref = reference(q, k, v, q_pos, key_pos, sinks, window)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_triton_splits_agree(splits):
    """Merging per-split partial softmaxes gives the same answer however the keys are split."""
    from magicdec.model.triton_attention import split_kv_attention

    q, k, v, q_pos, _ = case(2, 8, 2, 4, 640, 32, False, seed=splits)
    out = split_kv_attention(q, k, v, q_pos, None, n_splits=splits, block_n=32)
    torch.testing.assert_close(out.double(), reference(q, k, v, q_pos, None), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("pairs, rows, slots, want", [
    (1, 4, 32768, 8),     # a decode's few rows: two waves over the CPU's stand-in 4 SMs
    (3, 4, 32768, 2),     # floor(8 / 3): a third program would start a third wave
    (5, 4, 32768, 1),     # more pairs than two waves hold: one split
    (1, 64, 32768, 4),    # a verification's tile: one full wave
    (3, 64, 32768, 4),    # one wave of 3 programs keeps 3 of 4 SMs busy (75%), three waves of 4 splits all 12
    (1, 256, 32768, 2),   # 256 rows are two 128-row tiles: two programs per split
    (1, 128, 8192, 4),    # one wave: 4 splits of 2048 keys, the 16 keys per row of a 128-row tile
    (1, 128, 4096, 2),    # ... which a shorter cache caps: 2 splits of 2048
    (1, 4, 200, 1),       # shorter than two blocks: one split
])
def test_split_count(pairs, rows, slots, want):
    """choose_splits against hand-worked counts (a CPU stands in for 4 SMs; 128-key blocks)."""
    from magicdec.model.triton_attention import choose_splits

    assert choose_splits(pairs, rows, slots, 128, torch.device("cpu")) == want


def test_triton_reads_q_through_its_strides():
    """The model hands attention q as a transposed slice of its rotated q and k heads ([B, T, H + Hkv, D]), not a
    contiguous tensor: the kernel must read it through its strides, at every token of a verification."""
    from magicdec.model.triton_attention import split_kv_attention

    q, k, v, q_pos, _ = case(2, 8, 2, 3, 200, 16, False, seed=3)
    B, H, T, D = q.shape
    qk = torch.randn(B, T, H + 2, D, dtype=q.dtype)
    qk[:, :, :H] = q.transpose(1, 2)
    strided = qk[:, :, :H].transpose(1, 2)
    assert not strided.is_contiguous()
    out = split_kv_attention(strided, k, v, q_pos, None, n_splits=3, block_n=32)
    torch.testing.assert_close(out.double(), reference(q, k, v, q_pos, None), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("T", [1, 3])
def test_merge_kernel_matches_merge_splits(T):
    """The merge as one Triton kernel (the GPU's) against the plain merge, laid out tokens-first, an empty split
    (max -1e30, sum 0) included."""
    from magicdec.model.triton_attention import NEG, merge_kernel, merge_splits

    g = torch.Generator().manual_seed(T)
    B, Hkv, splits, rows, D = 2, 2, 3, 4 * T, 16
    acc = torch.randn(B, Hkv, splits, rows, D, generator=g)
    m = torch.randn(B, Hkv, splits, rows, generator=g)
    l = torch.rand(B, Hkv, splits, rows, generator=g) + 0.5
    m[:, :, 1], l[:, :, 1], acc[:, :, 1] = NEG.value, 0.0, 0.0
    out = merge_kernel(acc, m, l, torch.float32, T)
    ref = merge_splits.__wrapped__(acc, m, l, torch.float32, T)
    assert out.shape == ref.shape == (B, 4 * Hkv, T, D)
    assert out.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


def test_triton_ignores_stale_slots():
    """Slots past a sequence's length (left by a rollback) must not leak into the result."""
    from magicdec.model.triton_attention import split_kv_attention

    q, k, v, q_pos, _ = case(2, 4, 2, 1, 256, 16, False, seed=7)
    clean = split_kv_attention(q, k, v, q_pos, None, n_splits=2, block_n=32)
    for b in range(2):
        k[b, :, q_pos[b, -1] + 1:] = 1e4
        v[b, :, q_pos[b, -1] + 1:] = float("nan")
    torch.testing.assert_close(split_kv_attention(q, k, v, q_pos, None, n_splits=2, block_n=32), clean)


@pytest.mark.parametrize("room, block_n, want", [(232448, 128, 3),   # an H100's / H200's shared memory: 3 stages fit
                                                  (166912, 128, 2),   # an A100's: 224 KB do not, 2 stages
                                                  (166912, 64, 3)])   # 64-key blocks fit there too
def test_pipeline_stages_fit_the_gpus_shared_memory(monkeypatch, room, block_n, want):
    """Three stages of K and V blocks at head dim 128 in bf16, a 128-row q tile: 3 * 2 * block_n * 256 + 128 * 256
    bytes, against the device's opt-in shared memory per block (a stand-in for Triton's figure: no GPU here)."""
    from magicdec.model import triton_attention
    from magicdec.model.triton_attention import fitting_stages

    monkeypatch.setattr(triton_attention, "shared_memory", lambda device: room)
    assert fitting_stages(3, 128, block_n, 256, 256, torch.device("cuda")) == want
    assert fitting_stages(3, 128, block_n, 256, 256, torch.device("cpu")) == 3  # the interpreter: no limit


def test_backend_choice():
    assert resolve_backend("auto", torch.device("cpu")) == "sdpa"
    with pytest.raises(MagicDecError, match="unknown attention backend"):
        resolve_backend("xformers", torch.device("cpu"))
    with pytest.raises(MagicDecError, match="flash-attn"):
        resolve_backend("flash", torch.device("cpu"))


def reference_scores(q, k, q_pos, key_pos, sinks=0, window=0):
    """Each head's logits of the first query over every slot, by hand in float64; -inf where it may not look."""
    B, H, T, D = q.shape
    S = k.shape[2]
    G = H // k.shape[1]
    key_pos = torch.arange(S).expand(B, S) if key_pos is None else key_pos
    out = torch.full((B, H, S), float("-inf"), dtype=torch.float64)
    for b in range(B):
        qp = int(q_pos[b, 0])
        for h in range(H):
            for s in range(S):
                kp = int(key_pos[b, s])
                if kp <= qp and (not window or kp < sinks or kp > qp - window):
                    out[b, h, s] = float(k[b, h // G, s].double() @ q[b, h, 0].double()) / D ** 0.5
    return out


@pytest.mark.parametrize("backend", ["sdpa", "flex", "triton"])
@pytest.mark.parametrize("shape", [CASES[0], CASES[2], CASES[3], CASES[5]], ids=["decode", "verify", "mqa", "window"])
def test_first_query_scores_side_output(backend, shape):
    """--refresh reads the first query's logits that the verification's attention writes beside its output: every
    head over every slot, -inf where the query may not look (future, empty, outside the window); the output is
    unchanged by writing them."""
    *dims, scattered, (sinks, window) = shape
    q, k, v, q_pos, key_pos = case(*dims, scattered, seed=sum(dims) + 1)
    B, H, S = q.shape[0], q.shape[1], k.shape[2]
    scores = [torch.full((B, H, S), 7.0)]  # stale values everywhere: each must be overwritten
    out = make_attend(backend, q_pos, key_pos, S, sinks, window, scores)(q, k, v, 0)
    ref = reference_scores(q, k, q_pos, key_pos, sinks, window)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(scores[0]), finite)
    torch.testing.assert_close(scores[0][finite].double(), ref[finite], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out, make_attend(backend, q_pos, key_pos, S, sinks, window)(q, k, v))
