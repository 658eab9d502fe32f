"""The full KV cache: incremental, chunked, ragged, rolled-back and multi-token forwards all give the logits of one
plain forward of each sequence alone (which test_model.py checks against transformers).

Sequences run past 128 tokens so the flex backend's per-sequence KV-block bound (blocks of 128) is exercised; the
reference is always the sdpa forward of the whole sequence at once in a fresh B=1 cache.
"""
from __future__ import annotations

import pytest
import torch

from magicdec.model.forward_plan import NO_LOGITS, PLAIN
from magicdec.decoding.generate import prefill
from magicdec.model.kv_cache import KVCache
from magicdec.model.transformer import Transformer, load_model

BACKENDS = ["sdpa", "flex"]
MAX_LEN = 300
ATOL = 1e-4
VOCAB = 256


@pytest.fixture(scope="module")
def model(tiny_hf) -> Transformer:
    _, path = tiny_hf("llama")  # GQA, random N(0, 0.1) weights: logits spread ~0.8
    return load_model(path, "cpu", torch.float32)


pytestmark = pytest.mark.usefixtures("inference_mode")  # conftest: no autograd in these tests


def tokens(B: int, T: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def new_cache(model: Transformer, B: int, backend: str, max_len: int = MAX_LEN) -> KVCache:
    a = model.args
    return KVCache(a.n_layers, B, a.n_kv_heads, max_len, a.head_dim, torch.float32, "cpu", backend)


def alone(model: Transformer, seq: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] of one sequence [T] run alone, all at once, in a fresh B=1 cache."""
    return model(seq[None], new_cache(model, 1, "sdpa", max_len=seq.shape[0]))[0]


def ragged(model: Transformer, backend: str, X: torch.Tensor, lengths: list[int]) -> KVCache:
    """A cache where row b holds X[b, :lengths[b]]: all rows are fed max(lengths) tokens of X, then advanced by
    their own amounts, so the slots past a shorter row's length hold real (stale) keys that must stay masked."""
    lo, hi = min(lengths), max(lengths)
    cache = new_cache(model, X.shape[0], backend)
    model(X[:, :lo], cache, NO_LOGITS)
    cache.advance(lo)
    model(X[:, lo:hi], cache, NO_LOGITS)
    cache.advance(torch.tensor(lengths) - lo)
    assert cache.lengths.tolist() == lengths
    return cache


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() <= ATOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_then_steps_equal_full_forward(model, backend):
    X = tokens(2, 150, seed=0)
    full = model(X, new_cache(model, 2, "sdpa", max_len=150))
    cache = new_cache(model, 2, backend)
    got = [model(X[:, :100], cache)]
    cache.advance(100)
    for t in range(100, 150):  # crosses the 128-slot block boundary
        got.append(model(X[:, t:t + 1], cache))
        cache.advance(1)
    assert cache.lengths.tolist() == [150, 150]
    assert close(torch.cat(got, dim=1), full)
    assert close(full[1], alone(model, X[1]))  # batch rows do not interact


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", [7, 64, 150, 1000])  # 7 and 64 do not divide 150; 1000 > the prompt
def test_chunked_prefill_equals_unchunked(model, backend, chunk):
    X = tokens(2, 151, seed=1)
    ref_cache = new_cache(model, 2, "sdpa")
    full = model(X, ref_cache)
    ref_cache.advance(150)
    cache = new_cache(model, 2, backend)
    last = prefill(model, cache, X[:, :150], chunk)
    assert cache.lengths.tolist() == [150, 150]
    assert close(last, full[:, 149])
    for layer in range(model.args.n_layers):
        assert close(cache.k[layer][:, :, :150], ref_cache.k[layer][:, :, :150])
        assert close(cache.v[layer][:, :, :150], ref_cache.v[layer][:, :, :150])
    assert close(model(X[:, 150:], cache)[:, 0], full[:, 150])


@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_batch_equals_each_sequence_alone(model, backend):
    lengths = [40, 97, 140]
    X = tokens(3, 140, seed=2)
    D = tokens(3, 12, seed=3)  # each row's own continuation
    cache = ragged(model, backend, X, lengths)
    steps = []
    for j in range(D.shape[1]):
        steps.append(model(D[:, j:j + 1], cache))
        cache.advance(1)
    got = torch.cat(steps, dim=1)  # [3, 12, V]
    for b, n in enumerate(lengths):
        ref = alone(model, torch.cat([X[b, :n], D[b]]))[n:]
        assert close(got[b], ref), f"row {b} (length {n})"


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollback_then_redecode_equals_straight_decode(model, backend):
    X = tokens(2, 60, seed=4)
    D = tokens(2, 10, seed=5)
    garbage = tokens(2, 8, seed=6)

    straight = new_cache(model, 2, backend)
    prefill(model, straight, X, 32)
    want = []
    for j in range(10):
        want.append(model(D[:, j:j + 1], straight))
        straight.advance(1)

    cache = new_cache(model, 2, backend)
    prefill(model, cache, X, 32)
    saved = cache.lengths.clone()
    model(garbage, cache, NO_LOGITS)  # a rejected 8-token draft...
    cache.advance(8)
    for j in range(3):  # ...and a few garbage single steps
        model(garbage[:, j:j + 1], cache)
        cache.advance(1)
    cache.rollback(saved)
    saved += 100  # rollback copies the lengths: the caller's tensor is not aliased
    assert cache.lengths.tolist() == [60, 60]
    got = []
    for j in range(10):
        got.append(model(D[:, j:j + 1], cache))
        cache.advance(1)
    assert close(torch.cat(got, 1), torch.cat(want, 1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_rollback(model, backend):
    """Rolling rows back by different amounts leaves each row equal to its shorter sequence run alone."""
    X = tokens(2, 140, seed=7)
    D = tokens(2, 6, seed=8)
    cache = new_cache(model, 2, backend)
    prefill(model, cache, X, 64)
    keep = [45, 131]
    cache.rollback(torch.tensor(keep))
    got = []
    for j in range(D.shape[1]):
        got.append(model(D[:, j:j + 1], cache))
        cache.advance(1)
    got = torch.cat(got, 1)
    for b, n in enumerate(keep):
        assert close(got[b], alone(model, torch.cat([X[b, :n], D[b]]))[n:]), f"row {b}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", [2, 4, 7])
def test_multi_token_verify_equals_single_steps(model, backend, k):
    lengths = [50, 90, 125]  # row 2's k tokens cross the 128-slot block boundary
    X = tokens(3, 125, seed=9)
    V = tokens(3, k, seed=10)

    cache = ragged(model, backend, X, lengths)
    verify = model(V, cache)  # [3, k, V]: k tokens at once, lengths not advanced
    assert cache.lengths.tolist() == lengths

    steps_cache = ragged(model, backend, X, lengths)
    steps = []
    for j in range(k):
        steps.append(model(V[:, j:j + 1], steps_cache))
        steps_cache.advance(1)
    assert close(verify, torch.cat(steps, 1))
    for b, n in enumerate(lengths):
        assert close(verify[b], alone(model, torch.cat([X[b, :n], V[b]]))[n:]), f"row {b} (length {n})"

    # Ragged acceptance, as speculative decoding does: keep a different number of the k tokens per row, then the
    # next step sees exactly the accepted prefix (the rejected tokens' slots are stale and must stay masked).
    accepted = torch.tensor([k, 1, 0])
    cache.advance(accepted)
    nxt = tokens(3, 1, seed=11)
    after = model(nxt, cache)[:, 0]
    for b, n in enumerate(lengths):
        a = int(accepted[b])
        seq = torch.cat([X[b, :n], V[b, :a], nxt[b]])
        assert close(after[b], alone(model, seq)[-1]), f"row {b} accepted {a}"


def test_positions_and_nbytes(model):
    cache = new_cache(model, 3, "sdpa", max_len=20)
    cache.advance(torch.tensor([0, 5, 9]))
    assert cache.positions(3).tolist() == [[0, 1, 2], [5, 6, 7], [9, 10, 11]]
    cache.advance(2)
    assert cache.lengths.tolist() == [2, 7, 11]
    a = model.args
    assert KVCache.nbytes_for(a.n_layers, 3, a.n_kv_heads, 20, a.head_dim, torch.float32) == sum(
        t.numel() * t.element_size() for t in cache.k + cache.v)
    assert KVCache.nbytes_for(a.n_layers, 3, a.n_kv_heads, 20, a.head_dim, torch.bfloat16) == sum(
        t.numel() * 2 for t in cache.k + cache.v)


def flex_block_mask(q_pos: torch.Tensor, n_slots: int):
    """The BlockMask that flex_attend builds (read from the attend closure): eager flex on CPU computes every block
    whatever the mask says, so the block bounds can only be checked on the mask itself."""
    import inspect

    from magicdec.model.attention import make_attend

    return inspect.getclosurevars(make_attend("flex", q_pos, None, n_slots)).nonlocals["block_mask"]


@pytest.mark.parametrize("lengths,T", [([0, 127, 128, 250], 1), ([5, 120, 126, 200], 7), ([0, 3, 130, 140], 150)])
def test_flex_block_mask_covers_every_visible_slot(lengths, T):
    n_slots = 400
    q_pos = torch.tensor(lengths)[:, None] + torch.arange(T)
    bm = flex_block_mask(q_pos, n_slots)
    blocks = bm.to_dense()[:, 0].bool()  # [B, n_q_blocks, n_kv_blocks]: which blocks are computed
    q_block, kv_block = bm.BLOCK_SIZE
    slots = torch.arange(n_slots)
    for b in range(len(lengths)):
        for t in range(T):
            visible = slots[slots <= q_pos[b, t]]
            computed = blocks[b, t // q_block, visible // kv_block]
            assert computed.all(), f"row {b} query {t} at position {int(q_pos[b, t])} misses a visible block"
    # and the point of the block mask: a short sequence in a long cache skips the blocks past its end
    assert not blocks[0, 0, -1] and blocks[0, 0, 0]


# --- StreamingLLM cache --------------------------------------------------------------------------------------------
from magicdec.model.kv_cache import StreamingCache  # noqa: E402
from magicdec.model.attention import make_attend  # noqa: E402

SINKS, BUDGET = 4, 24


class WindowedFullCache(KVCache):
    """Reference: every position kept at its own slot, StreamingLLM's window applied by the mask alone."""

    def attend(self, T, plan=PLAIN):
        super().attend(T, plan)  # claims the slots the forward writes
        return make_attend(self.backend, self.positions(T, plan), None, self.max_len, SINKS, BUDGET - SINKS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_streaming_cache_equals_windowed_attention(model, backend):
    """Chunked prefill, decode, a 5-token verify, rollback and re-decode through the ring buffer (which wraps many
    times) give the logits of one forward where each query sees the sinks plus its last BUDGET-SINKS positions."""
    a, B, T = model.args, 3, 200
    X = tokens(B, T, seed=11)
    ref_cache = WindowedFullCache(a.n_layers, B, a.n_kv_heads, T, a.head_dim, torch.float32, "cpu", "sdpa")
    ref = model(X, ref_cache)
    cache = StreamingCache(a.n_layers, B, a.n_kv_heads, BUDGET, SINKS, 16, a.head_dim, torch.float32, "cpu", backend)
    assert cache.max_len == BUDGET + 16  # memory stays bounded by the budget, whatever the length
    out = [model(X[:, :16], cache)]
    cache.advance(16)
    out.append(model(X[:, 16:23], cache))  # a chunk that does not divide anything
    cache.advance(7)
    for t in range(23, 120):
        out.append(model(X[:, t:t + 1], cache))
        cache.advance(1)
    # verify 5 tokens, keep a ragged number of them per sequence, roll back the rest and re-decode
    garbage = tokens(B, 5, seed=3)
    model(garbage, cache)
    keep = torch.tensor([0, 2, 5])
    cache.advance(keep)
    cache.rollback(torch.full((B,), 120))  # all rejected in the end: rows must not see the garbage
    out.append(model(X[:, 120:125], cache))
    cache.advance(5)
    for t in range(125, T):
        out.append(model(X[:, t:t + 1], cache))
        cache.advance(1)
    torch.testing.assert_close(torch.cat(out, 1), ref, atol=ATOL, rtol=0)


def test_streaming_window_changes_the_result(model):
    """Control: the window really cuts context (else the test above would prove nothing)."""
    a, X = model.args, tokens(1, 150, seed=5)
    full = model(X, KVCache(a.n_layers, 1, a.n_kv_heads, 150, a.head_dim, torch.float32, "cpu"))
    windowed = model(X, WindowedFullCache(a.n_layers, 1, a.n_kv_heads, 150, a.head_dim, torch.float32, "cpu"))
    assert (full[:, BUDGET:] - windowed[:, BUDGET:]).abs().max() > 1e-2
    torch.testing.assert_close(full[:, :BUDGET], windowed[:, :BUDGET], atol=ATOL, rtol=0)


def test_fill_random_stands_in_for_a_prefill():
    """Random-weight speed runs skip the prefill: the full cache holds `length` tokens, the StreamingLLM cache the
    positions a prefill would have left: the sinks and the last window."""
    full = KVCache(2, 3, 2, 128, 16, torch.float32, "cpu")
    full.fill_random(100, seed=0)
    assert full.lengths.tolist() == [100] * 3 and full.k[0].std() > 0.5
    ring = StreamingCache(2, 3, 2, 24, 4, 16, 16, torch.float32, "cpu")
    ring.fill_random(100, seed=0)
    held = sorted(p for p in ring.key_pos[0].tolist() if p < 2**62)
    assert held == [0, 1, 2, 3] + list(range(80, 100))


def reindexed_streaming_by_hand(model: Transformer, ids: list[int], sinks: int, window: int) -> torch.Tensor:
    """StreamingLLM with positions inside the cache, one token at a time, written out in float64: each layer keeps
    its keys before RoPE; token p attends to the sinks 0..sinks-1 and its window (p - window, p], placed at positions
    0..n-1 in that order (n = how many it sees, itself last), keys and query rotated there. Logits [len(ids), V]."""
    a = model.args
    D, G = a.head_dim, a.n_heads // a.n_kv_heads
    inv_freq = model.inv_freq.double()

    def rotate(x, pos):  # x [..., D] at position pos (rotate-half, as the HF Llama)
        c, s = torch.cos(pos * inv_freq), torch.sin(pos * inv_freq)
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    keys = [[] for _ in model.layers]  # per layer: [Hkv, D] before RoPE, one per position
    values = [[] for _ in model.layers]
    out = []
    for p, tok in enumerate(ids):
        seen = [j for j in range(p + 1) if j < sinks or j > p - window]
        x = model.tok_embeddings.weight[tok].double()
        for i, layer in enumerate(model.layers):
            att = layer.attention
            h = layer.attention_norm(x.float()[None, None]).double()[0, 0]
            q, k, v = att.wqkv.weight.double().matmul(h).split([a.n_heads * D, a.n_kv_heads * D, a.n_kv_heads * D])
            keys[i].append(k.view(a.n_kv_heads, D))
            values[i].append(v.view(a.n_kv_heads, D))
            K = torch.stack([rotate(keys[i][j], n) for n, j in enumerate(seen)], 1)  # [Hkv, n, D]
            V = torch.stack([values[i][j] for j in seen], 1)
            q = rotate(q.view(a.n_heads, D), len(seen) - 1)
            heads = [torch.softmax(K[hh // G] @ q[hh] / D ** 0.5, -1) @ V[hh // G] for hh in range(a.n_heads)]
            x = x + att.wo.weight.double() @ torch.cat(heads)
            x = x + layer.feed_forward(layer.ffn_norm(x.float()[None, None]))[0, 0].double()
        out.append(model.output(model.norm(x.float()[None, None]))[0, 0])
    return torch.stack(out)


def reindexed_cache(model: Transformer, B: int, budget: int, sinks: int) -> StreamingCache:
    a = model.args
    return StreamingCache(a.n_layers, B, a.n_kv_heads, budget, sinks, 16, a.head_dim, torch.float32, "cpu",
                          rope=model.inv_freq)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reindexed_streaming_is_streamingllm_at_cache_positions(model, backend):
    """--reindex: token by token through the ring (it wraps many times), every logit equals the hand-written
    StreamingLLM that rotates its kept keys at their place in the cache, so no query-key distance ever exceeds the
    budget (200 positions through a 24-token budget). Some steps are rejected for some sequences (rows then sit at
    different positions) and garbage is written and rolled back: neither changes what is kept."""
    B, T = 3, 200
    X = tokens(B, T, seed=17)
    cache = reindexed_cache(model, B, BUDGET, SINKS)
    cache.backend = backend
    rejected = {(1, 3), (1, 50), (1, 51), (2, 80), (2, 81), (0, 120)}  # (row, step) whose token is not kept
    kept, got = [[] for _ in range(B)], [[] for _ in range(B)]
    for t in range(T):
        if t == 150:  # 3 garbage tokens written, then rolled back
            lengths = cache.lengths.clone()
            model(tokens(B, 3, seed=4), cache)
            cache.rollback(lengths)
        logits = model(X[:, t:t + 1], cache)[:, 0]
        keep = torch.tensor([(b, t) not in rejected for b in range(B)])
        cache.advance(keep.long())
        for b in range(B):
            if keep[b]:
                kept[b].append(int(X[b, t]))
                got[b].append(logits[b])
    assert [len(k) for k in kept] == [199, 197, 198]  # rows at different positions
    for b in range(B):
        ref = reindexed_streaming_by_hand(model, kept[b], SINKS, BUDGET - SINKS)
        torch.testing.assert_close(torch.stack(got[b]), ref.float(), atol=ATOL, rtol=0)
    # control: absolute positions (no --reindex) give other logits once the sinks are far from the window
    a = model.args
    plain = StreamingCache(a.n_layers, 1, a.n_kv_heads, BUDGET, SINKS, 16, a.head_dim, torch.float32, "cpu")
    prefill(model, plain, torch.tensor([kept[0][:-1]]), 1)
    assert (model(torch.tensor([kept[0][-1:]]), plain)[0, 0] - got[0][-1]).abs().max() > 1e-2


def test_reindexed_multi_token_forward_is_exact_for_its_last_query(model):
    """A forward of T tokens places the sinks by its last query, whose logits then equal the token-by-token
    reference. With one layer every key depends on its token and position only, so the cache holds the reference's
    keys whatever the forward length (deeper layers' keys of the forward's earlier tokens see the sinks nearer)."""
    from test_generate_speculative import first_layers

    one = first_layers(model, 1)
    X = tokens(2, 120, seed=8)
    cache = reindexed_cache(one, 2, BUDGET, SINKS)
    prefill(one, cache, X[:, :100], 7)  # chunks of 7: each one's earlier queries see the sinks nearer
    last = [one(X[:, 100:105], cache)[:, -1]]  # a 5-token verify-like forward
    cache.advance(5)
    last.append(one(X[:, 105:107], cache)[:, -1])  # the draft's 2-token re-feed
    for b in range(2):
        ref = reindexed_streaming_by_hand(one, X[b, :107].tolist(), SINKS, BUDGET - SINKS)
        torch.testing.assert_close(torch.stack([last[0][b], last[1][b]]), ref[[104, 106]].float(), atol=ATOL, rtol=0)


def test_reindexed_streaming_smollm2(smol_model, smol_prompts):
    """Real weights (SmolLM2-135M, 30 layers, GQA 9/3) on a Gutenberg prompt: a 40-token reindexed draft equals the
    hand-written StreamingLLM at cache positions at every one of 64 positions (24 past its window)."""
    X = smol_prompts[:1, :64]
    cache = reindexed_cache(smol_model, 1, 40, 4)
    got = []
    for t in range(X.shape[1]):
        got.append(smol_model(X[:, t:t + 1], cache)[0, 0])
        cache.advance(1)
    got = torch.stack(got)
    ref = reindexed_streaming_by_hand(smol_model, X[0].tolist(), 4, 36)
    torch.testing.assert_close(got, ref.float(), atol=2e-3, rtol=0)
