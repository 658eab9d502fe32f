"""A model over a small KV cache of its own, drafting one token per step: what the self-draft (the target's weights)
and a standalone draft (a small model) share — the options of the draft's cache (its budget and how its KV is
chosen: StreamingLLM, or a selection of magicdec/drafters/draft_cache.py), their checks, their sizes and the runtime draft."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from magicdec.drafters import draft_cache

from magicdec.model import draft_weights
from magicdec.config import appended_for, cache_slots
from magicdec.errors import MagicDecError
from magicdec.model.forward_plan import LAST_LOGITS, PLAIN, ForwardPlan
from magicdec.decoding.generate import Drafter, prefill
from magicdec.model.kv_cache import KVCache, StreamingCache
from magicdec.options import option
from magicdec.decoding.sampling import sample_from
from magicdec.model.tree import Tree

DRAFT_PREFILL_CHUNK = 256  # the draft's ring must hold one prefill chunk: small chunks keep the ring (and its reads) small


@dataclass(frozen=True)
class DraftCacheOptions:
    draft_budget: int = option(256, "the draft's KV budget in prompt tokens (streaming: sinks + recent window; a "
                                    "standalone draft: 0 = its full cache)", "--streamingllm_budget")
    sinks: int = option(16, "StreamingLLM sink tokens kept at the start")
    draft_policy: str = option("streaming", "how the draft picks its KV: streaming (sinks + recent window, its own "
                                            "prefill); snapkv or retrieval (selected per KV head from a full prefill "
                                            "of the prompt, its last 32 tokens kept, generated tokens appended): see "
                                            "magicdec/drafters/draft_cache.py", choices=draft_cache.POLICIES)
    chunk_size: int = option(8, "--draft_policy retrieval: tokens per scored chunk")
    reindex: bool = option(False, "streaming: attention sees positions inside the draft's cache (sinks, then the "
                                  "window), not in the prompt, so a draft trained on contexts shorter than the prompt "
                                  "stays in range")

    @property
    def selected(self) -> bool:
        return self.draft_policy != "streaming"

    @property
    def full(self) -> bool:
        """A standalone draft's full cache (budget 0)."""
        return self.draft_budget == 0

    def policy(self):
        """The selection policy object (draft_cache.SnapKV, Retrieval), None for StreamingLLM."""
        return draft_cache.policy_for(self.draft_policy, self.draft_budget, self.chunk_size) if self.selected else None

    def label(self) -> str:
        policy = "" if not self.selected else f" {self.draft_policy}"
        return f"{policy} b{self.draft_budget}" + (" reindex" if self.reindex else "")

    def check(self, prefix_len: int, full_allowed: bool, budget_flag: str = "--draft_budget") -> None:
        budget, sinks = self.draft_budget, self.sinks
        if sinks < 0:
            raise MagicDecError(f"--sinks must be >= 0, got {sinks}")
        if not (full_allowed and budget == 0):
            if budget <= sinks:
                raise MagicDecError(f"{budget_flag} {budget} must exceed --sinks {sinks} (the budget holds the sinks "
                                    "plus a recent window)")
            if budget >= prefix_len:
                raise MagicDecError(f"{budget_flag} {budget} >= --prefix_len {prefix_len}: the draft would read the "
                                    "whole prompt; use a budget below the prefix length")
        if self.selected:
            if budget == 0:
                raise MagicDecError(f"--draft_policy {self.draft_policy} selects within a budget: {budget_flag} 0 (the "
                                    "full cache) has nothing to select")
            if budget <= draft_cache.WINDOW:
                raise MagicDecError(f"{budget_flag} {budget} must exceed the {draft_cache.WINDOW}-token window that "
                                    f"--draft_policy {self.draft_policy} keeps at the prompt's end")
            if self.draft_policy == "retrieval" and not 1 <= self.chunk_size <= budget - draft_cache.WINDOW:
                raise MagicDecError(f"--chunk_size {self.chunk_size}: must be 1..{budget - draft_cache.WINDOW} (the "
                                    f"{budget_flag} {budget} minus the {draft_cache.WINDOW}-token window)")
        if self.chunk_size != 8 and self.draft_policy != "retrieval":
            raise MagicDecError("--chunk_size applies to --draft_policy retrieval only")
        if self.reindex and self.selected:
            raise MagicDecError(f"--reindex applies to --draft_policy streaming only (--draft_policy "
                                f"{self.draft_policy} keeps the target's keys at their prompt positions)")
        if self.reindex and budget == 0:
            raise MagicDecError(f"--reindex needs a StreamingLLM budget: {budget_flag} 0 is the full cache, whose "
                                "positions are the prompt's")

    def slots(self, prefix_len: int, gen_len: int, lookahead: int) -> int:
        """KV slots per sequence of the draft's cache."""
        if self.full:
            return cache_slots(prefix_len, gen_len, lookahead)
        if self.selected:  # a selected cache's ring holds every position generation reaches
            return self.draft_budget + appended_for(gen_len, lookahead)
        return self.draft_budget + ring_extra_for(gen_len, lookahead)

    def read_slots(self, prefix_len: int, gen_len: int, lookahead: int) -> int:
        """Slots a draft step reads (masked or not): the cost model's draft context (0: the whole context)."""
        return 0 if self.full else self.slots(prefix_len, gen_len, lookahead)


@dataclass(frozen=True)
class DraftWeightOptions:
    draft_weights: str = option("bf16", "the draft's linear layers and LM head: bf16 (the model's own), int8 or fp8 "
                                        "(a scale per output channel) or int4 (a scale and zero point per "
                                        "--draft_group input columns), quantized once at load; the target keeps its "
                                        "weights, so the output is unchanged. Kernels: gemlite and PyTorch's int4 "
                                        "matmul on a GPU, dequantize-and-multiply on a CPU (magicdec/model/draft_weights.py)",
                                choices=draft_weights.FORMATS)
    draft_group: int = option(128, "--draft_weights int4: input columns sharing a scale and zero point")

    def weights_label(self) -> str:
        if self.draft_weights == "bf16":
            return ""
        return f" {self.draft_weights}" + (f" g{self.draft_group}" if self.draft_weights == "int4" else "")

    def check_weights(self, device) -> None:
        if self.draft_group != 128 and self.draft_weights != "int4":
            raise MagicDecError("--draft_group sets int4's groups: use it with --draft_weights int4")
        draft_weights.check_format(self.draft_weights, self.draft_group, device=device)

    def check_weight_shapes(self, config) -> None:
        if self.draft_weights == "int4":
            draft_weights.check_format("int4", self.draft_group, draft_weights.input_widths(config))

    def copy_bytes(self, config) -> int:
        return draft_weights.copy_bytes(config, self.draft_weights, self.draft_group)

    def weights_for(self, model, ctx):
        """The model the draft steps run: `model` itself (bf16) or its quantized copy, with what the record says of
        it (the kernel each layer runs at the draft's row counts)."""
        if self.draft_weights == "bf16":
            return model
        draft = draft_weights.draft_copy(model, self.draft_weights, self.draft_group)
        B = ctx.prompts.shape[0]
        ctx.notes["draft_weights"] = {"format": self.draft_weights, "group": self.draft_group,
                                      "kernels": [draft_weights.kernels_used(draft, M) for M in (B, 2 * B)]}
        return draft


# the verification shapes `magicdec plan` tries for a drafter that drafts trees: a chain, chains with siblings, a
# Sequoia tree (shaped by the acceptance input's rates)
PLAN_TREES = ({}, {"tree_width": 2}, {"tree_width": 3}, {"tree_nodes": 16}, {"tree_nodes": 32})
PLAN_BUDGETS = (256, 1024, 4096)  # draft KV budgets (those below the prefix)


def plan_budgets(cfg, budgets=PLAN_BUDGETS) -> list[int]:
    """The budgets of a grid that are below the prefix (a budget the prompt fits in drafts from the whole prompt)."""
    return [b for b in budgets if b < cfg.workload.prefix_len]


def tree_of(cfg, gamma: int):
    """The tree a model draft verifies at --tree_width or --tree_nodes (None: a chain), for the cost model; False
    where it cannot predict one: a tree's later candidates need their rates (--synthetic_siblings)."""
    s = cfg.speculation
    if s.tree_width == 1 and not s.tree_nodes:
        return None
    if not s.synthetic_siblings:
        return False
    return s.drafted_tree(gamma) or Tree.chain_with_siblings(gamma, s.tree_width)


def ring_extra_for(gen_len: int, gamma: int) -> int:
    """Ring slots beyond the window: a draft prefill chunk, or what generating gen_len tokens (and a warm-up of
    4*(gamma+1)) writes before rolling back to the prompt — never overwriting a prompt key the window still needs."""
    return max(DRAFT_PREFILL_CHUNK, max(gen_len, 4 * (gamma + 1)) + 2 * gamma + 4)


def draft_prefill_chunk(chunk: int, full: bool) -> int:
    """A ring cache must hold a whole prefill chunk, so it is prefilled in small ones; a full cache in `chunk`s."""
    return chunk if full else min(chunk, DRAFT_PREFILL_CHUNK)


def refresh_slots(config, cache_len: int, dtype) -> int:
    """--refresh's buffers (each layer's first-query logits, fp32 per query head over the target's cache) counted
    as KV slots of `config`, for the memory estimate."""
    item = torch.empty((), dtype=dtype).element_size()
    return -(-2 * (config.n_heads // config.n_kv_heads) * cache_len // (config.head_dim * item))


class ModelDraft(Drafter):
    """`model` over `cache`: one draft step per token. The loop fills the cache once per batch of prompts (its
    preparation) and asks for gamma tokens per verification; which keys and values the cache keeps is the cache's
    business. `refresh` (draft_cache.Refresh) re-selects a selected cache from verifications' attention."""

    def __init__(self, model, cache, refresh: draft_cache.Refresh | None = None):
        self.model, self.cache, self.refresh = model, cache, refresh
        self.root = None  # a drafted tree's root position per sequence, until its accepted path is kept

    def begin(self) -> None:
        if self.refresh is not None:
            self.refresh.begin()

    def tree_for(self, tokens: int):
        """The tree this draft drafts (--tree_nodes); above width 1, the chain it runs, each depth also holding its
        next width - 1 candidates."""
        if self.shape is not None:
            return self.shape
        return None if self.width == 1 else Tree.chain_with_siblings(tokens // self.width, self.width)

    def propose(self, step, hist: torch.Tensor, m: torch.Tensor, start: torch.Tensor, gamma: int):
        """gamma tokens of a chain; above width 1, each of the gamma draft steps gives a tree level of `width`
        candidates in node order (the chain's token first): greedy, the draft's likeliest; sampled, drawn without
        replacement, each with the distribution it was drawn from. With a shape, its tree (propose_tree)."""
        if self.shape is not None:
            return self.propose_tree(step, hist, m, start)
        # Re-feed the last two committed tokens: after full acceptance the draft has not yet seen its own last
        # token, otherwise re-writing it is a no-op. Always two keeps the shapes fixed (CUDA graphs, no host sync).
        self.cache.rollback(start)
        inp = hist.gather(1, torch.stack([m - 2, m - 1], dim=1))
        tokens, qs = [], []
        for _ in range(gamma):
            out = step(self.model, inp, self.cache, LAST_LOGITS)
            self.cache.advance(inp.shape[1])
            if out.is_floating_point():  # probabilities: sample, keep q for verification
                picks, q = without_replacement(out, self.width)
                qs.append(q)
            else:
                picks = out.clone().view(out.shape[0], -1)  # a graph's output is overwritten by its next replay
            tokens.append(picks)
            inp = picks[:, :1]
        return torch.cat(tokens, 1), (torch.cat(qs, 1) if qs else None)

    def propose_tree(self, step, hist: torch.Tensor, m: torch.Tensor, start: torch.Tensor):
        """The nodes of `shape` after its root (the last committed token), a level per draft step: the step over
        the root (the 2-token re-feed) gives level 1, the step over level d's nodes (each seeing the draft's cache
        and its ancestors only) level d + 1. A node's children are the draft's likeliest at it (greedy) or drawn
        from it without replacement (sampled, with the distributions they were drawn from). The nodes' KV stays
        in the draft's cache until the verification says which path to keep (after_verify)."""
        tree, dev = self.shape, hist.device
        self.cache.rollback(start)
        out = step(self.model, hist.gather(1, torch.stack([m - 2, m - 1], dim=1)), self.cache, LAST_LOGITS)
        self.cache.advance(2)
        self.root = self.cache.lengths - 1
        at = out[:, None]  # per node of the level above: the draft's likeliest ids [B, n, K], or probabilities
        tokens, qs = [], []
        for depth in range(1, tree.depth + 1):
            level = tree.level_on_device(depth, dev)
            if at.is_floating_point():
                n, (B, above, V) = level.candidates, at.shape
                ids, q = without_replacement(at.reshape(B * above, V), n)
                picks = ids.view(B, above, n)[:, level.parent_at, level.rank]
                qs.append(q.view(B, above, n, V)[:, level.parent_at, level.rank])
            else:
                at = at if at.dim() == 3 else at[..., None]  # a width-1 top-k is the argmax [B, n]
                picks = at[:, level.parent_at, level.rank]
            tokens.append(picks)
            if depth < tree.depth:
                at = step(self.model, picks, self.cache, ForwardPlan.drafting(level))
        return torch.cat(tokens, 1), (torch.cat(qs, 1) if qs else None)

    def after_verify(self, verified: torch.Tensor, path: torch.Tensor | None = None) -> None:
        if self.shape is not None and path is not None:  # the accepted nodes' KV to the slots of their positions
            self.cache.keep_path(path, self.root)

    def verify_plan(self, cache, gamma: int) -> ForwardPlan:
        if self.refresh is None:
            return PLAIN
        return ForwardPlan(scores=self.refresh.due())  # every Nth verification also writes its attention

    def after_commit(self, cache) -> None:
        if self.refresh is not None and self.refresh.wrote:
            self.refresh.apply()  # the draft's cache selected again from that attention

    def summary(self) -> dict | None:
        return None if self.refresh is None else {"refreshes": self.refresh.count // self.refresh.every}


def without_replacement(probs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n draws from probs [B, V] without replacement: ids [B, n] and the distribution each was drawn from
    [B, n, V] (probs with the earlier draws removed, renormalized)."""
    ids, qs, q = [], [], probs.clone()
    for j in range(n):
        if j:
            q = q.scatter(1, ids[-1][:, None], 0.0)
            q = q / q.sum(-1, keepdim=True).clamp_min(1e-30)
        qs.append(q)
        ids.append(sample_from(q))
    return torch.stack(ids, 1), torch.stack(qs, 1)


def new_cache(opts: DraftCacheOptions, model, B: int, prefix_len: int, gen_len: int, lookahead: int, dtype, device,
              backend: str):
    """An empty StreamingLLM ring (or, budget 0, a full KVCache) for `model`; with --reindex its attention sees
    positions inside the cache."""
    a = model.args
    if opts.full:
        return KVCache(a.n_layers, B, model.n_kv_heads, opts.slots(prefix_len, gen_len, lookahead), a.head_dim,
                       dtype, device, backend)
    return StreamingCache(a.n_layers, B, model.n_kv_heads, opts.draft_budget, opts.sinks,
                          ring_extra_for(gen_len, lookahead), a.head_dim, dtype, device, backend,
                          model.inv_freq if opts.reindex else None)


def own_prefill(opts: DraftCacheOptions, model, ctx, seed_offset: int, progress_desc: str = "prefill (draft)"):
    """The draft's cache filled by its own prefill of the prompts: through a StreamingLLM ring this is MagicDec's
    second prefill, so the draft's KV is what its windowed attention produces; a selection policy prefills a full
    cache, selects from it and frees it. Random KV in place of the prefill for random-weight speed runs."""
    cfg = ctx.cfg
    B, P = ctx.prompts.shape
    dtype, device = cfg.runtime.torch_dtype, cfg.runtime.torch_device
    seed = None if ctx.random_kv is None else ctx.random_kv + seed_offset
    if opts.selected:
        return draft_cache.select_by_own_prefill(opts.policy(), model, ctx.prompts, cfg.runtime.prefill_chunk,
                                                 appended_for(cfg.workload.gen_len, ctx.lookahead), dtype, ctx.backend,
                                                 cfg.output.progress, seed)
    cache = new_cache(opts, model, B, P, cfg.workload.gen_len, ctx.lookahead, dtype, device, ctx.backend)
    if seed is not None:
        cache.fill_random(P, seed)
    else:
        prefill(model, cache, ctx.prompts, draft_prefill_chunk(cfg.runtime.prefill_chunk, opts.full),
                cfg.output.progress, desc=progress_desc)
    return cache
