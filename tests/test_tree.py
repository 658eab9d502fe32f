"""Token trees (magicdec/model/tree.py): shapes and masks against hand-built ones, a tree's verification through the model
against transformers on each path, and tree speculation through the loop (greedy equal to plain decoding, sampled
keeping the target's distribution). The acceptance rules themselves: test_acceptance.py."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the split-KV kernel on the CPU, set before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from conftest import chi_square  # noqa: E402
from magicdec.model.attention import make_attend  # noqa: E402
from magicdec.errors import MagicDecError  # noqa: E402
from magicdec.model.forward_plan import NO_LOGITS, PLAIN, ForwardPlan  # noqa: E402
from magicdec.model.kv_cache import KVCache  # noqa: E402
from magicdec.decoding.acceptance import synthetic_tree_verify  # noqa: E402
from magicdec.model.tree import Tree, TreeMask, expected_tokens, optimal_tree, rank_counts, visible  # noqa: E402

# root; two children; the first with two children, the second with one; one grandchild below node 3
BRANCHY = Tree((-1, 0, 0, 1, 1, 2, 3))


def test_shapes_by_hand():
    assert Tree.chain(3).parents == (-1, 0, 1, 2) and Tree.chain(3).is_chain
    t = Tree.chain_with_siblings(2, 3)
    assert t.parents == (-1, 0, 0, 0, 1, 1, 1) and t.depths == (0, 1, 1, 1, 2, 2, 2) and t.depth == 2
    assert BRANCHY.children == ((1, 2), (3, 4), (5,), (6,), (), (), ())
    anc = BRANCHY.ancestors
    assert anc[6].nonzero().flatten().tolist() == [0, 1, 3, 6] and anc[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert BRANCHY.ancestor_bits.tolist() == [1, 3, 5, 11, 19, 37, 75]


@pytest.mark.parametrize("parents, needle", [((0, 0), "-1 for the root"), ((-1, 1), "before it"),
                                             ((-1, *[0] * 64), "at most 64")])
def test_bad_trees_are_one_line(parents, needle):
    with pytest.raises(MagicDecError, match=needle) as e:
        Tree(tuple(parents))
    assert "\n" not in str(e.value)


def test_visible_by_hand():
    """Sequence 0 has 2 committed tokens, sequence 1 has 4; the tree's nodes sit right after them."""
    v = visible(TreeMask(BRANCHY.ancestors, BRANCHY.ancestor_bits, torch.tensor([2, 4])), 12)
    for b, base in enumerate((2, 4)):
        for i in range(BRANCHY.size):
            want = [s < base or (0 <= s - base < 7 and bool(BRANCHY.ancestors[i, s - base])) for s in range(12)]
            assert v[b, i].tolist() == want


def reference_attention(q, k, v, base, tree):
    """Float64 softmax attention, one (sequence, head, node) at a time: node i of sequence b over the slots before
    base[b] and the slots base[b] + j of its ancestors j, picked by walking up the parents."""
    B, H, T, D = q.shape
    G = H // k.shape[1]
    out = torch.zeros(B, H, T, D, dtype=torch.float64)
    for b in range(B):
        for i in range(T):
            up, chain = i, []
            while up >= 0:
                chain.append(up)
                up = tree.parents[up]
            slots = list(range(int(base[b]))) + [int(base[b]) + j for j in sorted(chain)]
            for h in range(H):
                kh, vh = k[b, h // G, slots].double(), v[b, h // G, slots].double()
                w = torch.softmax(kh @ q[b, h, i].double() / D ** 0.5, 0)
                out[b, h, i] = w @ vh
    return out


@pytest.mark.parametrize("backend", ["sdpa", "flex", "triton"])
@pytest.mark.parametrize("tree", [Tree.chain_with_siblings(3, 3), Tree.chain_with_siblings(7, 9)],
                         ids=["10 nodes", "64 nodes"])
def test_every_backend_masks_a_tree_as_the_float64_reference(backend, tree):
    """64 nodes of 4 query heads per KV head are 256 rows: the kernel's programs take 128 each."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D, S = 2, 8, 2, 16, 300
    T = tree.size
    q, k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, Hkv, S, D, generator=g), \
        torch.randn(B, Hkv, S, D, generator=g)
    base = torch.tensor([130, 7])  # ragged: the nodes' slots start after each sequence's committed ones
    td = tree.on_device("cpu")
    q_pos = base[:, None] + td.depths[None]
    out = make_attend(backend, q_pos, None, S, tree=TreeMask(td.ancestors, td.bits, base))(q, k, v)
    ref = reference_attention(q, k, v, base, tree)
    assert (out.double() - ref).abs().max() < 2e-5


@pytest.mark.parametrize("backend", ["sdpa", "flex", "triton"])
def test_every_backend_masks_a_drafted_level_in_a_ring_as_the_float64_reference(backend):
    """A draft's ring (StreamingLLM: 4 sinks, a 40-position window) drafting a tree level by level: the queries are
    level 2's nodes (position root + 2), node j's KV in the slot of position root + j wherever the ring maps it;
    each query sees the sinks, the window ending at its position, and its ancestors among the nodes only (stale
    nodes of other branches and positions outside the window hidden), checked one (sequence, head, node) at a
    time in float64."""
    from magicdec.model.kv_cache import StreamingCache

    tree = optimal_tree((0.7, 0.4, 0.3), 20, 4)
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D, sinks, window = 2, 8, 2, 16, 4, 40
    cache = StreamingCache(1, B, Hkv, sinks + window, sinks, 64, D, torch.float32, "cpu", backend)
    roots = torch.tensor([150, 61])  # ragged; the ring (40 + 64 slots) has wrapped for both
    for b, r in enumerate(roots.tolist()):  # committed positions 0..root, then stale ones past the tree
        pos = torch.tensor(list(range(sinks)) + list(range(r + 1 - window, r + 1 + tree.size + 5)))
        cache.key_pos[b, cache.slots(pos)] = pos
    cache.k[0].normal_(generator=g)
    cache.v[0].normal_(generator=g)
    cache.lengths.copy_(roots + 1)
    level = tree.level_on_device(2, "cpu")
    T = level.nodes.numel()
    q = torch.randn(B, H, T, D, generator=g)
    out = cache.attend(T, ForwardPlan.drafting(level))(q, cache.k[0], cache.v[0])
    G = H // Hkv
    for b, r in enumerate(roots.tolist()):
        for t, i in enumerate(level.nodes.tolist()):
            chain, up = [], i
            while up > 0:
                chain.append(up)
                up = tree.parents[up]
            seen = list(range(sinks)) + list(range(r + 3 - window, r + 1)) + [r + j for j in sorted(chain)]
            slots = cache.slots(torch.tensor(seen))
            for h in range(H):
                kh, vh = cache.k[0][b, h // G, slots].double(), cache.v[0][b, h // G, slots].double()
                w = torch.softmax(kh @ q[b, h, t].double() / D ** 0.5, 0)
                assert (out[b, h, t].double() - w @ vh).abs().max() < 2e-5, (backend, b, h, i)


@pytest.mark.parametrize("backend", ["sdpa", "flex", "triton"])
def test_tree_verification_through_the_model_equals_transformers_on_each_path(tiny_hf, backend):
    """Each node's logits from one tree forward equal transformers' Llama on the prompt followed by that node's
    path; after keep_path and a rollback to the accepted path, the next step equals transformers on prompt + path
    + next token (the path's KV is where its positions say)."""
    from magicdec.model.transformer import load_model

    hf, path = tiny_hf("llama", seed=3, num_hidden_layers=4, max_position_embeddings=1024)
    model = load_model(path, "cpu", torch.float32)
    a = model.args
    g = torch.Generator().manual_seed(1)
    B, P = 2, 37
    prompts = torch.randint(0, a.vocab_size, (B, P), generator=g)
    tree = BRANCHY
    nodes = torch.randint(0, a.vocab_size, (B, tree.size), generator=g)
    nodes[:, 0] = prompts[:, -1]  # the root: the last committed token, fed first
    cache = KVCache(a.n_layers, B, model.n_kv_heads, 64, a.head_dim, torch.float32, "cpu", backend)
    model(prompts[:, :-1], cache, NO_LOGITS)
    cache.advance(P - 1)
    logits = model(nodes, cache, PLAIN.with_tree(tree.on_device("cpu")))
    for b in range(B):
        for i in range(tree.size):
            up, chain = i, []
            while up > 0:
                chain.append(up)
                up = tree.parents[up]
            ids = torch.cat([prompts[b], nodes[b, sorted(chain)]])
            want = hf(ids[None]).logits[0, -1]
            assert torch.allclose(logits[b, i], want, atol=2e-4), (b, i)
    path = torch.tensor([[0, 1, 3, 6], [0, 2, 5, 5]])  # sequence 1 kept two nodes
    kept = torch.tensor([3, 2])
    cache.keep_path(path)
    cache.advance(kept + 1)  # the root and the kept nodes
    nxt = torch.randint(0, a.vocab_size, (B, 1), generator=g)
    step = model(nxt, cache)
    for b in range(B):
        ids = torch.cat([prompts[b], nodes[b, path[b, 1:int(kept[b]) + 1]], nxt[b]])
        assert torch.allclose(step[b, -1], hf(ids[None]).logits[0, -1], atol=2e-4), b


def tree_speculation(model, draft_model, prompts, n_new, gamma, width, sampling=None, first=None):
    """Speculation whose draft (over a StreamingLLM ring of its own prefill) proposes a tree `width` wide."""
    from conftest import copies, prefill_copies
    from magicdec.drafters.model_draft import ModelDraft
    from magicdec.decoding.acceptance import Acceptor
    from magicdec.decoding.generate import Decoder, decode, prefill
    from magicdec.model.kv_cache import StreamingCache

    a, (B, P) = model.args, prompts.shape
    cache = KVCache(a.n_layers, B, a.n_kv_heads, P + n_new + gamma * width + 2, a.head_dim, torch.float32, "cpu")
    logits = prefill_copies(model, cache, prompts, 64) if copies(prompts) else prefill(model, cache, prompts, 64, False)
    d = draft_model.args
    ring = StreamingCache(d.n_layers, B, d.n_kv_heads, 24, 4, 64 + n_new, d.head_dim, torch.float32, "cpu", "sdpa")
    prefill(draft_model, ring, prompts, 32, False)
    draft = ModelDraft(draft_model, ring).shaped(width)
    decoder = Decoder(model, Acceptor(sampling), drafter=draft, gamma=gamma)
    first = logits.argmax(-1) if first is None else first
    return decode(decoder, cache, first, n_new, prev=prompts[:, -1])[0], decoder


@pytest.mark.parametrize("standalone", [False, True])
def test_greedy_tree_speculation_equals_plain_greedy(tiny, standalone):
    """The self-draft (the target over a small ring) and a standalone draft (its first layer) proposing trees 3
    wide: the output is plain greedy decoding's, token for token, past the draft's budget."""
    from test_generate_speculative import first_layers, plain_greedy

    prompts = torch.randint(0, 256, (3, 80), generator=torch.Generator().manual_seed(4))
    draft = first_layers(tiny, 1) if standalone else tiny
    out, decoder = tree_speculation(tiny, draft, prompts, 40, 3, 3)
    assert out.tolist() == plain_greedy(tiny, prompts, 40).tolist()
    assert decoder.stats.alpha > 0


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_a_chain_verified_as_a_tree_is_the_chain_bitwise(tiny, backend):
    """Tree.chain(g) through the tree path (its mask, its positions) gives a chain verification's logits bit for
    bit; and drafted level by level (a level a node) it speculates exactly as the chain does, verification by
    verification."""
    from test_generate_speculative import speculate, tiny_prompts

    a, prompts = tiny.args, tiny_prompts(2, 40)
    tokens = torch.randint(0, 256, (2, 4), generator=torch.Generator().manual_seed(5))
    logits = []
    for tree in (None, Tree.chain(3).on_device("cpu")):
        cache = KVCache(a.n_layers, 2, a.n_kv_heads, 64, a.head_dim, torch.float32, "cpu", backend)
        tiny(prompts, cache, NO_LOGITS)
        cache.advance(40)
        logits.append(tiny(tokens, cache, PLAIN.with_tree(tree)))
    assert torch.equal(logits[0], logits[1])
    chain = speculate(tiny, tiny, prompts, 40, 3, budget=20)
    as_tree = speculate(tiny, tiny, prompts, 40, 3, budget=20, shape=Tree.chain(3))
    assert torch.equal(chain[0], as_tree[0]) and chain[2].trace == as_tree[2].trace


def assert_sampled_tree_keeps_the_targets_distribution(tiny, draft, monkeypatch) -> None:
    """N copies of one prompt, a tree one level deep and 3 wide drawn without replacement from `draft`: the first
    generated token after the fixed one follows the target's own distribution (T 0.6, top-p 0.9); trying the next
    candidate against p instead of the residual fails the same check."""
    from conftest import fixed_first_token
    import functools

    from magicdec.decoding import acceptance
    from magicdec.decoding.sampling import Sampling

    N, sampling = 4_000, Sampling(0.6, 0.9)
    prompt, first, p = fixed_first_token(tiny, N)
    torch.manual_seed(0)
    out, decoder = tree_speculation(tiny, draft, prompt.expand(N, -1), 2, 1, 3, sampling, first)
    stat, bound = chi_square(out[:, 1], p)
    assert stat < bound and 0.05 < decoder.stats.alpha < 0.99, (stat, bound, decoder.stats.alpha)
    wrong = functools.partial(acceptance.sampling_tree_verify, correct=False)  # the original, unpatched
    monkeypatch.setattr(acceptance, "sampling_tree_verify", wrong)
    torch.manual_seed(0)
    out, _ = tree_speculation(tiny, draft, prompt.expand(N, -1), 2, 1, 3, sampling, first)
    stat, bound = chi_square(out[:, 1], p)
    assert stat > 2 * bound, (stat, bound)


def test_sampled_tree_speculation_keeps_the_targets_distribution(tiny, monkeypatch):
    """A standalone draft (the target's first layer) proposing the tree."""
    from test_generate_speculative import first_layers

    assert_sampled_tree_keeps_the_targets_distribution(tiny, first_layers(tiny, 1), monkeypatch)


def test_rank_counts_by_hand():
    """Tree 3 deep, 2 wide. Row 0 kept node 2 (rank 1 at depth 1) then node 3 (rank 0), then both of node 3's
    children failed; row 1 kept nothing (both root children failed); row 2 is done (not counted)."""
    tree = Tree.chain_with_siblings(3, 2).on_device("cpu")  # root -> 1, 2; node 1 -> 3, 4; node 3 -> 5, 6
    path = torch.tensor([[0, 2, 2, 2], [0, 0, 0, 0], [0, 1, 3, 5]])
    tried, kept = rank_counts(tree, path, torch.tensor([1, 0, 3]), torch.tensor([True, True, False]))
    # row 0: depth 1 tried ranks 0, 1, kept rank 1; node 2 has no children. row 1: tried ranks 0, 1 at the root
    assert tried.tolist() == [2, 2] and kept.tolist() == [0, 1]


@pytest.mark.parametrize("tree", [Tree.chain(4), Tree.chain_with_siblings(3, 3), BRANCHY, Tree.branches(3, 2)],
                         ids=["chain", "siblings", "branchy", "branches"])
def test_expected_tokens_against_simulation(tree):
    """The closed form against 200,000 simulated verifications (the synthetic rule), and a chain's against
    (1 - alpha^(gamma + 1)) / (1 - alpha)."""
    rates = (0.7, 0.4, 0.25)
    B = 200_000
    u = torch.rand(B, tree.size, generator=torch.Generator().manual_seed(1))
    _, accepted, _ = synthetic_tree_verify(torch.zeros(B, tree.size, dtype=torch.long), tree.on_device("cpu"), rates, u)
    assert abs(expected_tokens(tree, rates) - (1 + accepted.double().mean().item())) < 0.01
    assert expected_tokens(Tree.chain(4), (0.7,)) == pytest.approx((1 - 0.7 ** 5) / 0.3)


def test_the_cost_model_verifies_a_trees_nodes():
    """A tree's verification, written out at Llama-3.1-8B's shapes (32 layers of 4096 wide, 8 KV heads of 128, MLP
    14336, vocabulary 128256) at B 1 over 100K tokens: its 13 nodes through every weight, the KV read once (or its
    attention's FLOPs at the fitted rate, the longer); the draft step the self-draft's over its 512-token budget, the
    chain's; the yield the tree's: at each of the 3 depths the chain's node kept at 0.8, else a sibling at 0.5, 0.3
    and 0.3, and only the chain's node goes deeper."""
    from magicdec.analysis import cost_model as cm
    from magicdec.config import ModelArgs

    c, d = ModelArgs.from_name("meta-llama/Meta-Llama-3.1-8B"), cm.Device(3e12, 7e14, attention_flops=130e12)
    tree = Tree.chain_with_siblings(3, 4)
    params = 32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336) + 128256 * 4096 + 4096 * 65

    def step(T, context):
        weights = 2 * params / 3e12 + 2 * T * params / 7e14
        kv_reads = context * 2 * 2 * 32 * 8 * 128 / 3e12  # K and V, bf16, 32 layers x 8 heads x 128
        attention = 2 * T * 2 * 32 * 32 * 128 * context / 130e12  # QK and PV of 32 query heads
        return weights + max(kv_reads, attention)

    p = cm.predict(c, d, 1, 100_000, 3, 0.8, 512, tree=tree, sibling_rates=(0.5, 0.3))
    assert tree.size == 13
    assert p["T_V"] == pytest.approx(step(13, 100_000), rel=1e-12)
    assert p["T_T"] == pytest.approx(step(1, 100_000), rel=1e-12)
    assert p["T_D"] == pytest.approx(step(1, 512), rel=1e-12)
    some_kept = 1 - 0.2 * 0.5 * 0.7 * 0.7  # a depth keeps one of its four candidates
    assert p["omega"] == pytest.approx(1 + some_kept * (1 + 0.8 + 0.8 ** 2), rel=1e-12)
    assert p["speedup"] == pytest.approx(p["omega"] * step(1, 100_000) / (3 * step(1, 512) + step(13, 100_000)),
                                         rel=1e-12)


@pytest.mark.parametrize("rates, nodes, depth", [((0.85, 0.61, 0.64), 7, 3), ((0.5, 0.3), 7, 6), ((0.9,), 6, 2)])
def test_sequoias_tree_is_the_best_of_every_tree(rates, nodes, depth):
    """Every tree of up to `nodes` nodes and `depth` levels (each parent tuple), its expected yield by the closed
    form: none beats the dynamic program's."""
    import itertools

    best = 0.0
    for n in range(1, nodes + 1):
        for parents in itertools.product(*[range(i) for i in range(1, n)]):
            tree = Tree((-1, *parents))
            if tree.depth <= depth:
                best = max(best, expected_tokens(tree, rates))
    found = optimal_tree(rates, nodes, depth)
    assert found.size <= nodes and found.depth <= depth
    assert expected_tokens(found, rates) == pytest.approx(best)
