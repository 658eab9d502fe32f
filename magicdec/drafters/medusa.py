"""Medusa: K heads over the target's last hidden state, head k proposing the token k + 2 positions after it
(magicdec/model/heads.py). After each verification the drafter keeps the target's hidden state at the position whose
logits gave the bonus token (a side output of the verification, its plan's `features`); head k proposes the token k + 1
positions after the bonus token: a chain of gamma <= K tokens, or a token tree whose level d holds head d's
likeliest candidates (greedy) or draws without replacement from it (sampled), under every node of level d - 1
(Medusa's trees are Cartesian: a head does not see the path). `--tree_width` / `--tree_nodes` shape the tree."""
from __future__ import annotations

import torch

from magicdec.model import heads
from magicdec.drafters.head_draft import FeatureTap, HeadDraft, KHeads, Sampler, level_picks, sampler_of, tree_at


class MedusaDraft(HeadDraft):
    """Medusa's heads over the target's hidden state at the bonus token's parent position."""

    def __init__(self, head: heads.MedusaHead, tap: FeatureTap, sampler: Sampler):
        self.head, self.tap, self.sampler = head, tap, sampler

    def draft_tokens(self, hist, m, start, gamma: int):
        f = self.tap.at(start)  # the feature at the bonus token's parent (position start = p - 1)
        tree = tree_at(self, gamma)
        if tree is None:
            tokens, qs = [], []
            for k in range(gamma):
                ids, q = self.sampler.pick(self.head.head(k, f))
                tokens.append(ids)
                qs.append(q)
            return torch.cat(tokens, 1), (None if qs[0] is None else torch.cat(qs, 1))
        tokens, qs = [], []
        for depth in range(1, tree.depth + 1):
            level = tree.level_on_device(depth, f.device)
            above = len(tree.levels[depth - 1])
            logits = self.head.head(depth - 1, f)[:, None].expand(-1, above, -1)
            picks, q = level_picks(logits, level, self.sampler)
            tokens.append(picks)
            qs.append(q)
        return torch.cat(tokens, 1), (None if qs[0] is None else torch.cat(qs, 1))


class Medusa(KHeads):
    name = "medusa"
    description = "Medusa: K trained heads over the target's last hidden state, head k drafting k + 1 tokens ahead"
    family = "medusa"

    def describe(self, cfg) -> str:
        return "trained heads over the target's hidden state (" + (cfg.draft.head or "a fresh head") + ")"

    def draft(self, head, tap, cfg, ctx) -> MedusaDraft:
        return MedusaDraft(head, tap, sampler_of(cfg))


DRAFTER = Medusa()
