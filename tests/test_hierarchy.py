"""magicdec/hierarchy.py: TriForce's two-level speculation. Greedy equals the plain autoregressive loop token for
token (tiny model and SmolLM2, a small-model bottom and a prompt-lookup bottom, B = 3 with ragged acceptance at
both levels); sampled, the first drafted position is distributed as the target's own, and the same check fails when
either level's rejection correction is removed."""
from __future__ import annotations

import pytest
import torch

from conftest import chi_square, copies, fixed_first_token, prefill_copies
from magicdec.drafters import draft_cache
from magicdec.drafters.model_draft import ModelDraft
from magicdec.decoding.acceptance import Acceptor
from magicdec.decoding.generate import Decoder, decode, prefill
from magicdec.decoding.sampling import Sampling
from magicdec.drafters.hierarchy import Hierarchy, WholeContext
from magicdec.model.kv_cache import KVCache, StreamingCache
from magicdec.drafters.lookup import PromptLookup
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
