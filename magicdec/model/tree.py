"""Token trees: a verification of several candidate continuations at once (SpecInfer, Sequoia, Medusa's trees).

A tree's node 0 is the root, the last committed token (what a chain's verification feeds first); every other node
is a drafted token whose parent comes before it. Its shape is static (the same for every sequence of a batch, one
CUDA graph per shape): `parents`, and each node's depth, the position offset its RoPE takes. In a verification node
i attends to the committed cache and to its ancestors (itself included) only; the tree's nodes are written to the
cache slots after the committed ones in node order, and once a path is accepted its nodes' KV moves to the
contiguous slots that path's positions take (KVCache.keep_path). A chain is the tree whose every node has one
child: its verification is today's.

Acceptance walks a tree from its root, greedy, sampled or at chosen rates: magicdec/decoding/acceptance.py.

A `DynamicTree` (EAGLE-2's, magicdec/drafters/dynamic_tree.py) has fixed shapes (its node count, depth bound and
children per node) and a topology that changes every verification: its TreeOnDevice's tensors are written in place
by the draft (write_topology), and everything downstream (the target's positions and attention mask, the
acceptance walk, the move of the accepted path's KV) reads only those tensors and the shapes, so one CUDA graph
of each serves every topology.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from magicdec.errors import MagicDecError

MAX_NODES = 64  # a node's ancestors are one 64-bit mask in the attention kernel


@dataclass(frozen=True)
class Tree:
    """A static token tree: parents[i] < i for every node i > 0, parents[0] = -1 (the root)."""
    parents: tuple[int, ...]

    def __post_init__(self):
        p = self.parents
        if not p or p[0] != -1 or any(not 0 <= p[i] < i for i in range(1, len(p))):
            raise MagicDecError(f"a token tree's parents must be -1 for the root, then each node's parent before it; "
                                f"got {list(p)}")
        if len(p) > MAX_NODES:
            raise MagicDecError(f"a token tree of {len(p)} nodes: at most {MAX_NODES} (the root included)")

    @staticmethod
    def chain(gamma: int) -> "Tree":
        return Tree((-1, *range(gamma)))

    @staticmethod
    def chain_with_siblings(gamma: int, width: int) -> "Tree":
        """A chain of gamma drafted tokens, each depth also holding width - 1 alternatives as leaves (a draft's next
        candidates at the positions its chain drafts): per depth the chain's node first, then its siblings."""
        parents, at = [-1], 0
        for _ in range(gamma):
            parents += [at] * width
            at = len(parents) - width
        return Tree(tuple(parents))

    @staticmethod
    def branches(length: int, width: int) -> "Tree":
        """`width` chains of `length` tokens from the root (prompt lookup's earlier occurrences), branch by branch."""
        parents = [-1]
        for _ in range(width):
            parents += [0] + list(range(len(parents), len(parents) + length - 1))
        return Tree(tuple(parents))

    @property
    def size(self) -> int:
        return len(self.parents)

    def in_level_order(self) -> "Tree":
        """The same tree, its nodes numbered level by level (each level's nodes in the order they were), so a
        draft can feed one level as one forward of consecutive nodes."""
        order = sorted(range(self.size), key=lambda i: (self.depths[i], i))
        new = {old: n for n, old in enumerate(order)}
        return Tree(tuple(-1 if i == 0 else new[self.parents[i]] for i in order))

    @functools.cached_property
    def levels(self) -> tuple[range, ...]:
        """Per depth, its nodes (a tree in level order: consecutive)."""
        if list(self.depths) != sorted(self.depths):
            raise MagicDecError("a token tree drafted level by level must be numbered in level order "
                                "(Tree.in_level_order)")
        return tuple(range(self.depths.index(d), self.size - self.depths[::-1].index(d)) for d in range(self.depth + 1))

    @functools.cached_property
    def depths(self) -> tuple[int, ...]:
        d = [0]
        for i in range(1, self.size):
            d.append(d[self.parents[i]] + 1)
        return tuple(d)

    @property
    def depth(self) -> int:
        return max(self.depths)

    @functools.cached_property
    def is_chain(self) -> bool:
        return self.parents == Tree.chain(self.size - 1).parents

    @functools.cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        out = [[] for _ in self.parents]
        for i in range(1, self.size):
            out[self.parents[i]].append(i)
        return tuple(tuple(c) for c in out)

    @functools.cached_property
    def max_children(self) -> int:
        """The most children a node has (a draft step's candidates per node)."""
        return max(len(c) for c in self.children)

    @functools.cached_property
    def level_widths(self) -> tuple[int, ...]:
        """Per depth d, the most children a node of depth d has (what a walk from the root tries there)."""
        out = [0] * (self.depth + 1)
        for i in range(self.size):
            out[self.depths[i]] = max(out[self.depths[i]], len(self.children[i]))
        return tuple(out)

    @functools.cached_property
    def ancestors(self) -> torch.Tensor:
        """[N, N] bool: ancestors[i, j] iff node j is node i or one of its ancestors (what node i attends to)."""
        a = torch.eye(self.size, dtype=torch.bool)
        for i in range(1, self.size):
            a[i] |= a[self.parents[i]]
        return a

    @functools.cached_property
    def ancestor_bits(self) -> torch.Tensor:
        """[N] int64: bit j of node i's entry set iff ancestors[i, j] (the attention kernel's mask)."""
        weights = torch.tensor([1 << j if j < 63 else -(1 << 63) for j in range(self.size)], dtype=torch.long)
        return (self.ancestors.long() * weights).sum(1)

    def on_device(self, device) -> "TreeOnDevice":
        return _on_device(self, str(device))

    def level_on_device(self, depth: int, device) -> "TreeLevel":
        return _level_on_device(self, depth, str(device))


@dataclass(frozen=True)
class DynamicTree:
    """The fixed shapes of a tree whose topology is device data: `size` nodes (the root included), at most `depth`
    levels below the root, at most `width` children per node. Its tensors (on_device) are made once per shape and
    device and rewritten in place by write_topology before each verification."""
    size: int
    depth: int
    width: int

    def __post_init__(self):
        if not 2 <= self.size <= MAX_NODES or self.depth < 1 or self.width < 1:
            raise MagicDecError(f"a dynamic token tree of {self.size} nodes (2..{MAX_NODES}), depth {self.depth} and "
                                f"width {self.width} (both at least 1)")

    @property
    def level_widths(self) -> tuple[int, ...]:
        """What an acceptance walk tries per depth: up to `width` children (-1 entries past a node's own)."""
        return (self.width,) * self.depth + (0,)

    def on_device(self, device) -> "TreeOnDevice":
        return _dynamic_on_device(self, str(device))


@dataclass(frozen=True)
class TreeOnDevice:
    """A tree's tensors on one device, made once (a graph's capture bakes them in); a DynamicTree's are rewritten
    in place (write_topology), `tree` then holding its shapes only."""
    tree: Tree | DynamicTree
    depths: torch.Tensor  # [N] long
    ancestors: torch.Tensor  # [N, N] bool
    bits: torch.Tensor  # [N] int64
    parents: torch.Tensor  # [N] long, the root's 0
    children: torch.Tensor  # [N, W] long: each node's children in order, -1 past them
    rank: torch.Tensor  # [N] long: each node's place among its siblings (0: its parent's first child)
    n_children: torch.Tensor  # [N] long

    def path_to(self, last: torch.Tensor) -> torch.Tensor:
        """[B, D + 1]: the nodes from the root to `last` [B] by depth, padded after it with `last`."""
        D = self.tree.depth
        B = last.shape[0]
        path = torch.zeros(B, D + 1, dtype=torch.long, device=last.device)
        depth = self.depths[last]
        node = last
        for d in range(D, 0, -1):  # walk up: at step d the node at depth d (or `last` itself while deeper than it)
            here = depth >= d
            path[:, d] = torch.where(here, node, last)
            node = torch.where(depth >= d, self.parents[node], node)
        return path


@dataclass(frozen=True, eq=False)
class TreeLevel:
    """One level of a token tree a draft is drafting: its nodes fed as one forward, after the root (the draft's last
    committed token, at position lengths - 1) and the levels above it. Node i is written at the slot of position
    root + i (as the target writes a tree) and takes position root + its depth."""
    tree: Tree | None  # None: a dynamic tree's level, its ancestors device data (dynamic_tree.py)
    depth: int
    nodes: torch.Tensor  # [T] long: the level's node indices
    bits: torch.Tensor  # [T] int64: their ancestor bits (Tree.ancestor_bits)
    ancestors: torch.Tensor  # [T, N] bool: their rows of Tree.ancestors
    parent_at: torch.Tensor  # [T] long: each node's parent's index within the level above
    rank: torch.Tensor  # [T] long: its place among its siblings
    candidates: int  # the most children a node of the level above has here: what is drawn per node there


@functools.lru_cache(maxsize=256)
def _level_on_device(tree: Tree, depth: int, device: str) -> TreeLevel:
    nodes = list(tree.levels[depth])
    above = tree.levels[depth - 1] if depth else range(0, 1)
    rank = [tree.children[tree.parents[i]].index(i) if i else 0 for i in nodes]
    return TreeLevel(tree, depth, torch.tensor(nodes, device=device), tree.ancestor_bits[nodes].to(device),
                     tree.ancestors[nodes].to(device),
                     torch.tensor([max(tree.parents[i], 0) - above.start for i in nodes], device=device),
                     torch.tensor(rank, device=device), max(rank) + 1)


@dataclass(frozen=True)
class TreeMask:
    """What attention needs of a token tree: the queries' rows of its ancestors mask [T, N] and their bits [T];
    the tree's node j sits in the slot of position base + j (base [B]: the root's position)."""
    ancestors: torch.Tensor
    bits: torch.Tensor
    base: torch.Tensor

    @property
    def size(self) -> int:
        return self.ancestors.shape[1]


def ancestor_bits(ancestors: torch.Tensor) -> torch.Tensor:
    """[..., N] bool -> [...] int64: bit j set iff column j is (Tree.ancestor_bits, on the device: bit 63 wraps to
    the sign as there)."""
    n = ancestors.shape[-1]
    return (ancestors.long() << torch.arange(n, device=ancestors.device)).sum(-1)


def write_topology(tree: TreeOnDevice, parents: torch.Tensor) -> None:
    """A DynamicTree's tensors rewritten in place from parents [N] long (the root's 0, every other node's parent
    before it, at most `width` children each): kernels only, no host read, so a CUDA graph replays it. A node's
    children are in node order."""
    N, W = tree.children.shape
    idx = torch.arange(N, device=parents.device)
    eye = idx[:, None] == idx[None]
    ancestors, depths = eye, torch.zeros_like(idx)
    for _ in range(tree.tree.depth):  # each pass reaches one level further up
        ancestors = eye | ancestors[parents]
        depths = torch.where(idx > 0, depths[parents] + 1, 0)
    rank = ((parents[None] == parents[:, None]) & (idx[None] < idx[:, None]) & (idx[None] > 0)).sum(1)
    children = torch.full((N * W,), -1, dtype=torch.long, device=parents.device)
    children.scatter_(0, (parents * W + rank)[1:], idx[1:])
    tree.parents.copy_(parents)
    tree.depths.copy_(depths)
    tree.ancestors.copy_(ancestors)
    tree.bits.copy_(ancestor_bits(ancestors))
    tree.rank.copy_(rank)
    tree.children.copy_(children.view(N, W))
    tree.n_children.zero_().scatter_add_(0, parents[1:], torch.ones_like(parents[1:]))


@functools.lru_cache(maxsize=64)
def _dynamic_on_device(tree: DynamicTree, device: str) -> TreeOnDevice:
    N, W = tree.size, tree.width
    long = lambda *shape: torch.zeros(shape, dtype=torch.long, device=device)  # noqa: E731
    out = TreeOnDevice(tree, long(N), torch.zeros(N, N, dtype=torch.bool, device=device), long(N), long(N),
                       long(N, W), long(N), long(N))
    write_topology(out, torch.arange(-1, N - 1, device=device).clamp(min=0) // W)  # a W-ary heap until a draft's
    return out


@functools.lru_cache(maxsize=64)
def _on_device(tree: Tree, device: str) -> TreeOnDevice:
    width = tree.max_children
    children = [list(c) + [-1] * (width - len(c)) for c in tree.children]
    rank = [0] * tree.size
    for c in tree.children:
        for r, node in enumerate(c):
            rank[node] = r
    return TreeOnDevice(tree, torch.tensor(tree.depths, device=device), tree.ancestors.to(device),
                        tree.ancestor_bits.to(device), torch.tensor((0, *tree.parents[1:]), device=device),
                        torch.tensor(children, dtype=torch.long, device=device).reshape(tree.size, width),
                        torch.tensor(rank, device=device), torch.tensor([len(c) for c in tree.children], device=device))


def expected_tokens(tree: Tree, rates: tuple[float, ...]) -> float:
    """Tokens a verification of `tree` yields on average (the next token included) when a node's child of sibling
    rank r is kept with probability rates[r] once those before it were not (the last rate for every rank past it;
    Sequoia's acceptance vector, independent of depth): for a chain at rate alpha, (1 - alpha^(gamma+1)) / (1 -
    alpha)."""
    kept = [0.0] * tree.size  # expected drafted tokens kept below each node
    for v in reversed(range(tree.size)):
        missed = 1.0
        for r, c in enumerate(tree.children[v]):
            rate = rates[min(r, len(rates) - 1)]
            kept[v] += missed * rate * (1 + kept[c])
            missed *= 1 - rate
    return 1 + kept[0]


def optimal_tree(rates: tuple[float, ...], nodes: int, max_depth: int, max_width: int = 8) -> Tree:
    """Sequoia's tree: of all trees of at most `nodes` nodes (the root included) and `max_depth` levels, the one
    whose expected_tokens under `rates` is largest, by dynamic programming: a subtree of n nodes at its best yields
    1 + sum over ranks r of P(the walk moves to the rank-r child) x its own subtree's best, its n - 1 nodes shared
    out over its children (a child of rank r moves the walk with probability prod_{j<r} (1 - rates[j]) x
    rates[r], so more nodes go to earlier ranks)."""
    def move(r):
        out = rates[min(r, len(rates) - 1)]
        for j in range(r):
            out *= 1 - rates[min(j, len(rates) - 1)]
        return out
    import numpy as np

    width = min(nodes - 1, max_width)
    reach = [move(r) for r in range(width)]
    # best[d][n]: the best yield (root counted) of a subtree of n nodes and at most d levels below its root
    best = [np.array([0.0] + [1.0] * nodes)]
    split = [[None] * (nodes + 1)]
    for d in range(1, max_depth + 1):
        row, how = [0.0, 1.0], [None, []]
        # g[r][m]: the best yield of children of ranks r.. sharing m nodes (k of them to rank r's subtree)
        g = np.zeros((width + 1, nodes))
        pick = np.zeros((width + 1, nodes), dtype=np.int64)
        for r in range(width - 1, -1, -1):
            for m in range(1, nodes):
                k = np.arange(m + 1)
                v = reach[r] * best[d - 1][k] + g[r + 1][m - k]
                pick[r, m] = int(v.argmax())
                g[r, m] = v[pick[r, m]]
        for n in range(2, nodes + 1):
            sizes, m, r = [], n - 1, 0
            while m > 0 and r < width and pick[r][m] > 0:
                sizes.append(pick[r][m])
                m, r = m - pick[r][m], r + 1
            row.append(1 + g[0][n - 1])
            how.append(sizes)
        best.append(np.array(row))
        split.append(how)
    n = max(range(1, nodes + 1), key=lambda k: (round(best[max_depth][k], 12), -k))  # fewest nodes at the best
    parents = [-1]

    def grow(parent, size, depth):
        for s in split[depth][size] or []:
            parents.append(parent)
            grow(len(parents) - 1, s, depth - 1)
    grow(0, n, max_depth)
    return Tree(tuple(parents)).in_level_order()


@functools.lru_cache(maxsize=64)
def shaped_tree(rates: tuple[float, ...], nodes: int, max_depth: int, max_width: int = 8) -> Tree:
    """optimal_tree, made once per (rates, nodes, depth, width): a run asks for its tree at every verification, the
    planner at every gamma of every option."""
    return optimal_tree(rates, nodes, max_depth, max_width)


def visible(mask: TreeMask, n_slots: int, q_pos: torch.Tensor | None = None, key_pos: torch.Tensor | None = None,
            sinks: int = 0, window: int = 0) -> torch.Tensor:
    """[B, T, S] bool: query t of sequence b sees the committed slots (positions before mask.base[b]; with a ring's
    key_pos [B, S], those its window shows the query at q_pos) and the slots of its ancestors j among the tree's
    nodes (position base[b] + j)."""
    N = mask.size
    kp = torch.arange(n_slots, device=mask.base.device)[None, :] if key_pos is None else key_pos
    rel = kp - mask.base[:, None]  # [B, S]
    in_tree = (rel >= 0) & (rel < N)
    anc = mask.ancestors[:, rel.clamp(0, N - 1)].permute(1, 0, 2)  # [B, T, S]
    committed = (rel < 0)[:, None, :]
    if window:
        committed = committed & ((kp < sinks)[:, None, :] | (kp[:, None, :] > q_pos[:, :, None] - window))
    return committed | (in_tree[:, None, :] & anc)


def rank_counts(tree: TreeOnDevice, path: torch.Tensor, accepted: torch.Tensor, active: torch.Tensor):
    """Sequoia's acceptance vector's counts from one verification of the active rows: per sibling rank r, how often
    a candidate of that rank was tried (its parent kept, the ones before it not) and kept ([W] each)."""
    W = max(tree.children.shape[1], 1)
    ranks = torch.arange(W, device=path.device)
    tried = torch.zeros(W, dtype=torch.long, device=path.device)
    kept = torch.zeros_like(tried)
    for d in range(1, path.shape[1]):
        on = (d <= accepted) & active
        r = tree.rank[path[:, d]]
        tried += ((ranks[None] <= r[:, None]) & on[:, None]).sum(0)
        kept += ((ranks[None] == r[:, None]) & on[:, None]).sum(0)
    n = tree.n_children[path.gather(1, accepted[:, None])[:, 0]]  # the last kept node's children: all rejected
    tried += ((ranks[None] < n[:, None]) & active[:, None]).sum(0)
    return tried, kept


def path_tokens(tokens: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """The drafted tokens along each path [B, D] (the root left out), as a chain's drafted tokens."""
    return tokens.gather(1, path[:, 1:])
