"""TriForce's hierarchical speculation (`--hierarchy`): a draft that is itself speculative. A bottom draft (a small
model over a StreamingLLM cache, or prompt lookup) proposes gamma_bottom tokens at a time to a middle level — the
target's own weights over a small cache (TriForce: its retrieval cache) — which verifies them losslessly, and goes on
until each sequence holds gamma tokens; the target then verifies those gamma in one pass over its full cache.

The middle level is the generation loop itself (generate.Decoder) with the middle as its "target" and the bottom as
its draft, so it is exact by the same argument as every other speculation here: its tokens are distributed as the
middle's own sampling distribution (or are the middle's argmax chain when greedy). The target's verification then
needs q, the middle's distribution at each proposed position: its verifications computed them, and the middle's
loop keeps them (Decoder.keep_probs); greedy needs none.

Acceptance and time are kept per level: the loop's own record is the target's verification of the middle's tokens;
`Hierarchy.summary()` is the middle's verification of the bottom's.
"""
from __future__ import annotations

import torch

from magicdec.generate import Decoder, Draft, Sampling
from magicdec.lookup import PromptLookup


class WholeContext:
    """Prompt lookup as a bottom draft: the middle's loop holds only the tokens since the last target verification,
    so the lookup reads the outer loop's committed tokens (`outer`, `m`, set before each middle run) followed by
    those."""

    def __init__(self, lookup: PromptLookup):
        self.lookup, self.outer, self.m = lookup, None, None

    model = cache = ranks = refresh = None

    def propose(self, step, hist, m, start, gamma):
        B, W = hist.shape
        width = self.outer.shape[1] + W
        whole = torch.zeros(B, width, dtype=hist.dtype, device=hist.device)
        whole[:, :self.outer.shape[1]] = self.outer
        # the middle's hist[:, 0] is the outer hist[:, m - 2] (its prev), hist[:, 1] its first token
        whole.scatter_(1, (self.m - 2)[:, None] + torch.arange(W, device=hist.device), hist)
        return self.lookup.propose(step, whole, self.m - 2 + m, start, gamma)


class Hierarchy:
    """A draft for the generation loop (generate.Draft's seam) made of a middle level (`middle`: a Draft of the
    target's weights over its small cache) that speculates with `bottom` (a Draft, or a PromptLookup) gamma_bottom
    tokens at a time."""

    ranks = None

    def __init__(self, middle: Draft, bottom, gamma_bottom: int, sampling: Sampling, target_cache,
                 cuda_graphs: bool = False, compile: bool = False, synthetic_acceptance: float | None = None):
        self.middle, self.sampling, self.target_cache = middle, sampling, target_cache
        self.bottom = WholeContext(bottom) if isinstance(bottom, PromptLookup) else bottom
        self.varying_lengths = getattr(bottom, "varying_lengths", False)  # the middle's verifications, as its bottom's
        # keep_probs: q for the target, the middle's distributions where it committed
        self.inner = Decoder(middle.model, sampling, compile=compile, draft=self.bottom, gamma=gamma_bottom,
                             cuda_graphs=cuda_graphs, synthetic_acceptance=synthetic_acceptance, keep_probs=True)
        self.totals = {"verifications": 0, "kept": 0, "examined": 0, "middle_steps": 0, "bottom_steps": 0,
                       "seconds": {}}

    @property
    def refresh(self):
        """--refresh re-selects the middle's cache from the target's verifications, as without a hierarchy."""
        return self.middle.refresh

    @property
    def model(self):
        return self.middle.model

    @property
    def cache(self):
        return self.middle.cache

    def propose(self, step, hist: torch.Tensor, m: torch.Tensor, start: torch.Tensor, gamma: int):
        """gamma tokens per sequence after hist[:, :m] from the middle's own speculative loop, and (sampling) the
        middle's distributions at them [B, gamma, V]."""
        cache = self.middle.cache
        prev, first = hist.gather(1, (m - 2)[:, None]), hist.gather(1, (m - 1)[:, None])
        cache.rollback(start)
        # The middle holds every committed token before `prev` (it computed them, or took them here before); prev's
        # KV it takes from the target's cache, which verified it: a gather, where a forward would read the weights.
        cache.take(self.target_cache, start)
        cache.advance(1)
        if isinstance(self.bottom, WholeContext):
            self.bottom.outer, self.bottom.m = hist, m
        self.inner.landscape_seed += 1  # synthetic acceptance: fresh draws for every middle run
        ids, _ = self.inner.generate(cache, first[:, 0], gamma + 1, prev=prev[:, 0])
        self._count(self.inner.stats)
        tokens = ids[:, 1:]
        # sampled: hist column 1 is `first`, columns 2.. the middle's tokens, each with the distribution it was
        # verified under (the marginal the middle's speculative sampling draws from)
        return tokens, None if self.inner.probs is None else self.inner.probs[:, 2:gamma + 2]

    def _count(self, stats) -> None:
        t = self.totals
        t["verifications"] += stats.verifications
        t["kept"] += sum(stats.kept)
        t["examined"] += sum(stats.reached)
        t["middle_steps"] += stats.iterations
        t["bottom_steps"] += stats.drafted
        for phase, seconds in stats.time.items():
            t["seconds"][phase] = t["seconds"].get(phase, 0.0) + seconds

    def reset(self) -> None:
        self.totals = {k: ({} if k == "seconds" else 0) for k in self.totals}

    def summary(self) -> dict:
        """The middle level's acceptance of the bottom's tokens and the time of each, since the last reset."""
        t = self.totals
        return {"alpha_bottom_to_middle": t["kept"] / t["examined"] if t["examined"] else None,
                "middle_verifications": t["middle_steps"], "bottom_draft_steps": t["bottom_steps"],
                "bottom_seconds": t["seconds"].get("draft", 0.0), "middle_seconds": t["seconds"].get("verify", 0.0),
                "bookkeeping_seconds": t["seconds"].get("other", 0.0)}
