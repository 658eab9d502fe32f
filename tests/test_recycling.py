"""magicdec/drafters/recycling.py (Token Recycling): the matrix update and the breadth-first fill against hand-written
tables; the prompt's start; the verification's candidate request against transformers' Llama (each node's k
likeliest ids over the vocabulary); a run through the decoder (greedy equals plain decoding, and the matrix rows of
the checked nodes hold the target's candidates); bad input one line. Greedy losslessness with its example options,
as a tree and as a Sequoia tree, sampled runs seeded: tests/test_runs.py's every-drafter tests."""
from __future__ import annotations

import pytest
import torch

from magicdec.decoding.generate import Decoder
from magicdec.drafters import recycling
from magicdec.drafters.recycling import TokenRecycling, fill, recycle
from magicdec.errors import MagicDecError
from magicdec.model.forward_plan import NO_LOGITS, CandidateRequest, ForwardPlan
from magicdec.model.kv_cache import KVCache
from magicdec.model.tree import Tree

V, K = 6, 2


def test_each_node_writes_its_tokens_row_and_of_equal_tokens_the_last():
    matrix = torch.full((V + 1, K), -1)
    tokens = torch.tensor([[1, 2], [1, 4]])  # token 1 at two nodes: the later (sequence 1) writes its row
    cands = torch.tensor([[[10, 11], [20, 21]], [[30, 31], [40, 41]]])
    recycle(matrix, tokens, cands)
    assert matrix[1].tolist() == [30, 31] and matrix[2].tolist() == [20, 21] and matrix[4].tolist() == [40, 41]
    assert matrix[V].tolist() == [10, 11]  # the sink took the other write
    assert (matrix[[0, 3, 5]] == -1).all()  # rows no node holds are untouched


def test_the_tree_is_filled_breadth_first_from_each_parents_row():
    matrix = torch.tensor([[0, 0], [2, 3], [4, 5], [1, 0], [5, 5], [1, 1], [0, 0]])
    tree = Tree.chain_with_siblings(2, 2)  # root; nodes 1, 2 under it; nodes 3, 4 under node 1
    assert tree.parents == (-1, 0, 0, 1, 1)
    got = fill(matrix, torch.tensor([3, 1]), tree.on_device("cpu"))
    # root 3: its row (1, 0); node 1 = 1, node 2 = 0; node 1's row (2, 3): nodes 3, 4 = 2, 3
    assert got[0].tolist() == [3, 1, 0, 2, 3]
    # root 1: (2, 3); node 1 = 2, node 2 = 3; node 1's (token 2's) row (4, 5)
    assert got[1].tolist() == [1, 2, 3, 4, 5]


def test_a_generation_starts_from_what_followed_each_prompt_tokens_latest_occurrence():
    d = TokenRecycling(torch.tensor([[5, 1, 5, 2], [3, 4, 3, 4]]), V, K)
    d.matrix.fill_(9)
    d.begin()
    assert d.matrix[5].tolist() == [2, 0] and d.matrix[1].tolist() == [5, 0]
    assert d.matrix[3].tolist() == [4, 0] and d.matrix[4].tolist() == [3, 0]
    assert d.matrix[0].tolist() == [0, 0]  # no prompt token: empty (token 0 in every column)


def test_the_verification_copies_out_each_nodes_likeliest_ids_as_transformers_ranks_them(tiny_hf):
    from magicdec.model.transformer import load_model

    hf, path = tiny_hf("llama", seed=5, num_hidden_layers=2, max_position_embeddings=512)
    model = load_model(path, "cpu", torch.float32)
    a = model.args
    g = torch.Generator().manual_seed(2)
    B, P, T, k = 2, 21, 4, 5
    prompts = torch.randint(0, a.vocab_size, (B, P), generator=g)
    tokens = torch.randint(0, a.vocab_size, (B, T), generator=g)
    cache = KVCache(a.n_layers, B, model.n_kv_heads, 64, a.head_dim, torch.float32, "cpu", "sdpa")
    model(prompts, cache, NO_LOGITS)
    cache.advance(P)
    request = CandidateRequest(k, torch.zeros(B, 8, k, dtype=torch.long))
    best = Decoder(model).verify_step(tokens, cache, ForwardPlan(candidates=request))
    for b in range(B):
        want = hf(torch.cat([prompts[b], tokens[b]])[None]).logits[0, P:]
        assert request.out[b, :T].tolist() == torch.topk(want, k).indices.tolist()
        assert best[b].tolist() == want.argmax(-1).tolist()


def test_greedy_decoding_with_recycled_candidates_is_plain_decoding_and_the_rows_are_the_targets(tiny):
    """Through the decoder, one prepared drafter serving a chain and then a width-3 tree (as a sweep's points share
    it): the same ids as plain greedy decoding, drafted tokens kept, and after each generation the row of each token
    the last verification checked holds the target's k likeliest next ids there."""
    from magicdec.decoding.generate import decode, prefill

    model = tiny
    a = model.args
    prompts = torch.randint(0, a.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    n_new, gamma = 24, 3

    def cache():
        c = KVCache(a.n_layers, 2, model.n_kv_heads, 40 + n_new + 16, a.head_dim, torch.float32, "cpu", "sdpa")
        first = prefill(model, c, prompts, 16).argmax(-1)
        return c, first

    c, first = cache()
    plain, _ = decode(Decoder(model), c, first, n_new)
    prepared = TokenRecycling(prompts, a.vocab_size, 4)
    for width in (1, 3):
        c, first = cache()
        drafter = prepared.shaped(width)
        decoder = Decoder(model, drafter=drafter, gamma=gamma)
        ids, _ = decode(decoder, c, first, n_new, prev=prompts[:, -1])
        assert torch.equal(ids, plain), width
        assert decoder.stats.alpha > 0
        n = drafter.tokens.shape[1]
        assert n == gamma * width + 1
        for b in range(2):
            for i in range(n):
                token = int(drafter.tokens[b, i])
                holders = (drafter.tokens == token).flatten().nonzero()[:, 0]
                if int(holders[-1]) == b * n + i:  # this node wrote the row (the last of equal tokens)
                    assert drafter.matrix[token].tolist() == drafter.request.out[b, i].tolist()


def test_bad_input_is_one_line():
    from magicdec.harness.run_config import RunConfig

    with pytest.raises(MagicDecError, match="--recycle_k 0: at least 1"):
        RunConfig.from_options({"drafter": "recycling", "recycle_k": 0}).check()
    with pytest.raises(MagicDecError, match="the tree gives a node 3 children, the matrix keeps 2"):
        RunConfig.from_options({"drafter": "recycling", "recycle_k": 2, "tree_width": 3}).check()
    assert recycling.DRAFTER.name == "recycling" and "token_recycling" in recycling.DRAFTER.aliases
