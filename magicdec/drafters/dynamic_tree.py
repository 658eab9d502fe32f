"""EAGLE-2's dynamic draft tree (Li et al. 2024), for a head that drafts level by level (magicdec/drafters/eagle.py).

Expansion: from the root, for `depth` levels, a frontier of the K nodes with the highest cumulative confidence (the
sum of the head's log-probabilities along the path); each frontier node's K likeliest children are candidates,
and the next frontier is the K best of those K x K. Rerank: of every candidate drafted (K at depth 1, K x K below),
the N - 1 best by cumulative confidence are verified with the root, in candidate order (depth by depth), so each
node's parent comes before it. The set is ancestor-closed: a child's confidence never exceeds its parent's, and a
stable sort keeps the parent, listed earlier, on a tie. The head runs on static shapes: K frontier nodes per level,
fed as one forward each (the frame: the root, then K nodes per level, each level's ancestors device data).

A batch shares one topology (the verification's shapes and mask are the batch's): a candidate is a place (its
parent, its rank among that parent's children), each sequence's own token there, ranked by the confidence summed
over the sequences as probabilities (log-sum-exp of their cumulative log-probabilities, capped at its parent's
so that rounding cannot break the closure). At B = 1 that is the sequence's own cumulative log-probability: exactly
EAGLE-2's selection.

The verified tree is a tree.DynamicTree: N nodes, at most `depth` levels and K children per node, its topology
written in place into its device tensors (tree.write_topology) by the proposal. The target's verification (positions
root + depth, the attention mask's ancestor bits), the acceptance (greedy: the deepest node matching the target's
argmax along its path; sampled: the multi-candidate walk over each node's children, here every candidate a point
mass, the top-k being deterministic) and the move of the accepted path's KV read only those tensors and the fixed
shapes, so a CUDA graph captured once serves every topology; eager, the same code runs with no host read.
"""
from __future__ import annotations

from typing import Callable

import torch

from magicdec.model.tree import TreeLevel, ancestor_bits


def frame_size(width: int, depth: int) -> int:
    """The head's frame: the root and the K frontier nodes of every level it feeds (all but the last)."""
    return 1 + width * (depth - 1)


def candidates(width: int, depth: int) -> int:
    """Candidates drafted: K at depth 1, K x K at each depth below."""
    return width + (depth - 1) * width * width


def shared(cumulative: torch.Tensor) -> torch.Tensor:
    """[B, ...] cumulative log-probabilities -> [...]: the batch's (log of their probabilities' sum)."""
    return torch.logsumexp(cumulative, 0)


def frame_level(ancestors: torch.Tensor, depth: int, width: int, parent_at: torch.Tensor) -> TreeLevel:
    """Level `depth` of the head's frame (nodes 1 + (depth - 1) K .. depth K, each a child of the node parent_at
    of the level above), its rows of `ancestors` [F, F] written in place: what the head's forward over it reads."""
    lo = 1 + (depth - 1) * width
    nodes = torch.arange(lo, lo + width, device=parent_at.device)
    above = parent_at + (lo - width) if depth > 1 else torch.zeros_like(parent_at)
    ancestors[lo:lo + width] |= ancestors[above]
    rows = ancestors[lo:lo + width]
    return TreeLevel(None, depth, nodes, ancestor_bits(rows), rows, parent_at, torch.zeros_like(parent_at), width)


def draft(root_logits: torch.Tensor, grow: Callable, width: int, depth: int, nodes: int):
    """EAGLE-2's tree from the head's logits at the root [B, V]; `grow(level, ids)` runs the head over a frontier
    (frame_level's TreeLevel, its K tokens ids [B, K] in the head's vocabulary) and returns the logits at its nodes
    [B, K, V]. Returns (ids [B, nodes - 1]: each sequence's token at every verified node after the root, in node
    order; parents [nodes] long, the root's 0)."""
    K, dev = width, root_logits.device
    top = torch.topk(torch.log_softmax(root_logits.float(), -1), K)
    cum, ids = top.values, top.indices  # [B, K]: the frontier's cumulative log-probs and tokens
    score = shared(cum)
    all_ids, scores = [ids], [score]
    parents = [torch.full((K,), -1, device=dev)]  # each candidate's parent among the candidates (-1: the root)
    front = torch.arange(K, device=dev)  # the frontier's candidate indices
    F = frame_size(K, depth)
    frame = torch.eye(F, dtype=torch.bool, device=dev)
    parent_at = torch.zeros(K, dtype=torch.long, device=dev)
    for d in range(1, depth):
        logits = grow(frame_level(frame, d, K, parent_at), ids)
        top = torch.topk(torch.log_softmax(logits.float(), -1), K)  # [B, K, K]
        cum_children = cum[:, :, None] + top.values
        children = torch.minimum(shared(cum_children), score[:, None]).flatten()  # [K x K], capped by the parent's
        all_ids.append(top.indices.flatten(1))
        scores.append(children)
        parents.append(front.repeat_interleave(K))
        chosen = torch.topk(children, K).indices
        front = candidates(K, d) + chosen
        parent_at, score = chosen // K, children[chosen]
        cum, ids = cum_children.flatten(1)[:, chosen], all_ids[-1][:, chosen]
    kept = torch.sort(torch.cat(scores), descending=True, stable=True).indices[:nodes - 1].sort().values
    node_of = torch.zeros(candidates(K, depth), dtype=torch.long, device=dev)
    node_of[kept] = torch.arange(1, nodes, device=dev)
    up = torch.cat(parents)[kept]
    tree_parents = torch.cat([torch.zeros(1, dtype=torch.long, device=dev),
                              torch.where(up >= 0, node_of[up.clamp(min=0)], 0)])
    return torch.cat(all_ids, 1)[:, kept], tree_parents
