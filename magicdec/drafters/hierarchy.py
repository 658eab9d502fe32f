"""TriForce's hierarchical speculation: a draft that is itself speculative. A bottom draft (a small model over a
StreamingLLM cache, or prompt lookup) proposes gamma_bottom tokens at a time to a middle level — the target's own
weights over a small cache (the self-draft; TriForce: its retrieval cache) — which verifies them losslessly, and goes
on until each sequence holds gamma tokens; the target then verifies those gamma in one pass over its full cache.

The middle level is the generation loop itself (generate.Decoder) with the middle as its "target" and the bottom as
its drafter, so it is exact by the same argument as every other speculation here: its tokens are distributed as the
middle's own sampling distribution (or are the middle's argmax chain when greedy). The target's verification then
needs q, the middle's distribution at each proposed position: its verifications computed them, and the middle's
loop keeps them (MiddleDecoder); greedy needs none.

Acceptance and time are kept per level: the loop's own record is the target's verification of the middle's tokens;
the summary is the middle's verification of the bottom's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from magicdec.analysis import cost_model as cm
from magicdec.decoding.acceptance import Acceptor, SyntheticAcceptor
from magicdec.model import quant_kv
from magicdec.config import appended_for, check_context
from magicdec.drafters import lookup, selfspec
from magicdec.drafters.base import DrafterKind, ModelRef, OnRanks, Part, raise_auto
from magicdec.drafters.model_draft import (
    DraftCacheOptions,
    ModelDraft,
    own_prefill,
    plan_budgets,
    ring_extra_for,
)
from magicdec.drafters.standalone import check_same_vocabulary
from magicdec.errors import MagicDecError
from magicdec.decoding.generate import Batch, Decoder, Drafter
from magicdec.options import option


class MiddleDecoder(Decoder):
    """The middle level's loop: sampled generation also keeps the middle's distribution at every committed position
    (hist column i's in probs[:, i]), which the target's verification takes as q."""

    probs = None

    def before_loop(self, batch: Batch) -> None:
        self.probs = None
        if not self._greedy:
            self.probs = torch.zeros(*batch.hist.shape, self.model.args.vocab_size, device=batch.hist.device)

    def after_verify(self, batch: Batch, verified: torch.Tensor, accepted: torch.Tensor) -> None:
        """The verified distributions [B, g+1, V] at the columns this verification commits (its accepted tokens and
        the one after), for the active rows."""
        if self.probs is None:
            return
        cols = batch.cols[:verified.shape[1]]
        idx = torch.clamp(batch.m, max=batch.n_new)[:, None] + cols[None]
        take = (cols[None] <= accepted[:, None]) & ~batch.done[:, None]
        rows = torch.arange(idx.shape[0], device=idx.device)[:, None]
        self.probs[rows, idx] = torch.where(take[..., None], verified, self.probs[rows, idx])


class WholeContext(Drafter):
    """Prompt lookup as a bottom draft: the middle's loop holds only the tokens since the last target verification,
    so the lookup reads the outer loop's committed tokens (`outer`, `m`, set before each middle run) followed by
    those."""

    def __init__(self, lookup_drafter):
        self.lookup, self.outer, self.m = lookup_drafter, None, None
        self.whole_run_warm_up = lookup_drafter.whole_run_warm_up

    def propose(self, step, hist, m, start, gamma):
        B, W = hist.shape
        whole = torch.zeros(B, self.outer.shape[1] + W, dtype=hist.dtype, device=hist.device)
        whole[:, :self.outer.shape[1]] = self.outer
        # the middle's hist[:, 0] is the outer hist[:, m - 2] (its prev), hist[:, 1] its first token
        whole.scatter_(1, (self.m - 2)[:, None] + torch.arange(W, device=hist.device), hist)
        return self.lookup.propose(step, whole, self.m - 2 + m, start, gamma)


class Hierarchy(Drafter):
    """A middle level (`middle`: a ModelDraft of the target's weights over its small cache) that speculates with
    `bottom` gamma_bottom tokens at a time, keeping what `acceptor` (the middle's acceptance of the bottom's tokens)
    says."""

    def __init__(self, middle: ModelDraft, bottom: Drafter, gamma_bottom: int, acceptor: Acceptor, target_cache,
                 step_mode: str = "eager"):
        self.middle, self.bottom, self.target_cache = middle, bottom, target_cache
        self.whole_run_warm_up = bottom.whole_run_warm_up  # the middle's verifications vary as its bottom's do
        self.inner = MiddleDecoder(middle.model, acceptor, drafter=bottom, gamma=gamma_bottom, step_mode=step_mode)
        self.begin()

    def begin(self) -> None:
        self.totals = {"verifications": 0, "kept": 0, "examined": 0, "middle_steps": 0, "bottom_steps": 0,
                       "seconds": {}}
        self.middle.begin()

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
        self.inner.acceptor.seed += 1  # a synthetic mode's fresh draws for every middle run
        ids, _ = self.inner.generate(cache, first[:, 0], gamma + 1, prev=prev[:, 0])
        self._count(self.inner.stats)
        # sampled: hist column 1 is `first`, columns 2.. the middle's tokens, each with the distribution it was
        # verified under (the marginal the middle's speculative sampling draws from)
        return ids[:, 1:], None if self.inner.probs is None else self.inner.probs[:, 2:gamma + 2]

    def verify_plan(self, cache, gamma: int):
        return self.middle.verify_plan(cache, gamma)  # --refresh re-selects the middle's cache, as without a hierarchy

    def after_commit(self, cache) -> None:
        self.middle.after_commit(cache)

    def _count(self, stats) -> None:
        t = self.totals
        t["verifications"] += stats.verifications
        t["kept"] += sum(stats.kept)
        t["examined"] += sum(stats.reached)
        t["middle_steps"] += stats.iterations
        t["bottom_steps"] += stats.drafted
        for phase, seconds in stats.time.items():
            t["seconds"][phase] = t["seconds"].get(phase, 0.0) + seconds

    def summary(self) -> dict:
        """The middle level's acceptance of the bottom's tokens and the time of each, since begin()."""
        t = self.totals
        return {"alpha_bottom_to_middle": t["kept"] / t["examined"] if t["examined"] else None,
                "middle_verifications": t["middle_steps"], "bottom_draft_steps": t["bottom_steps"],
                "bottom_seconds": t["seconds"].get("draft", 0.0), "middle_seconds": t["seconds"].get("verify", 0.0),
                "bookkeeping_seconds": t["seconds"].get("other", 0.0)} | (self.middle.summary() or {})


@dataclass(frozen=True)
class Config(selfspec.Config):
    draft: str | None = option(None, "the draft model: a model.pth made by convert_hf_checkpoint.py (or the dir "
                                     "holding it), sharing the target's tokenizer; hierarchy: its bottom level, or "
                                     "`ngram` for prompt lookup", metavar="ngram|PATH")
    draft_name: str | None = option(None, "the draft's repo id: its shapes with --random_weights")
    gamma_bottom: int = option(1, "tokens the bottom drafts per middle verification (TriForce: 1)")
    bottom_budget: int = option(256, "the bottom model's StreamingLLM budget")
    ngram_max: int = option(3, "the longest suffix looked up; shorter ones are tried when it never occurred", "--ngram")
    synthetic_bottom: float | None = option(None, "random-weight runs: the middle accepts each bottom token with this "
                                                  "probability (--synthetic_acceptance is the target's rate for the "
                                                  "middle's tokens)", parse=float)

    @property
    def lookup_bottom(self) -> bool:
        return self.draft == "ngram"

    def bottom_cache(self) -> DraftCacheOptions:
        return DraftCacheOptions(draft_budget=self.bottom_budget, sinks=self.sinks)


# what `magicdec plan` composes: bottoms (prompt lookup; None: the plan's --draft_name model), the middle's cache
# policies (with model_draft's budgets) and the bottom's tokens per middle verification
PLAN_BOTTOMS = ("ngram", None)
PLAN_POLICIES = ("retrieval", "streaming")
PLAN_GAMMA_BOTTOM = (1, 2)


class TriForce(DrafterKind):
    name = "hierarchy"
    description = ("TriForce's hierarchy: the self-draft (target weights over its --draft_policy cache) collects its "
                   "gamma tokens by speculating itself, --gamma_bottom at a time, with a bottom draft (--draft)")
    Config = Config
    switch = "--hierarchy"
    example = {"draft_policy": "retrieval", "draft_budget": 48, "sinks": 4, "bottom_budget": 24, "gamma_bottom": 2}
    variants = ({"draft": "ngram", "draft_policy": "retrieval"},)
    supports_auto_gamma = False

    def label(self, draft) -> str:
        bottom = "lookup" if draft.lookup_bottom else (Path(draft.draft).parent.name if draft.draft else
                                                        (draft.draft_name or "").split("/")[-1])
        return f"{self.name} {bottom}>selfspec{draft.label()}"

    def describe(self, cfg) -> str:
        d = cfg.draft
        bottom = (f"prompt lookup (n-grams {d.ngram_max}..1)" if d.lookup_bottom else
                  f"{d.draft or d.draft_name} over a {d.bottom_budget}-token StreamingLLM cache")
        rate = f", synthetic acceptance {d.synthetic_bottom}" if d.synthetic_bottom is not None else ""
        return (f"bottom: {bottom}, {d.gamma_bottom} token(s) per middle verification{rate}; middle: the target's "
                f"weights over the draft cache ({selfspec.DRAFTER.describe(cfg)}); per-level acceptance and time: "
                "metrics.speculation.drafter")

    def check(self, cfg) -> None:
        if cfg.speculation.auto:
            raise_auto(self.name)
        d = cfg.draft
        selfspec.check_self_draft(d, cfg)
        if not d.lookup_bottom and not (d.draft_name if cfg.models.random_weights else d.draft):
            raise MagicDecError("the hierarchy needs a bottom draft: --draft ngram (prompt lookup), --draft "
                                "PATH/model.pth, or with --random_weights --draft_name ID")
        if d.gamma_bottom < 1:
            raise MagicDecError(f"--gamma_bottom {d.gamma_bottom}: must be at least 1")
        if (d.synthetic_bottom is None) != (cfg.speculation.synthetic_acceptance is None):
            raise MagicDecError("the hierarchy with synthetic acceptance needs a rate for each level: "
                                "--synthetic_acceptance (target keeps middle tokens) and --synthetic_bottom (middle "
                                "keeps bottom tokens)")
        if d.synthetic_bottom is not None and not 0 <= d.synthetic_bottom <= 1:
            raise MagicDecError(f"--synthetic_bottom must be in [0, 1], got {d.synthetic_bottom}")
        if d.lookup_bottom:
            lookup.check_ngram(d.ngram_max)
        elif not d.sinks < d.bottom_budget < cfg.workload.prefix_len:
            raise MagicDecError(f"--bottom_budget {d.bottom_budget}: must exceed --sinks {d.sinks} and stay below "
                                f"--prefix_len {cfg.workload.prefix_len}")

    def models(self, cfg) -> dict[str, ModelRef]:
        d = cfg.draft
        if d.lookup_bottom:
            return {}
        return {"bottom": ModelRef(None if d.draft is None else Path(d.draft), d.draft_name, "--draft")}

    def check_models(self, cfg, target, models) -> None:
        cfg.draft.check_weight_shapes(target)
        if "bottom" not in models:
            return
        bottom = models["bottom"][0]
        check_same_vocabulary(bottom, target, "bottom draft")
        w = cfg.workload
        if not cfg.models.random_weights:  # its keys keep absolute positions
            ahead = cfg.speculation.largest + cfg.draft.gamma_bottom
            check_context(bottom, w.prefix_len, appended_for(w.gen_len, ahead), "gen_len + gamma + gamma_bottom + 2",
                          "the bottom draft's", " (--draft ngram has no context limit)")

    def lookahead(self, cfg) -> int:
        return cfg.draft.gamma_bottom + 2  # the middle runs ahead of the target

    def memory(self, cfg, target, models, rank) -> list[Part]:
        parts = [selfspec.self_draft_part(cfg.draft, cfg, target)]
        if "bottom" in models and rank == 0:  # the bottom model runs unsharded, on rank 0 (it broadcasts its tokens)
            parts.append(Part(models["bottom"][0], True,
                              cfg.draft.bottom_budget + ring_extra_for(cfg.workload.gen_len, cfg.lookahead)))
        return parts

    def prefill_queries(self, cfg) -> int:
        return selfspec.DRAFTER.prefill_queries(cfg)

    def prepare(self, cfg, ctx) -> Hierarchy:
        d = cfg.draft
        middle = selfspec.prepare_self_draft(d, ctx)
        greedy = cfg.decoding.greedy
        if d.lookup_bottom:
            bottom = WholeContext(lookup.PromptLookup(ctx.prompts, d.ngram_max,
                                                      None if greedy else ctx.target.args.vocab_size,
                                                      cfg.runtime.graphed))
        else:  # a small model over a StreamingLLM cache filled by its own prefill, on rank 0 alone
            config, ckpt = ctx.models["bottom"]
            bottom = None
            if ctx.rank == 0:
                model = ctx.load(config, ckpt, None)
                bottom = ModelDraft(model, own_prefill(d.bottom_cache(), model, ctx, seed_offset=2,
                                                       progress_desc="prefill (bottom draft)"))
            if ctx.world > 1:  # sampled proposals must be the same on every rank
                bottom = OnRanks(bottom, [0], config.vocab_size, greedy)
        acceptor = Acceptor.from_config(cfg.decoding)
        if d.synthetic_bottom is not None:  # the middle's rate for the bottom's tokens
            acceptor = SyntheticAcceptor(acceptor.sampling, d.synthetic_bottom)
        return Hierarchy(middle, bottom, d.gamma_bottom, acceptor, ctx.cache, cfg.runtime.step_mode)

    def options(self, cfg, target, device) -> list[dict]:
        return [{"draft": d, "draft_policy": p, "draft_budget": b, "gamma_bottom": g} for d in PLAN_BOTTOMS
                for p in PLAN_POLICIES for b in plan_budgets(cfg) for g in PLAN_GAMMA_BOTTOM]

    def predict(self, cfg, target, models, device, alpha, gamma, lookahead, summary=None) -> dict | None:
        """TriForce's two levels. The middle's loop runs until every one of the B sequences holds gamma tokens: the
        slowest sequence's number of middle verifications (planner.finish_verifications at the middle's measured
        acceptance of the bottom's tokens), each a (gamma_bottom + 1)-token step over the middle's cache after
        gamma_bottom bottom steps; plus a fixed cost per target verification (device.verify_overhead_s: the middle's
        setup, fitted to timed runs), counted in T_D because the run times it inside the draft. No prediction before
        that acceptance is measured."""
        from magicdec.analysis.planner import finish_verifications  # the planner imports the drafters

        alpha_b = (summary or {}).get("alpha_bottom_to_middle")
        if alpha_b is None:
            return None
        d, w = cfg.draft, cfg.workload
        gb, sampled, context = d.gamma_bottom, not cfg.decoding.greedy, w.prefix_len + w.gen_len // 2
        t_bottom = 0.0
        if "bottom" in models:
            t_bottom = cm.step_time(models["bottom"][0], device, w.B,
                                    d.bottom_budget + ring_extra_for(w.gen_len, lookahead), 1, sampled)
        if d.quantized_kv:  # the middle reads the whole context through its quantized copy
            middle_context, kv = context, quant_kv.kv_bytes_per_token(target, d.draft_kv)
        else:
            middle_context, kv = d.read_slots(w.prefix_len, w.gen_len, lookahead), None
        middle_verify = cm.step_time(target, device, w.B, middle_context, gb + 1, sampled, kv, d.draft_weights,
                                     d.draft_group)
        middle_runs = float(finish_verifications([gb], np.full(w.B, alpha_b), np.full(w.B, gamma))[0])
        t_d = (middle_runs * (gb * t_bottom + middle_verify) + device.verify_overhead_s) / gamma  # per drafted token
        p = cm.predict(target, replace(device, verify_overhead_s=0.0), w.B, context, gamma, alpha, 0, None, 0,
                       sampled)
        p = p | {"T_D": t_d, "T_D_over_T_T": t_d / p["T_T"], "middle_verifications": middle_runs}
        return p | {"speedup": p["omega"] / cm.verification_cost(p, gamma)}


DRAFTER = TriForce()
