"""The fused (torch.compile'd) ops against the plain ones they compile: a prefill, a 3-token verification and a
decode step of a tiny GQA model through a full cache and through a StreamingLLM ring, logits and every cache slot.
The compiled KV store must write the cache in place, and the compiled merge must lay its output out tokens-first.
(Inductor's CPU backend here; on the GPU the same functions compile to Triton kernels.)"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the split-KV kernel on the CPU, set before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from magicdec.model import fused  # noqa: E402
from magicdec.model.kv_cache import KVCache, StreamingCache  # noqa: E402
from magicdec.model.transformer import load_model  # noqa: E402


def run(model, cache, ids):
    """Logits of a 10-token prefill, then 3 tokens at once, then 1, each appended to the cache."""
    out = []
    with torch.inference_mode():
        for chunk in (ids[:, :10], ids[:, 10:13], ids[:, 13:14]):
            out.append(model(chunk, cache))
            cache.advance(chunk.shape[1])
    return out


@pytest.mark.parametrize("backend", ["sdpa", "triton"])  # triton: the split-KV kernel (interpreted) and its merge
@pytest.mark.parametrize("kind", ["full", "ring"])
def test_fused_ops_equal_plain_ones(tiny_hf, kind, backend):
    _, path = tiny_hf("llama")
    model = load_model(path, "cpu", torch.float32)
    a = model.args
    ids = torch.randint(0, a.vocab_size, (2, 14), generator=torch.Generator().manual_seed(0))

    def new_cache():
        if kind == "full":
            return KVCache(a.n_layers, 2, a.n_kv_heads, 20, a.head_dim, torch.float32, "cpu", backend)
        return StreamingCache(a.n_layers, 2, a.n_kv_heads, 8, 2, 4, a.head_dim, torch.float32, "cpu", backend)

    plain_cache, fused_cache = new_cache(), new_cache()
    plain = run(model, plain_cache, ids)
    try:
        fused.fuse()
        got = run(model, fused_cache, ids)
    finally:
        fused.fuse(False)
    for p, g in zip(plain, got):
        torch.testing.assert_close(g, p, atol=1e-5, rtol=1e-5)
    for p, g in zip(plain_cache.k + plain_cache.v, fused_cache.k + fused_cache.v):
        torch.testing.assert_close(g, p, atol=1e-5, rtol=1e-5)


def test_an_op_registered_after_fuse_is_compiled():
    """fuse() runs before attention's kernel module is imported (on first use): its merge must be compiled too."""
    def twice(x):
        return 2 * x

    try:
        fused.fuse()
        call = fused.op(twice)
        name = f"{twice.__module__}.{twice.__qualname__}"
        assert fused._active[name] is not twice
        assert torch.equal(call(torch.ones(3)), torch.full((3,), 2.0))
        fused.fuse(only=set(fused.names()) - {name})  # every other op fused, this one plain
        assert fused._active[name] is twice
        fused.fuse(only={name})
        assert fused._active[name] is not twice
        assert all(fused._active[n] is fused._plain[n] for n in fused.names() if n != name)
    finally:
        fused.fuse(False)
    assert fused._active[name] is twice
