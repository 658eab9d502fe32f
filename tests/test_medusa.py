"""Medusa as a drafter (magicdec/drafters/medusa.py), and the harness the head drafters' tests share: greedy
speculation with the heads equals a plain autoregressive loop (chain and tree, a ragged batch, the tiny model and
SmolLM2), and sampled speculation keeps the target's distribution (chi-square against the exact one)."""
from __future__ import annotations

import pytest
import torch
from conftest import chi_square, copies, fixed_first_token
from test_generate_speculative import assert_ragged, plain_greedy, tiny_prompts

from magicdec.model import heads
from magicdec.drafters.eagle import EagleDraft, prompt_positions
from magicdec.drafters.head_draft import FeatureTap, Sampler
from magicdec.drafters.hydra import HydraDraft
from magicdec.drafters.medusa import MedusaDraft
from magicdec.decoding.acceptance import Acceptor
from magicdec.decoding.generate import Decoder, decode, prefill_features
from magicdec.decoding.sampling import Sampling
from magicdec.model.kv_cache import KVCache
from magicdec.model.tree import optimal_tree


pytestmark = pytest.mark.usefixtures("inference_mode")  # conftest: no autograd in these tests


def shaped():
    return optimal_tree((0.7, 0.4, 0.3), 12, 3)


def speculate(target, head, prompts, n_new, gamma, sampling=Sampling(), width=1, shape=None, first=None,
              window=False, budget=20, sinks=4, runs=1, candidates=0, dynamic=None):
    """Speculation with a head drafter over a prefill that kept the head's features; (ids, decoder). `runs` > 1:
    the same decoder generates again from the prompt (as timed rounds do), and each run's acceptance trace is kept
    in decoder.traces. `dynamic` (nodes, K): EAGLE-2's dynamic tree."""
    a, (B, P) = target.args, prompts.shape
    nodes = gamma * width if shape is None else shape.size - 1
    if dynamic is not None:  # the verified nodes, or the head's frame of K nodes per level it feeds
        nodes = max(dynamic[0] - 1, dynamic[1] * (gamma - 1))
    cache = KVCache(a.n_layers, B, a.n_kv_heads, P + n_new + nodes + 2, a.head_dim, torch.float32, "cpu")
    taps = head.taps(a.n_layers)
    eagle = isinstance(head, heads.EagleHead)
    positions = prompt_positions(P, window, budget, sinks) if eagle else torch.tensor([P - 1])
    if copies(prompts):  # the sampled tests' N copies: one prefill, its KV and features copied (conftest.prefill_copies)
        one = KVCache(a.n_layers, 1, a.n_kv_heads, cache.max_len, a.head_dim, torch.float32, "cpu")
        logits, feats = prefill_features(target, one, prompts[:1], 64, taps, positions)
        for big, small in zip(cache.k + cache.v, one.k + one.v):
            big.copy_(small.expand_as(big))
        cache.lengths.copy_(one.lengths.expand(B))
        logits, feats = logits.expand(B, -1), feats.expand(B, -1, -1).contiguous()
    else:
        logits, feats = prefill_features(target, cache, prompts, 64, taps, positions)
    sampler = Sampler(sampling.greedy, sampling.temperature, sampling.top_p, sampling.top_k, candidates)
    if eagle:
        drafter = EagleDraft.over_prompt(head, target, prompts, feats, sampler, nodes, n_new, window, budget, sinks)
    else:
        tap = FeatureTap(taps, B, nodes + 1, feats.shape[-1], torch.float32, "cpu")
        tap.start(feats[:, -1], torch.full((B,), P - 1))
        drafter = MedusaDraft(head, tap, sampler) if isinstance(head, heads.MedusaHead) else \
            HydraDraft(head, tap, target.tok_embeddings.weight, sampler)
    drafter = drafter.shaped(width, shape)
    drafter.dynamic = dynamic
    decoder = Decoder(target, Acceptor(sampling), drafter=drafter, gamma=gamma, trace=True)
    first = logits.argmax(-1) if first is None else first
    prompt_lengths, decoder.traces, decoder.proposals = cache.lengths.clone(), [], []
    propose = drafter.propose

    def recorded(*args):
        out = propose(*args)
        decoder.proposals[-1].append(out[0].clone())
        return out

    drafter.propose = recorded
    for _ in range(runs):
        cache.rollback(prompt_lengths)
        decoder.proposals.append([])
        out, counts = decode(decoder, cache, first, n_new, prev=prompts[:, -1])
        assert counts.tolist() == [n_new] * B
        decoder.traces.append(decoder.trace)
    return out, decoder


def check_greedy(target, head, prompts, n_new, gamma, expected=None, **kw):
    expected = plain_greedy(target, prompts, n_new) if expected is None else expected
    out, decoder = speculate(target, head, prompts, n_new, gamma, **kw)
    assert out.tolist() == expected.tolist()
    assert_ragged(decoder)
    return decoder


@pytest.mark.parametrize("family", ["medusa", "eagle"])
def test_a_second_generation_drafts_as_the_first(tiny, tiny_eagle, family):
    """Timed rounds generate again from the prompt with the same drafter: the head's kept features (and EAGLE's KV)
    must start from the prompt again, so a greedy rerun accepts exactly what the first run did; a drafter that kept
    the last run's features drafts its first proposal from them."""
    head = tiny_eagle("eagle") if family == "eagle" else medusa_head(tiny)
    _, decoder = speculate(tiny, head, tiny_prompts(), 30, 3, runs=2)
    for first, again in zip(*decoder.proposals):
        assert torch.equal(first, again)
    assert decoder.traces[0] == decoder.traces[1] and sum(max(a, 0) for row in decoder.traces[0] for a in row) > 0


def check_sampled(target, head, monkeypatch, gamma=2, candidates=0, min_alpha=0.2):
    """N copies of one prompt, the first token fixed: the first drafted position's token follows the target's own
    distribution (T 0.6, top-p 0.9); drawing from p instead of the residual after a rejection fails the check.
    `candidates` K: the head draws among its K likeliest tokens only (--head_candidates). The head must keep at least
    `min_alpha` of its drafts: a head whose q misses the target keeps none, and the wrong rule would then pass."""
    import functools

    from magicdec.decoding import acceptance
    N, sampling = 4_000, Sampling(0.6, 0.9)
    prompt, first, p = fixed_first_token(target, N)
    torch.manual_seed(0)
    out, decoder = speculate(target, head, prompt.expand(N, -1), 2, gamma, sampling, first=first,
                             candidates=candidates)
    stat, bound = chi_square(out[:, 1], p)
    assert stat < bound and min_alpha <= decoder.stats.alpha < 0.98, (stat, bound, decoder.stats.alpha)
    wrong = functools.partial(acceptance.speculative_sampling_verify, correct=False)  # the original, unpatched
    monkeypatch.setattr(acceptance, "speculative_sampling_verify", wrong)
    torch.manual_seed(0)
    out, _ = speculate(target, head, prompt.expand(N, -1), 2, gamma, sampling, first=first, candidates=candidates)
    stat, bound = chi_square(out[:, 1], p)
    assert stat > 2 * bound, (stat, bound)


def medusa_head(model, seed=0, num_heads=4):
    """Medusa's own initialisation (identity ResBlocks, the target's LM head): head k repeats the target's
    prediction, which a repetitive model sometimes keeps; a little noise makes the heads differ."""
    head = heads.new_head("medusa", model.args, num_heads=num_heads, target=model, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for block in head:
        block[0].linear.weight.copy_(0.05 * torch.randn(block[0].linear.weight.shape, generator=g))
    return head


@pytest.mark.parametrize("gamma", [1, 3, 4])
def test_medusa_chain_equals_plain_greedy(tiny, gamma):
    check_greedy(tiny, medusa_head(tiny), tiny_prompts(), 50, gamma)


def test_medusa_trees_equal_plain_greedy(tiny):
    expected = plain_greedy(tiny, tiny_prompts(), 50)
    check_greedy(tiny, medusa_head(tiny), tiny_prompts(), 50, 3, expected, width=3)
    check_greedy(tiny, medusa_head(tiny), tiny_prompts(), 50, 3, expected, shape=shaped())


@pytest.mark.parametrize("candidates", [0, 8])
def test_medusa_sampled_keeps_the_targets_distribution(tiny, monkeypatch, candidates):
    # 8 candidates confine q to the head's 8 likeliest tokens: it overlaps p less (alpha 0.11 measured, 0.46 without)
    check_sampled(tiny, medusa_head(tiny), monkeypatch, candidates=candidates, min_alpha=0.2 if candidates == 0 else 0.1)


def test_medusa_heads_draft_what_each_head_says(tiny):
    """A proposal is head k's argmax at the bonus token's parent, as the heads computed by hand from the target's
    final hidden state there."""
    from magicdec.decoding.generate import prefill

    head, prompts = medusa_head(tiny, num_heads=3), tiny_prompts(2, 30)
    _, drafter_dec = speculate(tiny, head, prompts, 4, 3)
    a = tiny.args
    cache = KVCache(a.n_layers, 2, a.n_kv_heads, 40, a.head_dim, torch.float32, "cpu")
    prefill(tiny, cache, prompts[:, :-1], 64)
    x = tiny.tok_embeddings(prompts[:, -1:])
    # the final hidden at the prompt's last position, by the model's own layers, then each head by hand
    cache2 = KVCache(a.n_layers, 2, a.n_kv_heads, 40, a.head_dim, torch.float32, "cpu")
    _, feats = prefill_features(tiny, cache2, prompts, 64, (a.n_layers,), torch.tensor([29]))
    f = feats[:, 0]
    tap = FeatureTap((a.n_layers,), 2, 4, a.dim, torch.float32, "cpu")
    tap.start(f, torch.full((2,), 29))
    drafter = MedusaDraft(head, tap, Sampler(True))
    hist = torch.stack([prompts[:, -1], tiny(prompts[:, -1:], cache)[:, -1].argmax(-1)], 1)
    tokens, q = drafter.propose(None, hist, torch.tensor([2, 2]), torch.full((2,), 29), 3)
    sd = head.state_dict()
    for k in range(3):
        w, b, lm = sd[f"{k}.0.linear.weight"], sd[f"{k}.0.linear.bias"], sd[f"{k}.1.weight"]
        h = f + torch.nn.functional.silu(f @ w.T + b)
        assert torch.equal(tokens[:, k], (h @ lm.T).argmax(-1)), k
    assert q is None and x.shape[0] == 2


def check_smollm2(model, head, prompts, min_kept, **kw):
    """Greedy speculation on SmolLM2 over real text with a head fitted to two of the three prompts' continuations
    (conftest.fit_smol_head) equals plain decoding, the batch ragged, and at least `min_kept` drafted tokens were
    kept: losslessness is checked over many accepted tokens, not one."""
    decoder = check_greedy(model, head, prompts, 24, 3, **kw)
    assert sum(decoder.stats.kept) >= min_kept, (decoder.stats.kept, decoder.stats.sequence_kept)


def test_smollm2_medusa_equals_plain_greedy(smol_model, smol_prompts, smol_heads):
    check_smollm2(smol_model, smol_heads("medusa"), smol_prompts, 20)


def test_graphed_heads_warm_up_over_a_whole_run(tiny):
    """A head's graphed proposal takes the history buffer, as wide as the run is long: a warm-up shorter than the
    run captures a graph the timed runs never replay, and each timed run's first proposal captures anew."""
    from types import SimpleNamespace

    from magicdec.harness import timing
    tap = FeatureTap((tiny.args.n_layers,), 2, 4, tiny.args.dim, torch.float32, "cpu")
    decoder = SimpleNamespace(gamma=3, drafter=MedusaDraft(medusa_head(tiny), tap, Sampler(True)))
    assert timing.warm_up_length(decoder, 128, graphed=True) == 128
