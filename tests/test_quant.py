"""magicdec/quant.py: per-channel int8 / FP8 quantization on a hand-made matrix, the weight-only linear (torch-op
path, and the Triton kernel through its CPU interpreter) against a float64 reference of the dequantized weights, the
quantized copy sharing everything but its linears, and self-speculation with a quantized draft: greedy equals the
plain loop (tiny model, SmolLM2; B = 3, ragged), sampled keeps the target's distribution."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import chi_square, fixed_first_token
from magicdec.generate import Decoder, Draft, Sampling, decode, prefill
from magicdec.kv_cache import KVCache, StreamingCache
from magicdec.quant import QuantLinear, dequantize, quantize, quantized_copy, weight_only_linear
from test_generate_speculative import assert_ragged, plain_greedy


@pytest.fixture(autouse=True)
def no_grad():
    with torch.inference_mode():
        yield


def test_int8_scales_per_output_channel():
    w = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [127.0, 63.5, -127.0, 1.0]])
    q, scale = quantize(w, "int8")
    assert scale[0] == pytest.approx(2 / 127) and scale[2] == pytest.approx(1.0)
    assert q[0].tolist() == [64, -127, 32, 0]  # 63.5 rounds to 64 (half to even: 64), 31.75 to 32
    assert q[1].tolist() == [0, 0, 0, 0] and q[2].tolist() == [127, 64, -127, 1]  # 63.5 -> 64 (half to even)
    assert dequantize(q, scale)[1].abs().sum() == 0  # an all-zero row stays zero, no NaN


def test_fp8_scales_per_output_channel():
    w = torch.tensor([[448.0, -224.0, 1.0], [1.0, 0.5, -0.25]])
    q, scale = quantize(w, "fp8")
    assert q.dtype == torch.float8_e4m3fn and scale.tolist() == pytest.approx([1.0, 1 / 448])
    assert q.float()[0].tolist() == [448.0, -224.0, 1.0]  # exact in e4m3
    assert dequantize(q, scale)[1].tolist() == pytest.approx([1.0, 0.5, -0.25], rel=2 ** -4)


@pytest.mark.parametrize("fmt,rel", [("int8", None), ("fp8", 2 ** -4)])
def test_rounding_is_within_the_formats_step(fmt, rel):
    """int8: within half a step (scale / 2) of the weight; e4m3 (3 mantissa bits): within 2^-4 of it, relative,
    in its normal range."""
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    q, scale = quantize(w, fmt)
    err = (dequantize(q, scale) - w).abs()
    if fmt == "int8":
        assert (err <= scale[:, None] / 2 + 1e-7).all()
    else:
        normal = w.abs() / scale[:, None] >= 2 ** -6
        assert (err[normal] <= rel * w.abs()[normal] + 1e-7).all()


# The Triton kernel with fp8 weights runs on the GPU only (the CPU interpreter cannot widen fp8):
# benchmarks/quant_speed.py checks it there against this reference.
@pytest.mark.parametrize("fmt,kernel,split_k", [("int8", False, None), ("fp8", False, None), ("int8", True, 1),
                                               ("int8", True, 3)],
                         ids=["int8-torch", "fp8-torch", "int8-triton", "int8-triton-split3"])
@pytest.mark.parametrize("M", [1, 3, 37])
def test_weight_only_linear_matches_float64_dequantized(fmt, kernel, split_k, M):
    """split 3: K = 100 in ranges of 64, 36 and none (a split with nothing to do sums zeros)."""
    g = torch.Generator().manual_seed(M)
    w, x, b = torch.randn(72, 100, generator=g), torch.randn(M, 100, generator=g), torch.randn(72, generator=g)
    q, scale = quantize(w, fmt)
    config = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": split_k} if split_k else None
    y = weight_only_linear(x, q, scale, b, kernel=kernel, config=config)
    ref = x.double() @ dequantize(q, scale).double().T + b.double()
    assert y.shape == (M, 72) and torch.allclose(y.double(), ref, atol=1e-4, rtol=1e-5)
    assert (y.double() - (x.double() @ w.double().T + b.double())).abs().max() > 1e-3  # it is quantized


def test_quantized_copy_shares_all_but_its_linears(tiny):
    draft = quantized_copy(tiny, "int8")
    linears = [n for n, m in tiny.named_modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(draft.get_submodule(n), QuantLinear) for n in linears)
    assert all(isinstance(tiny.get_submodule(n), nn.Linear) for n in linears)  # the target is untouched
    assert draft.tok_embeddings.weight is tiny.tok_embeddings.weight
    assert draft.layers[1].attention_norm.weight is tiny.layers[1].attention_norm.weight
    assert draft.inv_freq is tiny.inv_freq
    q = draft.layers[0].feed_forward.w2
    assert q.q.dtype == torch.int8 and q.scale.shape == (tiny.args.dim,)
    # one byte per linear weight (+ a 4-byte scale per row) against 4 (fp32 here)
    assert draft.weight_bytes() < 0.3 * tiny.weight_bytes()


def quantized_speculation(target, fmt, prompts, n_new, gamma, budget, sampling=Sampling(), first=None):
    a, (B, P) = target.args, prompts.shape
    draft = quantized_copy(target, fmt)
    cache = KVCache(a.n_layers, B, a.n_kv_heads, P + n_new + gamma + 2, a.head_dim, torch.float32, "cpu")
    draft_cache = StreamingCache(a.n_layers, B, a.n_kv_heads, budget, 4, 64, a.head_dim, torch.float32, "cpu")
    logits = prefill(target, cache, prompts, 64)
    prefill(draft, draft_cache, prompts, 64)
    decoder = Decoder(target, sampling, draft=Draft(draft, draft_cache), gamma=gamma, trace=True)
    first = logits.argmax(-1) if first is None else first
    out, counts = decode(decoder, cache, first, n_new, prev=prompts[:, -1])
    return out, counts, decoder


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("gamma", [1, 3])
def test_tiny_quantized_selfspec_equals_plain_greedy(tiny, fmt, gamma):
    prompts = torch.randint(0, 256, (3, 48), generator=torch.Generator().manual_seed(gamma))
    out, counts, decoder = quantized_speculation(tiny, fmt, prompts, 60, gamma, budget=20)
    assert counts.tolist() == [60] * 3 and out.tolist() == plain_greedy(tiny, prompts, 60).tolist()
    assert_ragged(decoder)


def test_smollm2_quantized_selfspec_equals_plain_greedy(smol_model, smol_prompts):
    out, counts, decoder = quantized_speculation(smol_model, "int8", smol_prompts, 40, 3, budget=32)
    assert out.tolist() == plain_greedy(smol_model, smol_prompts, 40).tolist()
    assert_ragged(decoder)
    assert 0.3 < decoder.stats.alpha < 1


def test_sampled_speculation_with_a_quantized_draft_is_lossless(tiny, monkeypatch):
    """N copies of one prompt, its first token fixed: the second token (the first drafted, by an int8 draft over a
    12-token StreamingLLM cache) is distributed as the target's own at temperature 0.6, top-p 0.9 (chi-square below
    its 1 - 3e-7 quantile); without the rejection correction the same check fails."""
    from magicdec import generate, verify

    N, sampling = 4_000, Sampling(0.6, 0.9)
    prompt, first, p = fixed_first_token(tiny, N)

    torch.manual_seed(0)
    out, _, decoder = quantized_speculation(tiny, "int8", prompt.expand(N, -1), 2, 1, 12, sampling, first)
    stat, bound = chi_square(out[:, 1], p)
    assert stat < bound and 0.05 < decoder.stats.alpha < 0.95, (stat, bound, decoder.stats.alpha)
    wrong = lambda p_, q, d: verify.speculative_sampling_verify(p_, q, d, correct=False)  # noqa: E731
    monkeypatch.setattr(generate, "speculative_sampling_verify", wrong)
    out, _, _ = quantized_speculation(tiny, "int8", prompt.expand(N, -1), 2, 1, 12, sampling, first)
    stat, bound = chi_square(out[:, 1], p)
    assert stat > 2 * bound, (stat, bound)


def test_copy_bytes_counts_what_the_copy_holds(tiny):
    from magicdec.quant import copy_bytes

    draft = quantized_copy(tiny, "int8")
    held = sum(m.q.nbytes + m.scale.nbytes for m in draft.modules() if isinstance(m, QuantLinear))
    assert copy_bytes(tiny.args) == held
