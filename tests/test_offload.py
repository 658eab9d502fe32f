"""magicdec/model/offload.py on CPU (host and "device" both CPU memory, the same code path as on a GPU): prefill and decode
through the offloaded cache give exactly the on-chip cache's logits for any number of on-chip layers; each forward
copies every offloaded layer once, in order, into slot layer % 2; a prefetch that fetched a neighbouring layer is
caught; a selection reads an offloaded layer's prompt KV; speculation over an offloaded target is lossless."""
from __future__ import annotations

import pytest
import torch

from magicdec.drafters import draft_cache
from magicdec.drafters.model_draft import ModelDraft
from magicdec.decoding.generate import Decoder, decode, prefill
from magicdec.model.kv_cache import KVCache, StreamingCache
from magicdec.model.offload import OffloadedCache
from test_generate_speculative import assert_ragged, plain_greedy


pytestmark = pytest.mark.usefixtures("inference_mode")  # conftest: no autograd in these tests


def caches(model, B, P, extra, on_chip):
    a = model.args
    full = KVCache(a.n_layers, B, a.n_kv_heads, P + extra, a.head_dim, torch.float32, "cpu")
    off = OffloadedCache(a.n_layers, B, a.n_kv_heads, P + extra, a.head_dim, torch.float32, "cpu", "sdpa", on_chip, P)
    return full, off


def run(model, cache, prompts, steps):
    """Prefill in chunks of 16, then `steps` ragged 3-token forwards (rolled back by a different amount per
    sequence, as verifications do): every forward's logits."""
    out = [prefill(model, cache, prompts, 16)]
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, model.args.vocab_size, (prompts.shape[0], 3), generator=g)
        out.append(model(tokens, cache))
        cache.advance(torch.randint(1, 4, (prompts.shape[0],), generator=g))
    return out


@pytest.mark.parametrize("on_chip", [0, 1, 3, 4])
def test_offloaded_cache_gives_the_on_chip_logits(tiny, on_chip):
    prompts = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(0))
    full, off = caches(tiny, 3, 40, 40, on_chip)
    for a, b in zip(run(tiny, full, prompts, 8), run(tiny, off, prompts, 8)):
        assert torch.equal(a, b)
    layers = tiny.args.n_layers
    per_forward = [(layer, layer % 2) for layer in range(on_chip, layers)]
    assert off.fetch_log == per_forward * (3 + 8)  # 3 prefill chunks, 8 decode forwards: each layer once, in order


def test_a_neighbours_kv_is_caught(tiny, monkeypatch):
    """The controls: a prefetch that copies the next layer's host KV into the slot (a data index off by one)
    changes the logits; one that fetches the wrong layer is refused by the slot check."""
    prompts = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    full, off = caches(tiny, 2, 40, 10, 1)
    right = OffloadedCache._prefetch

    def neighbours_data(self, layer):
        rotate = lambda xs: xs[1:] + xs[:1]  # noqa: E731  host list index i + 1 in place of i
        self.host_k, self.host_v = rotate(self.host_k), rotate(self.host_v)
        right(self, layer)
        self.host_k, self.host_v = self.host_k[-1:] + self.host_k[:-1], self.host_v[-1:] + self.host_v[:-1]

    monkeypatch.setattr(OffloadedCache, "_prefetch", neighbours_data)
    a, b = run(tiny, full, prompts, 2), run(tiny, off, prompts, 2)
    assert not all(torch.equal(x, y) for x, y in zip(a, b))
    monkeypatch.setattr(OffloadedCache, "_prefetch", lambda self, layer: right(self, min(layer + 1, self.n_layers - 1)))
    with pytest.raises(AssertionError, match="holds layer"):
        run(tiny, caches(tiny, 2, 40, 10, 1)[1], prompts, 1)


def test_selection_reads_the_offloaded_prompt(tiny):
    """A retrieval draft cache built from an offloaded target holds what one built from the on-chip target does."""
    prompts = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(2))
    policy = draft_cache.Retrieval(48, 4, window=32)
    built = []
    for cache in caches(tiny, 2, 96, 20, 1):
        _, queries = draft_cache.prefill_recording(tiny, cache, prompts, policy.queries, 32)
        built.append(draft_cache.build(policy, cache, queries, append=20))
    for x, y in zip(built[0].k + built[0].v, built[1].k + built[1].v):
        assert torch.equal(x, y)


def test_speculation_over_an_offloaded_target_is_lossless(tiny):
    prompts = torch.randint(0, 256, (3, 48), generator=torch.Generator().manual_seed(4))
    a, n_new, gamma = tiny.args, 50, 3
    cache = OffloadedCache(a.n_layers, 3, a.n_kv_heads, 48 + n_new + gamma + 2, a.head_dim, torch.float32, "cpu",
                           "sdpa", 2, 48)
    dc = StreamingCache(a.n_layers, 3, a.n_kv_heads, 20, 4, 64, a.head_dim, torch.float32, "cpu")
    logits = prefill(tiny, cache, prompts, 16)
    prefill(tiny, dc, prompts, 16)
    decoder = Decoder(tiny, drafter=ModelDraft(tiny, dc), gamma=gamma, trace=True)
    out, _ = decode(decoder, cache, logits.argmax(-1), n_new, prev=prompts[:, -1])
    assert out.tolist() == plain_greedy(tiny, prompts, n_new).tolist()
    assert_ragged(decoder)


@pytest.mark.parametrize("on_chip", [None, 1])  # None: the on-chip KVCache
def test_a_small_cache_takes_generated_positions_from_the_target(tiny, on_chip):
    """StreamingCache.take (a hierarchy's middle level): each sequence's K and V at its own generated position,
    from the target's cache (its tail when offloaded), into the ring slot of that position, every layer."""
    a, prompts = tiny.args, torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(6))
    full, off = caches(tiny, 2, 40, 20, on_chip or 0)
    target = full if on_chip is None else off
    prefill(tiny, target, prompts, 16)
    tiny(torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(7)), target)  # positions 40..44
    target.advance(5)
    small = StreamingCache(a.n_layers, 2, a.n_kv_heads, 16, 4, 32, a.head_dim, torch.float32, "cpu")
    pos = torch.tensor([41, 43])
    small.take(target, pos)
    for layer in range(a.n_layers):
        k, v = target.layer_kv(layer)
        for b in range(2):
            slot = int(small.slots(pos)[b])
            assert torch.equal(small.k[layer][b, :, slot], k[b, :, int(pos[b])])
            assert torch.equal(small.v[layer][b, :, slot], v[b, :, int(pos[b])])
            assert small.key_pos[b, slot] == pos[b] and k[b, :, int(pos[b])].abs().sum() > 0
