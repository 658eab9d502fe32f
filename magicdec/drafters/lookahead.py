"""Lookahead decoding (Fu et al., 2024): no draft model. Each verification also runs Jacobi iterations, and the
n-grams they produce are what later verifications guess.

The target's one pass per step carries a token tree of two branches from the last committed token (the root):
- the **lookahead branch**, a window of W columns and N - 1 levels of Jacobi guesses. Level 0 is a chain of W - 1
  tokens after the root (the root is its column 0); the token at level l, column i follows the level-(l-1) token of
  its column, so it sees level 0's columns up to i and the levels above in its own column (LADE's mask, as a tree:
  its position is i + l past the root). The target's next token after each column's top (level N - 2) completes
  that column's n-gram: (level 0, ..., level N - 2, the target's token), N tokens, filed in a pool under its first;
  then every level moves down one (level 0 takes level 1's columns 1.., the top takes the target's tokens): one
  Jacobi iteration per step, whatever was accepted (LADE's default).
- the **verification branch**: up to G n-grams from the pool that start with the root, latest first, each as a
  branch of N - 1 tokens.

The tree is verified as any other (the longest matching path greedy, the multi-candidate rule sampled: every node
is a deterministic candidate), so the output is the target's whatever the window holds; a lookahead path that
matches is kept too. The window starts as tokens copied at random from each sequence's prompt. Per sequence the
pool is a ring of the latest `pool` n-grams (an n-gram filed again moves to the front, LADE's LRU), on the device.

It spends (N - 1)(W + G) tokens per pass where a chain spends gamma + 1: cheap while a verification is bound by
reading the KV cache, a loss once the pass's extra rows cost (large batch, short context). `--gamma` is the tree's
depth, W + N - 3: the window is gamma + 3 - N columns wide.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from magicdec.analysis import cost_model as cm
from magicdec.drafters.base import DrafterKind
from magicdec.errors import MagicDecError
from magicdec.decoding.generate import Drafter
from magicdec.options import option
from magicdec.model.tree import MAX_NODES, Tree


def window_width(gamma: int, n: int) -> int:
    return gamma + 3 - n


def lookahead_tree(window: int, n: int, guesses: int) -> Tree:
    """The root, then G guess branches of N - 1 tokens, then the window: level 0's columns 1..W - 1 (a chain), then
    levels 1..N - 2 row by row, column i's token a child of the level below in that column."""
    parents = [-1]
    for _ in range(guesses):
        parents += [0] + list(range(len(parents), len(parents) + n - 2))
    below = [0] + list(range(len(parents), len(parents) + window - 1))  # level 0 by column (the root at 0)
    parents += below[:-1]
    for _ in range(n - 2):
        row = list(range(len(parents), len(parents) + window))
        parents += below
        below = row
    return Tree(tuple(parents))


class LookaheadDraft(Drafter):
    """Per sequence: the Jacobi window [B, N - 1, W] (level 0's column 0 unused: the root takes it) and the n-gram
    pool [B, pool + 1, N] with each entry's stamp (when it was filed; -1: empty). The extra last slot takes what
    is dropped (an n-gram filed twice in one step), so every step writes one fixed shape."""

    def __init__(self, prompts: torch.Tensor, window: int, n: int, guesses: int, pool: int, seed: int):
        self.prompts, self.W, self.N, self.G, self.P, self.seed = prompts, window, n, guesses, pool, seed
        self.tree = lookahead_tree(window, n, guesses)
        self.begin()

    def begin(self) -> None:
        B, L = self.prompts.shape
        dev = self.prompts.device
        g = torch.Generator(device="cpu").manual_seed(self.seed)
        at = torch.randint(0, L, (B, self.N - 1, self.W), generator=g).to(dev)
        self.window = self.prompts.gather(1, at.view(B, -1)).view(B, self.N - 1, self.W)
        self.pool = torch.full((B, self.P + 1, self.N), -1, dtype=torch.long, device=dev)
        self.stamp = torch.full((B, self.P + 1), -1, dtype=torch.long, device=dev)
        self.clock = 0
        self.root = None
        self.guessed, self.found = 0, torch.zeros((), dtype=torch.long, device=dev)

    def tree_for(self, tokens: int):
        return self.tree

    def propose(self, step, hist: torch.Tensor, m: torch.Tensor, start: torch.Tensor, gamma: int):
        """The tree's nodes after the root [B, T - 1]: the guesses (where the pool holds fewer than G n-grams
        starting with the root, the latest again; none: the root repeated), then the window."""
        B = hist.shape[0]
        self.root = hist.gather(1, (m - 1)[:, None])[:, 0]
        pool, stamp = self.pool[:, :self.P], self.stamp[:, :self.P]
        top = torch.where(pool[:, :, 0] == self.root[:, None], stamp, -1).topk(self.G, 1)  # the latest G matches
        hit = top.values >= 0
        idx = torch.where(hit, top.indices, top.indices[:, :1])
        guesses = pool.gather(1, idx[:, :, None].expand(B, self.G, self.N))[:, :, 1:]  # [B, G, N - 1]
        guesses = torch.where(hit[:, :1, None], guesses, self.root[:, None, None])
        self.guessed, self.found = self.guessed + B, self.found + hit[:, 0].sum()
        return torch.cat([guesses.reshape(B, -1), self.window[:, 0, 1:], self.window[:, 1:].reshape(B, -1)], 1), None

    def after_verify(self, verified: torch.Tensor, path: torch.Tensor | None = None) -> None:
        """The target's tokens after each column's top complete the window's n-grams: file them, then step the
        window (one Jacobi iteration)."""
        out = verified if verified.dim() == 2 else verified.argmax(-1)
        top = out[:, -self.W:]  # the window's top level is the tree's last W nodes
        columns = self.window.clone()
        columns[:, 0, 0] = self.root
        self.file(torch.cat([columns.transpose(1, 2), top[:, :, None]], 2))  # [B, W, N]
        self.window = torch.cat([self.window[:, 1:], top[:, None]], 1)

    def file(self, grams: torch.Tensor) -> None:
        """grams [B, W, N] into the pool as its newest entries (later ones newer): an equal entry already there is
        emptied first (LADE's LRU), an n-gram also later in `grams` is filed once; the oldest entries make room."""
        B, W, N = grams.shape
        keep = ~(grams[:, :, None] == grams[:, None, :]).all(-1).triu(1).any(2)  # [B, W]: no later twin
        twin = ((self.pool[:, None] == grams[:, :, None]).all(-1) & keep[:, :, None]).any(1)  # [B, P + 1]
        self.stamp = torch.where(twin, -1, self.stamp)
        rank = keep.long().cumsum(1) - 1  # each kept n-gram's place among the kept
        oldest = self.stamp[:, :self.P].topk(W, 1, largest=False).indices  # [B, W]
        slot = torch.where(keep, oldest.gather(1, rank.clamp(min=0)), self.P)
        self.pool.scatter_(1, slot[:, :, None].expand(B, W, N), grams)
        self.stamp.scatter_(1, slot, self.clock + rank)
        self.pool[:, self.P] = -1
        self.stamp[:, self.P] = -1
        self.clock += W

    def summary(self) -> dict:
        return {"guessed": self.guessed, "pool_hits": int(self.found)}


@dataclass(frozen=True)
class Config:
    ngram_size: int = option(4, "Lookahead's n-gram size N: the window's levels are N - 1, each guess N - 1 tokens")
    guesses: int = option(4, "Lookahead's guesses per verification (n-grams from the pool starting with the last "
                             "committed token)")
    pool: int = option(1024, "Lookahead's n-gram pool per sequence (the latest kept)")


# what `magicdec plan` composes: (n-gram size, guesses) pairs (gamma sets the window's width)
PLAN_SHAPES = ((3, 2), (4, 4), (5, 4))


class Lookahead(DrafterKind):
    name = "lookahead"
    description = ("Lookahead decoding: no draft model; a Jacobi window in the target's own pass fills a pool of "
                   "n-grams, and those starting with the last token are verified as a tree")
    Config = Config
    supports_auto_gamma = False
    verifies_trees = True
    example = {"ngram_size": 3, "guesses": 2, "pool": 64}

    def label(self, draft) -> str:
        return f"{self.name} n{draft.ngram_size} g{draft.guesses}"

    def describe(self, cfg) -> str:
        d = cfg.draft
        w = window_width(cfg.speculation.largest, d.ngram_size)
        return (f"none: Lookahead decoding, window {w} x {d.ngram_size - 1} levels, {d.guesses} guesses of "
                f"{d.ngram_size - 1} tokens from a pool of {d.pool} n-grams")

    def check(self, cfg) -> None:
        super().check(cfg)
        d, gamma = cfg.draft, cfg.speculation.largest
        if d.ngram_size < 3:
            raise MagicDecError(f"--ngram_size {d.ngram_size}: Lookahead needs n-grams of at least 3 tokens (a window "
                                "of at least 2 levels)")
        if len(cfg.speculation.gammas) > 1:
            raise MagicDecError("--drafter lookahead: give one --gamma (its tree's depth sets the window's width)")
        if window_width(gamma, d.ngram_size) < 2:
            raise MagicDecError(f"--gamma {gamma} with --ngram_size {d.ngram_size}: Lookahead's window is gamma + 3 - "
                                f"N columns wide and needs 2; give --gamma {d.ngram_size - 1} or more")
        if d.guesses < 1 or d.pool < d.guesses:
            raise MagicDecError(f"--guesses {d.guesses} --pool {d.pool}: need 1 <= guesses <= pool")
        nodes = (d.ngram_size - 1) * (window_width(gamma, d.ngram_size) + d.guesses)
        if nodes > MAX_NODES:
            raise MagicDecError(f"--gamma {gamma} --ngram_size {d.ngram_size} --guesses {d.guesses}: a tree of "
                                f"{nodes} nodes ((N - 1) x (window + guesses)); at most {MAX_NODES}: lower one")
        if cfg.speculation.tree_width > 1:
            raise MagicDecError("--tree_width with --drafter lookahead: its tree is its own (--guesses, --ngram_size)")

    def lookahead(self, cfg) -> int:
        d, gamma = cfg.draft, cfg.speculation.largest
        return (d.ngram_size - 1) * (window_width(gamma, d.ngram_size) + d.guesses) - 1 - gamma

    def prepare(self, cfg, ctx) -> LookaheadDraft:
        d = cfg.draft
        return LookaheadDraft(ctx.prompts, window_width(cfg.speculation.largest, d.ngram_size), d.ngram_size,
                              d.guesses, d.pool, cfg.workload.seed)

    def options(self, cfg, target, device) -> list[dict]:
        return [{"ngram_size": n, "guesses": g} for n, g in PLAN_SHAPES]

    def predict(self, cfg, target, models, device, alpha, gamma, lookahead, summary=None) -> dict:
        """No draft steps: the pass verifies the whole tree (T_V at its node count); the tokens a verification
        yields taken as a chain of N - 1 guessed at alpha, or at each level's measured rate (--synthetic_positions:
        what its synthetic run draws), the window's own paths left out."""
        w, d = cfg.workload, cfg.draft
        context, sampled = w.prefix_len + w.gen_len // 2, not cfg.decoding.greedy
        levels = cfg.speculation.synthetic_positions  # the first guess's rate per level, where measured so
        if levels:
            alpha = cm.positions_alpha(levels, alpha, d.ngram_size - 1)
        p = cm.predict(target, device, w.B, context, d.ngram_size - 1, alpha, 0, None, 0, sampled)
        nodes = (d.ngram_size - 1) * (window_width(gamma, d.ngram_size) + d.guesses)
        t_v = cm.step_time(target, device, w.B, context, nodes, sampled) + cm.tree_verify_seconds(device)
        return cm.without_draft_steps(p | {"T_V": t_v, "T_V_over_T_T": t_v / p["T_T"]}, d.ngram_size - 1)


DRAFTER = Lookahead()
