"""The Triton kernel (compiled, on the GPU) against a float64 reference: a target's tree over a full cache, and a
draft's tree level over a StreamingLLM ring (bf16 inputs); the output of a run is in results/trees/gpu_greedy_check/.
    python3 benchmarks/tree_kernel_check.py"""
import torch
from magicdec.model.attention import make_attend
from magicdec.model.kv_cache import StreamingCache
from magicdec.model.tree import Tree, TreeMask, optimal_tree
from magicdec.model.forward_plan import ForwardPlan

dev, B, H, Hkv, D, dt = "cuda", 2, 8, 2, 128, torch.bfloat16
g = torch.Generator(device=dev).manual_seed(0)


def ancestors(tree, i):
    out = [i]
    while tree.parents[out[-1]] > 0:
        out.append(tree.parents[out[-1]])
    return sorted(out) if i else []


def max_error(out, q, k, v, seen):
    """seen(b, t): the slots query t of sequence b may see; float64 softmax attention over them, per head."""
    err = 0.0
    for b in range(B):
        for t in range(q.shape[2]):
            slots = seen(b, t)
            for h in range(H):
                w = torch.softmax(k[b, h // 4, slots].double() @ q[b, h, t].double() / D ** 0.5, 0)
                err = max(err, float((out[b, h, t].double() - w @ v[b, h // 4, slots].double()).abs().max()))
    return err


for tree in (Tree.chain_with_siblings(3, 3), Tree.chain_with_siblings(7, 9)):
    q = torch.randn(B, H, tree.size, D, generator=g, device=dev, dtype=dt)
    k, v = (torch.randn(B, Hkv, 3000, D, generator=g, device=dev, dtype=dt) for _ in range(2))
    base = torch.tensor([1300, 70], device=dev)
    td = tree.on_device(dev)
    out = make_attend("triton", base[:, None] + td.depths[None], None, 3000,
                      tree=TreeMask(td.ancestors, td.bits, base))(q, k, v)
    print("full cache tree", tree.size, "nodes: max error", max_error(
        out, q, k, v, lambda b, t: list(range(int(base[b]))) + [int(base[b]) + j for j in [0] + ancestors(tree, t)]))

tree = optimal_tree((0.7, 0.4, 0.3), 20, 4)
sinks, window = 4, 400
cache = StreamingCache(1, B, Hkv, sinks + window, sinks, 64, D, dt, dev, "triton")
roots = [1500, 610]
for b, r in enumerate(roots):  # committed positions, then stale ones where the tree's nodes go
    pos = torch.tensor(list(range(sinks)) + list(range(r + 1 - window, r + 1 + tree.size + 5)), device=dev)
    cache.key_pos[b, cache.slots(pos)] = pos
cache.k[0].normal_(generator=g)
cache.v[0].normal_(generator=g)
cache.lengths.copy_(torch.tensor(roots, device=dev) + 1)
for depth in (1, 2, 3):
    level = tree.level_on_device(depth, dev)
    q = torch.randn(B, H, level.nodes.numel(), D, generator=g, device=dev, dtype=dt)
    out = cache.attend(level.nodes.numel(), ForwardPlan.drafting(level))(q, cache.k[0], cache.v[0])
    nodes = level.nodes.tolist()
    print("ring level", depth, len(nodes), "nodes: max error", max_error(out, q, cache.k[0], cache.v[0], lambda b, t: cache.slots(torch.tensor(
        list(range(sinks)) + list(range(roots[b] + depth + 1 - window, roots[b] + 1))
        + [roots[b] + j for j in ancestors(tree, nodes[t])], device=dev))))
