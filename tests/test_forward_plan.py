"""The forward plan (magicdec/model/forward_plan.py): a cache given a tree plan attends and writes scores as a float64
reference says, a drafted level's plan writes and positions its nodes where they belong, a CUDA graph is captured
once per distinct plan key, no code outside the cache classes sets an attribute on a cache, and a decoder runs a
shaped copy of its drafter, never the prepared one."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from magicdec.decoding import generate
from magicdec.model.forward_plan import FeatureRequest, LAST_LOGITS, NO_LOGITS, PLAIN, ForwardPlan
from magicdec.model.kv_cache import KVCache
from magicdec.model.tree import Tree, optimal_tree
from test_tree import BRANCHY, reference_attention

ROOT = Path(__file__).resolve().parent.parent


def test_a_tree_plan_attends_and_writes_scores_as_the_float64_reference():
    """Ragged sequences verifying BRANCHY with a refresh's scores asked for: each node sees the committed slots and
    its ancestors (float64 attention, one node at a time), the first query's logits over every slot land in the
    buffer (-inf where it sees nothing), and the nodes take their depths' positions. The same cache with the plain
    plan is causal and writes no scores: nothing of the tree stays behind on the cache."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D, S = 2, 4, 2, 8, 40
    cache = KVCache(1, B, Hkv, S, D, torch.float32, "cpu")
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    base = torch.tensor([21, 6])
    cache.lengths.copy_(base)
    T = BRANCHY.size
    q = torch.randn(B, H, T, D, generator=g)
    scores = [torch.zeros(B, H, S)]
    plan = ForwardPlan(tree=BRANCHY.on_device("cpu"), scores=scores)
    assert cache.positions(T, plan).tolist() == [[b + d for d in BRANCHY.depths] for b in base.tolist()]
    out = cache.attend(T, plan)(q, cache.k[0], cache.v[0], 0)
    assert (out.double() - reference_attention(q, cache.k[0], cache.v[0], base, BRANCHY)).abs().max() < 2e-5
    for b, n in enumerate(base.tolist()):  # the root sees the committed slots and itself
        for h in range(H):
            want = cache.k[0][b, h // (H // Hkv)].double() @ q[b, h, 0].double() / D ** 0.5
            assert torch.allclose(scores[0][b, h, :n + 1].double(), want[:n + 1], atol=1e-5)
            assert torch.isinf(scores[0][b, h, n + 1:]).all()
    written = scores[0].clone()
    plain = cache.attend(T)(q, cache.k[0], cache.v[0], 0)
    causal = reference_attention(q, cache.k[0], cache.v[0], base, Tree.chain(T - 1))  # node i sees base + 0..i
    assert (plain.double() - causal).abs().max() < 2e-5 and torch.equal(scores[0], written)
    assert not any(hasattr(cache, name) for name in ("tree", "level", "features", "scores"))


def test_a_drafted_levels_plan_writes_its_nodes_at_root_plus_index_and_positions_them_at_their_depth():
    tree = optimal_tree((0.7, 0.4, 0.3), 12, 3)
    level = tree.level_on_device(2, "cpu")
    T = level.nodes.numel()
    cache = KVCache(1, 2, 1, 64, 4, torch.float32, "cpu")
    cache.lengths.copy_(torch.tensor([10, 30]))  # the root: the last token held, at 9 and 29
    plan = ForwardPlan.drafting(level)
    assert cache.positions(T, plan).tolist() == [[9 + 2] * T, [29 + 2] * T]
    cache.attend(T, plan)
    k = torch.arange(2 * T, dtype=torch.float32).view(2, T, 1, 1).expand(2, T, 1, 4)
    cache.write(0, k, k)
    for b, root in enumerate((9, 29)):
        for t, node in enumerate(level.nodes.tolist()):
            assert cache.k[0][b, 0, root + node].tolist() == [float(b * T + t)] * 4


def test_a_plans_key_names_what_changes_the_work():
    tree = optimal_tree((0.7, 0.4, 0.3), 12, 3)
    request = FeatureRequest((1,), torch.zeros(1, 4, 8))
    level = lambda depth: ForwardPlan.drafting(tree.level_on_device(depth, "cpu"))  # noqa: E731
    same = [(PLAIN, ForwardPlan()), (PLAIN.with_tree(tree.on_device("cpu")), ForwardPlan(tree=tree.on_device("cpu"))),
            (ForwardPlan(scores=[torch.zeros(1)]), ForwardPlan(scores=[torch.ones(1)])), (level(1), level(1)),
            (ForwardPlan(features=request), ForwardPlan(features=request))]
    for a, b in same:
        assert a.key == b.key
    different = [PLAIN, LAST_LOGITS, NO_LOGITS, PLAIN.sharded(), PLAIN.with_tree(tree.on_device("cpu")),
                 PLAIN.with_tree(BRANCHY.on_device("cpu")), ForwardPlan(scores=[torch.zeros(1)]),
                 level(1), level(2),
                 ForwardPlan(features=request), ForwardPlan(features=FeatureRequest((1,), torch.zeros(1, 4, 8)))]
    assert len({p.key for p in different}) == len(different)
    with pytest.raises(ValueError, match="logits"):
        ForwardPlan(logits="first")
    with pytest.raises(ValueError, match="not both"):
        ForwardPlan(tree=tree.on_device("cpu"), level=tree.level_on_device(1, "cpu"))


def test_a_graphed_step_captures_once_per_plan_key(monkeypatch):
    """GraphedStep with capture stubbed (no CUDA here): plans built apart with one key share a graph; each tree, level,
    feature request, scores or not, and logits mode gets its own."""
    captured = []

    def fake_capture(fn, pool=None, warm_up=True):
        captured.append(fn)
        return type("Graph", (), {"replay": lambda self: None})(), fn()

    monkeypatch.setattr(generate, "capture", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    step = generate.GraphedStep(lambda tokens, cache, plan: tokens + 1)
    tokens, cache = torch.zeros(2, 3), object()
    tree = optimal_tree((0.7, 0.4, 0.3), 12, 3)
    request = FeatureRequest((1,), torch.zeros(1, 4, 8))
    plans = [PLAIN, ForwardPlan(), ForwardPlan(scores=[torch.zeros(1)]), ForwardPlan(scores=[torch.ones(1)]),
             PLAIN.with_tree(tree.on_device("cpu")), ForwardPlan(tree=tree.on_device("cpu")),
             ForwardPlan.drafting(tree.level_on_device(1, "cpu")), ForwardPlan.drafting(tree.level_on_device(1, "cpu")),
             ForwardPlan.drafting(tree.level_on_device(2, "cpu")), ForwardPlan(features=request),
             ForwardPlan(features=request), LAST_LOGITS]
    for plan in plans:
        step(tokens, cache, plan)
    assert len(captured) == len(step.graphs) == 7  # plain, scores, the tree, two levels, the request, last


def cache_attributes_set_outside(source: str) -> list[str]:
    """`X.attr = ...` (or +=, or a tuple of targets) where X is a name or attribute naming a cache (`cache`,
    `self.cache`, `draft_cache`, ...), outside a class whose name ends in Cache: each as 'line: text'."""
    found = []

    def names_a_cache(node) -> bool:
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return "cache" in name.lower()

    def visit(node, in_cache_class: bool):
        if isinstance(node, ast.ClassDef):
            in_cache_class = node.name.endswith("Cache")
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and not in_cache_class:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            flat = [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
            for t in flat:
                if isinstance(t, ast.Attribute) and names_a_cache(t.value):
                    found.append(f"{node.lineno}: {ast.unparse(t)}")
        for child in ast.iter_child_nodes(node):
            visit(child, in_cache_class)

    visit(ast.parse(source), False)
    return found


def test_no_attribute_is_set_on_a_cache_from_outside_the_cache_classes():
    """What a forward is travels in its plan; the cache holds KV and its own bookkeeping. The check finds what the
    loop and the drafters did before the plan (a tree, a level, a feature request, scores set on the cache)."""
    old = ("def verify(self, cache, tokens, tree):\n    cache.tree = tree\n"
           "def draft(self, level):\n    self.cache.level, x = level, 1\n"
           "class SelectionCache:\n    def keep(self, cache):\n        self.kept = 1\n")
    assert cache_attributes_set_outside(old) == ["2: cache.tree", "4: self.cache.level"]
    offenders = {str(p.relative_to(ROOT)): hits for p in sorted((ROOT / "magicdec").rglob("*.py"))
                 if (hits := cache_attributes_set_outside(p.read_text()))}
    assert offenders == {}


def test_a_decoder_runs_a_shaped_copy_and_leaves_the_prepared_drafter_as_it_was():
    """engine.decoder at a tree width and at a drafted tree's shape: the decoder's drafter is a copy shaped so, the
    prepared drafter keeps width 1 and no shape (a sweep's next point starts from it), and the copy shares its
    state (the draft's cache)."""
    from magicdec.drafters.model_draft import ModelDraft
    from magicdec.harness.engine import Engine
    from magicdec.harness.run_config import RunConfig

    base = {"random_weights": True, "model_name": "JackFram/llama-68m", "device": "cpu", "prefix_len": 512,
            "gen_len": 16, "gamma": [3], "drafter": "selfspec"}
    prepared = ModelDraft(model=None, cache=object())
    for options in ({"tree_width": 3}, {"tree_nodes": 8, "tree_rates": (0.7, 0.4, 0.3)}):
        cfg = RunConfig.from_options(base | options)
        decoder = Engine(cfg).decoder(cfg, prepared, 3)
        shape = cfg.speculation.drafted_tree(3)
        assert decoder.drafter is not prepared and decoder.drafter.cache is prepared.cache
        assert decoder.drafter.shape == shape and (shape is None) == ("tree_width" in options)
        assert decoder.drafter.width == decoder.width == (3 if shape is None else shape.max_children) > 1
        assert prepared.width == 1 and prepared.shape is None
