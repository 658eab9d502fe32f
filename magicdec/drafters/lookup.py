"""Prompt-lookup drafting: no draft model at all. The gamma tokens proposed for a sequence are those that followed
the latest earlier occurrence of its last `n` tokens in its prompt and output so far, for the largest n from
`ngram_max` down to 1 that occurs; batched on the device (no per-sequence host loop).

A proposal is a point mass, so speculative sampling accepts a proposed token x with probability p(x) and otherwise
samples from the target's distribution without x: lossless for greedy and sampling alike. The batch keeps one shape:
its proposals are as long as the longest real one (a host read per verification), shorter rows filled by repeating
their last token, which the verification accepts only where the target would have produced it anyway. Where no
sequence matches, nothing is proposed and the verification is one plain decode step.

Under synthetic acceptance (random-weight speed runs) every row proposes gamma tokens: what is kept is then the
synthetic rule's (an i.i.d. rate, or rates and a trace measured on real text), not how often the random model's own
output happens to repeat, which would otherwise decide how many tokens are drafted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from magicdec.analysis import cost_model as cm
from magicdec.drafters.base import DrafterKind
from magicdec.errors import MagicDecError
from magicdec.decoding.generate import Drafter, GraphedStep
from magicdec.options import option
from magicdec.model.tree import Tree


def propose_ngram(ctx: torch.Tensor, length: torch.Tensor, gamma: int, ngram_max: int, branches: int = 1):
    """ctx [B, L] token ids, of which the first length[b] are sequence b's; returns (tokens [B, gamma], proposed [B]):
    the gamma tokens after the latest earlier occurrence of the longest matching suffix (n = ngram_max..1) of each
    sequence, and how many of them are real: the copy stops at the sequence's end (the last token repeated past it),
    and a sequence with no match proposes none (proposed 0, its last token repeated). `branches` K > 1: tokens
    [B, K, gamma], the continuations of the K latest occurrences of that suffix (the latest first; where it occurred
    fewer times, the latest again); `proposed` is the latest's."""
    B, L = ctx.shape
    K = branches
    start = torch.zeros(B, K, dtype=torch.long, device=ctx.device)  # where each branch is copied from
    found = torch.zeros(B, dtype=torch.bool, device=ctx.device)
    for n in range(min(ngram_max, L - 1), 0, -1):
        tail = ctx.gather(1, (length[:, None] - n + torch.arange(n, device=ctx.device)).clamp(min=0))  # [B, n]
        match = (ctx.unfold(1, n, 1) == tail[:, None, :]).all(-1)  # [B, L - n + 1]: window at s equals the tail
        s = torch.arange(L - n + 1, device=ctx.device)
        earlier = match & (s[None, :] + n < length[:, None]) & (length[:, None] > n)  # a token follows, not the tail
        at = torch.where(earlier, s[None, :], -1)
        latest = at.amax(1, keepdim=True) if K == 1 else at.topk(min(K, at.shape[1]), 1).values  # [B, <= K]
        latest = torch.where(latest >= 0, latest, latest[:, :1])  # fewer occurrences: the latest again
        if latest.shape[1] < K:
            latest = torch.cat([latest, latest[:, :1].expand(B, K - latest.shape[1])], 1)
        new = ~found & (latest[:, 0] >= 0)
        start = torch.where(new[:, None], latest + n, start)
        found = found | new
    last = (length - 1).clamp(min=0)[:, None, None]
    idx = torch.where(found[:, None, None], start[:, :, None] + torch.arange(gamma, device=ctx.device), last)
    proposed = torch.where(found, (length - start[:, 0]).clamp(max=gamma), 0)
    tokens = ctx.gather(1, torch.minimum(idx, last).view(B, K * gamma)).view(B, K, gamma)
    return (tokens[:, 0] if K == 1 else tokens), proposed


class PromptLookup(Drafter):
    """A drafter that reads the prompts and the committed tokens instead of running a model. `vocab_size` set:
    sampled decoding, which verifies against one-hot q. `cuda_graphs`: the proposal's ~50 small kernels replay as
    one CUDA graph (captured per history shape): launched eagerly they cost half a decode step at SmolLM2's shape
    (results/lookup)."""

    whole_run_warm_up = True  # a verification is as long as the batch's longest proposal: its shape varies

    def __init__(self, prompts: torch.Tensor, ngram_max: int = 3, vocab_size: int | None = None,
                 cuda_graphs: bool = False, full: bool = False):
        self.prompts, self.ngram_max, self.vocab_size, self.full = prompts, ngram_max, vocab_size, full
        self._graphed = None
        if cuda_graphs and prompts.is_cuda:  # the loop's history buffer keeps one shape per run: one capture
            self._graphed = GraphedStep(self._propose)  # and one per width: a shaped copy passes its own
        self.proposed = None  # per sequence, how many real tokens the last proposal held

    def _propose(self, hist: torch.Tensor, m: torch.Tensor, gamma: int, width: int):
        P = self.prompts.shape[1]
        ctx = torch.cat([self.prompts[:, :P - 1], hist], 1)
        return propose_ngram(ctx, P - 1 + m, gamma, self.ngram_max, width)

    def tree_for(self, tokens: int):
        """Above width 1: a branch per earlier occurrence, each as long as the proposal."""
        return None if self.width == 1 else Tree.branches(tokens // self.width, self.width)

    def propose(self, step, hist: torch.Tensor, m: torch.Tensor, start: torch.Tensor, gamma: int):
        """Up to gamma tokens per sequence after its committed tokens hist[:, :m] (hist[:, 0] is the prompt's last
        token): [B, n] with n the longest real proposal (0: nothing matched anywhere), and their one-hot
        distributions when sampling (deterministic candidates: verification needs no q). Above width 1, [B, width
        * n]: a branch of n per occurrence, in node order."""
        tokens, self.proposed = (self._graphed or self._propose)(hist, m, gamma, self.width)
        if self.full:  # synthetic acceptance: gamma drafted every time (module docstring)
            self.proposed = torch.full_like(self.proposed, gamma)
        n = int(self.proposed.max())  # the loop's host read: its verification's length
        if self.width > 1:
            return tokens[:, :, :n].reshape(tokens.shape[0], -1).clone(), None
        tokens = tokens[:, :n].clone()  # a replay's output is overwritten by the next one
        q = None if self.vocab_size is None else F.one_hot(tokens, self.vocab_size).float()
        return tokens, q


@dataclass(frozen=True)
class Config:
    ngram_max: int = option(3, "the longest suffix looked up; shorter ones are tried when it never occurred", "--ngram")


PLAN_NGRAMS = (2, 3, 4)  # what `magicdec plan` composes: the longest suffixes looked up, chains and two branches
PLAN_WIDTHS = (1, 2)


class Lookup(DrafterKind):
    name = "lookup"
    description = ("prompt lookup: no draft model; the tokens that followed the latest earlier occurrence of the last "
                   "n tokens (n = --ngram_max..1) in the prompt and output are proposed")
    Config = Config
    example = {"ngram_max": 2}
    supports_auto_gamma = False
    supports_trees = True

    def label(self, draft) -> str:
        return f"{self.name} n{draft.ngram_max}"

    def describe(self, cfg) -> str:
        return f"none: prompt lookup (suffixes of {cfg.draft.ngram_max} tokens down to 1)"

    def check(self, cfg) -> None:
        super().check(cfg)
        check_ngram(cfg.draft.ngram_max)

    def prepare(self, cfg, ctx) -> PromptLookup:
        return PromptLookup(ctx.prompts, cfg.draft.ngram_max, None if cfg.decoding.greedy else ctx.target.args.vocab_size,
                            cfg.runtime.graphed, full=cfg.speculation.synthetic_acceptance is not None)

    def options(self, cfg, target, device) -> list[dict]:
        return [{"ngram_max": n, "tree_width": w} for n in PLAN_NGRAMS for w in PLAN_WIDTHS]

    def predict(self, cfg, target, models, device, alpha, gamma, lookahead, summary=None) -> dict | None:
        """No draft steps: the n-gram search is in the fixed cost per verification (T_O). Above width 1 the
        verification takes every branch (width * gamma tokens) and yields what the branches' rates keep (the later
        branches at --synthetic_siblings; None without them). The prediction takes gamma tokens proposed every time,
        so it overstates Omega where nothing was found."""
        w, width = cfg.workload, cfg.speculation.tree_width
        if width > 1 and not cfg.speculation.synthetic_siblings:
            return None
        tree = Tree.branches(gamma, width) if width > 1 else None
        p = cm.predict(target, device, w.B, w.prefix_len + w.gen_len // 2, gamma, alpha, 0, None, 0,
                       not cfg.decoding.greedy, tree=tree, sibling_rates=cfg.speculation.synthetic_siblings)
        return cm.without_draft_steps(p, gamma)


def check_ngram(ngram_max: int) -> None:
    if ngram_max < 1:
        raise MagicDecError(f"--ngram_max {ngram_max}: must be at least 1 (the longest suffix looked up)")


DRAFTER = Lookup()
