"""What the Medusa and Hydra drafters share (magicdec/drafters/head_draft.py's KHeads): the cost model's prediction
of their draft step, against one written out by hand. No model is run: a head has no KV, so its step has no term
that grows with the context, and each drafted level pays one head's ResBlock and its own LM head of the target's
vocabulary."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from magicdec.analysis import cost_model as cm
from magicdec.model import heads
from magicdec.config import ModelArgs
from magicdec.harness.run_config import RunConfig
from magicdec.model.tree import Tree

L31 = ModelArgs.from_name("meta-llama/Meta-Llama-3.1-8B")
DEVICE = cm.Device(bandwidth=2e12, matmul_flops=4e14, layer_overhead_s=3e-5, sampling_s_per_logit=1e-11)
TINY = ModelArgs(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=96)


def run_config(drafter: str, **options) -> RunConfig:
    """A run at Llama-3.1-8B's shapes with random weights (what `magicdec compare` predicts at)."""
    base = {"random_weights": True, "model_name": L31.name, "B": 4, "prefix_len": 4096, "gen_len": 64, "gamma": [3],
            "drafter": drafter, "device": "cpu", "dataset": "stdlib"}
    return RunConfig.from_options(base | options, strict=False)


def predicted(cfg: RunConfig, device=DEVICE, target=L31, alpha=0.8) -> dict:
    return cfg.drafter.predict(cfg, target, {}, device, alpha, cfg.speculation.largest, cfg.lookahead)


def head_by_hand(d: cm.Device, params: int, rows: int, V: int, pick_rows: int = 0) -> float:
    """One head over `rows` rows, written out: its weights' bytes once, their FLOPs per row, a layer's fixed cost,
    and `pick_rows` rows of V logits sampled."""
    return 2 * params / d.bandwidth + 2 * rows * params / d.matmul_flops + d.layer_overhead_s + \
        pick_rows * V * d.sampling_s_per_logit


def medusa_params(a: ModelArgs, blocks: int = 1) -> int:
    return blocks * (a.dim * a.dim + a.dim) + a.vocab_size * a.dim  # ResBlocks (linear + bias), LM head (no bias)


def hydra_params(a: ModelArgs, k: int) -> int:
    wide = (k + 2) * a.dim  # the hidden and k + 1 embeddings: linear and residual map, each with a bias
    return 2 * (wide * a.dim + a.dim) + a.vocab_size * a.dim + a.vocab_size  # LM head with a bias


def test_medusa_draft_step_is_one_head_without_kv():
    """T_D: a ResBlock and its LM head over B rows per drafted token; no KV term (the same at 4K and 32K), and
    larger with the vocabulary; T_T and T_V the target's."""
    B, gamma, context = 4, 3, 4096 + 32
    p = predicted(run_config("medusa"))
    assert p["T_D"] == pytest.approx(head_by_hand(DEVICE, medusa_params(L31), B, L31.vocab_size), rel=1e-9)
    assert p["T_T"] == pytest.approx(cm.step_time(L31, DEVICE, B, context), rel=1e-9)
    assert p["T_V"] == pytest.approx(cm.step_time(L31, DEVICE, B, context, gamma + 1), rel=1e-9)
    assert p["speedup"] == pytest.approx(cm.omega(0.8, gamma) / (gamma * p["T_D"] / p["T_T"] + p["T_V"] / p["T_T"]))
    assert predicted(run_config("medusa", prefix_len=32768))["T_D"] == p["T_D"]
    wide = replace(L31, vocab_size=2 * L31.vocab_size)
    assert predicted(run_config("medusa"), target=wide)["T_D"] - p["T_D"] == pytest.approx(
        2 * L31.vocab_size * L31.dim / DEVICE.bandwidth + 2 * B * L31.vocab_size * L31.dim / DEVICE.matmul_flops,
        rel=1e-9)
    sampled = predicted(run_config("medusa", temperature=0.6, top_p=0.9))
    assert sampled["T_D"] - p["T_D"] == pytest.approx(B * L31.vocab_size * DEVICE.sampling_s_per_logit, rel=1e-9)


def test_hydra_draft_step_reads_the_drafted_tokens_embeddings():
    """Hydra's grounded head k maps the hidden and k + 1 embeddings, (k + 2) dim wide, through its linear and its
    residual's map, and its LM head has a bias: T_D the mean over the gamma heads; no KV term."""
    B, gamma = 4, 3
    p = predicted(run_config("hydra"))
    by_hand = sum(head_by_hand(DEVICE, hydra_params(L31, k), B, L31.vocab_size) for k in range(gamma)) / gamma
    assert p["T_D"] == pytest.approx(by_hand, rel=1e-9)
    assert predicted(run_config("hydra", prefix_len=32768))["T_D"] == p["T_D"]
    assert p["T_D"] > predicted(run_config("medusa"))["T_D"]


def test_a_heads_config_sets_its_blocks_and_grounding(tmp_path):
    """--head: ResBlocks per head and Hydra's grounding from its config.json (the head may be another target's:
    the shapes are the target's the prediction is at)."""
    heads.save(heads.new_head("medusa", TINY, num_heads=3, num_layers=2), tmp_path / "medusa")
    heads.save(heads.new_head("hydra", TINY, num_heads=3, grounded=False), tmp_path / "hydra")
    B = 4
    medusa = predicted(run_config("medusa", head=str(tmp_path / "medusa")))
    assert medusa["T_D"] == pytest.approx(head_by_hand(DEVICE, medusa_params(L31, 2), B, L31.vocab_size), rel=1e-9)
    hydra = predicted(run_config("hydra", head=str(tmp_path / "hydra")))
    flat = medusa_params(L31) + L31.vocab_size  # the hidden alone, its LM head's bias
    assert hydra["T_D"] == pytest.approx(head_by_hand(DEVICE, flat, B, L31.vocab_size), rel=1e-9)


def test_trees_medusa_shares_its_features_hydra_runs_every_path():
    """A tree (with its sibling rates; none without them): T_V over its nodes. Medusa's head d runs once over the
    B features whatever the level's width (it picks over every node of the level above), Hydra's over each node of
    the level above."""
    assert predicted(run_config("medusa", tree_width=2)) is None
    tree_options = {"tree_width": 2, "synthetic_acceptance": 0.8, "synthetic_siblings": [0.5]}
    B, gamma, context, V = 4, 3, 4096 + 32, L31.vocab_size
    tree = Tree.chain_with_siblings(gamma, 2)
    above = [len(level) for level in tree.levels][:-1]  # 1, 2, 2
    medusa = predicted(run_config("medusa", **tree_options))
    assert medusa["T_V"] == pytest.approx(cm.step_time(L31, DEVICE, B, context, tree.size), rel=1e-9)
    assert medusa["T_D"] == pytest.approx(predicted(run_config("medusa"))["T_D"], rel=1e-12)
    hydra = predicted(run_config("hydra", **tree_options))
    by_hand = sum(head_by_hand(DEVICE, hydra_params(L31, k), B * n, V) for k, n in enumerate(above)) / gamma
    assert hydra["T_D"] == pytest.approx(by_hand, rel=1e-9)
    sampled = predicted(run_config("medusa", temperature=0.6, top_p=0.9, **tree_options))
    assert sampled["T_D"] == pytest.approx(
        sum(head_by_hand(DEVICE, medusa_params(L31), B, V, B * n) for n in above) / gamma, rel=1e-9)


@pytest.mark.parametrize("B", [1, 13, 32])
@pytest.mark.parametrize("drafter", ["medusa", "hydra"])
def test_head_draft_step_is_a_small_part_of_a_target_step_at_llama31_8b_32k(drafter, B):
    """Llama-3.1-8B's shapes at 32K on the committed H100 profile: a head's step (a ResBlock and a 128256-word LM
    head) costs well under a tenth of a target step, at every batch size."""

    device = cm.load_profile(Path(__file__).resolve().parents[1] / "magicdec" / "analysis" / "profiles" / "h100.json")[0]
    p = predicted(run_config(drafter, B=B, prefix_len=32768), device)
    assert 0 < p["T_D_over_T_T"] < 0.1 and p["speedup"] > 1


@pytest.mark.parametrize("top_p", [0.9, 1.0])
def test_a_heads_candidates_are_the_runs_distribution_over_its_likeliest_tokens(top_p):
    """Sampler(candidates=K): temperature, then top-p among the K likeliest tokens, zero elsewhere, written out by
    hand per row; its draws lie among those K."""
    import math

    import torch

    from magicdec.drafters.head_draft import Sampler

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 2
    sampler = Sampler(False, 0.6, top_p, 0, candidates=8)
    q = sampler.probabilities(logits)
    for r in range(3):
        top = sorted(range(50), key=lambda i: -float(logits[r, i]))[:8]
        w = [math.exp(float(logits[r, i]) / 0.6) for i in top]
        w = [x / sum(w) for x in w]
        kept, covered = [], 0.0
        for i, x in zip(top, w):
            if covered >= top_p:
                break
            kept.append((i, x))
            covered += x
        expect = torch.zeros(50)
        for i, x in kept:
            expect[i] = x / sum(x for _, x in kept)
        assert torch.allclose(q[r], expect, atol=1e-6), r
    ids, q_drawn = sampler.pick(logits.repeat(200, 1))
    assert bool((q_drawn[:, 0].gather(1, ids) > 0).all())
    whole = Sampler(False, 0.6, top_p, 0, candidates=0).probabilities(logits)
    assert int((whole > 0).sum()) > int((q > 0).sum())  # the whole vocabulary's nucleus is wider here


@pytest.mark.parametrize("drafter", ["medusa", "hydra", "eagle"])
def test_fitted_fixed_costs_add_to_each_drafted_level(drafter):
    """Device.head_level_s (by drafter) and, sampled, Device.pick_s (candidates or the whole vocabulary, in place of
    the per-logit count) add to each of gamma's drafted levels: T_D grows by exactly their sum, written out."""
    fitted = replace(DEVICE, head_level_s={drafter: 1e-4, "other": 1.0}, pick_s={"candidates": 5e-5,
                                                                                "vocabulary": 2e-4})
    bare = predicted(run_config(drafter))["T_D"]  # greedy: no pick counted
    assert predicted(run_config(drafter), device=fitted)["T_D"] == pytest.approx(bare + 1e-4, rel=1e-9)
    sampled = {"temperature": 0.6, "top_p": 0.9}
    assert predicted(run_config(drafter, **sampled), device=fitted)["T_D"] == pytest.approx(bare + 1e-4 + 5e-5,
                                                                                          rel=1e-9)
    assert predicted(run_config(drafter, head_candidates=0, **sampled), device=fitted)["T_D"] == pytest.approx(
        bare + 1e-4 + 2e-4, rel=1e-9)


@pytest.mark.parametrize("drafter", ["medusa", "hydra", "eagle"])
def test_a_negative_candidate_count_is_one_line(drafter):
    from magicdec.errors import MagicDecError

    cfg = run_config(drafter, head_candidates=-1, temperature=0.6, top_p=0.9)
    with pytest.raises(MagicDecError) as e:
        cfg.drafter.check(cfg)
    assert "--head_candidates -1" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("drafter", ["medusa", "hydra"])
def test_a_fresh_head_of_no_heads_is_one_line(drafter):
    """It named --gamma ("has 0 heads; give --gamma 0 or less"), which the run refuses in turn."""
    from magicdec.errors import MagicDecError

    cfg = run_config(drafter, num_heads=0)
    with pytest.raises(MagicDecError) as e:
        cfg.drafter.check(cfg)
    assert str(e.value) == f"--num_heads 0: a fresh {drafter} head has at least 1"
