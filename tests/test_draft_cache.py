"""magicdec/drafters/draft_cache.py: each selection policy keeps, per KV head, the positions a hand-written loop over the
scores picks; greedy self-speculation with a selected draft cache equals the plain autoregressive loop token for
token (B = 3 with ragged acceptance, generation past the budget); bad flags are one line each."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import SELFSPEC, TINY_RUN, chi_square, copies, fixed_first_token, prefill_copies, run_here
from magicdec.drafters import draft_cache
from magicdec.drafters.model_draft import ModelDraft
from magicdec.decoding.acceptance import Acceptor
from magicdec.decoding.generate import Decoder, decode
from magicdec.decoding.sampling import Sampling
from magicdec.model.kv_cache import KVCache
from test_generate_speculative import assert_ragged, plain_greedy


pytestmark = pytest.mark.usefixtures("inference_mode")  # conftest: no autograd in these tests


def qk(B=2, H=4, Hkv=2, n=3, P=24, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, n, D, generator=g), torch.randn(B, Hkv, P, D, generator=g)


def snapkv_by_hand(q, k, window, keep, kernel=5):
    """Per (sequence, KV head): attention of each of the last `window` queries (query i at position P - window + i
    sees positions <= its own), summed over queries, averaged over `kernel` neighbours (zeros beyond the ends),
    summed over the head's query group; the `keep` best positions."""
    B, H, n, D = q.shape
    Hkv, P = k.shape[1], k.shape[2]
    G, out = H // Hkv, []
    for b in range(B):
        heads = []
        for h in range(Hkv):
            total = [0.0] * (P - window)
            for g in range(G):
                summed = [0.0] * (P - window)
                for i in range(n):
                    pos = P - window + i
                    logits = [sum(float(q[b, h * G + g, i, d]) * float(k[b, h, p, d]) for d in range(D)) / math.sqrt(D)
                              for p in range(pos + 1)]
                    z = sum(math.exp(x) for x in logits)
                    for p in range(P - window):
                        summed[p] += math.exp(logits[p]) / z
                for p in range(P - window):
                    near = [summed[j] for j in range(p - kernel // 2, p + kernel // 2 + 1) if 0 <= j < P - window]
                    total[p] += sum(near) / kernel
            heads.append(sorted(sorted(range(P - window), key=lambda p: -total[p])[:keep]))
        out.append(heads)
    return out


def retrieval_by_hand(q, k, window, chunk, n_chunks):
    """Per (sequence, KV head): chunk c scores the last query of each of the head's query heads against the mean of
    keys c*chunk .. c*chunk + chunk - 1, summed; chunk 0 first, then the best; their positions."""
    B, H, _, D = q.shape
    Hkv, P = k.shape[1], k.shape[2]
    G, out = H // Hkv, []
    for b in range(B):
        heads = []
        for h in range(Hkv):
            scores = []
            for c in range((P - window) // chunk):
                mean = [sum(float(k[b, h, c * chunk + j, d]) for j in range(chunk)) / chunk for d in range(D)]
                scores.append(sum(float(q[b, h * G + g, -1, d]) * mean[d] for g in range(G) for d in range(D)))
            best = [0] + sorted(range(1, len(scores)), key=lambda c: -scores[c])[:n_chunks - 1]
            heads.append([c * chunk + j for c in sorted(best) for j in range(chunk)])
        out.append(heads)
    return out


def test_snapkv_keeps_what_a_loop_over_the_attention_keeps():
    q, k = qk(n=3)
    policy = draft_cache.SnapKV(budget=3 + 7, window=3)
    assert policy.select(q, k).tolist() == snapkv_by_hand(q, k, window=3, keep=7)


def test_snapkv_follows_the_attention_per_kv_head():
    """Hand-made: the window's queries look almost only at position 2 (KV head 0) and 9 (KV head 1); pooling (kernel
    5) spreads each peak over the two positions on either side, so each head keeps its own peak's five."""
    B, H, Hkv, n, P, D = 1, 2, 2, 2, 16, 2
    q, k = torch.zeros(B, H, n, D), torch.zeros(B, Hkv, P, D)
    q[0, :, :, 0] = 20.0
    k[0, 0, 2, 0], k[0, 1, 9, 0] = 1.0, 1.0
    kept = draft_cache.SnapKV(budget=n + 5, window=n).select(q, k)[0].tolist()
    assert kept == [[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]]


def test_retrieval_keeps_chunk_0_and_the_best_chunks():
    q, k = qk(n=1, P=40)
    policy = draft_cache.Retrieval(budget=4 + 3 * 4, chunk_size=4, window=4)
    assert policy.select(q, k).tolist() == retrieval_by_hand(q, k, window=4, chunk=4, n_chunks=3)


def test_retrieval_hand_made_chunk():
    """Keys of chunk 5 point along the last query, every other key is 0: chunk 0 (always) and chunk 5."""
    q, k = torch.zeros(1, 2, 1, 2), torch.zeros(1, 1, 48, 2)
    q[0, :, 0, 1] = 1.0
    k[0, 0, 20:24, 1] = 3.0
    assert draft_cache.Retrieval(budget=8 + 8, chunk_size=4, window=8).select(q, k)[0, 0].tolist() == \
        [0, 1, 2, 3, 20, 21, 22, 23]


def selected_speculation(model, policy, prompts, n_new, gamma, sampling=Sampling(), first=None, refresh=None):
    a, (B, P) = model.args, prompts.shape
    cache = KVCache(a.n_layers, B, a.n_kv_heads, P + n_new + gamma + 2, a.head_dim, torch.float32, "cpu")
    logits, queries = (prefill_copies(model, cache, prompts, 64, policy.queries) if copies(prompts) else
                       draft_cache.prefill_recording(model, cache, prompts, policy.queries, 64))
    dc = draft_cache.build(policy, cache, queries, append=n_new + gamma + 2)
    again = refresh and draft_cache.Refresh(policy, refresh, cache, dc, a.n_heads)
    decoder = Decoder(model, Acceptor(sampling), drafter=ModelDraft(model, dc, refresh=again), gamma=gamma, trace=sampling.greedy)
    first = logits.argmax(-1) if first is None else first
    out, counts = decode(decoder, cache, first, n_new, prev=prompts[:, -1])
    return out, counts, decoder


@pytest.mark.parametrize("policy", [draft_cache.SnapKV(48, window=32), draft_cache.Retrieval(48, 4, window=32)],
                         ids=["snapkv", "retrieval"])
@pytest.mark.parametrize("gamma", [1, 3])
def test_selected_draft_equals_plain_greedy(tiny, policy, gamma):
    """96-token prompts, a 48-token budget (16 selected + the last 32), 70 generated tokens appended."""
    prompts = torch.randint(0, 256, (3, 96), generator=torch.Generator().manual_seed(gamma))
    out, counts, decoder = selected_speculation(tiny, policy, prompts, 70, gamma)
    assert counts.tolist() == [70] * 3 and out.tolist() == plain_greedy(tiny, prompts, 70).tolist()
    assert_ragged(decoder)
    assert 0 < decoder.stats.alpha < 1


@pytest.mark.parametrize("policy", [draft_cache.SnapKV(48, window=32), draft_cache.Retrieval(48, 4, window=32)],
                         ids=["snapkv", "retrieval"])
def test_sampled_speculation_with_a_selected_draft_is_lossless(tiny, policy, monkeypatch):
    """N copies of one prompt, its first token fixed: the second token, the first one drafted, must be distributed
    as the target's own (temperature 0.6, top-p 0.9) whatever the selected draft proposed: Pearson's chi-square over
    the tokens (those expected fewer than 5 times pooled) below its 1 - 3e-7 quantile (Wilson-Hilferty), and no
    token outside the top-p set; without the rejection correction the same check fails."""
    import functools

    from magicdec.decoding import acceptance
    N, sampling = 4_000, Sampling(0.6, 0.9)
    prompt, first, p = fixed_first_token(tiny, N)

    torch.manual_seed(0)
    out, _, decoder = selected_speculation(tiny, policy, prompt.expand(N, -1), 2, 1, sampling, first)
    stat, bound = chi_square(out[:, 1], p)
    assert stat < bound and 0.05 < decoder.stats.alpha < 0.95, (stat, bound, decoder.stats.alpha)
    wrong = functools.partial(acceptance.speculative_sampling_verify, correct=False)  # the original, unpatched
    monkeypatch.setattr(acceptance, "speculative_sampling_verify", wrong)
    out, _, _ = selected_speculation(tiny, policy, prompt.expand(N, -1), 2, 1, sampling, first)
    stat, bound = chi_square(out[:, 1], p)
    assert stat > 2 * bound, (stat, bound)


def test_selected_cache_holds_the_targets_kv_at_the_selected_positions(tiny):
    """After the build: each KV head's kept slots hold the target's keys at exactly the positions the policy
    selected, and the ring the prompt's last 32 positions."""
    a, prompts = tiny.args, torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(3))
    cache = KVCache(a.n_layers, 2, a.n_kv_heads, 100, a.head_dim, torch.float32, "cpu")
    policy = draft_cache.SnapKV(48)
    _, queries = draft_cache.prefill_recording(tiny, cache, prompts, policy.queries, 64)
    dc = draft_cache.build(policy, cache, queries, append=8, max_new=16)
    for layer in range(a.n_layers):
        picked = policy.select(queries[layer], cache.k[layer][:, :, :80])
        for b in range(2):
            for h in range(a.n_kv_heads):
                assert torch.equal(dc.k[layer][b, h, :16], cache.k[layer][b, h, picked[b, h]])
                for p in range(48, 80):
                    assert torch.equal(dc.k[layer][b, h, int(dc.slots(torch.tensor(p)))], cache.k[layer][b, h, p])
    assert dc.key_pos[:, :16].eq(0).all() and dc.lengths.tolist() == [80, 80]




@pytest.mark.parametrize("flags,needle", [
    (("--draft_policy", "h2o"), "invalid choice: 'h2o'"),
    (("--draft_policy", "snapkv", "--draft_budget", "32"), "--draft_budget 32 must exceed the 32-token window"),
    (("--draft_policy", "retrieval", "--draft_budget", "64", "--chunk_size", "0"), "--chunk_size 0: must be 1..32"),
    (("--draft_policy", "retrieval", "--draft_budget", "64", "--chunk_size", "33"), "--chunk_size 33: must be 1..32"),
    (("--draft_budget", "64", "--chunk_size", "4"), "--chunk_size applies to --draft_policy retrieval only"),
    (("--draft_policy", "snapkv", "--draft_budget", "200"), "--draft_budget 200 >= --prefix_len 200"),
    (("--draft_budget", "64", "--refresh", "4"), "--refresh re-selects a selected cache"),
    (("--draft_policy", "snapkv", "--draft_budget", "64", "--refresh", "0"), "--refresh 0: must be at least 1"),
])
def test_bad_policy_flags_are_one_line(flags, needle):
    p = run_here(SELFSPEC, *TINY_RUN, *flags)
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("policy,refresh", [(draft_cache.SnapKV(48, window=32), None),
                                            (draft_cache.Retrieval(48, 4, window=32), 2)], ids=["snapkv", "retrieval-2"])
def test_smollm2_selected_draft_equals_plain_greedy(smol_model, smol_prompts, policy, refresh):
    """SmolLM2-135M on Gutenberg text (its prompts from the speculative tests): 40 tokens past a 48-token budget,
    and with the selection made again every 2 verifications. Each policy once on the real weights, one of them
    refreshed: every policy with and without --refresh runs on the tiny model (test_selected_draft_equals_plain_greedy,
    test_refreshed_draft_equals_plain_greedy)."""
    out, counts, decoder = selected_speculation(smol_model, policy, smol_prompts, 40, 3, refresh=refresh)
    assert out.tolist() == plain_greedy(smol_model, smol_prompts, 40).tolist()
    assert_ragged(decoder)


def first_query_logits(q, k):
    """One query [B, H, D] against every key [B, Hkv, S, D], scaled: the logits a verification writes aside."""
    B, H, D = q.shape
    Hkv = k.shape[1]
    return torch.einsum("bhgd,bhsd->bhgs", q.view(B, Hkv, H // Hkv, D), k).reshape(B, H, -1) / math.sqrt(D)


def test_retrieval_reselects_what_a_loop_over_the_chunks_keeps():
    """From a query's logits over the whole cache (prompt of 40, 6 generated positions after it) the chunks a
    hand-written loop scores by that query against their mean keys."""
    q, k = qk(n=1, P=46)
    policy = draft_cache.Retrieval(budget=4 + 3 * 4, chunk_size=4, window=4)
    got = policy.reselect(first_query_logits(q[:, :, 0], k), prompt_len=40, n_kv_heads=2)
    assert got.tolist() == retrieval_by_hand(q, k[:, :, :40], window=4, chunk=4, n_chunks=3)


def test_snapkv_reselects_from_one_querys_attention():
    """By hand: the query's softmax over everything it sees (prompt and generated), on the prompt's candidates,
    averaged over 5 neighbours, summed over the head's group; the best positions per KV head."""
    q, k = qk(n=1, P=46, seed=4)
    policy, P, keep = draft_cache.SnapKV(budget=3 + 7, window=3), 40, 7
    got = policy.reselect(first_query_logits(q[:, :, 0], k), prompt_len=P, n_kv_heads=2)
    B, H, _, D = q.shape
    expected = []
    for b in range(B):
        heads = []
        for h in range(2):
            total = [0.0] * (P - 3)
            for g in range(2):
                logits = [sum(float(q[b, h * 2 + g, 0, d]) * float(k[b, h, s, d]) for d in range(D)) / math.sqrt(D)
                          for s in range(46)]
                z = sum(math.exp(x) for x in logits)
                attn = [math.exp(x) / z for x in logits[:P - 3]]
                for p in range(P - 3):
                    total[p] += sum(attn[j] for j in range(p - 2, p + 3) if 0 <= j < P - 3) / 5
            heads.append(sorted(sorted(range(P - 3), key=lambda p: -total[p])[:keep]))
        expected.append(heads)
    assert got.tolist() == expected


@pytest.mark.parametrize("policy", [draft_cache.SnapKV(48, window=32), draft_cache.Retrieval(48, 4, window=32)],
                         ids=["snapkv", "retrieval"])
def test_refreshed_draft_equals_plain_greedy(tiny, policy):
    """--refresh 2: every second verification re-selects the kept positions from its attention (written aside by
    the verification); still the plain loop's tokens, and the selection really moved."""
    prompts = torch.randint(0, 256, (3, 96), generator=torch.Generator().manual_seed(9))
    a, n_new, gamma = tiny.args, 60, 3
    cache = KVCache(a.n_layers, 3, a.n_kv_heads, 96 + n_new + gamma + 2, a.head_dim, torch.float32, "cpu")
    logits, queries = draft_cache.prefill_recording(tiny, cache, prompts, policy.queries, 64)
    dc = draft_cache.build(policy, cache, queries, append=n_new + gamma + 2)
    refresh = draft_cache.Refresh(policy, 2, cache, dc, a.n_heads)
    initial = dc.k[0][:, :, :dc.kept].clone()
    decoder = Decoder(tiny, drafter=ModelDraft(tiny, dc, refresh=refresh), gamma=gamma, trace=True)
    out, counts = decode(decoder, cache, logits.argmax(-1), n_new, prev=prompts[:, -1])
    assert out.tolist() == plain_greedy(tiny, prompts, n_new).tolist()
    assert_ragged(decoder)
    assert refresh.count >= 10 and not torch.equal(dc.k[0][:, :, :dc.kept], initial)
    refresh.begin()  # the next generation starts from the prefill's selection
    assert torch.equal(dc.k[0][:, :, :dc.kept], initial)
