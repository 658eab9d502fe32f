"""magicdec/model/quant_kv.py (QuantSpec's draft KV): the quantization against a hand-written one, the split-KV kernel
over the codes (Triton's CPU interpreter) against float64 attention over hand-dequantized K and V, and the draft
over a quantized copy drafting losslessly: greedy speculation equals plain greedy decoding through the reference
path and through the kernel, sampled speculation keeps the target's distribution (and fails to without the
rejection correction). Its memory and the cost model's draft step count the copy's bytes. Bad input: one line."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from conftest import SELFSPEC, TINY_RUN, chi_square, copies, fixed_first_token, prefill_copies, run_here  # noqa: E402
from magicdec.analysis import cost_model as cm  # noqa: E402
from magicdec.model import quant_kv  # noqa: E402
from magicdec.model import triton_quant_kv  # noqa: E402
from magicdec.config import ModelArgs  # noqa: E402
from magicdec.drafters.model_draft import ModelDraft  # noqa: E402
from magicdec.decoding.acceptance import Acceptor  # noqa: E402
from magicdec.decoding.generate import Decoder, decode, prefill  # noqa: E402
from magicdec.model.kv_cache import KVCache  # noqa: E402
from magicdec.decoding.sampling import Sampling  # noqa: E402
from test_attention import reference  # noqa: E402
from test_generate_speculative import plain_greedy  # noqa: E402


def hand_quantized(row: list[float], bits: int) -> list[float]:
    """One row's values after quantization, written out: 8 bits over [min, max] in 255 steps (scale and minimum
    rounded to fp16 first); 4 bits keep the 8-bit code's upper nibble and stand for the middle of its 16 codes."""
    f16 = lambda x: float(torch.tensor(x).half())  # noqa: E731
    lo = f16(min(row))
    s = f16(max((max(row) - min(row)) / 255, 1e-6))
    codes = [max(0, min(255, round((x - lo) / s))) for x in row]
    if bits == 8:
        return [c * s + lo for c in codes]
    return [(c // 16) * f16(16 * s) + f16(lo + 7.5 * s) for c in codes]


@pytest.mark.parametrize("bits", [8, 4])
def test_quantization_matches_hand_written(bits):
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(bits)) * 3
    codes, sz = quant_kv.quantize(x, bits)
    assert codes.dtype == torch.uint8 and codes.shape == (3, 5, 32 * bits // 8) and sz.shape == (3, 5, 2)
    got = quant_kv.dequantize(codes, sz, bits)
    want = torch.tensor([[hand_quantized(r.tolist(), bits) for r in rows] for rows in x])
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
    step = (x.amax(-1) - x.amin(-1)) / 255 * (16 if bits == 4 else 1)  # the error stays within half a step
    assert ((got - x).abs().amax(-1) <= 0.5 * step * 1.02 + 1e-3).all()


def test_quantized_copy_is_the_targets_kv_quantized_and_writes_and_takes_quantize_as_they_store():
    g = torch.Generator().manual_seed(0)
    target = KVCache(2, 2, 3, 40, 16, torch.float32, "cpu")
    for t in (*target.k, *target.v):
        t.copy_(torch.randn(t.shape, generator=g))
    target.lengths.copy_(torch.tensor([30, 25]))
    copy = quant_kv.QuantizedKVCache.of(target, 4, chunk=7)  # chunks that do not divide the length
    k, v = copy.layer_kv(1)
    assert torch.equal(copy.lengths, target.lengths) and copy.max_len == 40
    torch.testing.assert_close(k[:, :, :30], quant_kv.dequantize(*quant_kv.quantize(target.k[1][:, :, :30], 4), 4))
    new_k, new_v = torch.randn(2, 2, 3, 16, generator=g), torch.randn(2, 2, 3, 16, generator=g)
    copy.attend(2)  # a forward of two tokens claims its slots first
    copy.write(0, new_k, new_v)  # at each sequence's own next two positions (30, 31 and 25, 26)
    k, v = copy.layer_kv(0)
    for b, start in enumerate((30, 25)):
        torch.testing.assert_close(v[b, :, start:start + 2].transpose(0, 1),
                                   quant_kv.dequantize(*quant_kv.quantize(new_v[b], 4), 4))
    copy.take(target, torch.tensor([32, 27]))  # the target's verified KV at one position per sequence
    k, v = copy.layer_kv(1)
    for b, pos in enumerate((32, 27)):  # past what the copy and the writes hold
        torch.testing.assert_close(k[b, :, pos], quant_kv.dequantize(*quant_kv.quantize(target.k[1][b, :, pos], 4), 4))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("T,D,splits", [(1, 32, 3), (4, 64, 2), (3, 16, 1)])
def test_kernel_over_codes_matches_attention_over_their_values(bits, T, D, splits):
    """GQA, ragged lengths: the kernel's logits scaled and shifted per key row, its values per row, against float64
    attention over the dequantized K and V."""
    from magicdec.model.triton_attention import split_kv_attention

    g = torch.Generator().manual_seed(bits + T)
    B, H, Hkv, S = 2, 8, 2, 300
    q, k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, Hkv, S, D, generator=g) * 2, \
        torch.randn(B, Hkv, S, D, generator=g) + 1
    q_pos = torch.tensor([[250], [97]]) + torch.arange(T)
    (kc, ksz), (vc, vsz) = quant_kv.quantize(k, bits), quant_kv.quantize(v, bits)
    out = split_kv_attention(q, kc, vc, q_pos, None, n_splits=splits, block_n=32, k_scale_zero=ksz,
                             v_scale_zero=vsz, kv_bits=bits)
    ref = reference(q, quant_kv.dequantize(kc, ksz, bits), quant_kv.dequantize(vc, vsz, bits), q_pos, None)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


def speculation(model, prompts, n_new, gamma, bits, backend, sampling=Sampling(), first=None, draft_model=None):
    """Self-speculation over the quantized copy of the target's prefilled cache."""
    a, (B, P) = model.args, prompts.shape
    cache = KVCache(a.n_layers, B, a.n_kv_heads, P + n_new + gamma + 2, a.head_dim, torch.float32, "cpu")
    logits = prefill_copies(model, cache, prompts, 64) if copies(prompts) else prefill(model, cache, prompts, 64, False)
    draft = quant_kv.QuantizedKVCache.of(cache, bits)
    draft.backend = backend
    decoder = Decoder(model, Acceptor(sampling), drafter=ModelDraft(draft_model or model, draft), gamma=gamma)
    first = logits.argmax(-1) if first is None else first
    return decode(decoder, cache, first, n_new, prev=prompts[:, -1])[0], decoder


@pytest.mark.parametrize("bits,backend", [(8, "sdpa"), (4, "sdpa"), (4, "triton")])
def test_greedy_speculation_over_a_quantized_copy_equals_plain_greedy(tiny, bits, backend):
    prompts = torch.randint(0, 256, (3, 80), generator=torch.Generator().manual_seed(4))
    # Triton's interpreter runs the kernel in Python on a CPU: 12 tokens there, the same kernel at every step
    out, decoder = speculation(tiny, prompts, 12 if backend == "triton" else 40, 3, bits, backend)
    assert out.tolist() == plain_greedy(tiny, prompts, out.shape[1]).tolist()
    assert 0 < decoder.stats.alpha <= 1


def test_sampled_speculation_over_a_quantized_copy_keeps_the_targets_distribution(tiny, monkeypatch):
    """The first drafted position of N copies of one prompt follows the target's distribution (T 0.6, top-p 0.9);
    drawing from p instead of the residual after a rejection fails the same test. QuantSpec's draft: 4-bit KV and
    4-bit weights (4-bit KV alone agrees with this model too often for the wrong correction to show)."""
    import functools

    from magicdec.decoding import acceptance

    from magicdec.model import draft_weights
    N, sampling = 10_000, Sampling(0.6, 0.9)  # a draft this close needs more draws for the wrong rule to show
    prompt, first, p = fixed_first_token(tiny, N)
    draft = draft_weights.draft_copy(tiny, "int4", 32)
    torch.manual_seed(0)
    out, decoder = speculation(tiny, prompt.expand(N, -1), 2, 1, 4, "sdpa", sampling, first, draft)
    stat, bound = chi_square(out[:, 1], p)
    assert stat < bound and 0.05 < decoder.stats.alpha < 0.95, (stat, bound, decoder.stats.alpha)
    wrong = functools.partial(acceptance.speculative_sampling_verify, correct=False)  # the original, unpatched
    monkeypatch.setattr(acceptance, "speculative_sampling_verify", wrong)
    out, _ = speculation(tiny, prompt.expand(N, -1), 2, 1, 4, "sdpa", sampling, first, draft)
    stat, bound = chi_square(out[:, 1], p)
    assert stat > 1.5 * bound, (stat, bound)


LLAMA31_8B = ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336, vocab_size=128256)


def test_the_copys_bytes_in_memory_and_in_the_cost_model():
    """32 layers x 8 KV heads x (128 codes / 2 + 4 bytes of scale and zero) x K and V per token at 4 bits."""
    assert quant_kv.kv_bytes_per_token(LLAMA31_8B, "int4") == 2 * 32 * 8 * 68
    assert quant_kv.kv_bytes_per_token(LLAMA31_8B, "int8") == 2 * 32 * 8 * 132
    assert quant_kv.kv_bytes_per_token(LLAMA31_8B, "bf16") == cm.kv_bytes_per_token(LLAMA31_8B)
    d = cm.Device(bandwidth=3e12, matmul_flops=7e14)
    p = cm.predict(LLAMA31_8B, d, 13, 32768, 3, 0.9, 0, draft_kv_per_token=2 * 32 * 8 * 68)
    reads = cm.weight_bytes(LLAMA31_8B) + 13 * 32768 * 2 * 32 * 8 * 68
    assert p["T_D"] == pytest.approx(reads / 3e12 + cm.step_flops(LLAMA31_8B, 13, 32768, 1) / 7e14)


def test_memory_estimate_counts_the_quantized_copy():
    from dataclasses import replace

    from magicdec import drafters
    from magicdec.harness.engine import memory_needed
    from magicdec.harness.run_config import RunConfig

    cfg = RunConfig.from_options({"random_weights": True, "model_name": "meta-llama/Llama-3.1-8B", "B": 2,
                                  "prefix_len": 4096, "gen_len": 64, "drafter": "selfspec", "gamma": [3],
                                  "draft_kv": "int4", "device": "cpu"})
    kind = drafters.get("selfspec")
    parts = kind.memory(cfg, LLAMA31_8B, {}, 0)
    plain = memory_needed(2, 256, torch.bfloat16, [replace(part, kv_bytes=0) for part in parts])
    need = memory_needed(2, 256, torch.bfloat16, parts)
    cache_len = 4096 + cfg.lookahead + 64 + 2
    assert need["kv_cache"] - plain["kv_cache"] == 2 * cache_len * 2 * 32 * 8 * 68




@pytest.mark.parametrize("flags,needle", [
    (("--draft_kv", "int2"), "invalid choice: 'int2'"),
    (("--draft_kv", "int8", "--draft_policy", "snapkv"), "--draft_kv int8 reads the target's whole KV: "
                                                          "--draft_policy and --reindex choose a bf16 draft cache"),
    (("--draft_kv", "int4", "--reindex"), "--draft_kv int4 reads the target's whole KV"),
])
def test_bad_draft_kv_flags_are_one_line(flags, needle):
    p = run_here(SELFSPEC, *TINY_RUN, *flags)
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("bits", [8, 4])
def test_store_kernel_writes_what_the_plain_store_writes(bits):
    """The Triton store (the GPU's) against the plain one, at ragged slots, from a strided [B, T, Hkv, D] view."""
    g = torch.Generator().manual_seed(bits)
    B, T, Hkv, D, S = 3, 2, 2, 32, 20
    fused_kv = torch.randn(B, T, 2 * Hkv, D, generator=g) * 3  # k and v as halves of one tensor, as the model has
    k, v = fused_kv[:, :, :Hkv], fused_kv[:, :, Hkv:]
    slots = torch.tensor([[3, 4], [10, 11], [0, 1]])
    rows = torch.arange(B)[:, None]
    caches = []
    for store in (triton_quant_kv.store_quantized_kernel, quant_kv.store_quantized.__wrapped__):
        c = quant_kv.QuantizedKVCache(1, B, Hkv, S, D, bits, torch.float32, "cpu")
        store(c.k[0], c.v[0], c.k_sz[0], c.v_sz[0], rows, slots, k, v, bits)
        caches.append(c)
    for a, b in zip(caches[0].k + caches[0].v + caches[0].k_sz + caches[0].v_sz,
                    caches[1].k + caches[1].v + caches[1].k_sz + caches[1].v_sz):
        assert torch.equal(a, b)
    assert caches[0].k[0][1, :, 10].any() and not caches[0].k[0][1, :, 12].any()
