"""Medusa: K heads over the target's last hidden state, head k proposing the token k + 2 positions after it
(magicdec/heads.py). After each verification the drafter keeps the target's hidden state at the position whose
logits gave the bonus token (a side output of the verification, `KVCache.features`); head k proposes the token k + 1
positions after the bonus token: a chain of gamma <= K tokens, or a token tree whose level d holds head d's
likeliest candidates (greedy) or draws without replacement from it (sampled), under every node of level d - 1
(Medusa's trees are Cartesian: a head does not see the path). `--tree_width` / `--tree_nodes` shape the tree."""
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
    level_picks,
    prepare_head,
    sampler_of,
    tree_at,
)
from magicdec.generate import Drafter

Config = KHeadsConfig


class MedusaDraft(Drafter):
    """Medusa's heads over the target's hidden state at the bonus token's parent position."""

    shape = None

    def __init__(self, head: heads.MedusaHead, tap: FeatureTap, sampler: Sampler):
        self.head, self.tap, self.sampler = head, tap, sampler

    def tree_for(self, tokens: int):
        return tree_at(self, tokens // self.width)

    def propose(self, step, hist, m, start, gamma: int):
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

    def before_verify(self, cache, gamma: int) -> None:
        self.tap.before_verify(cache)
        self.T = gamma + 1

    def after_verify(self, verified, path=None) -> None:
        self.tap.after_verify(path)

    def after_commit(self, cache) -> None:
        self.tap.after_commit(cache, self.T)


class Medusa(DrafterKind):
    name = "medusa"
    description = "Medusa: K trained heads over the target's last hidden state, head k drafting k + 1 tokens ahead"
    Config = Config
    supports_auto_gamma = False
    supports_trees = drafts_shaped_trees = True
    example = {"num_heads": 3}
    family = "medusa"

    def label(self, draft) -> str:
        return f"{self.name} " + (Path(draft.head).name if draft.head else f"fresh k{draft.num_heads}")

    def describe(self, cfg) -> str:
        return "trained heads over the target's hidden state (" + (cfg.draft.head or "a fresh head") + ")"

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
        return (heads.final_tap(target.n_layers),), torch.tensor([cfg.workload.prefix_len - 1])

    def prepare(self, cfg, ctx) -> MedusaDraft:
        head, tap = prepare_head(cfg, ctx, self.family)
        return MedusaDraft(head, tap, sampler_of(cfg))


DRAFTER = Medusa()
