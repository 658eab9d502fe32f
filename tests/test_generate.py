"""Prefill + decode loop against a plain greedy loop over full re-forwards of transformers' model on the same weights;
EOS bookkeeping; temperature 0; top-k / top-p filtering against hand-computed numbers."""
from __future__ import annotations

import math

import pytest
import torch

from magicdec.decoding.acceptance import Acceptor
from magicdec.decoding.generate import Decoder, decode, prefill
from magicdec.model.kv_cache import KVCache
from magicdec.model.transformer import load_model
from magicdec.decoding.sampling import Sampling, next_token, probabilities, sample_from

P, N_NEW = 16, 24


def new_cache(model, B, max_len, backend="sdpa") -> KVCache:
    a = model.args
    return KVCache(a.n_layers, B, a.n_kv_heads, max_len, a.head_dim, torch.float32, "cpu", backend)


@pytest.fixture(scope="module")
def pair(tiny_hf):
    hf, path = tiny_hf("llama")
    return hf, load_model(path, "cpu", torch.float32)


@pytest.fixture(scope="module")
def prompts():
    return torch.randint(0, 256, (3, P), generator=torch.Generator().manual_seed(20))


@pytest.fixture(scope="module")
def reference(pair, prompts):
    """Greedy continuation [3, N_NEW] by a plain loop: re-run transformers on the whole sequence, take the argmax."""
    hf, _ = pair
    ids = prompts
    with torch.no_grad():
        for _ in range(N_NEW):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, P:]


def run_decode(model, prompts, n_new, eos_ids=(), backend="sdpa", chunk=5, sampling=Sampling()):
    with torch.inference_mode():
        cache = new_cache(model, prompts.shape[0], prompts.shape[1] + n_new, backend)
        logits = prefill(model, cache, prompts, chunk)
        first = next_token(logits, sampling.temperature, sampling.top_p, sampling.top_k)
        out, count = decode(Decoder(model, Acceptor(sampling)), cache, first, n_new, eos_ids)
    return out, count, cache


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_greedy_decode_matches_plain_loop(pair, prompts, reference, backend):
    _, model = pair
    out, count, cache = run_decode(model, prompts, N_NEW, backend=backend)
    assert out.tolist() == reference.tolist()
    assert count.tolist() == [N_NEW] * 3
    assert cache.lengths.tolist() == [P + N_NEW - 1] * 3  # the last generated token is not fed back


def test_single_token_decode(pair, prompts, reference):
    out, count, _ = run_decode(pair[1], prompts, 1)
    assert out.tolist() == reference[:, :1].tolist() and count.tolist() == [1, 1, 1]


def first_hit(row: list[int], eos: set[int]) -> int | None:
    return next((i for i, t in enumerate(row) if t in eos), None)


def test_eos_stops_counting_and_holds_eos(pair, prompts, reference):
    ref = reference.tolist()
    # EOS set picked from the reference itself: row 0's first token, and a token that row 1 first produces some
    # steps in and rows 0 and 2 never produce, so the rows stop at step 0, mid-way, and never.
    eos = {ref[0][0]}
    eos.add(next(t for i, t in enumerate(ref[1]) if i >= 3 and t not in ref[0] + ref[2] and t not in ref[1][:i]))
    hits = [first_hit(r, eos) for r in ref]
    assert hits[0] == 0 and 3 <= hits[1] < N_NEW - 1 and hits[2] is None  # precondition on the chosen ids

    out, count, _ = run_decode(pair[1], prompts, N_NEW, eos_ids=sorted(eos))
    for b, (row, hit) in enumerate(zip(ref, hits)):
        if hit is None:
            assert out[b].tolist() == row and count[b] == N_NEW
        else:
            assert out[b, :hit + 1].tolist() == row[:hit + 1], f"row {b}: tokens up to EOS"
            assert out[b, hit:].tolist() == [row[hit]] * (N_NEW - hit), f"row {b}: EOS held after stopping"
            assert count[b] == hit + 1, f"row {b}: counts the tokens up to and including EOS"


def test_eos_unused_when_not_produced(pair, prompts, reference):
    absent = next(t for t in range(256) if t not in reference.flatten().tolist())
    out, count, _ = run_decode(pair[1], prompts, N_NEW, eos_ids=[absent])
    assert out.tolist() == reference.tolist() and count.tolist() == [N_NEW] * 3


# ------------------------------------------------------------------ sampling

def test_temperature_zero_is_argmax_and_finite():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 7, 50, generator=gen) * 30
    logits[0, 0, :] = float("-inf")
    logits[0, 0, 13] = 0.0
    logits[1, 2, 5] = 1e30
    tok = next_token(logits, 0.0, top_p=0.3, top_k=2)  # top_p / top_k do not matter when greedy
    assert tok.tolist() == logits.argmax(-1).tolist()
    assert tok[0, 0] == 13 and tok[1, 2] == 5


def test_greedy_decoder_ignores_top_k_top_p(pair, prompts, reference):
    out, _, _ = run_decode(pair[1], prompts, 8, sampling=Sampling(temperature=0.0, top_p=0.2, top_k=3))
    assert out.tolist() == reference[:, :8].tolist()


def test_probabilities_at_temperature_zero_is_one_hot():
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, -1.0, 0.0]])
    probs = probabilities(logits, 0.0)
    assert not probs.isnan().any()
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_tiny_temperature_is_finite_and_nearly_greedy():
    logits = torch.tensor([[1.0, 3.0, 2.0, -float("inf")], [200.0, -300.0, 0.0, 10.0]])
    probs = probabilities(logits, 1e-6, top_p=0.9, top_k=2)
    assert torch.isfinite(probs).all()
    assert torch.allclose(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


# Hand-computed: a distribution p = (0.5, 0.2, 0.15, 0.1, 0.05) given as logits log p, in shuffled order.
P5 = [0.5, 0.2, 0.15, 0.1, 0.05]
ORDER = [3, 0, 4, 1, 2]  # position j holds P5[ORDER[j]]


def shuffled(values):
    return [values[i] for i in ORDER]


def hand_case(keep: list[float]) -> list[float]:
    """P5 restricted to `keep` (a prefix of it) and renormalised, in shuffled order."""
    total = sum(keep)
    return shuffled([p / total for p in keep] + [0.0] * (5 - len(keep)))


@pytest.mark.parametrize("top_k,top_p,expected", [
    (0, 1.0, P5),  # no filtering
    (2, 1.0, [0.5, 0.2]),  # top-2: 5/7, 2/7
    (0, 0.6, [0.5, 0.2]),  # 0.5 < 0.6 so the 2nd stays; 0.5 + 0.2 >= 0.6 so the 3rd goes
    (0, 0.8, [0.5, 0.2, 0.15]),  # 0.7 < 0.8 keeps the 3rd; 0.85 >= 0.8 drops the 4th
    (0, 0.3, [0.5]),  # the top token alone already covers 0.3
    (0, 1e-9, [0.5]),  # the top token always stays
    (3, 0.6, [0.5, 0.2]),  # top-3 renormalised (0.588, 0.235, 0.176), then 0.588 < 0.6 keeps the 2nd only
    (4, 0.95, [0.5, 0.2, 0.15, 0.1]),  # top-k cuts before top-p would
    (5, 1.0, P5), (10, 1.0, P5),  # k >= vocab: no filtering
])
def test_top_k_top_p_hand_computed(top_k, top_p, expected):
    logits = torch.tensor([shuffled([math.log(p) for p in P5])] * 2)
    logits[1] += 7.0  # a shift changes nothing
    probs = probabilities(logits, 1.0, top_p=top_p, top_k=top_k)
    assert torch.allclose(probs, torch.tensor([hand_case(expected)] * 2), atol=1e-6)


def test_temperature_hand_computed():
    logits = torch.tensor(shuffled([math.log(p) for p in P5]))
    # temperature 2: p ** (1/2), renormalised
    roots = [math.sqrt(p) for p in P5]
    want = shuffled([r / sum(roots) for r in roots])
    assert torch.allclose(probabilities(logits, 2.0), torch.tensor(want), atol=1e-6)
    # temperature 0.5 then top_p 0.8: p ** 2 = (.25, .04, .0225, .01, .0025) / .325 = (.769, .123, ...):
    # .769 < .8 keeps the 2nd, .892 >= .8 drops the rest
    sq = [p * p for p in P5]
    want = shuffled([sq[0] / (sq[0] + sq[1]), sq[1] / (sq[0] + sq[1]), 0.0, 0.0, 0.0])
    assert torch.allclose(probabilities(logits, 0.5, top_p=0.8), torch.tensor(want), atol=1e-6)


def test_sample_from_follows_probabilities():
    probs = torch.tensor(hand_case([0.5, 0.2, 0.15]))  # two zero-probability tokens
    torch.manual_seed(0)
    draws = sample_from(probs.expand(20000, 5))
    freq = torch.bincount(draws, minlength=5).float() / 20000
    assert (freq[probs == 0] == 0).all()
    assert (freq - probs).abs().max() < 0.015


def test_sampling_is_seeded_and_respects_top_k(pair, prompts):
    model = pair[1]
    s = Sampling(temperature=1.0, top_p=1.0, top_k=1)  # top-1 sampling is greedy
    torch.manual_seed(1)
    out1, _, _ = run_decode(model, prompts, 6, sampling=Sampling(temperature=0.8, top_p=0.9))
    torch.manual_seed(1)
    out2, _, _ = run_decode(model, prompts, 6, sampling=Sampling(temperature=0.8, top_p=0.9))
    assert out1.tolist() == out2.tolist()
    greedy, _, _ = run_decode(model, prompts, 6)
    top1, _, _ = run_decode(model, prompts, 6, sampling=s)
    assert top1.tolist() == greedy.tolist()
