"""The Triton kernel (compiled, on the GPU) against a float64 reference: a target's tree over a full cache, and a
draft's tree level over a StreamingLLM ring (bf16 inputs)."""
import torch
from magicdec.attention import make_attend
from magicdec.kv_cache import StreamingCache
from magicdec.tree import Tree, TreeMask, optimal_tree

dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
B, H, Hkv, D = 2, 8, 2, 128
dt = torch.bfloat16
for tree in (Tree.chain_with_siblings(3, 3), Tree.chain_with_siblings(7, 9)):
    S = 3000
    T = tree.size
    q = torch.randn(B, H, T, D, generator=g, device=dev, dtype=dt)
    k = torch.randn(B, Hkv, S, D, generator=g, device=dev, dtype=dt)
    v = torch.randn(B, Hkv, S, D, generator=g, device=dev, dtype=dt)
    base = torch.tensor([1300, 70], device=dev)
    td = tree.on_device(dev)
    q_pos = base[:, None] + td.depths[None]
    out = make_attend("triton", q_pos, None, S, tree=TreeMask(td.ancestors, td.bits, base))(q, k, v)
    err = 0.0
    for b in range(B):
        for i in range(T):
            up, chain = i, []
            while up >= 0:
                chain.append(up)
                up = tree.parents[up]
            slots = list(range(int(base[b]))) + [int(base[b]) + j for j in sorted(chain)]
            for h in range(H):
                kh, vh = k[b, h // 4, slots].double(), v[b, h // 4, slots].double()
                w = torch.softmax(kh @ q[b, h, i].double() / D ** 0.5, 0)
                err = max(err, float((out[b, h, i].double() - w @ vh).abs().max()))
    print("full cache tree", T, "nodes: max error", err)

tree = optimal_tree((0.7, 0.4, 0.3), 20, 4)
sinks, window = 4, 400
cache = StreamingCache(1, B, Hkv, sinks + window, sinks, 64, D, dt, dev, "triton")
roots = torch.tensor([1500, 610])
for b, r in enumerate(roots.tolist()):
    pos = torch.tensor(list(range(sinks)) + list(range(r + 1 - window, r + 1 + tree.size + 5)), device=dev)
    cache.key_pos[b, cache.slots(pos)] = pos
cache.k[0].normal_(generator=g)
cache.v[0].normal_(generator=g)
cache.lengths.copy_(roots + 1)
for depth in (1, 2, 3):
    level = tree.level_on_device(depth, dev)
    T = level.nodes.numel()
    cache.level = level
    q = torch.randn(B, H, T, D, generator=g, device=dev, dtype=dt)
    out = cache.attend(T)(q, cache.k[0], cache.v[0])
    cache.level = None
    err = 0.0
    for b, r in enumerate(roots.tolist()):
        for t, i in enumerate(level.nodes.tolist()):
            chain, up = [], i
            while up > 0:
                chain.append(up)
                up = tree.parents[up]
            seen = list(range(sinks)) + list(range(r + depth + 1 - window, r + 1)) + [r + j for j in sorted(chain)]
            slots = cache.slots(torch.tensor(seen, device=dev))
            for h in range(H):
                kh, vh = cache.k[0][b, h // 4, slots].double(), cache.v[0][b, h // 4, slots].double()
                w = torch.softmax(kh @ q[b, h, t].double() / D ** 0.5, 0)
                err = max(err, float((out[b, h, t].double() - w @ vh).abs().max()))
    print("ring level", depth, T, "nodes: max error", err)
