"""magicdec/model/draft_weights.py: each format's quantization against a hand-written one, the quantized copy against the
model it copies (shared tensors, the original untouched, logits close), and every format drafting losslessly on the
CPU reference path: greedy speculation equals plain greedy decoding, and sampled speculation keeps the target's
distribution (and fails to without the rejection correction). Bad input: one line each."""
from __future__ import annotations

import importlib.util
import math
import weakref

import pytest
import torch

from conftest import REPO, SELFSPEC, TINY_RUN, chi_square, fixed_first_token, run_here
from magicdec.drafters import draft_cache
from magicdec.model import draft_weights as dw
from magicdec.drafters.model_draft import ModelDraft
from magicdec.errors import MagicDecError
from magicdec.decoding.acceptance import Acceptor
from magicdec.decoding.generate import Decoder, decode, prefill
from magicdec.decoding.sampling import Sampling
from magicdec.model.kv_cache import KVCache, StreamingCache
from test_generate_speculative import plain_greedy

FORMATS = [f for f in dw.FORMATS if f != "bf16"]
GROUP = 32  # divides the tiny models' widths (64, 96)


def hand_int8(w):
    out = torch.empty_like(w)
    for n in range(w.shape[0]):
        s = max(abs(float(x)) for x in w[n]) / 127
        out[n] = torch.tensor([max(-127, min(127, round(float(x) / s))) * s for x in w[n]])
    return out


def hand_int4(w, group):
    out = torch.empty_like(w)
    for n in range(w.shape[0]):
        for g0 in range(0, w.shape[1], group):
            vals = [float(x) for x in w[n, g0:g0 + group]]
            s = float(torch.tensor((max(vals) - min(vals)) / 15).to(torch.bfloat16))
            z = float(torch.tensor(-min(vals) / s).to(torch.bfloat16))
            out[n, g0:g0 + group] = torch.tensor([(max(0, min(15, round(v / s + z))) - z) * s for v in vals])
    return out


def test_int8_and_int4_match_hand_written_quantization():
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(dw.dequantize(dw.quantize(w, "int8"), torch.float32), hand_int8(w), atol=1e-6)
    assert torch.allclose(dw.dequantize(dw.quantize(w, "int4", 16), torch.float32), hand_int4(w, 16), atol=1e-5)


@pytest.mark.parametrize("fmt,bound", [("int8", 0.5 / 127), ("fp8", 1 / 16), ("int4", 0.5 / 15 * 2)])
def test_each_format_keeps_its_rounding_error(fmt, bound):
    """Per element: int8 within half a step of its row's scale; fp8 within e4m3's relative step (3 mantissa bits) of
    the element, or of its row's scale near zero; int4 within half a step of its group's range (and the bf16 rounding
    of the zero point)."""
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(1)) * 0.02
    q = dw.quantize(w, fmt, 64)
    err = (dw.dequantize(q, torch.float32) - w).abs()
    if fmt == "int8":
        assert (err <= bound * w.abs().amax(1, keepdim=True) + 1e-9).all()
    elif fmt == "fp8":
        assert (err <= bound * w.abs() + q.scale * 2 ** -9).all()
    else:
        g = w.view(8, 4, 64)
        spread = (g.amax(-1) - g.amin(-1)).repeat_interleave(64, 1)
        assert (err <= bound * spread).all()
    assert q.data.dtype == {"int8": torch.int8, "fp8": dw.FP8, "int4": torch.uint8}[fmt]


def test_quantizing_in_row_chunks_is_quantizing_at_once():
    w = torch.randn(300, 64, generator=torch.Generator().manual_seed(2))
    for fmt in FORMATS:
        a, b = dw.quantize(w, fmt, 32, rows=128), dw.quantize(w, fmt, 32, rows=1024)
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)


def test_format_bytes():
    assert dw.format_bytes(4096, 4096, "bf16", 128) == 2 * 4096 * 4096
    assert dw.format_bytes(4096, 4096, "int8", 128) == 4096 * 4096 + 4 * 4096
    assert dw.format_bytes(4096, 4096, "int4", 128) == 4096 * 4096 // 2 + 4 * 4096 * 32


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_copy_shares_all_but_its_linears_and_leaves_the_model_alone(tiny, fmt):
    draft = dw.quantized_copy(tiny, fmt, GROUP)
    assert draft.tok_embeddings.weight is tiny.tok_embeddings.weight
    assert draft.layers[1].ffn_norm.weight is tiny.layers[1].ffn_norm.weight
    assert isinstance(tiny.layers[0].attention.wqkv, torch.nn.Linear)
    assert draft.layers[0].attention.wqkv.full is tiny.layers[0].attention.wqkv.weight  # long calls run it
    names = [n for n, m in draft.named_modules() if isinstance(m, dw.QuantLinear)]
    assert len(names) == 5 * tiny.args.n_layers + 1 and "output" in names
    kept = dw.draft_copy(tiny, fmt, GROUP)
    assert dw.draft_copy(tiny, fmt, GROUP) is kept  # made once per model and format
    gone = weakref.ref(kept)
    del kept
    dw.forget_copies()  # a sweep's next group: the copy goes with its last reference
    assert gone() is None
    prompts = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    logits = []
    for model in (tiny, draft):
        a = model.args
        cache = KVCache(a.n_layers, 2, a.n_kv_heads, 24, a.head_dim, torch.float32, "cpu")
        logits.append(model(prompts, cache))
    rel = ((logits[0] - logits[1]).norm() / logits[0].norm()).item()
    # the logits move in proportion to the weights (4.3-4.5 times as far in this 2-layer model, for each format)
    pairs = [(m.weight, dict(draft.named_modules())[n]) for n, m in tiny.named_modules() if n in names]
    moved = sum((dw.dequantize(q.q, torch.float32) - w).norm() ** 2 for w, q in pairs) ** 0.5
    weight_rel = (moved / sum(w.norm() ** 2 for w, _ in pairs) ** 0.5).item()
    assert 0.5 * weight_rel < rel < 8 * weight_rel, (rel, weight_rel)


def speculation(model, draft_model, prompts, n_new, gamma, sampling=Sampling(), first=None, streaming=True):
    """Self-speculation with `draft_model` drafting over a StreamingLLM ring filled by its own prefill, or (streaming
    False: no draft prefill, for the large sampled batches) over a SnapKV selection from the target's prefill."""
    a, (B, P) = model.args, prompts.shape
    cache = KVCache(a.n_layers, B, a.n_kv_heads, P + n_new + gamma + 2, a.head_dim, torch.float32, "cpu")
    if streaming:
        logits = prefill(model, cache, prompts, 64, False)
        draft = StreamingCache(a.n_layers, B, a.n_kv_heads, 24, 4, 64 + n_new, a.head_dim, torch.float32, "cpu",
                               "sdpa")
        prefill(draft_model, draft, prompts, 32, False)
    else:  # one prompt copied B times: prefilled once, its KV and recorded queries copied to every row
        policy, one = draft_cache.SnapKV(48, window=32), KVCache(a.n_layers, 1, a.n_kv_heads, cache.max_len,
                                                                  a.head_dim, torch.float32, "cpu")
        assert prompts.eq(prompts[:1]).all()
        logits, queries = draft_cache.prefill_recording(model, one, prompts[:1], policy.queries, 96)
        for big, small in zip(cache.k + cache.v, one.k + one.v):
            big.copy_(small.expand_as(big))
        cache.lengths.fill_(P)
        logits, queries = logits.expand(B, -1), [q.expand(B, *q.shape[1:]) for q in queries]
        draft = draft_cache.build(policy, cache, queries, append=n_new + gamma + 2)
    decoder = Decoder(model, Acceptor(sampling), drafter=ModelDraft(draft_model, draft), gamma=gamma)
    first = logits.argmax(-1) if first is None else first
    return decode(decoder, cache, first, n_new, prev=prompts[:, -1])[0], decoder


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_speculation_with_each_format_equals_plain_greedy(tiny, fmt):
    prompts = torch.randint(0, 256, (3, 80), generator=torch.Generator().manual_seed(4))
    out, decoder = speculation(tiny, dw.draft_copy(tiny, fmt, GROUP), prompts, 40, 3)
    assert out.tolist() == plain_greedy(tiny, prompts, 40).tolist()
    assert 0 < decoder.stats.alpha <= 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_sampled_speculation_with_each_format_keeps_the_targets_distribution(tiny, fmt, monkeypatch):
    """The first drafted token of N copies of one prompt follows the target's own distribution (T 0.6, top-p 0.9),
    chi-square below its 1 - 3e-7 quantile; drawing from p instead of the residual after a rejection fails it."""
    import functools

    from magicdec.decoding import acceptance
    N, sampling = 4_000, Sampling(0.6, 0.9)
    prompt, first, p = fixed_first_token(tiny, N)
    draft = dw.draft_copy(tiny, fmt, GROUP)
    torch.manual_seed(0)
    out, decoder = speculation(tiny, draft, prompt.expand(N, -1), 2, 1, sampling, first, streaming=False)
    stat, bound = chi_square(out[:, 1], p)
    assert stat < bound and 0.05 < decoder.stats.alpha < 0.95, (stat, bound, decoder.stats.alpha)
    wrong = functools.partial(acceptance.speculative_sampling_verify, correct=False)  # the original, unpatched
    monkeypatch.setattr(acceptance, "speculative_sampling_verify", wrong)
    out, _ = speculation(tiny, draft, prompt.expand(N, -1), 2, 1, sampling, first, streaming=False)
    stat, bound = chi_square(out[:, 1], p)
    assert stat > 2 * bound, (stat, bound)




@pytest.mark.parametrize("flags,needle", [
    (("--draft_weights", "int3"), "invalid choice: 'int3'"),
    (("--draft_weights", "int4", "--draft_group", "100"),
     "--draft_group 100 does not divide wqkv's input width 768: use --draft_group 128"),
    (("--draft_weights", "int4", "--draft_group", "7"), "--draft_group 7: must be an even number"),
    (("--draft_weights", "int8", "--draft_group", "64"), "--draft_group sets int4's groups: use it with "
                                                         "--draft_weights int4"),
])
def test_bad_format_flags_are_one_line(flags, needle):
    p = run_here(SELFSPEC, *TINY_RUN, "--draft_budget", "64", *flags)
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_a_format_for_the_baseline_is_refused():
    p = run_here(REPO / "tests" / "baseline_benchmark.py", *TINY_RUN, "--draft_weights", "int8")
    assert p.returncode == 2 and "--draft_weights is an option of" in p.stderr and "baseline" in p.stderr, p.stderr


def test_gpu_formats_need_gemlite_and_the_right_gpu(monkeypatch):
    """On a GPU: gemlite absent names its install; fp8 below compute capability 8.9, and any format below 8.0, is
    refused with the format to use instead. (CPU machines run the reference path and need neither.)"""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gemlite" else real(n, *a))
    with pytest.raises(MagicDecError, match="needs gemlite, which is not installed: pip install gemlite"):
        dw.check_format("int8", 128, device="cuda")
    dw.check_format("int8", 128, device="cpu")
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "gemlite" else real(n, *a))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    with pytest.raises(MagicDecError, match=r"fp8 needs a GPU with fp8 .* this one is 8.0: use int8"):
        dw.check_format("fp8", 128, device="cuda")
    dw.check_format("int4", 128, device="cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 5))
    with pytest.raises(MagicDecError, match="compute capability 8.0"):
        dw.check_format("int8", 128, device="cuda")


def test_gemlite_is_used_only_on_the_shapes_it_was_checked_on():
    """Widths that are multiples of 128 and int4 groups of 128 (Llama's; on SmolLM2's 576 its int8 kernel crashed
    and its int4 one drafted garbage): anything else is refused before gemlite is imported, and the layer runs the
    reference."""
    for fmt, shape, group in (("int8", (64, 576), 128), ("fp8", (576, 128), 128), ("int4", (128, 256), 64)):
        q = dw.quantize(torch.randn(*shape), fmt, group)
        with pytest.raises(ValueError, match="multiples of 128"):
            dw.gemlite_kernel(q, None, torch.bfloat16)


def test_copy_bytes_counts_the_quantized_layers_at_llama_shapes():
    from magicdec.config import ModelArgs

    c = ModelArgs.from_name("meta-llama/Meta-Llama-3.1-8B")
    int8, int4 = dw.copy_bytes(c, "int8", 128), dw.copy_bytes(c, "int4", 128)
    linear_params = c.n_layers * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336) + 128256 * 4096
    # int8: a byte a weight and a 4-byte scale a row; int4: half a byte, and a bf16 scale and zero per 128 weights
    assert math.isclose(int8, linear_params, rel_tol=1e-3)
    assert math.isclose(int4, linear_params * (0.5 + 4 / 128), rel_tol=1e-6)


def test_a_quantized_draft_proposing_a_tree_keeps_the_targets_distribution(tiny, monkeypatch):
    """The composition the atlas found paying, sampled: a low-bit self-draft (int4, the format furthest from the
    target; each format's chain has its own test above) proposing a 3-wide tree keeps the target's distribution, and
    fails it without the residual (test_tree's check)."""
    from test_tree import assert_sampled_tree_keeps_the_targets_distribution

    assert_sampled_tree_keeps_the_targets_distribution(tiny, dw.draft_copy(tiny, "int4", GROUP), monkeypatch)
