"""A standalone draft (the seed's `longspec`): a small model sharing the target's tokenizer drafts over a KV cache of
its own — a StreamingLLM ring, a selection from its own full prefill, or (budget 0) its full cache. Under tensor
parallelism it may run on fewer ranks than the target (`--draft_ranks`) and broadcast its tokens."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from magicdec.analysis import cost_model as cm
from magicdec.model import tp
from magicdec.config import check_context
from magicdec.drafters.base import DrafterKind, ModelRef, OnRanks, Part
from magicdec.drafters.model_draft import (
    PLAN_TREES,
    DraftCacheOptions,
    DraftWeightOptions,
    ModelDraft,
    draft_prefill_chunk,
    own_prefill,
    plan_budgets,
    tree_of,
)
from magicdec.errors import MagicDecError
from magicdec.options import option

PLAN_WEIGHTS = ("bf16", "int8")  # what `magicdec plan` composes (with model_draft's budgets and trees; 0: its full cache)


@dataclass(frozen=True)
class Config(DraftCacheOptions, DraftWeightOptions):
    draft: str | None = option(None, "the draft model: a model.pth made by convert_hf_checkpoint.py (or the dir "
                                     "holding it), sharing the target's tokenizer", metavar="PATH")
    draft_name: str | None = option(None, "the draft's repo id: its shapes with --random_weights")
    draft_ranks: tuple | None = option(None, "tensor parallelism: ranks that run the draft and broadcast its tokens "
                                             "to the others (default: all of --rank_group)", parse=int, nargs="+")


class Standalone(DrafterKind):
    name = "standalone"
    aliases = ("longspec",)
    description = "standalone draft: a small model (--draft) with a small KV cache (--draft_policy) drafts for the target"
    Config = Config
    supports_trees = drafts_shaped_trees = True
    example = {"draft_budget": 24, "sinks": 4}

    def label(self, draft) -> str:
        who = Path(draft.draft).parent.name if draft.draft else (draft.draft_name or "").split("/")[-1]
        return f"{self.name} {who}".rstrip() + (" full" if draft.full else draft.label()) + draft.weights_label()

    def describe(self, cfg) -> str:
        d = cfg.draft
        if d.full:
            return "its own prefill into its full cache"
        if d.selected:
            return (f"{d.draft_policy}: selected per KV head from the draft's own full prefill (draft_prefill_s: that "
                    "prefill and the selection)")
        return "its own prefill through its cache" + (", positions inside the cache (--reindex)" if d.reindex else "")

    def check(self, cfg) -> None:
        super().check(cfg)
        d = cfg.draft
        d.check(cfg.workload.prefix_len, full_allowed=True)
        d.check_weights(cfg.runtime.torch_device)
        if cfg.models.random_weights and not d.draft_name:
            raise MagicDecError("--random_weights with a standalone draft needs --draft_name (the draft's shapes) "
                                "beside --model_name (the target's)")
        if not cfg.models.random_weights and not d.draft:
            raise MagicDecError("a standalone draft needs --draft DRAFT/model.pth (a small model sharing the target's "
                                "tokenizer)")
        ranks = d.draft_ranks or cfg.runtime.rank_group
        if not set(ranks) <= set(cfg.runtime.rank_group):
            raise MagicDecError(f"--draft_ranks {' '.join(map(str, ranks))} must be ranks of --rank_group")

    def models(self, cfg) -> dict[str, ModelRef]:
        d = cfg.draft
        return {"draft": ModelRef(None if d.draft is None else Path(d.draft), d.draft_name, "--draft")}

    def check_models(self, cfg, target, models) -> None:
        draft, draft_ckpt = models["draft"]
        d, w = cfg.draft, cfg.workload
        check_same_vocabulary(draft, target, "draft")
        d.check_weight_shapes(draft)
        target_tok = cfg.models.tokenizer or (cfg.models.model.parent if cfg.models.model else None)
        if draft_ckpt is not None and target_tok is not None:
            check_same_tokenizer(target_tok, draft_ckpt.parent)
        # Without --reindex the draft's keys keep their absolute positions (see StreamingCache), so with real weights
        # a draft must have been trained on contexts this long; random-weight speed runs only need the shapes.
        if cfg.models.random_weights:
            return
        if d.reindex:  # the farthest a query sees: the budget, or a prefill chunk past its sinks
            farthest = max(d.draft_budget, draft_prefill_chunk(cfg.runtime.prefill_chunk, False) + d.sinks)
            if farthest > draft.max_seq_len:
                raise MagicDecError(f"--reindex: the draft would see {farthest} positions back (its budget, or a "
                                    f"prefill chunk past the sinks), beyond its context of {draft.max_seq_len}; "
                                    "lower --draft_budget or --prefill_chunk")
        else:
            check_context(draft, w.prefix_len, w.gen_len + cfg.speculation.largest + 1, "gen_len + gamma + 1",
                          "the draft's", " (--reindex keeps a draft within its context)")

    def memory(self, cfg, target, models, rank) -> list[Part]:
        d = cfg.draft
        if rank not in self.ranks(cfg):
            return []
        draft = tp.local_config(models["draft"][0], self.ranks(cfg), rank)
        slots = d.slots(cfg.workload.prefix_len, cfg.workload.gen_len, cfg.lookahead)
        if d.selected:  # its own full prefill, selected from, then freed
            slots += cfg.workload.prefix_len
        return [Part(draft, True, slots, d.copy_bytes(draft))]

    def ranks(self, cfg) -> list[int]:
        return sorted(cfg.draft.draft_ranks or cfg.runtime.rank_group)

    def prepare(self, cfg, ctx):
        ranks = self.ranks(cfg)
        draft_cfg, ckpt = ctx.models["draft"]
        drafter = None
        if ctx.rank in ranks:
            shard = None
            if ctx.world > 1 and len(ranks) > 1:
                group = ctx.target_shard.group if len(ranks) == ctx.world else tp.group_for(ranks, ctx.world)
                shard = tp.make_shard(draft_cfg, ranks, group)
            model = cfg.draft.weights_for(ctx.load(draft_cfg, ckpt, shard), ctx)
            if shard is not None and shard.group is not ctx.target_shard.group:
                ctx.notes["all_reduce"] = tp.enable_fast_all_reduce(shard, cfg.runtime.torch_device,
                                                                    cfg.runtime.torch_dtype)
            drafter = ModelDraft(model, own_prefill(cfg.draft, model, ctx, seed_offset=1))
        elif ctx.world > 1:  # ranks outside a draft group must still create it with everyone
            if len(ranks) > 1 and len(ranks) < ctx.world:
                tp.group_for(ranks, ctx.world)
        if ctx.world > 1:
            ctx.notes["draft_ranks"] = ranks
        if ctx.world > 1 and len(ranks) < ctx.world:
            return OnRanks(drafter, ranks, draft_cfg.vocab_size, cfg.decoding.greedy)
        return drafter

    def options(self, cfg, target, device) -> list[dict]:
        """Its budgets (0: the draft's full cache) and weight formats; the draft model is the plan's --draft_name."""
        return [{"draft_budget": b, "draft_weights": w} | t for b in [0, *plan_budgets(cfg)] for w in PLAN_WEIGHTS
                for t in PLAN_TREES]

    def predict(self, cfg, target, models, device, alpha, gamma, lookahead, summary=None) -> dict | None:
        d, w = cfg.draft, cfg.workload
        tree = tree_of(cfg, gamma)
        if tree is False:
            return None
        return cm.predict(target, device, w.B, w.prefix_len + w.gen_len // 2, gamma, alpha,
                          d.read_slots(w.prefix_len, w.gen_len, lookahead), models["draft"][0], 0,
                          not cfg.decoding.greedy, draft_weights=d.draft_weights, draft_group=d.draft_group,
                          tree=tree, sibling_rates=cfg.speculation.synthetic_siblings)


def check_same_vocabulary(draft, target, what: str) -> None:
    if draft.vocab_size != target.vocab_size:
        raise MagicDecError(f"{what} vocabulary ({draft.vocab_size}) differs from the target's ({target.vocab_size}): "
                            "a draft must share the target's tokenizer")


def check_same_tokenizer(target_dir: Path, draft_dir: Path) -> None:
    """Every id must mean the same string: decode each one with both (a probe text can miss a permutation)."""
    from magicdec.model.tokenizer import load_tokenizer

    t, d = load_tokenizer(target_dir), load_tokenizer(draft_dir)
    if t.vocab_size != d.vocab_size or any(t.decode([i]) != d.decode([i]) for i in range(t.vocab_size)):
        raise MagicDecError("draft and target tokenizers differ (same text, different ids): pick a draft trained with "
                            "the target's tokenizer")


DRAFTER = Standalone()
