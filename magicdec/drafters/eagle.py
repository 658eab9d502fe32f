"""EAGLE (EAGLE-1/2 and EAGLE-3): a feature-level draft (magicdec/model/heads.py). The head keeps its own KV over the
context, fed pairs (the target's feature at position t, the embedding of token t + 1) at position t; after each
verification the accepted positions' target features are fed (the verification's side output), then the head
drafts autoregressively from its own predicted features, the target's LM head (EAGLE-1) or its own norm and LM head
over a reduced vocabulary (EAGLE-3, mapped by d2t) giving the tokens. A chain, or a tree drafted level by level (one
head forward per level over that level's nodes, each seeing its ancestors): a static tree (--tree_width or
--tree_nodes), or EAGLE-2's dynamic tree (--dynamic_tree_nodes N, --dynamic_tree_topk K, depth --gamma;
magicdec/drafters/dynamic_tree.py): per proposal the head expands a frontier of its K most confident nodes per
level and the N - 1 most confident of every candidate drafted are verified with the root. Its topology changes
every step while its shapes do not: the proposal writes it into the verified tree's device tensors
(tree.DynamicTree), which the verification, the acceptance and the KV move read, so the graphs captured once serve
every step, and nothing is read back to the host. At B > 1 the batch shares one topology, ranked by the
confidence summed over its sequences (each sequence its own tokens at each place); at B = 1 it is EAGLE-2's. Its
candidates are the head's top-k, deterministic, so sampled decoding verifies them as point masses (the
multi-candidate rule, as Token Recycling's and SuffixDecoding's trees). EAGLE-3 heads take it as they are (the
confidence is their own softmax over the draft vocabulary, the tokens mapped by d2t). Not with
--synthetic_acceptance (its tree rates are cached per static tree). The cost model prices it at its best case (the
frame's head work, N nodes verified, the yield of Sequoia's best N-node tree: Eagle.predict), so `magicdec plan`
sizes it (N, K) per point beside the chains and static trees.

The head's KV (`--head_kv`): `full`, every position of the context; or `window`, a StreamingLLM ring of
`--head_sinks` sink positions and a recent window (`--head_budget` in all) whose attention sees positions inside the
ring (re-indexed: LongSpec's constant-memory draft), filled from the prompt's sinks and last window alone (a one-layer
head's KV at a position depends on that position's pair only).

Per proposal, fixed shapes: the head re-feeds the last verification's rows from its root (gamma + 1 pairs, or the
tree's accepted path), keeps those up to the bonus token's parent, then drafts."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from magicdec.analysis import cost_model as cm
from magicdec.model import heads
from magicdec.drafters import dynamic_tree
from magicdec.drafters.base import DrafterKind, Part
from magicdec.drafters.model_draft import PLAN_TREES
from magicdec.drafters.head_draft import (FeatureTap, HeadDraft, HeadOptions, Sampler, check_head_files, check_head_run,
                                          graphs_for, head_bytes, head_prediction, level_picks, load_head,
                                          prompt_features, sampler_of, tree_at, untrained_head)
from magicdec.config import cache_slots
from magicdec.errors import MagicDecError
from magicdec.model.forward_plan import ForwardPlan
from magicdec.model.kv_cache import KVCache, StreamingCache
from magicdec.model.tree import MAX_NODES, DynamicTree, Tree, expected_tokens, shaped_tree, write_topology
from magicdec.options import option

HEAD_KV = ("full", "window")
PREPARE_CHUNK = 256  # pairs per head forward while the prompt is fed (a ring holds a chunk past its window)


# what `magicdec plan` composes: the head's KV (full, or a window of these budgets), and model_draft's trees or
# EAGLE-2's dynamic tree of these many verified nodes at EAGLE-2's K (few: the planner checks and predicts each at
# every gamma; those the frame or the candidates cannot hold at a gamma are skipped there by check_dynamic)
PLAN_WINDOWS = (256, 1024)
PLAN_DYNAMIC_NODES = (16, 32, 64)
PLAN_DYNAMIC_TOPK = 10


@dataclass(frozen=True)
class Config(HeadOptions):
    head_kv: str = option("full", "the EAGLE head's own KV over the context: full (every position) or window (a "
                                  "StreamingLLM ring of --head_budget positions, attention re-indexed inside it: "
                                  "constant memory)", choices=HEAD_KV)
    head_budget: int = option(256, "--head_kv window: positions the head's ring keeps (sinks + recent window)")
    head_sinks: int = option(4, "--head_kv window: sink positions kept at the start")
    eagle3: bool = option(False, "a fresh head (no --head) is EAGLE-3's: fc over several target layers, its own norm "
                                 "and LM head")
    eagle3_layers: tuple = option((), "a fresh EAGLE-3 head's target layers (hidden-state taps: the inputs of those "
                                      "layers; default 2, n/2, n-3 as EAGLE-3)", parse=int, nargs="+")
    draft_vocab: int = option(0, "a fresh EAGLE-3 head's draft vocabulary (0: the target's)")
    dynamic_tree_nodes: int = option(0, "EAGLE-2's dynamic draft tree: verify this many nodes (the root included, "
                                        "at most 64), chosen per step as the head's most confident of its candidates "
                                        "(depth --gamma); 0: off (a chain, or --tree_width / --tree_nodes' tree)")
    dynamic_tree_topk: int = option(10, "--dynamic_tree_nodes: the K of EAGLE-2's expansion: each frontier node's "
                                        "K likeliest children are candidates, the next frontier the K most "
                                        "confident of them")

    @property
    def window(self) -> bool:
        return self.head_kv == "window"

    def window_slots(self, lookahead: int) -> int:
        """Slots of the head's ring (--head_kv window): its budget and what one forward may write ahead of it (a
        prompt chunk, or a verification's rows); attention reads them all, masked."""
        return self.head_budget + max(PREPARE_CHUNK, 2 * (lookahead + 2))


@dataclass(frozen=True)
class HeadShape:
    """What an EAGLE head's draft work depends on beyond the target's shapes."""
    layers: int  # decoder layers (EAGLE-3: 1)
    eagle3: bool  # attention over 2 dim-wide inputs, fc over the taps at the catch-up only, its own LM head
    taps: int  # target layers fc reads (EAGLE-3)
    lm_vocab: int  # the LM head's rows: the target's vocabulary, or EAGLE-3's draft vocabulary


def head_shape(d: Config, target) -> HeadShape:
    """The head's shape: --head's config.json (only what does not depend on the target's size, so a prediction at
    another model's shapes reads it too), else the fresh head's options."""
    if d.head:
        found = heads.detect(Path(d.head))
        c = heads.read_config(Path(d.head))
        if found == "eagle3":
            taps = c.get("eagle_aux_hidden_state_layer_ids") or heads.eagle3_default_taps(target.n_layers)
            vocab = min(int(c.get("draft_vocab_size", target.vocab_size)), target.vocab_size)
            return HeadShape(1, True, len(taps), vocab)
        return HeadShape(int(c.get("num_hidden_layers", 1)), False, 1, target.vocab_size)
    if d.eagle3:
        taps = d.eagle3_layers or heads.eagle3_default_taps(target.n_layers)
        return HeadShape(1, True, len(taps), min(d.draft_vocab or target.vocab_size, target.vocab_size))
    return HeadShape(1, False, 1, target.vocab_size)


def draft_seconds(shape: HeadShape, target, device, B: int, context: int, sizes: list[int], sampled: bool) -> float:
    """Seconds of one proposal's draft work (EagleDraft.propose), `sizes` the nodes per level of what it drafts (the
    root's 1, then 1 per drafted token of a chain, or a tree's levels): the catch-up forward over the last
    verification's gamma + 1 rows, then one forward per level but the last. Each forward is a step of a one-layer
    model of the target's shapes (heads.head_args: the head is one such decoder layer; step_time counts its
    weights, its KV over `context` slots, attention's FLOPs and one layer's fixed cost) whose LM head (the
    target's, read whole each time) runs only over the rows the next level's tokens come from: the catch-up's over
    the root (one row per sequence, its other rows only refill the head's KV), a level's over its nodes. EAGLE-1
    also runs fc (2 dim -> dim, a bias) in every forward; EAGLE-3 runs fc over its taps in the catch-up only (its
    later forwards feed its own features), its attention reads a 2 dim input (q, k and v twice as wide), and its
    LM head is its own over its draft vocabulary. Not counted: norms, the embedding gather, the feature tap's
    copies (small beside a layer and an LM head)."""
    a = target
    one = replace(heads.head_args(a, shape.layers), vocab_size=shape.lm_vocab)
    qkv = a.dim * (a.n_heads + 2 * a.n_kv_heads) * a.head_dim * shape.layers  # EAGLE-3's second input half

    def forward(T: int, logit_rows: int) -> float:
        extra = cm.linear_time(device, qkv, B * T) if shape.eagle3 else \
            cm.linear_time(device, 2 * a.dim * a.dim + a.dim, B * T)
        return cm.step_time(one, device, B, context, T, sampled, logit_rows=logit_rows) + extra

    gamma = len(sizes) - 1
    seconds = forward(gamma + 1, B)
    if shape.eagle3:
        seconds += cm.linear_time(device, shape.taps * a.dim * a.dim, B * (gamma + 1))
    return seconds + sum(forward(n, B * n) for n in sizes[1:-1])


def head_cache(head, B: int, slots: int, window: bool, budget: int, sinks: int, max_new: int, dtype, device, backend):
    a = head.args
    if window:
        return StreamingCache(a.n_layers, B, a.n_kv_heads, budget, sinks, max_new, a.head_dim, dtype, device, backend,
                              head.inv_freq)
    return KVCache(a.n_layers, B, a.n_kv_heads, slots, a.head_dim, dtype, device, backend)


def feed(head, cache, features: torch.Tensor, next_ids: torch.Tensor, embed, chunk: int = PREPARE_CHUNK) -> None:
    """Pairs (features [B, n, F], next_ids [B, n]) at the cache's next n positions, in chunks."""
    for s in range(0, next_ids.shape[1], chunk):
        head(features[:, s:s + chunk], next_ids[:, s:s + chunk], embed, cache)
        cache.advance(next_ids[:, s:s + chunk].shape[1])


def prompt_positions(P: int, window: bool, budget: int, sinks: int) -> torch.Tensor:
    """The prompt positions whose target features the head needs: all, or a window's sinks and last positions (the
    last, P - 1, is the first verification's root)."""
    if not window or budget >= P:
        return torch.arange(P)
    return torch.cat([torch.arange(sinks), torch.arange(P - 1 - (budget - sinks), P)])


class EagleDraft(HeadDraft):
    dynamic = None  # (nodes, K) of EAGLE-2's dynamic tree (--dynamic_tree_nodes), or None
    frame = None  # ... the tree its last proposal wrote (a DynamicTree: its depth that proposal's gamma)

    def __init__(self, head: heads.EagleHead, cache, tap: FeatureTap, embed: torch.Tensor, lm_head: torch.Tensor,
                 sampler: Sampler, vocab: int):
        self.head, self.cache, self.tap, self.embed, self.lm_head = head, cache, tap, embed, lm_head
        self.sampler, self.vocab = sampler, vocab

    @classmethod
    def over_prompt(cls, head, target, prompts: torch.Tensor, features: torch.Tensor, sampler: Sampler, lookahead: int,
                    gen_len: int, window: bool = False, budget: int = 256, sinks: int = 4, backend: str = "sdpa",
                    random_seed: int | None = None):
        """The draft over a prefilled prompt: features [B, n, F] at prompt_positions(P, window, budget, sinks)."""
        B, P = prompts.shape
        dtype, device = features.dtype, features.device
        max_new = max(PREPARE_CHUNK, 2 * (lookahead + 2))
        cache = head_cache(head, B, cache_slots(P, gen_len, lookahead), window, budget, sinks, max_new, dtype,
                           device, backend)
        taps = head.taps(target.args.n_layers)
        tap = FeatureTap(taps, B, lookahead + 1, features.shape[-1], dtype, device)
        embed = target.tok_embeddings.weight
        draft = cls(head, cache, tap, embed, target.output.weight, sampler, target.args.vocab_size)
        if random_seed is not None:  # random KV stood in for the prefill: the head's too
            cache.fill_random(P - 1, random_seed)
        else:
            pos = prompt_positions(P, window, budget, sinks).to(device)
            ids = prompts[:, 1:]
            if pos.numel() == P:
                feed(head, cache, features[:, :P - 1], ids, embed)
            else:  # the sinks, then the window up to P - 2
                feed(head, cache, features[:, :sinks], ids[:, :sinks], embed, max_new)
                cache.lengths.fill_(int(pos[sinks]))
                feed(head, cache, features[:, sinks:-1], ids[:, int(pos[sinks]):], embed, max_new)
        tap.start(features[:, -1], torch.full((B,), P - 1, dtype=torch.long, device=device))
        return draft

    def _tokens(self, hidden: torch.Tensor, n: int = 1):
        """Draft ids in the target's vocabulary [R, n] and their q over it [R, n, V] (or None) from predicted
        features [R, H]."""
        ids, q = self.sampler.pick(self.head.logits(hidden, self.lm_head), n)
        if q is not None and q.shape[-1] != self.vocab:  # EAGLE-3's draft vocabulary, spread over the target's
            full = q.new_zeros(*q.shape[:-1], self.vocab)
            q = full.scatter_(-1, self.head.to_target(torch.arange(q.shape[-1], device=q.device)).expand_as(q), q)
        return self.head.to_target(ids), q

    def _catch_up(self, hist, m, start) -> torch.Tensor:
        """Feed the last verification's target features (rows at root ..) with the tokens after them; keep the head's
        cache up to the bonus token's parent (position start); return the predicted feature at the bonus token."""
        rows, root = self.tap.rows, self.tap.root
        R = rows.shape[1]
        a = (start - root).clamp(0, R - 1)  # the row of the bonus token's parent
        cols = (m - 1 - a)[:, None] + torch.arange(R, device=hist.device)  # the token after each row's position
        ids = hist.gather(1, cols.clamp(0, hist.shape[1] - 1))
        self.cache.rollback(root)
        out = self.head(rows, ids, self.embed, self.cache)
        self.cache.rollback(start + 1)
        return out.gather(1, a[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]

    def propose(self, step, hist, m, start, gamma: int):
        if self.dynamic is not None:  # its tensors made here, before a graph captures the proposal's writes to them
            self.frame = DynamicTree(self.dynamic[0], gamma, self.dynamic[1])
            self.frame.on_device(hist.device)
        return super().propose(step, hist, m, start, gamma)

    def tree_for(self, tokens: int):
        return self.frame if self.dynamic is not None else super().tree_for(tokens)

    def _dynamic(self, h: torch.Tensor, depth: int):
        """EAGLE-2's tree from the predicted feature at the root h [B, H] (dynamic_tree.draft), its topology written
        into the verified tree's tensors: (tokens [B, N - 1], None: every candidate deterministic)."""
        nodes, K = self.dynamic
        hidden = h[:, None]  # the predicted feature at each node of the frontier last fed (the root's)

        def grow(level, ids):
            nonlocal hidden
            hidden = self.head(hidden[:, level.parent_at], self.head.to_target(ids), self.embed, self.cache,
                               plan=ForwardPlan.drafting(level))
            return self.head.logits(hidden, self.lm_head)

        ids, parents = dynamic_tree.draft(self.head.logits(h, self.lm_head), grow, K, depth, nodes)
        write_topology(DynamicTree(nodes, depth, K).on_device(h.device), parents)
        return self.head.to_target(ids), None

    def draft_tokens(self, hist, m, start, gamma: int):
        h = self._catch_up(hist, m, start)
        if self.dynamic is not None:
            return self._dynamic(h, gamma)
        tree = tree_at(self, gamma)
        tokens, qs = [], []
        if tree is None:
            for k in range(gamma):
                ids, q = self._tokens(h)
                tokens.append(ids)
                qs.append(q)
                if k + 1 < gamma:
                    h = self.head(h[:, None], ids, self.embed, self.cache)[:, 0]
                    self.cache.advance(1)
            return torch.cat(tokens, 1), (None if qs[0] is None else torch.cat(qs, 1))
        hidden = h[:, None]  # [B, n, H]: the predicted feature at each node of the level above (the root's)
        for depth in range(1, tree.depth + 1):
            level = tree.level_on_device(depth, h.device)
            B, above, H = hidden.shape
            logits = self.head.logits(hidden, self.lm_head)
            picks, q = level_picks(logits, level, self.sampler)
            picks = self.head.to_target(picks)
            if q is not None and q.shape[-1] != self.vocab:
                full = q.new_zeros(*q.shape[:-1], self.vocab)
                q = full.scatter_(-1, self.head.to_target(torch.arange(q.shape[-1], device=q.device)).expand_as(q), q)
            tokens.append(picks)
            qs.append(q)
            if depth < tree.depth:
                hidden = self.head(hidden[:, level.parent_at], picks, self.embed, self.cache,
                                   plan=ForwardPlan.drafting(level))
        return torch.cat(tokens, 1), (None if qs[0] is None else torch.cat(qs, 1))


class Eagle(DrafterKind):
    name = "eagle"
    aliases = ("eagle3",)
    description = ("EAGLE: a one-layer feature-level draft head over the target's hidden states (EAGLE-3: several "
                   "layers'), with its own KV over the context (--head_kv full or window)")
    Config = Config
    supports_auto_gamma = False
    supports_trees = drafts_shaped_trees = True
    example = {"head_kv": "window", "head_budget": 24, "head_sinks": 4}
    variants = ({}, {"head_kv": "window"})
    family = "eagle"

    def label(self, draft) -> str:
        who = Path(draft.head).name if draft.head else ("fresh eagle3" if draft.eagle3 else "fresh")
        return f"{self.name} {who}" + (f" window {draft.head_budget}" if draft.window else "") + \
            (f" dynamic {draft.dynamic_tree_nodes} k{draft.dynamic_tree_topk}" if draft.dynamic_tree_nodes else "")

    def untrained(self, cfg) -> str | None:
        return untrained_head(cfg, "eagle3" if cfg.draft.eagle3 else self.family)

    def describe(self, cfg) -> str:
        d = cfg.draft
        kv = f"a re-indexed window of {d.head_budget}" if d.window else "its full KV"
        return f"a feature-level head ({d.head or 'fresh'}) over the target's hidden states, {kv}"

    def check(self, cfg) -> None:
        super().check(cfg)
        check_head_run(cfg, self.name)
        d = cfg.draft
        if d.window:
            if d.head_sinks < 0 or d.head_budget <= d.head_sinks:
                raise MagicDecError(f"--head_budget {d.head_budget} must exceed --head_sinks {d.head_sinks} (>= 0): the "
                                    "ring holds the sinks and a recent window")
        elif d.head_budget != 256 or d.head_sinks != 4:
            raise MagicDecError("--head_budget and --head_sinks size the head's window: give --head_kv window")
        if d.head and (d.eagle3 or d.eagle3_layers or d.draft_vocab):
            raise MagicDecError("--eagle3, --eagle3_layers and --draft_vocab shape a fresh head; --head's checkpoint "
                                "says its own (drop them, or drop --head)")
        if (d.eagle3_layers or d.draft_vocab) and not d.eagle3:
            raise MagicDecError("--eagle3_layers and --draft_vocab shape a fresh EAGLE-3 head: add --eagle3")
        check_dynamic(cfg)

    def check_models(self, cfg, target, models) -> None:
        d = cfg.draft
        check_head_files(cfg, target, ("eagle", "eagle3"), self.name)
        vocab = head_shape(d, target).lm_vocab
        if d.dynamic_tree_nodes and d.dynamic_tree_topk > vocab:
            raise MagicDecError(f"--dynamic_tree_topk {d.dynamic_tree_topk}: more than the head's {vocab} tokens; "
                                f"give {vocab} or less")
        if d.eagle3 and not d.head:
            heads.check_taps(d.eagle3_layers or heads.eagle3_default_taps(target.n_layers), target.n_layers,
                             "--eagle3_layers")
            if d.draft_vocab and not 1 <= d.draft_vocab <= target.vocab_size:
                raise MagicDecError(f"--draft_vocab {d.draft_vocab}: must be 1..{target.vocab_size} (the target's)")

    def lookahead(self, cfg) -> int:
        """A dynamic tree's verified nodes, or the head's frame (K nodes per level it feeds), past gamma."""
        d, s = cfg.draft, cfg.speculation
        if not d.dynamic_tree_nodes:
            return 0
        frame = dynamic_tree.frame_size(d.dynamic_tree_topk, s.largest) - 1
        return max(d.dynamic_tree_nodes - 1, frame) - s.nodes

    def memory(self, cfg, target, models, rank) -> list[Part]:
        d, w = cfg.draft, cfg.workload
        slots = d.window_slots(cfg.lookahead) if d.window else cache_slots(w.prefix_len, w.gen_len, cfg.lookahead)
        item = torch.empty((), dtype=cfg.runtime.torch_dtype).element_size()
        # the prompt's features the head is fed (over random KV, the last position's only: its KV is random too)
        n = 1 if cfg.runtime.skip_prefill else len(prompt_positions(w.prefix_len, d.window, d.head_budget, d.head_sinks))
        taps = len(self._taps(cfg, target))
        # the head's KV as slots of a one-layer model of the target's shape; the prompt's kept features as KV bytes
        return [Part(heads.head_args(target, 1), False, slots, head_bytes(cfg, target, self.family),
                     kv_bytes=n * taps * target.dim * item)]

    def _taps(self, cfg, target) -> tuple[int, ...]:
        d = cfg.draft
        if d.head:
            return heads.load(Path(d.head), target, check_only=True).taps(target.n_layers)
        if d.eagle3:
            return tuple(d.eagle3_layers) or heads.eagle3_default_taps(target.n_layers)
        return (heads.final_tap(target.n_layers),)

    def prefill_features(self, cfg, target):
        d, P = cfg.draft, cfg.workload.prefix_len
        return self._taps(cfg, target), prompt_positions(P, d.window, d.head_budget, d.head_sinks)

    def prepare(self, cfg, ctx) -> EagleDraft:
        d = cfg.draft
        head = load_head(cfg, ctx, self.family)
        B, P = ctx.prompts.shape
        taps = head.taps(ctx.target.args.n_layers)
        features = prompt_features(ctx, taps, prompt_positions(P, d.window, d.head_budget, d.head_sinks))
        draft = EagleDraft.over_prompt(head, ctx.target, ctx.prompts, features, sampler_of(cfg), ctx.lookahead,
                                       cfg.workload.gen_len, d.window, d.head_budget, d.head_sinks, ctx.backend,
                                       None if ctx.random_kv is None else ctx.random_kv + 2)
        draft.dynamic = (d.dynamic_tree_nodes, d.dynamic_tree_topk) if d.dynamic_tree_nodes else None
        draft.use_graphs(graphs_for(cfg))
        return draft

    def options(self, cfg, target, device) -> list[dict]:
        kv = [{}] + [{"head_kv": "window", "head_budget": b} for b in PLAN_WINDOWS]
        dynamic = tuple({"dynamic_tree_nodes": n, "dynamic_tree_topk": PLAN_DYNAMIC_TOPK} for n in PLAN_DYNAMIC_NODES)
        return [k | t for k in kv for t in PLAN_TREES + dynamic]

    def predict(self, cfg, target, models, device, alpha, gamma, lookahead, summary=None) -> dict | None:
        """The draft step T_D is one proposal's head work (draft_seconds) over gamma (head_prediction). The head's
        KV is the whole context (--head_kv full: T_D grows with it, one layer's worth of the target's reads) or its
        ring's slots (window: the budget and the ring's spare slots, read masked as a StreamingLLM draft's are,
        whatever the prefix).

        EAGLE-2's dynamic tree (N nodes, K, depth gamma): its shape changes every step, so it is priced at its best
        case. The draft is its frame: the catch-up, then gamma - 1 forwards over K frontier nodes each (the LM head
        over those K rows), as EagleDraft._dynamic feeds it. The verification is over N nodes. The yield is that of
        the best tree of N nodes, gamma levels and K children per node at most (Sequoia's, tree.optimal_tree) at
        alpha for a node's first child and the later children's rates: EAGLE-2 verifies the N candidates its head
        is most confident of, and were its confidence ranks the acceptance ranks, that is the best N-node tree. They
        are not (and its frontier holds K nodes per level, a bound Sequoia's tree does not keep), so this is an
        upper bound of its yield. The later children's rates are --synthetic_siblings (the planner's per-option
        siblings; a sweep's check of a measured run, its measured ones); without them, None, as a static tree's: a
        tree's yield rests on its siblings' rates, and none is assumed."""
        d, w = cfg.draft, cfg.workload
        kv = d.window_slots(lookahead) if d.window else w.prefix_len + w.gen_len // 2
        shape = head_shape(d, target)

        def seconds(sizes, sampled):
            return draft_seconds(shape, target, device, w.B, kv, sizes, sampled)
        if not d.dynamic_tree_nodes:
            return head_prediction(cfg, target, device, alpha, gamma, seconds)
        siblings = cfg.speculation.synthetic_siblings
        if not siblings:
            return None
        N, K = d.dynamic_tree_nodes, d.dynamic_tree_topk
        rates = (alpha, *siblings)
        best = shaped_tree(rates, N, gamma, K)
        # EAGLE-2 verifies N nodes even where fewer reach the best yield (the rest adding nothing): T_V counts all N
        verified = Tree(best.parents + (0,) * (N - best.size))
        p = head_prediction(cfg, target, device, alpha, gamma, seconds, tree=verified, sizes=[1] + [K] * gamma)
        return cm.with_draft_step(p | {"omega": expected_tokens(best, rates)}, gamma, p["T_D"])


def check_dynamic(cfg) -> None:
    """--dynamic_tree_nodes and --dynamic_tree_topk, before anything is allocated."""
    d, s = cfg.draft, cfg.speculation
    N, K = d.dynamic_tree_nodes, d.dynamic_tree_topk
    if not N:
        if K != Config.dynamic_tree_topk:
            raise MagicDecError("--dynamic_tree_topk shapes EAGLE-2's dynamic tree: give --dynamic_tree_nodes N too")
        return
    if not 2 <= N <= MAX_NODES:
        raise MagicDecError(f"--dynamic_tree_nodes {N}: must be 2..{MAX_NODES} (the verified nodes, the root included; "
                            f"the attention kernel's mask holds {MAX_NODES}), or 0 for no dynamic tree")
    if K < 1:
        raise MagicDecError(f"--dynamic_tree_topk {K}: must be at least 1 (the children per frontier node and the "
                            "frontier's width; EAGLE-2's is 10)")
    if s.tree_width > 1 or s.tree_nodes:
        raise MagicDecError("--dynamic_tree_nodes and --tree_width / --tree_nodes all shape the tree: give one of them")
    if s.synthetic_acceptance is not None:
        raise MagicDecError("--dynamic_tree_nodes with --synthetic_acceptance: synthetic rates are per static tree "
                            "(its sibling ranks); drop one of them")
    frame = dynamic_tree.frame_size(K, s.largest)
    if frame > MAX_NODES:
        raise MagicDecError(f"--dynamic_tree_topk {K} at --gamma {s.largest}: the head feeds a frame of {frame} nodes "
                            f"(1 + K x (gamma - 1)), at most {MAX_NODES}; lower --dynamic_tree_topk or --gamma")
    drafted = dynamic_tree.candidates(K, min(s.gammas))
    if N - 1 > drafted:
        raise MagicDecError(f"--dynamic_tree_nodes {N}: the root and {N - 1} drafted nodes, but --gamma "
                            f"{min(s.gammas)} and --dynamic_tree_topk {K} draft {drafted} candidates (K + (gamma - 1) "
                            "x K^2); lower it or raise one of those")


DRAFTER = Eagle()
