"""EAGLE and EAGLE-3 as drafters (magicdec/drafters/eagle.py): greedy speculation equals a plain autoregressive loop
with the head's KV full and as a re-indexed StreamingLLM window, chains and trees, a ragged batch; sampled
speculation keeps the target's distribution. The heads are trained here for a few steps on the tiny model's own
greedy text (fixed seed and step count), so that some drafts are kept and losslessness is not the trivial check of
a draft always rejected; the training forward (no cache) is the one the drafter runs over its KV cache."""
from __future__ import annotations

import pytest
import torch
from test_generate_speculative import plain_greedy, tiny_prompts
from test_medusa import check_greedy, check_sampled, shaped

from magicdec import heads
from magicdec.generate import prefill_features
from magicdec.kv_cache import KVCache


def trained(model, family, steps=120, seed=0, **kw):
    """A head fitted to the model's greedy continuations of random prompts (pairs (feature t, token t + 1) predict
    token t + 2 through the target's LM head, or EAGLE-3's own)."""
    a = model.args
    prompts = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(seed + 1))
    head = heads.new_head(family, a, seed=seed, **kw)
    with torch.inference_mode():
        text = torch.cat([prompts, plain_greedy(model, prompts, 64)], 1)
        cache = KVCache(a.n_layers, 8, a.n_kv_heads, text.shape[1], a.head_dim, torch.float32, "cpu")
        _, feats = prefill_features(model, cache, text, 128, head.taps(a.n_layers))
    feats, text = feats.clone(), text.clone()
    head.train().requires_grad_(True)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    lm = model.output.weight.detach()
    torch.manual_seed(seed)
    for _ in range(steps):
        h = head(feats[:, :-1], text[:, 1:], model.tok_embeddings.weight.detach())
        logits = head.logits(h[:, :-1], lm)
        target = text[:, 2:]
        if family == "eagle3" and head.draft_vocab != a.vocab_size:
            target = torch.where(target < head.draft_vocab, target, -100)  # the d2t of the first ids: the identity
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                 ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def eagle(tiny):
    return trained(tiny, "eagle")


@pytest.fixture(scope="module")
def eagle3(tiny):
    return trained(tiny, "eagle3", layers=(1, 2, 3), draft_vocab=200)


@pytest.fixture(autouse=True)
def no_grad():
    with torch.inference_mode():
        yield


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


def test_eagle_sampled_keeps_the_targets_distribution(tiny, eagle, monkeypatch):
    check_sampled(tiny, eagle, monkeypatch)


def test_eagle3_sampled_keeps_the_targets_distribution(tiny, eagle3, monkeypatch):
    check_sampled(tiny, eagle3, monkeypatch)


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


def test_smollm2_eagle_equals_plain_greedy(smol_model, smol_prompts):
    from test_medusa import speculate

    head = heads.new_head("eagle", smol_model.args, init="identity")
    out, _ = speculate(smol_model, head, smol_prompts, 24, 3, window=True, budget=32, sinks=4)
    assert out.tolist() == plain_greedy(smol_model, smol_prompts, 24).tolist()


@pytest.mark.parametrize("kv, skip, rows", [("full", False, 32768), ("window", False, 4 + 253), ("full", True, 1)])
def test_memory_counts_the_prompt_features_the_head_is_fed(kv, skip, rows):
    """The head is fed the target's features at every prompt position (full KV) or at its window's (the sinks, the
    last 252 positions before the root, the root: window); over random KV (--skip_prefill) at the last position
    only, its KV being random too: 32K x 13 at Llama-3.1-8B's shape was refused for 3.5 GB of features it never
    read."""
    from magicdec import drafters
    from magicdec.config import ModelArgs
    from magicdec.run_config import RunConfig

    target = ModelArgs.from_name("meta-llama/Meta-Llama-3.1-8B")
    extra = {"head_budget": 256} if kv == "window" else {}
    cfg = RunConfig.from_options({"random_weights": True, "model_name": "meta-llama/Meta-Llama-3.1-8B", "B": 13,
                                  "prefix_len": 32768, "gen_len": 64, "drafter": "eagle", "gamma": [2],
                                  "head_kv": kv, "skip_prefill": skip, "device": "cpu"} | extra)
    (part,) = drafters.get("eagle").memory(cfg, target, {}, 0)
    assert part.kv_bytes == rows * target.dim * cfg.runtime.torch_dtype.itemsize
