"""Token Recycling (Luo et al., "Turning Trash into Treasure", ACL 2025): no draft model and no datastore. Every
verification computes the target's distribution at each node it checks, and all but the kept token are usually
thrown away; here each node's `k` likeliest ids are kept instead, as the row of its token in an adjacency matrix
[V, k] ("after token t, these came up"). A proposal is a static token tree filled from the matrix breadth first: the
root is the last committed token, and a node's children are the first candidates of its own token's row, in rank
order. Candidates are deterministic (point masses), so speculative sampling verifies them losslessly.

What differs from the paper, and why:
- The tree is the harness's (`--tree_nodes N --tree_rates ...`: Sequoia's shape for that acceptance vector, at
  most 64 nodes, the attention kernel's mask; `--tree_width K`: a chain with K - 1 siblings per depth; width 1: the
  chain of each row's first candidate) instead of the paper's hand-made 80-node tree.
- The matrix starts each generation from the prompt (each prompt token's row holds, first, the token that followed
  its latest occurrence) rather than carrying over from the timed rounds before, which replay the same prompts and
  would hand the next round its own answer. The paper's hot start (a matrix inherited from earlier requests) was
  measured as a matrix of the target's top-k over 2M tokens of other books: acceptance moved within ±4%, so it was
  removed (results/recycling/README.md; the code: commit 0f97a2d). One matrix serves the batch; where several nodes
  of one verification hold the same token, the last node (in batch-major, node order) writes its row, so a run is
  reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from magicdec.analysis import cost_model as cm
from magicdec.decoding.generate import Drafter, GraphedStep
from magicdec.drafters.base import DrafterKind, Part
from magicdec.errors import MagicDecError
from magicdec.drafters.model_draft import tree_of
from magicdec.model.forward_plan import CandidateRequest, ForwardPlan
from magicdec.model.tree import MAX_NODES, Tree
from magicdec.options import option


def recycle(matrix: torch.Tensor, tokens: torch.Tensor, candidates: torch.Tensor) -> None:
    """Write each node's candidates [B, N, k] into the row of its token tokens [B, N] of matrix [V + 1, k] (row V:
    a sink): of nodes holding the same token the last one (flattened order) writes, the others into the sink, so
    the result does not depend on the order a GPU scatters in."""
    rows = tokens.reshape(-1)
    order = torch.arange(rows.numel(), device=rows.device)
    last = torch.full((matrix.shape[0],), -1, dtype=torch.long, device=rows.device)
    last.scatter_reduce_(0, rows, order, "amax")
    target = torch.where(last[rows] == order, rows, matrix.shape[0] - 1)
    matrix[target] = candidates.reshape(rows.numel(), -1)


def fill(matrix: torch.Tensor, root: torch.Tensor, tree) -> torch.Tensor:
    """A tree's tokens [B, N] from the matrix, breadth first: node 0 the root [B], node i the entry of its parent's
    token's row at its rank among its siblings. `tree`: a tree.TreeOnDevice numbered level by level."""
    tokens = root[:, None].expand(root.shape[0], tree.tree.size).clone()
    for level in tree.tree.levels[1:]:
        at = slice(level.start, level.stop)
        tokens[:, at] = matrix[tokens[:, tree.parents[at]], tree.rank[at]]
    return tokens


class TokenRecycling(Drafter):
    """The matrix (k columns, a sink row past the vocabulary), the prompts it starts from, and the verification's
    candidate buffer. `vocab_size` set: sampled decoding (a chain's q is one-hot at its tokens). `cuda_graphs`: the
    fill replays as one CUDA graph per tree."""

    whole_run_warm_up = True  # the fill's graph is captured over the run's history buffer

    def __init__(self, prompts: torch.Tensor, vocab: int, k: int, vocab_size: int | None = None,
                 cuda_graphs: bool = False):
        B, dev = prompts.shape[0], prompts.device
        self.prompts, self.k, self.vocab_size = prompts, k, vocab_size
        self.matrix = torch.zeros(vocab + 1, k, dtype=torch.long, device=dev)  # filled in place: graphs read it
        # as many rows as any tree holds: a prepared drafter serves decoders of every width and shape
        self.request = CandidateRequest(k, torch.zeros(B, MAX_NODES, k, dtype=torch.long, device=dev))
        self.plan = ForwardPlan(candidates=self.request)
        self._graphed = GraphedStep(self._fill) if cuda_graphs and prompts.is_cuda else None
        self.tokens = None  # the last proposal's nodes, root first [B, N]

    def begin(self) -> None:
        """Each generation starts from its prompts: a prompt token's row first holds what followed its latest
        occurrence (module docstring)."""
        self.matrix.zero_()
        p = self.prompts
        follow = torch.zeros(p.shape[0], p.shape[1] - 1, self.k, dtype=torch.long, device=p.device)
        follow[..., 0] = p[:, 1:]
        recycle(self.matrix, p[:, :-1], follow)

    def tree_for(self, tokens: int):
        if self.shape is not None:
            return self.shape
        return None if self.width == 1 else Tree.chain_with_siblings(tokens // self.width, self.width)

    def _fill(self, hist: torch.Tensor, m: torch.Tensor, tree):
        root = hist.gather(1, (m - 1)[:, None])[:, 0]
        return fill(self.matrix, root, tree)

    def propose(self, step, hist: torch.Tensor, m: torch.Tensor, start: torch.Tensor, gamma: int):
        """The tree's nodes after the root (a chain's gamma tokens, each its predecessor's first candidate)."""
        tree = (self.tree_for(gamma * self.width) or Tree.chain(gamma)).on_device(hist.device)  # one per shape:
        self.tokens = (self._graphed or self._fill)(hist, m, tree).clone()  # a graph each; a replay's output is reused
        drafted = self.tokens[:, 1:]
        chain = self.shape is None and self.width == 1
        q = F.one_hot(drafted, self.vocab_size).float() if chain and self.vocab_size is not None else None
        return drafted, q

    def verify_plan(self, cache, gamma: int):
        return self.plan

    def after_verify(self, verified: torch.Tensor, path: torch.Tensor | None = None) -> None:
        """Every checked node's candidates into its token's row: the kept path's and the rejected nodes' alike."""
        n = self.tokens.shape[1]
        recycle(self.matrix, self.tokens, self.request.out[:, :n])


@dataclass(frozen=True)
class Config:
    recycle_k: int = option(8, "candidates kept per token (the adjacency matrix's width): a tree node has at most "
                               "this many children")


class Recycling(DrafterKind):
    name = "recycling"
    aliases = ("token_recycling",)
    description = ("Token Recycling: no draft model; each verified node's likeliest next tokens are kept in a [V, k] "
                   "adjacency matrix, and a static token tree is filled from it breadth first")
    Config = Config
    example = {"recycle_k": 4}
    supports_auto_gamma = False
    supports_trees = True
    drafts_shaped_trees = True

    def label(self, draft) -> str:
        return f"{self.name} k{draft.recycle_k}"

    def describe(self, cfg) -> str:
        return (f"none: Token Recycling (each token's {cfg.draft.recycle_k} likeliest successors, from "
                "verifications)")

    def check(self, cfg) -> None:
        super().check(cfg)
        k, s = cfg.draft.recycle_k, cfg.speculation
        if k < 1:
            raise MagicDecError(f"--recycle_k {k}: at least 1 (the candidates kept per token)")
        widest = s.drafted_tree(s.largest).max_children if s.tree_nodes and s.shaping_rates else s.tree_width
        if widest > k:
            raise MagicDecError(f"--recycle_k {k}: the tree gives a node {widest} children, the matrix keeps {k} "
                                f"per token; raise --recycle_k to {widest} or narrow the tree")

    def memory(self, cfg, target, models: dict, rank: int) -> list[Part]:
        """The matrix ([V + 1, k] ids) and the verification's candidate buffer: no weights, no KV."""
        k, B = cfg.draft.recycle_k, cfg.workload.B
        return [Part(target, weights=False, slots=0,
                     extra_bytes=8 * k * ((target.vocab_size + 1) + B * MAX_NODES))]

    def prepare(self, cfg, ctx) -> TokenRecycling:
        d, V = cfg.draft, ctx.target.args.vocab_size
        return TokenRecycling(ctx.prompts, V, d.recycle_k, None if cfg.decoding.greedy else V, cfg.runtime.graphed)

    def options(self, cfg, target, device) -> list[dict]:
        return [{"tree_width": w} for w in (1, 2, 4)]

    def predict(self, cfg, target, models, device, alpha, gamma, lookahead, summary=None) -> dict | None:
        """No draft steps (the fill is in the fixed cost per verification); the verification of the chain or tree
        (a tree's later candidates at --synthetic_siblings; None without them)."""
        w, s = cfg.workload, cfg.speculation
        tree = tree_of(cfg, gamma)
        if tree is False:
            return None
        p = cm.predict(target, device, w.B, w.prefix_len + w.gen_len // 2, gamma, alpha, 0, None, 0,
                       not cfg.decoding.greedy, tree=tree, sibling_rates=s.synthetic_siblings)
        return cm.without_draft_steps(p, gamma)


DRAFTER = Recycling()

