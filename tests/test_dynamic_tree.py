"""EAGLE-2's dynamic draft tree (magicdec/drafters/dynamic_tree.py, through magicdec/drafters/eagle.py): the
selection against a hand-written enumeration of paths (every path when K covers the vocabulary, EAGLE-2's beam
otherwise; one sequence and a batch ranked by the sum of its probabilities); the first proposal of a real head
against the same beam over its uncached forward along each path; the topology written in place against
tree.Tree's own tensors; greedy speculation equals a plain autoregressive loop (B = 1 and a ragged batch, several
N / K / depths, the head's KV full and windowed, EAGLE and EAGLE-3), the topology changing from step to step;
sampled speculation keeps the target's distribution, and fails without the rejection's correction; each bad option
is one line. The cost model's best-case price (Eagle.predict) against trees and forwards written out by hand, and the
planner's dynamic options checked as it checks them."""
from __future__ import annotations

import functools
import math

import pytest
import torch
from conftest import chi_square, fixed_first_token
from test_eagle import eagle_forward_by_hand
from test_generate_speculative import assert_ragged, plain_greedy, tiny_prompts
from test_head_draft import DEVICE, L31, predicted, run_config
from test_medusa import speculate

from magicdec.decoding.generate import prefill_features
from magicdec.decoding.sampling import Sampling
from magicdec.analysis import cost_model as cm
from magicdec.drafters import dynamic_tree, eagle
from magicdec.drafters.eagle import EagleDraft
from magicdec.drafters.head_draft import Sampler
from magicdec.errors import MagicDecError
from magicdec.model.kv_cache import KVCache
from magicdec.model.tree import DynamicTree, Tree, expected_tokens, write_topology

pytestmark = pytest.mark.usefixtures("inference_mode")  # conftest: no autograd in these tests


# --- the selection against paths enumerated by hand ------------------------------------------------------------------
def by_hand(logp, B: int, K: int, depth: int, nodes: int, beam: bool = True):
    """EAGLE-2's tree written out over plain Python lists: logp(b, path) is sequence b's log-probabilities [V] after
    its token path; a node is a place, its rank path (r1, .., rd), holding sequence b's r-th likeliest child of its
    parent's token at each step; its score is log(sum over b of exp(the path's log-probability)). beam: the next
    frontier is the K best of the frontier's K children each, and the tree the nodes - 1 best of every child drafted
    (EAGLE-2); else the nodes - 1 best of every path of up to `depth` tokens. Returns {rank path: [B] token paths}."""
    def children(place, paths):
        ranked = [sorted(range(len(p)), key=lambda t: -p[t])[:K] for p in (logp(b, paths[b]) for b in range(B))]
        return [(place + (r,), [paths[b] + (ranked[b][r],) for b in range(B)]) for r in range(K)]

    def score(paths):
        total = [sum(logp(b, path[:i])[path[i]] for i in range(len(path))) for b, path in enumerate(paths)]
        return math.log(sum(math.exp(x) for x in total))

    drafted, frontier = [], [((), [()] * B)]
    for _ in range(depth):
        level = [c for place, paths in frontier for c in children(place, paths)]
        drafted += level
        frontier = sorted(level, key=lambda c: -score(c[1]))[:K] if beam else level
    return dict(sorted(drafted, key=lambda c: -score(c[1]))[:nodes - 1])


def as_places(ids: torch.Tensor, parents: torch.Tensor, logp, K: int) -> dict:
    """draft's output as by_hand's: each node's rank path, its parent's extended by the rank of sequence 0's token
    among the parent's children."""
    places, paths = {0: ()}, {0: [()] * ids.shape[0]}
    for i in range(1, ids.shape[1] + 1):
        p = int(parents[i])
        assert p < i
        ranked = sorted(range(len(logp(0, paths[p][0]))), key=lambda t: -logp(0, paths[p][0])[t])[:K]
        places[i] = places[p] + (ranked.index(int(ids[0, i - 1])),)
        paths[i] = [paths[p][b] + (int(ids[b, i - 1]),) for b in range(ids.shape[0])]
    return {places[i]: paths[i] for i in range(1, ids.shape[1] + 1)}


def markov(B: int, V: int, seed: int):
    """A fake head: sequence b's log-probabilities after a path depend on its last token (a table per sequence):
    (the root's logits [B, V], draft's grow, by_hand's logp)."""
    g = torch.Generator().manual_seed(seed)
    root = 2 * torch.randn(B, V, generator=g, dtype=torch.float64)
    table = 2 * torch.randn(B, V, V, generator=g, dtype=torch.float64)
    logp = lambda b, path: torch.log_softmax(table[b, path[-1]] if path else root[b], -1).tolist()  # noqa: E731
    grow = lambda level, ids: table[torch.arange(B)[:, None], ids]  # noqa: E731
    return root, grow, logp


@pytest.mark.parametrize("B, V, K, depth, nodes, beam", [
    (1, 6, 6, 3, 7, False), (3, 6, 6, 3, 7, False),  # K = V >= nodes - 1: the best paths of all
    (1, 7, 3, 4, 16, True), (3, 7, 3, 4, 16, True), (2, 9, 4, 2, 20, True), (1, 5, 2, 1, 3, True)])
def test_the_selection_is_eagle2s_written_out(B, V, K, depth, nodes, beam):
    root, grow, logp = markov(B, V, seed=B * 100 + V)
    ids, parents = dynamic_tree.draft(root, grow, K, depth, nodes)
    assert ids.shape == (B, nodes - 1) and parents.shape == (nodes,) and int(parents[0]) == 0
    assert as_places(ids, parents, logp, K) == by_hand(logp, B, K, depth, nodes, beam)


def test_ties_keep_the_parent():
    """Probabilities of 1 (log 0) make a node at each depth as confident as its parent: of the three, the two kept
    are the shallower, so the tree stays closed."""
    V, K = 4, 2
    certain = torch.tensor([0.0, -1e9, -1e9, -1e9])
    ids, parents = dynamic_tree.draft(certain[None], lambda level, ids: certain.expand(1, K, V), K, 3, 3)
    assert parents.tolist() == [0, 0, 1] and ids.tolist() == [[0, 0]]


def test_a_heads_first_proposal_is_the_beam_over_its_uncached_forward(tiny, tiny_eagle):
    """The head drafts through its KV cache and the frame's masks and positions; the reference runs the head's own
    causal forward (no cache) over the prompt's target features, then its own predicted features along each path,
    for by_hand's beam."""
    head, a = tiny_eagle("eagle"), tiny.args
    prompts, first = tiny_prompts(2), torch.tensor([5, 9])
    B, P = prompts.shape
    K, depth, nodes = 3, 3, 10
    cache = KVCache(a.n_layers, B, a.n_kv_heads, P + 40, a.head_dim, torch.float32, "cpu")
    _, feats = prefill_features(tiny, cache, prompts, 64, head.taps(a.n_layers))
    drafter = EagleDraft.over_prompt(head, tiny, prompts, feats, Sampler(True), 20, 8)
    drafter.dynamic = (nodes, K)
    hist = torch.stack([prompts[:, -1], first], 1)
    ids, q = drafter.propose(None, hist, torch.full((B,), 2), torch.full((B,), P - 1), depth)
    tree = drafter.tree_for(nodes - 1).on_device("cpu")
    embed = tiny.tok_embeddings.weight

    @functools.lru_cache(maxsize=None)
    def logp(b, path):
        f, t = feats[b:b + 1], torch.cat([prompts[b, 1:], first[b:b + 1]])[None]
        h = head(f, t, embed)[:, -1]  # the predicted feature at the first token
        for token in path:  # each drafted token after the head's own predicted feature before it
            f, t = torch.cat([f, h[:, None]], 1), torch.cat([t, torch.tensor([[token]])], 1)
            h = head(f, t, embed)[:, -1]
        return torch.log_softmax(head.logits(h, tiny.output.weight)[0].double(), -1).tolist()

    assert q is None and tree.tree == DynamicTree(nodes, depth, K)
    assert as_places(ids, tree.parents, logp, K) == by_hand(logp, B, K, depth, nodes)


@pytest.mark.parametrize("seed", range(3))
def test_the_topology_written_in_place_is_the_trees_own(seed):
    """write_topology's tensors against tree.Tree's (made on the host from its parents), 64 nodes included (the
    mask's sign bit)."""
    g = torch.Generator().manual_seed(seed)
    N, depth, width = (64, 6, 4) if seed == 0 else (12, 3, 3)
    parents, depths, counts = [-1], [0], [0]
    while len(parents) < N:  # a random tree within the shapes, each node after its parent
        p = int(torch.randint(0, len(parents), (1,), generator=g))
        if depths[p] < depth and counts[p] < width:
            parents.append(p)
            depths.append(depths[p] + 1)
            counts[p] += 1
            counts.append(0)
    tree = Tree(tuple(parents)).in_level_order()
    want = tree.on_device("cpu")
    got = DynamicTree(N, depth, width).on_device("cpu")
    write_topology(got, torch.tensor((0, *tree.parents[1:])))
    for name in ("depths", "ancestors", "bits", "parents", "rank", "n_children"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for i in range(N):  # children in node order, -1 past them
        own = [int(c) for c in want.children[i] if c >= 0]
        assert got.children[i].tolist() == own + [-1] * (width - len(own))


# --- speculation through the decoder ---------------------------------------------------------------------------------
@pytest.mark.parametrize("gamma, nodes, K", [(1, 4, 3), (3, 12, 4), (4, 20, 3), (5, 40, 10)])
def test_greedy_dynamic_trees_equal_plain_greedy(tiny, tiny_eagle, gamma, nodes, K, monkeypatch):
    """A ragged batch of 3 and one sequence alone: the same ids as plain greedy decoding, drafted tokens kept, and
    the verified topology not the same at every step (it is dynamic)."""
    head = tiny_eagle("eagle")
    written = []
    monkeypatch.setattr(eagle, "write_topology", lambda tree, parents: (
        written.append(tuple(parents.tolist())), write_topology(tree, parents)))
    expected = plain_greedy(tiny, tiny_prompts(), 40)
    out, decoder = speculate(tiny, head, tiny_prompts(), 40, gamma, dynamic=(nodes, K))
    assert out.tolist() == expected.tolist()
    assert_ragged(decoder)
    assert decoder.stats.alpha > 0 and (len(set(written)) > 1 or gamma == 1)
    alone, _ = speculate(tiny, head, tiny_prompts()[1:2], 40, gamma, dynamic=(nodes, K))
    assert alone.tolist() == expected[1:2].tolist()


def test_greedy_dynamic_trees_with_a_windowed_head_and_eagle3(tiny, tiny_eagle):
    expected = plain_greedy(tiny, tiny_prompts(), 40)
    out, _ = speculate(tiny, tiny_eagle("eagle"), tiny_prompts(), 40, 3, dynamic=(12, 4), window=True, budget=20)
    assert out.tolist() == expected.tolist()
    out, decoder = speculate(tiny, tiny_eagle("eagle3"), tiny_prompts(), 40, 3, dynamic=(16, 5))
    assert out.tolist() == expected.tolist() and decoder.stats.alpha > 0
    out, _ = speculate(tiny, tiny_eagle("eagle3"), tiny_prompts(), 40, 3, dynamic=(16, 5), window=True, budget=20)
    assert out.tolist() == expected.tolist()


def test_sampled_dynamic_trees_keep_the_targets_distribution(tiny, tiny_eagle, monkeypatch):
    """N copies of one prompt, the first token fixed: the root's children are the head's K likeliest tokens, point
    masses; the token sampled after the first follows the target's own distribution (T 0.6, top-p 0.9; chi-square
    below its 1 - 3e-7 quantile); leaving p as it was after a rejected candidate fails it. K 16: the target's
    distribution there is flat (its 16 likeliest tokens hold half of it), and the candidates must hold enough of
    it for the wrong rule to show."""
    from magicdec.decoding import acceptance

    N, sampling = 4_000, Sampling(0.6, 0.9)
    prompt, first, p = fixed_first_token(tiny, N)
    head = tiny_eagle("eagle", "sampled")

    def second_tokens():
        torch.manual_seed(0)
        out, decoder = speculate(tiny, head, prompt.expand(N, -1), 2, 2, sampling, first=first, dynamic=(24, 16))
        return out[:, 1], decoder

    tokens, decoder = second_tokens()
    stat, bound = chi_square(tokens, p)
    assert stat < bound and 0.2 <= decoder.stats.alpha < 0.98, (stat, bound, decoder.stats.alpha)
    wrong = functools.partial(acceptance.sampling_tree_verify, correct=False)
    monkeypatch.setattr(acceptance, "sampling_tree_verify", wrong)
    stat, bound = chi_square(second_tokens()[0], p)
    assert stat > 2 * bound, (stat, bound)


# --- options --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, said", [
    ({"dynamic_tree_nodes": 65}, "--dynamic_tree_nodes 65: must be 2..64"),
    ({"dynamic_tree_nodes": 1}, "--dynamic_tree_nodes 1: must be 2..64"),
    ({"dynamic_tree_nodes": 16, "dynamic_tree_topk": 0}, "--dynamic_tree_topk 0: must be at least 1"),
    ({"dynamic_tree_topk": 4}, "--dynamic_tree_topk shapes EAGLE-2's dynamic tree: give --dynamic_tree_nodes"),
    ({"dynamic_tree_nodes": 16, "tree_width": 2}, "--dynamic_tree_nodes and --tree_width / --tree_nodes"),
    ({"dynamic_tree_nodes": 16, "synthetic_acceptance": 0.8}, "--dynamic_tree_nodes with --synthetic_acceptance"),
    ({"dynamic_tree_nodes": 16, "gamma": [8]}, "--dynamic_tree_topk 10 at --gamma 8: the head feeds a frame of 71"),
    ({"dynamic_tree_nodes": 12, "dynamic_tree_topk": 2, "gamma": [2]},
     "--dynamic_tree_nodes 12: the root and 11 drafted nodes, but --gamma 2 and --dynamic_tree_topk 2 draft 6"),
])
def test_bad_options_are_one_line(options, said):
    from magicdec.harness.run_config import RunConfig

    with pytest.raises(MagicDecError) as e:
        RunConfig.from_options({"drafter": "eagle"} | options).check()
    assert str(e.value).startswith(said) and "\n" not in str(e.value), str(e.value)


def test_a_topk_past_the_heads_vocabulary_is_one_line():
    from magicdec.config import ModelArgs
    from magicdec.harness.run_config import RunConfig

    target = ModelArgs(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=96)
    cfg = RunConfig.from_options({"drafter": "eagle", "eagle3": True, "draft_vocab": 8, "dynamic_tree_nodes": 8,
                                  "dynamic_tree_topk": 9, "gamma": [2]})
    cfg.check()
    with pytest.raises(MagicDecError, match=r"^--dynamic_tree_topk 9: more than the head's 8 tokens; give 8 or less$"):
        cfg.drafter.check_models(cfg, target, {})


def test_the_run_config_sizes_the_caches_for_the_frame_and_labels_it():
    from magicdec.harness.run_config import RunConfig

    cfg = RunConfig.from_options({"drafter": "eagle", "dynamic_tree_nodes": 16, "dynamic_tree_topk": 4, "gamma": [5]})
    cfg.check()
    assert cfg.lookahead == 16 and cfg.describe() == "eagle fresh dynamic 16 k4"  # the frame: 1 + 4 x 4 nodes
    cfg = RunConfig.from_options({"drafter": "eagle", "dynamic_tree_nodes": 40, "dynamic_tree_topk": 6, "gamma": [2]})
    assert cfg.lookahead == 39


# --- the cost model's prediction (Eagle.predict) and the planner's options: no model is run ---------------------------
def dynamic(nodes: int, K: int, gamma: int, **options):
    return run_config("eagle", dynamic_tree_nodes=nodes, dynamic_tree_topk=K, gamma=[gamma], **options)


def test_the_yield_is_the_best_tree_of_n_nodes_written_out():
    """N = 4, depth 2, K = 2, a first child kept at 0.8 and a later one at 0.5: of the trees of 3 drafted nodes,
    two levels and two children a node, the best is the root's two children and the first one's first child,
    1 + 0.8 (1 + 0.8) + 0.2 x 0.5 = 2.54 (a chain of two with a sibling below yields 1 + 0.8 (1 + 0.8 + 0.2 x 0.5)
    = 2.52; the second child's child 1 + 0.8 + 0.1 (1 + 0.8) = 1.98). At K = 1 the tree is the chain:
    1 + 0.5 + 0.25, though the root's two children would yield 1 + 0.5 + 0.5 x 0.9."""
    p = predicted(dynamic(4, 2, 2, synthetic_siblings=[0.5]))
    assert p["omega"] == pytest.approx(1 + 0.8 * (1 + 0.8) + 0.2 * 0.5)
    assert p["omega"] == pytest.approx(expected_tokens(Tree((-1, 0, 0, 1)), (0.8, 0.5)))
    assert predicted(dynamic(3, 1, 2, synthetic_siblings=[0.9]), alpha=0.5)["omega"] == pytest.approx(1.75)
    B, ctx = 4, 4096 + 32  # the verification over the 4 nodes; the draft the catch-up and one level of K = 2 nodes
    assert p["T_V"] == pytest.approx(cm.step_time(L31, DEVICE, B, ctx, 4), rel=1e-9)
    assert p["T_D"] == pytest.approx((eagle_forward_by_hand(DEVICE, B, ctx, 3, B)
                                      + eagle_forward_by_hand(DEVICE, B, ctx, 2, 2 * B)) / 2, rel=1e-9)
    assert p["speedup"] == pytest.approx(p["omega"] / (2 * p["T_D"] / p["T_T"] + p["T_V"] / p["T_T"]))


def test_n_nodes_are_verified_where_fewer_reach_the_best_yield():
    """Later children never kept (rate 0): the best tree is the chain, yet the verification is over all N nodes."""
    p = predicted(dynamic(16, 10, 3, synthetic_siblings=[0.0]))
    assert p["omega"] == pytest.approx(cm.omega(0.8, 3))
    assert p["T_V"] == pytest.approx(cm.step_time(L31, DEVICE, 4, 4096 + 32, 16), rel=1e-9)


def test_no_prediction_without_the_later_childrens_rates():
    """Without --synthetic_siblings, None, as a static tree's: its yield rests on them (a sweep's check of a measured
    run gives it the run's own: test_sweep)."""
    assert predicted(dynamic(16, 10, 3)) is None
    assert predicted(dynamic(16, 10, 3, synthetic_siblings=[0.5, 0.3])) is not None


def test_the_verification_grows_with_n_and_the_draft_with_k_and_gamma():
    siblings = {"synthetic_siblings": [0.5, 0.3]}
    by_nodes = [predicted(dynamic(n, 10, 4, **siblings)) for n in (16, 32, 64)]
    assert by_nodes[0]["T_V"] < by_nodes[1]["T_V"] < by_nodes[2]["T_V"]
    assert by_nodes[0]["T_D"] == by_nodes[1]["T_D"] == by_nodes[2]["T_D"]  # the same frame
    assert by_nodes[0]["omega"] < by_nodes[1]["omega"] < by_nodes[2]["omega"]
    by_k = [predicted(dynamic(16, k, 4, **siblings))["T_D"] for k in (2, 4, 10)]
    assert by_k[0] < by_k[1] < by_k[2]
    proposal = [g * predicted(dynamic(16, 10, g, **siblings))["T_D"] for g in (2, 3, 4)]
    assert proposal[0] < proposal[1] < proposal[2]


def test_the_planner_is_offered_dynamic_trees_that_check_where_they_fit():
    """Eagle.options lists EAGLE-2's N = 16, 32, 64 at K = 10 beside the chains and static trees (each head KV);
    each option is a valid run at gamma 4, and a dynamic one fails its check, as the planner skips it, where its
    frame (gamma 8: 71 nodes) or its candidates (gamma 1: 10) cannot hold it."""
    from magicdec.harness.plan_command import GAMMAS

    options = eagle.DRAFTER.options(None, L31, DEVICE)
    trees = [o for o in options if o.get("dynamic_tree_nodes")]
    assert {(o["dynamic_tree_nodes"], o["dynamic_tree_topk"]) for o in trees} == {(16, 10), (32, 10), (64, 10)}
    assert len(trees) == 3 * 3  # each head KV: full and two windows
    for o in options:  # a Sequoia tree shaped for the rates the planner gives it
        run_config("eagle", gamma=[4], **o | ({"tree_rates": [0.8]} if o.get("tree_nodes") else {})).check()
    for o in trees:
        fits = []
        for g in GAMMAS:
            try:
                run_config("eagle", gamma=[g], **o).check()
                fits.append(g)
            except MagicDecError as e:
                assert "\n" not in str(e)
        assert fits == [g for g in GAMMAS if 2 <= g <= 7]
