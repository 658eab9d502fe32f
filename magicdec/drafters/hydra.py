"""Hydra: sequentially dependent draft heads (magicdec/heads.py). Head k reads the target's hidden state at the bonus
token's parent position and the embeddings of the bonus token and of the k tokens drafted before its own, so a
chain is drafted head after head, each seeing the path so far; a tree level by level, each node's children its
head's likeliest (greedy) or drawn without replacement (sampled) given that node's path. Non-grounded heads (a
checkpoint's `grounded_heads` false) read the hidden state alone, as Medusa's do."""
from __future__ import annotations

from pathlib import Path

import torch

from magicdec import heads
from magicdec.drafters.base import DrafterKind, Part
from magicdec.drafters.head_draft import (
    FeatureTap,
    KHeadsConfig,
    Sampler,
    check_depth,
    check_head_files,
    check_head_run,
    head_bytes,
    hidden_offset,
    level_picks,
    prepare_head,
    sampler_of,
    tree_at,
)
from magicdec.generate import Drafter


class HydraDraft(Drafter):
    shape = None

    def __init__(self, head: heads.HydraHead, tap: FeatureTap, embed: torch.Tensor, sampler: Sampler):
        self.head, self.tap, self.embed, self.sampler = head, tap, embed, sampler

    def tree_for(self, tokens: int):
        return tree_at(self, tokens // self.width)

    def _grow(self, inputs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """A head's inputs one token on: the path's, then the new token's embedding (grounded heads)."""
        if not self.head.grounded:
            return inputs
        return torch.cat([inputs, heads.embedding_of(self.embed, ids).to(inputs.dtype)], -1)

    def propose(self, step, hist, m, start, gamma: int):
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

    def before_verify(self, cache, gamma: int) -> None:
        self.tap.before_verify(cache)
        self.T = gamma + 1

    def after_verify(self, verified, path=None) -> None:
        self.tap.after_verify(path)

    def after_commit(self, cache) -> None:
        self.tap.after_commit(cache, self.T)


class Hydra(DrafterKind):
    name = "hydra"
    description = ("Hydra: trained heads over the target's hidden state, each also reading the tokens drafted before "
                   "its own")
    Config = KHeadsConfig
    supports_auto_gamma = False
    supports_trees = drafts_shaped_trees = True
    example = {"num_heads": 3}
    family = "hydra"

    def label(self, draft) -> str:
        return f"{self.name} " + (Path(draft.head).name if draft.head else f"fresh k{draft.num_heads}")

    def describe(self, cfg) -> str:
        return "sequentially dependent heads over the target's hidden state (" + (cfg.draft.head or "a fresh head") + ")"

    def check(self, cfg) -> None:
        super().check(cfg)
        check_head_run(cfg, self.name)
        if not cfg.draft.head:
            check_depth(cfg, cfg.draft.num_heads, self.name)

    def check_models(self, cfg, target, models) -> None:
        head = check_head_files(cfg, target, (self.family,), self.name)
        if head is not None:
            check_depth(cfg, head.num_heads, self.name)

    def memory(self, cfg, target, models, rank) -> list[Part]:
        return [Part(target, False, 0, extra_bytes=head_bytes(cfg, target, self.family))]

    def prefill_features(self, cfg, target):
        return (heads.final_tap(target.n_layers) - hidden_offset(cfg),), torch.tensor([cfg.workload.prefix_len - 1])

    def prepare(self, cfg, ctx) -> HydraDraft:
        head, tap = prepare_head(cfg, ctx, self.family)
        return HydraDraft(head, tap, ctx.target.tok_embeddings.weight, sampler_of(cfg))


DRAFTER = Hydra()
