"""Self-speculation (MagicDec): the target's own weights draft over a small KV cache — a StreamingLLM ring (sinks +
recent window, filled by its own prefill; `--reindex` for positions inside the cache), or a selection from the
target's prefill (SnapKV, TriForce's retrieval), optionally selected again every N verifications from the attention
the verification computed anyway (`--refresh`)."""
from __future__ import annotations

from dataclasses import dataclass

from magicdec import cost_model as cm
from magicdec import draft_cache
from magicdec.drafters.base import DrafterKind, Part
from magicdec.drafters.model_draft import (DraftCacheOptions, DraftWeightOptions, ModelDraft, appended_for, own_prefill,
                                           refresh_slots)
from magicdec.errors import MagicDecError
from magicdec.options import option


@dataclass(frozen=True)
class Config(DraftCacheOptions, DraftWeightOptions):
    refresh: int | None = option(None, "snapkv / retrieval: every N verifications select the draft's kept prompt "
                                       "positions again, from the attention that verification computed over the full "
                                       "cache (its side output)", parse=int, metavar="N")

    def label(self) -> str:
        return super().label() + (f" refresh {self.refresh}" if self.refresh else "") + self.weights_label()


class SelfDraft(DrafterKind):
    name = "selfspec"
    description = "self-speculation: the target drafts with a small KV cache (--draft_policy) and verifies with its full one"
    Config = Config
    example = {"draft_budget": 24, "sinks": 4}
    variants = ({}, {"draft_policy": "snapkv"}, {"draft_policy": "retrieval"})

    def label(self, draft) -> str:
        return self.name + draft.label()

    def describe(self, cfg) -> str:
        d = cfg.draft
        weights = "" if d.draft_weights == "bf16" else f"; the target's weights in {d.draft_weights.upper()}"
        if not d.selected:
            return ("its own prefill through its cache" + (", positions inside the cache (--reindex)" if d.reindex
                                                           else "") + weights)
        again = f", selected again every {d.refresh} verifications from their attention (--refresh)" if d.refresh else ""
        return (f"{d.draft_policy}: selected per KV head from the target's prefill KV, no draft prefill "
                f"(draft_prefill_s: the selection){again}{weights}")

    def check(self, cfg) -> None:
        super().check(cfg)
        check_self_draft(cfg.draft, cfg)

    def check_models(self, cfg, target, models) -> None:
        cfg.draft.check_weight_shapes(target)

    def memory(self, cfg, target, models, rank) -> list[Part]:
        return [Part(target, False, self_draft_slots(cfg.draft, cfg, target), cfg.draft.copy_bytes(target))]

    def prefill_queries(self, cfg) -> int:
        return cfg.draft.policy().queries if cfg.draft.selected else 0

    def prepare(self, cfg, ctx) -> ModelDraft:
        return prepare_self_draft(cfg.draft, ctx)

    def predict(self, cfg, target, models, device, alpha, gamma, lookahead, summary=None) -> dict | None:
        return predict_self_draft(cfg.draft, cfg, target, device, alpha, gamma, lookahead)


def check_self_draft(d: Config, cfg) -> None:
    d.check(cfg.workload.prefix_len, full_allowed=False)
    d.check_weights(cfg.runtime.torch_device)
    if d.refresh is not None and not d.selected:
        raise MagicDecError("--refresh re-selects a selected cache: use it with --draft_policy snapkv or retrieval")
    if d.refresh is not None and d.refresh < 1:
        raise MagicDecError(f"--refresh {d.refresh}: must be at least 1 (verifications between re-selections)")
    if d.refresh and cfg.runtime.offload:
        raise MagicDecError("--refresh re-selects from the target's whole cache after each verification: not with "
                            "--offload (its prompt KV is on the host)")


def self_draft_slots(d: Config, cfg, target) -> int:
    slots = d.slots(cfg.workload.prefix_len, cfg.workload.gen_len, cfg.lookahead)
    if d.refresh:
        cache_len = cfg.workload.prefix_len + appended_for(cfg.workload.gen_len, cfg.lookahead)
        slots += refresh_slots(target, cache_len, cfg.runtime.torch_dtype)
    return slots


def prepare_self_draft(d: Config, ctx) -> ModelDraft:
    """The target over the draft's cache: selected from the target's prefill (its KV and the recorded queries),
    or filled by its own StreamingLLM prefill."""
    model = d.weights_for(ctx.target, ctx)
    if not d.selected:
        return ModelDraft(model, own_prefill(d, model, ctx, seed_offset=1))
    policy = d.policy()
    cache = draft_cache.build(policy, ctx.cache, ctx.queries, appended_for(ctx.cfg.workload.gen_len, ctx.lookahead))
    refresh = None
    if d.refresh:
        refresh = draft_cache.Refresh(policy, d.refresh, ctx.cache, cache, ctx.target.layers[0].attention.n_heads,
                                      graphed=ctx.cfg.runtime.step_mode == "cuda_graphs")
    return ModelDraft(model, cache, refresh)


def predict_self_draft(d: Config, cfg, target, device, alpha, gamma, lookahead) -> dict:
    """The target over the draft's slots (a ring reads its spare slots too, masked); a refresh adds its bytes every
    N verifications."""
    w = cfg.workload
    context = w.prefix_len + w.gen_len // 2
    p = cm.predict(target, device, w.B, context, gamma, alpha, d.read_slots(w.prefix_len, w.gen_len, lookahead), None,
                   0, not cfg.decoding.greedy)
    if d.refresh:
        p = cm.with_overhead(p, gamma, cm.refresh_seconds(target, device, w.B, context, d.policy()) / d.refresh)
    return p


DRAFTER = SelfDraft()
