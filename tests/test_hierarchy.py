"""magicdec/hierarchy.py: TriForce's two-level speculation. Greedy equals the plain autoregressive loop token for
token (tiny model and SmolLM2, a small-model bottom and a prompt-lookup bottom, B = 3 with ragged acceptance at
both levels); sampled, the first drafted position is distributed as the target's own, and the same check fails when
either level's rejection correction is removed. The prediction (TriForce.predict): the middle loop's verifications per
target verification against a simulation of that loop, and its fixed cost counted in the draft per drafted token."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import chi_square, copies, fixed_first_token, prefill_copies
from magicdec.analysis import cost_model as cm
from magicdec.config import ModelArgs
from magicdec.drafters import draft_cache
from magicdec.drafters.model_draft import ModelDraft
from magicdec.decoding.acceptance import Acceptor
from magicdec.decoding.generate import Decoder, decode, prefill
from magicdec.decoding.sampling import Sampling
from magicdec.drafters.hierarchy import Hierarchy, WholeContext
from magicdec.model.kv_cache import KVCache, StreamingCache
from magicdec.drafters.lookup import PromptLookup
from magicdec.harness.run_config import RunConfig
from test_generate_speculative import assert_ragged, first_layers, plain_greedy
from test_lookup import repetitive_prompts


pytestmark = pytest.mark.usefixtures("inference_mode")  # conftest: no autograd in these tests


def hierarchical(target, prompts, n_new, gamma, gamma_bottom, bottom_kind, bottom_model=None, budget=48,
                 sampling=Sampling(), first=None):
    """The target over its full cache; the middle its own weights over a retrieval cache selected from the
    target's prefill (chunks of 4, the last 32 prompt tokens); the bottom a small model over a StreamingLLM cache
    of 20 tokens, or prompt lookup."""
    a, (B, P) = target.args, prompts.shape
    cache = KVCache(a.n_layers, B, a.n_kv_heads, P + n_new + gamma + 2, a.head_dim, torch.float32, "cpu")
    policy = draft_cache.Retrieval(budget, 4, window=32)
    logits, queries = (prefill_copies(target, cache, prompts, 64, policy.queries) if copies(prompts) else
                       draft_cache.prefill_recording(target, cache, prompts, policy.queries, 64))
    middle = ModelDraft(target, draft_cache.build(policy, cache, queries, append=n_new + gamma + gamma_bottom + 4))
    if bottom_kind == "model":
        d = bottom_model.args
        bc = StreamingCache(d.n_layers, B, d.n_kv_heads, 20, 4, 64, d.head_dim, torch.float32, "cpu")
        prefill(bottom_model, bc, prompts, 16)
        bottom = ModelDraft(bottom_model, bc)
    else:
        bottom = WholeContext(PromptLookup(prompts, 3, None if sampling.greedy else a.vocab_size))
    draft = Hierarchy(middle, bottom, gamma_bottom, Acceptor(sampling), cache)
    decoder = Decoder(target, Acceptor(sampling), drafter=draft, gamma=gamma, trace=sampling.greedy)
    first = logits.argmax(-1) if first is None else first
    out, counts = decode(decoder, cache, first, n_new, prev=prompts[:, -1])
    return out, counts, decoder, draft


@pytest.mark.parametrize("bottom_kind", ["model", "lookup"])
@pytest.mark.parametrize("gamma,gamma_bottom", [(4, 1), (6, 2)])
def test_tiny_hierarchy_equals_plain_greedy(tiny, bottom_kind, gamma, gamma_bottom):
    prompts = repetitive_prompts(3, 96, seed=gamma)  # phrases recur: the lookup finds matches
    out, counts, decoder, draft = hierarchical(tiny, prompts, 60, gamma, gamma_bottom, bottom_kind,
                                               first_layers(tiny, 1))
    assert counts.tolist() == [60] * 3 and out.tolist() == plain_greedy(tiny, prompts, 60).tolist()
    assert_ragged(decoder)  # the target kept different numbers of the middle's tokens per sequence
    levels = draft.summary()
    assert 0 < levels["alpha_bottom_to_middle"] < 1 and 0 < decoder.stats.alpha < 1
    assert levels["middle_verifications"] > 0 and levels["bottom_draft_steps"] >= 0


@pytest.mark.parametrize("bottom_kind", ["model", "lookup"])
def test_smollm2_hierarchy_equals_plain_greedy(smol_model, smol_prompts, bottom_kind):
    out, counts, decoder, draft = hierarchical(smol_model, smol_prompts, 32, 4, 2, bottom_kind,
                                               first_layers(smol_model, 6), budget=64)
    assert out.tolist() == plain_greedy(smol_model, smol_prompts, 32).tolist()
    assert_ragged(decoder)
    assert draft.summary()["alpha_bottom_to_middle"] > 0


@pytest.mark.parametrize("broken", [None, "middle", "target"])
def test_sampled_hierarchy_keeps_the_targets_distribution(tiny, broken, monkeypatch):
    """N copies of one prompt, its first token fixed; the second token is the first the middle proposed (gamma 2,
    from a 1-layer bottom one token at a time). It must follow the target's own distribution at T 0.6, top-p 0.9
    (chi-square below its 1 - 3e-7 quantile); drawing from p instead of the residual after a rejection at either
    level (the middle verifies 1 token at a time, the target 2: told apart by q's length) fails the same check."""
    from magicdec.decoding import acceptance
    N, sampling = 4_000, Sampling(0.6, 0.9)
    prompt, first, p = fixed_first_token(tiny, N)

    if broken:
        length = {"middle": 1, "target": 2}[broken]
        right = acceptance.speculative_sampling_verify
        monkeypatch.setattr(acceptance, "speculative_sampling_verify", lambda p_, q, d: right(
            p_, q, d, correct=q.shape[1] != length))
    torch.manual_seed(0)
    out, _, decoder, draft = hierarchical(tiny, prompt.expand(N, -1), 2, 2, 1, "model", first_layers(tiny, 1),
                                          sampling=sampling, first=first)
    stat, bound = chi_square(out[:, 1], p)
    if broken:
        assert stat > bound, (stat, bound)  # the check above fails
    else:
        assert stat < bound, (stat, bound)
        assert 0.05 < draft.summary()["alpha_bottom_to_middle"] < 0.95 and 0.05 < decoder.stats.alpha < 0.95


# --- the prediction of the middle loop (TriForce.predict) -------------------------------------------------------------
L31_NAME = "meta-llama/Meta-Llama-3.1-8B"


def hierarchy_prediction(B, gamma, gamma_bottom, alpha_b, verify_overhead_s=0.0):
    """TriForce.predict for a prompt-lookup bottom (no bottom model) at Llama-3.1-8B's shapes, 32K x B."""
    cfg = RunConfig.from_options({"random_weights": True, "model_name": L31_NAME, "drafter": "hierarchy",
                                  "draft": "ngram", "B": B, "prefix_len": 32768, "gen_len": 64, "gamma": [gamma],
                                  "gamma_bottom": gamma_bottom, "device": "cpu", "dataset": "stdlib",
                                  "draft_policy": "streaming", "draft_budget": 1024}, strict=False)
    device = cm.Device(3e12, 7e14, verify_overhead_s=verify_overhead_s)
    return cfg.drafter.predict(cfg, ModelArgs.from_name(L31_NAME), {}, device, 0.8, gamma, cfg.lookahead,
                               {"alpha_bottom_to_middle": alpha_b})


def simulated_middle_verifications(B, gamma, gamma_bottom, alpha_b, trials=20000, seed=0):
    """Monte Carlo of the middle loop, written from its description alone: every loop iteration, each of the B
    sequences gains 1 + the accepted prefix of gamma_bottom bottom tokens (each kept with probability alpha_b, up to
    the first rejection); the loop runs until every sequence holds gamma tokens. The mean number of iterations."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((trials, B), dtype=np.int64)
    loops = np.zeros(trials, dtype=np.int64)
    while (running := (tokens < gamma).any(1)).any():
        loops += running
        kept = rng.random((trials, B, gamma_bottom)) < alpha_b
        tokens += running[:, None] * (1 + np.cumprod(kept, axis=-1).sum(-1))
    return loops.mean()


@pytest.mark.parametrize("B,gamma,gamma_bottom,alpha_b", [
    (1, 8, 2, 0.6), (16, 8, 2, 0.6), (4, 5, 1, 0.8),
    (8, 40, 3, 0.7),  # more than the planner's EXACT (32) tokens: its normal approximation of the slowest
])
def test_predicted_middle_verifications_match_a_simulated_middle_loop(B, gamma, gamma_bottom, alpha_b):
    p = hierarchy_prediction(B, gamma, gamma_bottom, alpha_b)
    assert p["middle_verifications"] == pytest.approx(
        simulated_middle_verifications(B, gamma, gamma_bottom, alpha_b), rel=0.02)


def test_a_larger_batch_waits_for_its_slowest_sequence_in_the_middle_loop():
    one, many = (hierarchy_prediction(B, 8, 2, 0.6)["middle_verifications"] for B in (1, 16))
    assert many > one * 1.2  # ~6.2 against ~4.4 verifications
    # T_D (at no fixed cost) is the middle verifications x the middle's step / gamma: a lower bottom rate, more runs
    low, high = hierarchy_prediction(4, 8, 2, 0.5), hierarchy_prediction(4, 8, 2, 0.9)
    assert low["middle_verifications"] > high["middle_verifications"]
    assert low["T_D"] / high["T_D"] == pytest.approx(low["middle_verifications"] / high["middle_verifications"])


@pytest.mark.parametrize("gamma", [4, 8])
def test_the_hierarchys_fixed_cost_is_counted_in_its_draft_per_drafted_token(gamma):
    """device.verify_overhead_s (the middle's set-up per target verification) enters T_D as overhead / gamma and
    not T_O, which stays 0 (the run times the set-up inside the draft)."""
    without, with_ = (hierarchy_prediction(4, gamma, 2, 0.7, overhead) for overhead in (0.0, 0.004))
    assert with_["T_D"] - without["T_D"] == pytest.approx(0.004 / gamma, rel=1e-9)
    assert with_["T_O"] == 0 and with_["T_O_over_T_T"] == 0 and without["T_O"] == 0
    assert with_["T_V"] == without["T_V"] and with_["middle_verifications"] == without["middle_verifications"]
    cost = gamma * with_["T_D"] + with_["T_V"]  # one target verification, in seconds
    assert with_["speedup"] == pytest.approx(with_["omega"] * with_["T_T"] / cost)
