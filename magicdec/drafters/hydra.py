"""Hydra: sequentially dependent draft heads (magicdec/model/heads.py). Head k reads the target's hidden state at the bonus
token's parent position and the embeddings of the bonus token and of the k tokens drafted before its own, so a
chain is drafted head after head, each seeing the path so far; a tree level by level, each node's children its
head's likeliest (greedy) or drawn without replacement (sampled) given that node's path. Non-grounded heads (a
checkpoint's `grounded_heads` false) read the hidden state alone, as Medusa's do."""
from __future__ import annotations

import torch

from magicdec.model import heads
from magicdec.drafters.head_draft import FeatureTap, HeadDraft, KHeads, Sampler, level_picks, sampler_of, tree_at


class HydraDraft(HeadDraft):
    def __init__(self, head: heads.HydraHead, tap: FeatureTap, embed: torch.Tensor, sampler: Sampler):
        self.head, self.tap, self.embed, self.sampler = head, tap, embed, sampler

    def _grow(self, inputs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """A head's inputs one token on: the path's, then the new token's embedding (grounded heads)."""
        if not self.head.grounded:
            return inputs
        return torch.cat([inputs, heads.embedding_of(self.embed, ids).to(inputs.dtype)], -1)

    def draft_tokens(self, hist, m, start, gamma: int):
        f = self.tap.at(start)  # [B, H]: the feature at the bonus token's parent
        bonus = hist.gather(1, (m - 1)[:, None])[:, 0]
        inputs = self._grow(f, bonus)[:, None]  # [B, 1, .]: the root's path
        tree = tree_at(self, gamma)
        tokens, qs = [], []
        if tree is None:
            for k in range(gamma):
                ids, q = self.sampler.pick(self.head.head(k, inputs[:, 0]))
                tokens.append(ids)
                qs.append(q)
                inputs = self._grow(inputs[:, 0], ids[:, 0])[:, None]
            return torch.cat(tokens, 1), (None if qs[0] is None else torch.cat(qs, 1))
        for depth in range(1, tree.depth + 1):
            level = tree.level_on_device(depth, f.device)
            picks, q = level_picks(self.head.head(depth - 1, inputs), level, self.sampler)
            tokens.append(picks)
            qs.append(q)
            inputs = self._grow(inputs[:, level.parent_at], picks)  # each node's path, for its children
        return torch.cat(tokens, 1), (None if qs[0] is None else torch.cat(qs, 1))


class Hydra(KHeads):
    name = "hydra"
    description = ("Hydra: trained heads over the target's hidden state, each also reading the tokens drafted before "
                   "its own")
    family = "hydra"

    def describe(self, cfg) -> str:
        return "sequentially dependent heads over the target's hidden state (" + (cfg.draft.head or "a fresh head") + ")"

    def draft(self, head, tap, cfg, ctx) -> HydraDraft:
        return HydraDraft(head, tap, ctx.target.tok_embeddings.weight, sampler_of(cfg))


DRAFTER = Hydra()
