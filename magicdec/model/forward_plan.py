"""What one forward is, passed with it: `model(tokens, cache, plan)`. The cache holds KV and its own lengths; what
differs from one forward to the next — which logits come back, a verified token tree and its mask, a drafted tree
level, hidden states a head reads, attention scores a refresh selects from — is named here, so the model, the
caches and attention read it from one value, and a CUDA graph is captured per distinct `key`."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from magicdec.model.tree import TreeLevel, TreeOnDevice

LOGITS = ("all", "last", "none")


@dataclass(frozen=True, eq=False)
class FeatureRequest:
    """What a drafter asks the target's forward to copy (a forward plan's `features`): the taps, in
    order, concatenated along the last axis into `out` [B, S, F] at rows 0..T-1 of a T-token forward (S: the
    longest forward it covers). A static buffer: a CUDA graph captured with the request writes the same memory."""
    taps: tuple[int, ...]
    out: torch.Tensor


@dataclass(frozen=True, eq=False)
class CandidateRequest:
    """What a drafter asks of a verification besides its tokens (a forward plan's `candidates`): each position's `k`
    likeliest ids, written into `out` [B, S, k] at rows 0..T-1 of a T-token forward (S: the longest it covers), over
    the whole vocabulary. A static buffer, as FeatureRequest's."""
    k: int
    out: torch.Tensor


@dataclass(frozen=True, eq=False)
class ForwardPlan:
    """logits: "all" [B, T, V], "last" [B, 1, V], or "none" (prefill chunks before the last). gather: under tensor
    parallelism, the vocabulary slices gathered (False leaves each rank its slice: tp.vocab_argmax). tree: a
    verified token tree (its nodes' positions and mask; the root is the next token). level: one level of a token
    tree a draft drafts (the root is the last token held). features: hidden states copied out for a head. scores:
    per layer [B, H, max_len] fp32 buffers the attention writes its first query's logits to (--refresh).
    candidates: each position's likeliest ids copied out for a drafter that recycles them (Token Recycling)."""
    logits: str = "all"
    gather: bool = True
    tree: TreeOnDevice | None = None
    level: TreeLevel | None = None
    features: FeatureRequest | None = None
    scores: list[torch.Tensor] | None = None
    candidates: CandidateRequest | None = None

    def __post_init__(self):
        if self.logits not in LOGITS:
            raise ValueError(f"logits {self.logits!r}: one of {', '.join(LOGITS)}")
        if self.tree is not None and self.level is not None:
            raise ValueError("a forward verifies a tree or drafts a level of one, not both")

    @property
    def key(self) -> tuple:
        """What changes a forward's work beyond its tensors' shapes (a CUDA graph each): the logits asked for, the
        tree (its shape: its tensors are made once per shape), the level and feature request (their identities: each
        is a static buffer a graph bakes in), whether scores are written, and the candidate request (its identity)."""
        return (self.logits, self.gather, None if self.tree is None else self.tree.tree, self.level, self.features,
                self.scores is not None, self.candidates)

    def sharded(self) -> "ForwardPlan":
        """This plan with the vocabulary left in slices (a greedy step's argmax reads them without gathering)."""
        return self if not self.gather else replace(self, gather=False)

    def with_tree(self, tree: TreeOnDevice | None) -> "ForwardPlan":
        return self if tree is None else replace(self, tree=tree)

    @staticmethod
    def drafting(level: TreeLevel) -> "ForwardPlan":
        """A draft's step over one level of the tree it drafts: logits at every node."""
        return ForwardPlan(level=level)


PLAIN = ForwardPlan()  # a plain forward: every position's logits, nothing else (a chain's verification)
LAST_LOGITS = ForwardPlan(logits="last")  # the last position's: a decode or draft step, a prefill's last chunk
NO_LOGITS = ForwardPlan(logits="none")  # none: a prefill chunk before the last


def prefill_chunk(last: bool) -> ForwardPlan:
    """A prefill chunk's plan: only the last chunk's last position has logits."""
    return LAST_LOGITS if last else NO_LOGITS
