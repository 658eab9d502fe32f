"""Self-speculation (MagicDec): the target's own weights draft over a small KV cache — a StreamingLLM ring (sinks +
recent window, filled by its own prefill; `--reindex` for positions inside the cache), or a selection from the
target's prefill (SnapKV, TriForce's retrieval), optionally selected again every N verifications from the attention
the verification computed anyway (`--refresh`) — or over the target's whole KV through an 8- or 4-bit copy
(`--draft_kv`, QuantSpec's draft: magicdec/model/quant_kv.py)."""
from __future__ import annotations

from dataclasses import dataclass

from magicdec.analysis import cost_model as cm
from magicdec.drafters import draft_cache
from magicdec.model import quant_kv
from magicdec.config import appended_for, cache_slots
from magicdec.drafters.base import DrafterKind, Part
from magicdec.drafters.model_draft import (
    PLAN_TREES,
    DraftCacheOptions,
    DraftWeightOptions,
    ModelDraft,
    own_prefill,
    plan_budgets,
    refresh_slots,
    tree_of,
)
from magicdec.errors import MagicDecError
from magicdec.options import option


# what `magicdec plan` composes: cache policies, weight formats and KV formats (with model_draft's budgets and trees)
PLAN_POLICIES = ("streaming", "snapkv")
PLAN_WEIGHTS = ("bf16", "int8", "fp8", "int4")
PLAN_KV = ("int8", "int4")  # besides a bf16 cache of a budget: the whole KV through a quantized copy


@dataclass(frozen=True)
class Config(DraftCacheOptions, DraftWeightOptions):
    refresh: int | None = option(None, "snapkv / retrieval: every N verifications select the draft's kept prompt "
                                       "positions again, from the attention that verification computed over the full "
                                       "cache (its side output)", parse=int, metavar="N")
    draft_kv: str = option("bf16", "the KV the draft reads: bf16 (its cache of --draft_budget tokens, chosen by "
                                   "--draft_policy) or int8 / int4: the target's whole KV through a quantized copy "
                                   "(QuantSpec's draft; a scale and zero point per token and head, int4 the upper "
                                   "nibble of int8: magicdec/model/quant_kv.py)", choices=quant_kv.FORMATS)

    @property
    def quantized_kv(self) -> bool:
        return self.draft_kv != "bf16"

    def label(self) -> str:
        cache = f" kv {self.draft_kv}" if self.quantized_kv else super().label()
        return cache + (f" refresh {self.refresh}" if self.refresh else "") + self.weights_label()


class SelfDraft(DrafterKind):
    name = "selfspec"
    description = "self-speculation: the target drafts with a small KV cache (--draft_policy) and verifies with its full one"
    Config = Config
    supports_trees = drafts_shaped_trees = True
    example = {"draft_budget": 24, "sinks": 4}
    variants = ({}, {"draft_policy": "snapkv"}, {"draft_policy": "retrieval"})

    def label(self, draft) -> str:
        return self.name + draft.label()

    def describe(self, cfg) -> str:
        d = cfg.draft
        weights = "" if d.draft_weights == "bf16" else f"; the target's weights in {d.draft_weights.upper()}"
        if d.quantized_kv:
            return (f"the target's whole KV through a {d.draft_kv.upper()} copy (QuantSpec), quantized from its "
                    f"prefill, its own tokens' KV quantized as written{weights}")
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
        return [self_draft_part(cfg.draft, cfg, target)]

    def prefill_queries(self, cfg) -> int:
        return cfg.draft.policy().queries if cfg.draft.selected else 0

    def prepare(self, cfg, ctx) -> ModelDraft:
        return prepare_self_draft(cfg.draft, ctx)

    def options(self, cfg, target, device) -> list[dict]:
        caches = [{"draft_policy": p, "draft_budget": b} for p in PLAN_POLICIES for b in plan_budgets(cfg)]
        caches += [{"draft_kv": kv} for kv in PLAN_KV]
        return [c | {"draft_weights": w} | t for c in caches for w in PLAN_WEIGHTS for t in PLAN_TREES]

    def predict(self, cfg, target, models, device, alpha, gamma, lookahead, summary=None) -> dict | None:
        return predict_self_draft(cfg.draft, cfg, target, device, alpha, gamma, lookahead)


def check_self_draft(d: Config, cfg) -> None:
    if d.quantized_kv and (d.selected or d.reindex):
        raise MagicDecError(f"--draft_kv {d.draft_kv} reads the target's whole KV: --draft_policy and --reindex choose "
                            "a bf16 draft cache (leave them out, or use --draft_kv bf16)")
    if not d.quantized_kv:  # its budget is unused
        d.check(cfg.workload.prefix_len, full_allowed=False)
    d.check_weights(cfg.runtime.torch_device)
    if d.refresh is not None and not d.selected:
        raise MagicDecError("--refresh re-selects a selected cache: use it with --draft_policy snapkv or retrieval")
    if d.refresh is not None and d.refresh < 1:
        raise MagicDecError(f"--refresh {d.refresh}: must be at least 1 (verifications between re-selections)")
    if cfg.speculation.tree_nodes and d.quantized_kv:
        raise MagicDecError(f"--tree_nodes with --draft_kv {d.draft_kv}: a quantized draft cache drafts chains only "
                            "(use --tree_width, whose draft steps feed one token each)")
    if d.refresh and cfg.runtime.offload:
        raise MagicDecError("--refresh re-selects from the target's whole cache after each verification: not with "
                            "--offload (its prompt KV is on the host)")


def self_draft_part(d: Config, cfg, target) -> Part:
    """The self-draft's memory: its cache's slots (or its quantized copy of the target's whole KV) and its weight
    copy."""
    w = cfg.workload
    cache_len = cache_slots(w.prefix_len, w.gen_len, cfg.lookahead)
    if d.quantized_kv:
        copy = cache_len * quant_kv.kv_bytes_per_token(target, d.draft_kv)  # per sequence
        return Part(target, False, 0, d.copy_bytes(target), copy)
    slots = d.slots(w.prefix_len, w.gen_len, cfg.lookahead)
    if d.refresh:
        slots += refresh_slots(target, cache_len, cfg.runtime.torch_dtype)
    return Part(target, False, slots, d.copy_bytes(target))


def prepare_self_draft(d: Config, ctx) -> ModelDraft:
    """The target over the draft's cache: selected from the target's prefill (its KV and the recorded queries),
    or filled by its own StreamingLLM prefill."""
    model = d.weights_for(ctx.target, ctx)
    if d.quantized_kv:
        return ModelDraft(model, quant_kv.QuantizedKVCache.of(ctx.cache, quant_kv.BITS[d.draft_kv]))
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
    """The target over the draft's slots (a ring reads its spare slots too, masked), or over its whole context in
    the quantized copy's bytes; a refresh adds its bytes every N verifications."""
    w = cfg.workload
    context = w.prefix_len + w.gen_len // 2
    slots = 0 if d.quantized_kv else d.read_slots(w.prefix_len, w.gen_len, lookahead)
    kv = quant_kv.kv_bytes_per_token(target, d.draft_kv) if d.quantized_kv else None
    tree = tree_of(cfg, gamma)
    if tree is False:
        return None
    p = cm.predict(target, device, w.B, context, gamma, alpha, slots, None, 0, not cfg.decoding.greedy,
                   draft_kv_per_token=kv, draft_weights=d.draft_weights, draft_group=d.draft_group, tree=tree,
                   sibling_rates=cfg.speculation.synthetic_siblings)
    if d.refresh:
        p = cm.with_overhead(p, gamma, cm.refresh_seconds(target, device, w.B, context, d.policy()) / d.refresh)
    return p


DRAFTER = SelfDraft()
