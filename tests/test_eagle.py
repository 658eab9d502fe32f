"""EAGLE and EAGLE-3 as drafters (magicdec/drafters/eagle.py): greedy speculation equals a plain autoregressive loop
with the head's KV full and as a re-indexed StreamingLLM window, chains and trees, a ragged batch; sampled
speculation keeps the target's distribution; the cost model's prediction of its draft step equals one written out
by hand. The heads are trained once per session (conftest.fit_eagle: a fixed seed and step count) on the tiny model's
own greedy text, so that some drafts are kept and losslessness is not the trivial check of a draft always rejected,
or distilled to its sampled distribution for the sampled tests; the training forward (no cache) is the one the
drafter runs over its KV cache."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_generate_speculative import plain_greedy, tiny_prompts
from test_head_draft import DEVICE, L31, predicted, run_config
from test_medusa import check_greedy, check_sampled, shaped

from magicdec.analysis import cost_model as cm
from magicdec.model import heads
from magicdec.config import ModelArgs
from magicdec.drafters.eagle import Config, HeadShape, head_shape
from magicdec.model.kv_cache import KVCache
from magicdec.harness.run_config import RunConfig
from magicdec.model.tree import Tree, expected_tokens


@pytest.fixture(scope="module")
def eagle(tiny_eagle):
    return tiny_eagle("eagle")


@pytest.fixture(scope="module")
def eagle3(tiny_eagle):
    return tiny_eagle("eagle3")


pytestmark = pytest.mark.usefixtures("inference_mode")  # conftest: no autograd in these tests


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_eagle_chain_full_and_window_equal_plain_greedy(tiny, eagle, gamma):
    expected = plain_greedy(tiny, tiny_prompts(), 50)
    check_greedy(tiny, eagle, tiny_prompts(), 50, gamma, expected)
    check_greedy(tiny, eagle, tiny_prompts(), 50, gamma, expected, window=True, budget=20, sinks=4)


def test_eagle_trees_equal_plain_greedy(tiny, eagle):
    expected = plain_greedy(tiny, tiny_prompts(), 50)
    check_greedy(tiny, eagle, tiny_prompts(), 50, 3, expected, shape=shaped())
    check_greedy(tiny, eagle, tiny_prompts(), 50, 3, expected, width=2, window=True, budget=20, sinks=4)


def test_eagle3_reads_three_layers_and_its_draft_vocabulary(tiny, eagle3):
    assert eagle3.taps(4) == (1, 2, 3) and eagle3.fc.in_features == 3 * tiny.args.dim and eagle3.draft_vocab == 200
    expected = plain_greedy(tiny, tiny_prompts(), 50)
    check_greedy(tiny, eagle3, tiny_prompts(), 50, 3, expected)
    check_greedy(tiny, eagle3, tiny_prompts(), 50, 3, expected, shape=shaped(), window=True)


@pytest.mark.parametrize("family", ["eagle", "eagle3"])
def test_eagle_sampled_keeps_the_targets_distribution(tiny, tiny_eagle, monkeypatch, family):
    """With the head distilled to the target's distribution (alpha >= 0.2 at the tested position), so that the
    wrong-residual control fails the chi-square."""
    check_sampled(tiny, tiny_eagle(family, "sampled"), monkeypatch)


def test_cached_forward_equals_the_training_forward(tiny, eagle):
    """The drafter's forward over its KV cache, in chunks, equals the causal forward over the whole sequence."""
    a = tiny.args
    feats = torch.randn(2, 30, a.dim, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(1))
    want = eagle(feats, ids, tiny.tok_embeddings.weight)
    cache = KVCache(1, 2, a.n_kv_heads, 40, a.head_dim, torch.float32, "cpu")
    got = []
    for s in (0, 7, 20):
        e = {0: 7, 7: 20, 20: 30}[s]
        got.append(eagle(feats[:, s:e], ids[:, s:e], tiny.tok_embeddings.weight, cache))
        cache.advance(e - s)
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=1e-5, atol=1e-5)


def test_smollm2_eagle_equals_plain_greedy(smol_model, smol_prompts, smol_heads):
    from test_medusa import check_smollm2

    check_smollm2(smol_model, smol_heads("eagle"), smol_prompts, 20, window=True, budget=32, sinks=4)


@pytest.mark.parametrize("kv, skip, rows", [("full", False, 32768), ("window", False, 4 + 253), ("full", True, 1)])
def test_memory_counts_the_prompt_features_the_head_is_fed(kv, skip, rows):
    """The head is fed the target's features at every prompt position (full KV) or at its window's (the sinks, the
    last 252 positions before the root, the root: window); over random KV (--skip_prefill) at the last position
    only, its KV being random too: 32K x 13 at Llama-3.1-8B's shape was refused for 3.5 GB of features it never
    read."""
    from magicdec import drafters
    target = L31
    extra = {"head_budget": 256} if kv == "window" else {}
    cfg = RunConfig.from_options({"random_weights": True, "model_name": "meta-llama/Meta-Llama-3.1-8B", "B": 13,
                                  "prefix_len": 32768, "gen_len": 64, "drafter": "eagle", "gamma": [2],
                                  "head_kv": kv, "skip_prefill": skip, "device": "cpu"} | extra)
    (part,) = drafters.get("eagle").memory(cfg, target, {}, 0)
    assert part.kv_bytes == rows * target.dim * cfg.runtime.torch_dtype.itemsize


# --- the cost model's prediction (Eagle.predict): no model is run --------------------------------------------------
def eagle_forward_by_hand(d: cm.Device, B: int, context: int, T: int, logit_rows: int) -> float:
    """One EAGLE-1 head forward over T rows per sequence, written out: fc (2 dim -> dim, a bias), one decoder layer
    of Llama-3.1-8B's shapes over `context` cached positions, the target's LM head over `logit_rows` rows."""
    layer = cm.weight_bytes(heads.head_args(L31, 1), 1) - L31.vocab_size * L31.dim  # the layer and its norms
    fc, lm = 2 * L31.dim * L31.dim + L31.dim, L31.vocab_size * L31.dim
    weights = 2 * (layer + fc + lm) / d.bandwidth + 2 * (B * T * (layer + fc) + logit_rows * lm) / d.matmul_flops
    kv = B * context * 2 * 2 * L31.n_kv_heads * L31.head_dim / d.bandwidth  # K and V of one layer, bf16
    attention = 2 * B * T * 2 * L31.n_heads * L31.head_dim * context / d.matmul_flops  # QK and PV
    return weights + kv + attention + d.layer_overhead_s


def test_eagle_prediction_full_is_a_one_layer_model_over_the_whole_context():
    """T_D: one proposal's head work over gamma — the catch-up forward over the last verification's gamma + 1 rows
    (its LM head on one row per sequence), then gamma - 1 one-token forwards, each with its LM head — the head's
    KV the whole context; T_T and T_V the target's. Bandwidth-bound (free FLOPs), a draft step is a step of a
    one-layer model of the target's shapes (its LM head the target's) plus fc's bytes."""
    cfg = run_config("eagle")
    B, gamma, context = 4, 3, 4096 + 32
    p = predicted(cfg)
    by_hand = (eagle_forward_by_hand(DEVICE, B, context, gamma + 1, B)
               + (gamma - 1) * eagle_forward_by_hand(DEVICE, B, context, 1, B)) / gamma
    assert p["T_D"] == pytest.approx(by_hand, rel=1e-9)
    assert p["T_T"] == pytest.approx(cm.step_time(L31, DEVICE, B, context), rel=1e-9)
    assert p["T_V"] == pytest.approx(cm.step_time(L31, DEVICE, B, context, gamma + 1), rel=1e-9)
    assert p["speedup"] == pytest.approx(cm.omega(0.8, gamma) / (gamma * p["T_D"] / p["T_T"] + p["T_V"] / p["T_T"]))

    free = replace(DEVICE, matmul_flops=1e30)
    fc_bytes = 2 * (2 * L31.dim * L31.dim + L31.dim)
    assert predicted(cfg, free)["T_D"] == pytest.approx(
        cm.step_time(heads.head_args(L31, 1), free, B, context) + fc_bytes / free.bandwidth, rel=1e-9)
    long = 32768 + 32  # its KV grows with the context
    assert predicted(run_config("eagle", prefix_len=32768))["T_D"] == pytest.approx(
        (eagle_forward_by_hand(DEVICE, B, long, gamma + 1, B)
         + (gamma - 1) * eagle_forward_by_hand(DEVICE, B, long, 1, B)) / gamma, rel=1e-9)


def test_eagle_prediction_window_reads_its_ring_whatever_the_prefix():
    """--head_kv window: the head reads its ring's slots (the budget and the ring's spare slots, masked), so T_D
    is the same at 4K and 32K while T_T grows."""
    short, long = (predicted(run_config("eagle", head_kv="window", head_budget=512, prefix_len=P))
                   for P in (4096, 32768))
    assert short["T_D"] == long["T_D"] and long["T_T"] > short["T_T"]
    cfg = run_config("eagle", head_kv="window", head_budget=512)
    slots = 512 + max(256, 2 * (cfg.lookahead + 2))
    assert short["T_D"] == pytest.approx((eagle_forward_by_hand(DEVICE, 4, slots, 4, 4)
                                          + 2 * eagle_forward_by_hand(DEVICE, 4, slots, 1, 4)) / 3, rel=1e-9)


def test_eagle3_prediction_reads_its_draft_vocabulary_and_a_heads_config(tmp_path):
    """EAGLE-3: fc over its taps at the catch-up only, q / k / v over a 2 dim input, its own LM head over its draft
    vocabulary; a --head's shape comes from its config.json, whatever the target it is predicted at."""
    full, small = (predicted(run_config("eagle", eagle3=True, draft_vocab=v)) for v in (0, 32000))
    assert full["T_D"] - small["T_D"] > 2 * (L31.vocab_size - 32000) * L31.dim / DEVICE.bandwidth  # LM head bytes
    one = heads.head_args(L31, 1)
    qkv = L31.dim * (L31.n_heads + 2 * L31.n_kv_heads) * L31.head_dim
    B, gamma, ctx = 4, 3, 4096 + 32
    by_hand = (cm.step_time(one, DEVICE, B, ctx, gamma + 1, logit_rows=B) + cm.linear_time(DEVICE, qkv, B * (gamma + 1))
               + cm.linear_time(DEVICE, 3 * L31.dim * L31.dim, B * (gamma + 1))
               + (gamma - 1) * (cm.step_time(one, DEVICE, B, ctx) + cm.linear_time(DEVICE, qkv, B))) / gamma
    assert full["T_D"] == pytest.approx(by_hand, rel=1e-9)

    tiny_args = ModelArgs(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=96)
    heads.save(heads.new_head("eagle3", tiny_args, layers=(1, 2, 3), draft_vocab=200), tmp_path / "e3")
    assert head_shape(Config(head=str(tmp_path / "e3")), L31) == HeadShape(1, True, 3, 200)
    heads.save(heads.new_head("eagle", tiny_args, num_layers=2), tmp_path / "e1")
    assert head_shape(Config(head=str(tmp_path / "e1")), L31) == HeadShape(2, False, 1, L31.vocab_size)
    two, fc = heads.head_args(L31, 2), 2 * L31.dim * L31.dim + L31.dim
    assert predicted(run_config("eagle", head=str(tmp_path / "e1")))["T_D"] == pytest.approx(
        (cm.step_time(two, DEVICE, B, ctx, gamma + 1, logit_rows=B) + cm.linear_time(DEVICE, fc, B * (gamma + 1))
         + (gamma - 1) * (cm.step_time(two, DEVICE, B, ctx) + cm.linear_time(DEVICE, fc, B))) / gamma, rel=1e-9)


def test_eagle_prediction_of_trees():
    """A tree: T_V over its nodes, Ω its expected yield at alpha and the sibling rates; the draft's forwards run
    over each level's nodes and its LM heads over the level above's. Without sibling rates, no prediction (as a
    model draft's tree)."""
    assert predicted(run_config("eagle", tree_width=2)) is None
    cfg = run_config("eagle", tree_width=2, synthetic_acceptance=0.8, synthetic_siblings=[0.5])
    p, chain = predicted(cfg), predicted(run_config("eagle"))
    tree = Tree.chain_with_siblings(3, 2)
    B, ctx = 4, 4096 + 32
    assert p["T_V"] == pytest.approx(cm.step_time(L31, DEVICE, B, ctx, tree.size), rel=1e-9)
    assert p["omega"] == pytest.approx(expected_tokens(tree, (0.8, 0.5)))
    assert p["T_D"] == pytest.approx((eagle_forward_by_hand(DEVICE, B, ctx, 4, B)
                                      + 2 * eagle_forward_by_hand(DEVICE, B, ctx, 2, 2 * B)) / 3, rel=1e-9)
    assert p["T_D"] > chain["T_D"]


@pytest.mark.parametrize("B", [1, 13, 32])
@pytest.mark.parametrize("head_kv", ["full", "window"])
def test_eagle_draft_step_is_a_small_part_of_a_target_step_at_llama31_8b_32k(B, head_kv):
    """Llama-3.1-8B's shapes at 32K on the committed H100 profile (its fitted head costs included): a draft step
    (one layer, the LM head, fc, its fixed cost) costs about a tenth of a target step of 32 layers at B = 1 (0.12
    measured, results/heads) and less as the batch's KV grows, at every batch size a small part."""

    device = cm.load_profile(Path(__file__).resolve().parents[1] / "magicdec" / "analysis" / "profiles" / "h100.json")[0]
    p = predicted(run_config("eagle", B=B, prefix_len=32768, head_kv=head_kv), device)
    assert 0 < p["T_D_over_T_T"] < (0.15 if B == 1 else 0.08) and p["speedup"] > 1
