"""What the three trained-head drafters share (Medusa, Hydra, EAGLE; magicdec/model/heads.py holds the heads): the `--head`
options, the checks of a head against the target before anything large is allocated, the head loaded or made fresh,
the feature tap (the target's hidden states a head reads, asked of each verification and kept along the accepted
path), and how a head's distribution becomes drafted tokens (greedy, or sampled with the q the verification
needs)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from magicdec.analysis import cost_model as cm
from magicdec.model import heads
from magicdec.drafters.base import DrafterKind, Part
from magicdec.drafters.model_draft import PLAN_TREES, tree_of, without_replacement
from magicdec.errors import MagicDecError
from magicdec.model.forward_plan import FeatureRequest, ForwardPlan
from magicdec.decoding.generate import Drafter, GraphedStep, prefill_features
from magicdec.model.kv_cache import KVCache
from magicdec.options import option
from magicdec.decoding.sampling import probabilities, sample_from
from magicdec.model.tree import Tree


@dataclass(frozen=True)
class HeadOptions:
    head: str | None = option(None, "a trained head: the directory of its published checkpoint (Medusa: config.json "
                                    "+ medusa_lm_head.pt; Hydra: config.json + hydra_lm_head.pt; EAGLE / EAGLE-3: "
                                    "config.json + pytorch_model.bin or model.safetensors; magicdec/model/heads.py). "
                                    "Without it a fresh head at the target's shapes, initialised as its family's "
                                    "training starts (speed runs)", metavar="DIR")
    head_seed: int = option(0, "the seed of a fresh head's weights (no --head)")
    head_candidates: int = option(64, "sampled decoding: a head draws from its K likeliest tokens, top-p and top-k "
                                      "applied among them (the draft's distribution is its own choice: the "
                                      "verification reads it, so the output stays the target's). 0: the whole "
                                      "vocabulary (a sort of every row of logits per drafted level)")


@dataclass(frozen=True)
class KHeadsConfig(HeadOptions):
    num_heads: int = option(4, "a fresh Medusa / Hydra head's number of heads (--head: its checkpoint's); gamma, or "
                               "a tree's depth, is at most this")


class Sampler:
    """How a head's logits become drafted tokens: greedy, the likeliest (top-n for a tree's candidates); sampled,
    drawn from the run's distribution (temperature, top-p, top-k) without replacement, with the q each was drawn
    from (the verification's). With `candidates` K the distribution is the run's over the K likeliest tokens: one
    top-k selection per row instead of top-p's sort of the whole vocabulary."""

    def __init__(self, greedy: bool, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 candidates: int = 0):
        self.greedy, self.temperature, self.top_p, self.top_k = greedy, temperature, top_p, top_k
        self.candidates = candidates

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """[R, V] fp32: the distribution a head draws from."""
        if not 0 < self.candidates < logits.shape[-1]:
            return probabilities(logits, self.temperature, self.top_p, self.top_k)
        values, ids = torch.topk(logits, self.candidates)
        among = probabilities(values, self.temperature, self.top_p, self.top_k)
        return torch.zeros(logits.shape, dtype=among.dtype, device=logits.device).scatter_(-1, ids, among)

    def pick(self, logits: torch.Tensor, n: int = 1):
        """logits [R, V] -> (ids [R, n], q [R, n, V] or None)."""
        if self.greedy:
            return torch.topk(logits, n).indices, None
        p = self.probabilities(logits)
        if n == 1:
            ids = sample_from(p)[:, None]
            return ids, p[:, None]
        return without_replacement(p, n)


def graphs_for(cfg) -> bool:
    """Whether a head's proposal replays as a CUDA graph: --step_mode cuda_graphs on a GPU."""
    return cfg.runtime.step_mode == "cuda_graphs" and cfg.runtime.torch_device.type == "cuda"


def sampler_of(cfg) -> Sampler:
    d = cfg.decoding
    return Sampler(d.greedy, d.temperature, d.top_p, d.top_k, cfg.draft.head_candidates)


def tree_at(drafter, depth: int):
    """The tree a head drafter drafts `depth` levels deep: its --tree_nodes shape, else above width 1 the chain with
    width - 1 candidates beside each position; None: a chain."""
    if drafter.shape is not None:
        return drafter.shape
    return None if drafter.width == 1 else Tree.chain_with_siblings(depth, drafter.width)


def level_sizes(tree, gamma: int) -> list[int]:
    """Nodes per level of what a head drafts, the root's first: 1 per drafted token of a chain (tree None), or a
    tree's levels (for the cost model)."""
    return [1] * (gamma + 1) if tree is None else [len(level) for level in tree.levels]


def head_prediction(cfg, target, device, alpha: float, gamma: int, proposal_seconds, tree=None,
                    sizes: list[int] | None = None) -> dict | None:
    """A head drafter's prediction: the target's step and verification as for any draft (cost_model.predict, a tree
    at its later candidates' rates), T_D one proposal's head work (`proposal_seconds(level_sizes, sampled)`) and
    the device's fitted fixed cost per drafted level (Device.head_level_s, and sampled its pick, Device.pick_s) over
    gamma, so that gamma T_D is a proposal's. None for a tree without those rates (--synthetic_siblings), as a
    model draft's. `tree` and `sizes` stand in for the config's verified tree and the levels drafted where the
    drafter verifies what it did not draft level for level (EAGLE-2's dynamic tree: a frame of K nodes per level, a
    best-case tree verified)."""
    w = cfg.workload
    tree = tree_of(cfg, gamma) if tree is None else tree
    if tree is False:
        return None
    sampled = not cfg.decoding.greedy
    p = cm.predict(target, device, w.B, w.prefix_len + w.gen_len // 2, gamma, alpha, 0, None, 0, sampled, tree=tree,
                   sibling_rates=cfg.speculation.synthetic_siblings)
    sizes = sizes or level_sizes(tree, gamma)
    pick = device.pick_s.get("candidates" if cfg.draft.head_candidates else "vocabulary") if sampled else None
    work = proposal_seconds(sizes, sampled and pick is None)  # a fitted pick stands in for the per-logit count
    fixed = (len(sizes) - 1) * (device.head_level_s.get(cfg.drafter.name, 0.0) + (pick or 0.0))
    return cm.with_draft_step(p, gamma, (work + fixed) / gamma)


def level_picks(logits: torch.Tensor, level, sampler: Sampler):
    """A tree level's tokens from the logits at each node of the level above ([B, n_above, V]): a node's children
    are its likeliest (greedy) or drawn without replacement (sampled): ids [B, n], q [B, n, V] or None."""
    B, above, V = logits.shape
    ids, q = sampler.pick(logits.reshape(B * above, V), level.candidates)
    picks = ids.view(B, above, -1)[:, level.parent_at, level.rank]
    if q is not None:
        q = q.view(B, above, -1, V)[:, level.parent_at, level.rank]
    return picks, q


class FeatureTap:
    """The target's hidden states a head reads, asked of each verification (`verify_plan`: the plan's features
    request, a static buffer) and kept along the accepted path (`after_verify`, `after_commit`): `rows` [B, R, F]
    holds them at positions root .. root + R - 1, where root is the target's cache length at the verification.
    `rows` and `root` live in fixed buffers (a CUDA graph of the proposal reads them where it was captured); `begin`
    puts back what `start` kept, so every generation from the prompt starts alike."""

    def __init__(self, taps: tuple[int, ...], B: int, longest: int, width: int, dtype, device):
        self.request = FeatureRequest(tuple(taps), torch.zeros(B, longest, width, dtype=dtype, device=device))
        self.kept = torch.zeros(B, longest, width, dtype=dtype, device=device)
        self.root = torch.zeros(B, dtype=torch.long, device=device)
        self.rows = self.kept[:, :1]
        self.first = self.first_root = self.path = None

    def start(self, last: torch.Tensor, root: torch.Tensor) -> None:
        """Before the first verification: the prompt's last feature [B, F] at position root [B]."""
        self.first, self.first_root = last.clone(), root.clone()
        self.begin()

    def begin(self) -> None:
        self.keep(self.first[:, None])
        self.root.copy_(self.first_root)

    def keep(self, rows: torch.Tensor) -> None:
        self.rows = self.kept[:, :rows.shape[1]]
        self.rows.copy_(rows)

    def verify_plan(self, cache) -> ForwardPlan:
        self.root.copy_(cache.lengths)
        return ForwardPlan(features=self.request)

    def after_verify(self, path) -> None:
        self.path = path

    def after_commit(self, T: int) -> None:
        out = self.request.out[:, :T]
        if self.path is not None:  # a tree's accepted path, in depth order
            out = out.gather(1, self.path[..., None].expand(-1, -1, out.shape[-1]))
        self.keep(out)
        self.path = None

    def at(self, p: torch.Tensor) -> torch.Tensor:
        """[B, F]: the feature at position p [B] (kept rows; a stopped sequence's clamped inside them)."""
        i = (p - self.root).clamp(0, self.rows.shape[1] - 1)
        return self.rows.gather(1, i[:, None, None].expand(-1, 1, self.rows.shape[-1]))[:, 0]


def check_head_files(cfg, target, families: tuple[str, ...], name: str):
    """Before anything large is allocated: the --head files are of this drafter's family and fit the target."""
    d = cfg.draft
    if not d.head:
        return None
    found = heads.detect(Path(d.head))
    if found not in families:
        raise MagicDecError(f"--head {d.head} holds a {found} head, not a {name} one: use --drafter "
                            f"{'eagle' if found.startswith('eagle') else found} (or a {name} checkpoint)")
    return heads.load(Path(d.head), target, found, check_only=True)


def prompt_features(ctx, taps: tuple[int, ...], positions: torch.Tensor) -> torch.Tensor:
    """[B, n, F]: the target's features at the prompt positions a head asked for: what the prefill kept
    (PrepareContext.features), or, where a shared prefill kept none (compare, sweeps), a second pass of the target
    over the prompt into a scratch cache (its cost and memory: a prefill's)."""
    kept = ctx.feature_positions
    if ctx.features is not None and kept is not None:
        if ctx.random_kv is not None:  # random KV stood in for the prefill: the last position's only
            return ctx.features[:, -1:].expand(-1, positions.numel(), -1)
        where = {int(p): i for i, p in enumerate(kept.tolist())}
        if ctx.features.shape[-1] == len(taps) * ctx.target.args.dim and all(int(p) in where for p in positions):
            return ctx.features[:, [where[int(p)] for p in positions]]
    a, (B, P) = ctx.target.args, ctx.prompts.shape
    if ctx.random_kv is not None:  # random KV stood in for the prefill (speed runs): a random feature stands in too
        gen = torch.Generator(device=ctx.prompts.device).manual_seed(ctx.random_kv + 1)
        last = torch.randn(B, 1, len(taps) * a.dim, generator=gen, device=ctx.prompts.device,
                           dtype=ctx.cfg.runtime.torch_dtype)
        return last.expand(-1, positions.numel(), -1)
    scratch = KVCache(a.n_layers, B, ctx.target.n_kv_heads, P, a.head_dim, ctx.cfg.runtime.torch_dtype,
                      ctx.prompts.device, ctx.backend)
    ctx.notes["head_features"] = "a second target pass over the prompt (the shared prefill kept no features)"
    return prefill_features(ctx.target, scratch, ctx.prompts, ctx.cfg.runtime.prefill_chunk, taps, positions)[1]


def hidden_offset(cfg) -> int:
    """Hydra's hidden_state_offset (a tap below the final norm), read from --head's config; 0 otherwise."""
    if not cfg.draft.head:
        return 0
    import json

    try:
        return int(json.loads((Path(cfg.draft.head) / "config.json").read_text()).get("hidden_state_offset", 0))
    except (OSError, ValueError):
        return 0


def untrained_head(cfg, family: str) -> str | None:
    """DrafterKind.untrained for a head drafter: None where --head names a trained head."""
    if cfg.draft.head:
        return None
    return (f"untrained: no alpha to measure (train one: magicdec train-head --family {family} --out DIR; then "
            f"--head DIR, or magicdec compare --heads over a folder of them)")


def check_head_run(cfg, name: str) -> None:
    """Checks that need no file: heads read one process's hidden states; a head's candidates are a count."""
    if len(cfg.runtime.rank_group) > 1:
        raise MagicDecError(f"--drafter {name}: a trained head reads the target's hidden states on one process; run it "
                            "with --rank_group 0 (no tensor parallelism)")
    if cfg.runtime.offload:
        raise MagicDecError(f"--drafter {name} with --offload: not supported (give one or the other)")
    if cfg.draft.head_candidates < 0:
        raise MagicDecError(f"--head_candidates {cfg.draft.head_candidates}: give a positive count of a head's likeliest "
                            "tokens to draw among, or 0 for the whole vocabulary")


def check_depth(cfg, num_heads: int, name: str) -> None:
    """gamma (a chain) or a tree's depth within the heads."""
    s = cfg.speculation
    deepest = s.largest
    if deepest > num_heads:
        raise MagicDecError(f"--gamma {deepest}: {name} drafts at most one token per head and has {num_heads} heads; "
                            f"give --gamma {num_heads} or less (or a head with more heads)")


def fresh_head(cfg, target_args, family: str, target=None):
    d = cfg.draft
    if family in ("eagle", "eagle3"):
        return heads.new_head(family, target_args, layers=getattr(d, "eagle3_layers", None) or None,
                              draft_vocab=getattr(d, "draft_vocab", 0) or None, seed=d.head_seed, init="identity")
    return heads.new_head(family, target_args, num_heads=d.num_heads, grounded=True, seed=d.head_seed, target=target,
                          init="identity")


def head_bytes(cfg, target, family: str) -> int:
    """The head's weights in the run's dtype (a fresh one's at its shapes; a checkpoint's from its files)."""
    item = torch.empty((), dtype=cfg.runtime.torch_dtype).element_size()
    if cfg.draft.head:
        return heads.weight_bytes(heads.load(Path(cfg.draft.head), target, check_only=True), item)
    with torch.device("meta"):
        return heads.weight_bytes(fresh_head(cfg, target, resolved_family(cfg, family)), item)


def resolved_family(cfg, family: str) -> str:
    return "eagle3" if family == "eagle" and getattr(cfg.draft, "eagle3", False) else family


def load_head(cfg, ctx, family: str):
    """The run's head on the device in its dtype: loaded from --head, or fresh at the target's shapes."""
    target, dtype = ctx.target, cfg.runtime.torch_dtype
    a = target.args
    head = heads.load(Path(cfg.draft.head), a, dtype=dtype) if cfg.draft.head else \
        fresh_head(cfg, a, resolved_family(cfg, family), target)
    return heads.place(head, cfg.runtime.torch_device, dtype)


def prepare_head(cfg, ctx, family: str):
    """The head (load_head) and its feature tap, started at the prompt's last position."""
    head = load_head(cfg, ctx, family)
    a, dtype, device = ctx.target.args, cfg.runtime.torch_dtype, cfg.runtime.torch_device
    taps = head.taps(a.n_layers)
    B, P = ctx.prompts.shape
    tap = FeatureTap(taps, B, ctx.lookahead + 1, len(taps) * a.dim, dtype, device)
    last = prompt_features(ctx, taps, torch.tensor([P - 1]))[:, -1]
    tap.start(last, torch.full((B,), P - 1, dtype=torch.long, device=device))
    return head, tap


class HeadDraft(Drafter):
    """What every head drafter does around a verification: its feature tap asks the target's forward for the hidden
    states the head reads, and keeps them along the accepted path; its tree, if any, is tree_at's. A subclass
    drafts in `draft_tokens(hist, m, start, gamma)`; with `use_graphs` the whole proposal replays as one CUDA graph
    per shape (the kept rows, the width, the tree): eager, a head's small kernels cost as much as the target's
    graphed step."""

    graph = None
    whole_run_warm_up = True  # the graphed proposal reads the history buffer, as wide as the run is long

    def use_graphs(self, on: bool) -> None:
        shape = lambda *args: (self.tap.rows.shape[1], self.width, id(self.shape))  # noqa: E731
        self.graph = GraphedStep(self.draft_tokens, key=shape) if on else None

    def shaped(self, width: int, shape=None) -> "HeadDraft":
        drafter = super().shaped(width, shape)
        drafter.use_graphs(self.graph is not None)  # graphs of its own proposal: the copy's width and tree
        return drafter

    def draft_tokens(self, hist, m, start, gamma: int):
        raise NotImplementedError

    def propose(self, step, hist, m, start, gamma: int):
        if self.graph is None:
            return self.draft_tokens(hist, m, start, gamma)
        tokens, q = self.graph(hist, m, start, gamma)
        return tokens.clone(), (None if q is None else q.clone())  # a replay's outputs are overwritten by the next

    def tree_for(self, tokens: int):
        return tree_at(self, tokens // self.width)

    def begin(self) -> None:
        self.tap.begin()

    def verify_plan(self, cache, gamma: int) -> ForwardPlan:
        self.T = gamma + 1
        return self.tap.verify_plan(cache)

    def after_verify(self, verified, path=None) -> None:
        self.tap.after_verify(path)

    def after_commit(self, cache) -> None:
        self.tap.after_commit(self.T)


PLAN_HEADS = (3, 4, 5)  # what `magicdec plan` composes for Medusa and Hydra: fresh heads' counts, and trees


class KHeads(DrafterKind):
    """Medusa and Hydra: K heads over the target's hidden state at the bonus token's parent, no KV of their own; a
    subclass names its family and makes its runtime drafter (`draft`)."""
    Config = KHeadsConfig
    supports_auto_gamma = False
    supports_trees = drafts_shaped_trees = True
    example = {"num_heads": 3}
    family = ""

    def untrained(self, cfg) -> str | None:
        return untrained_head(cfg, self.family)

    def draft(self, head, tap: FeatureTap, cfg, ctx) -> HeadDraft:
        raise NotImplementedError

    def label(self, draft) -> str:
        return f"{self.name} " + (Path(draft.head).name if draft.head else f"fresh k{draft.num_heads}")

    def check(self, cfg) -> None:
        super().check(cfg)
        check_head_run(cfg, self.name)
        if not cfg.draft.head:
            if cfg.draft.num_heads < 1:
                raise MagicDecError(f"--num_heads {cfg.draft.num_heads}: a fresh {self.name} head has at least 1")
            check_depth(cfg, cfg.draft.num_heads, self.name)

    def check_models(self, cfg, target, models) -> None:
        head = check_head_files(cfg, target, (self.family,), self.name)
        if head is not None:
            check_depth(cfg, head.num_heads, self.name)

    def memory(self, cfg, target, models, rank) -> list[Part]:
        return [Part(target, False, 0, extra_bytes=head_bytes(cfg, target, self.family))]

    def options(self, cfg, target, device) -> list[dict]:
        return [{"num_heads": k} | t for k in PLAN_HEADS for t in PLAN_TREES]

    def prefill_features(self, cfg, target):
        return (heads.final_tap(target.n_layers) - hidden_offset(cfg),), torch.tensor([cfg.workload.prefix_len - 1])

    def prepare(self, cfg, ctx) -> HeadDraft:
        head, tap = prepare_head(cfg, ctx, self.family)
        draft = self.draft(head, tap, cfg, ctx)
        draft.use_graphs(graphs_for(cfg))
        return draft

    def head_shape(self, cfg) -> tuple[int, bool]:
        """(ResBlocks per head, whether head k also reads k + 1 token embeddings: Hydra's grounded heads), from
        --head's config.json (no size in it is used, so a prediction at another model's shapes reads it too), else
        a fresh head's (one ResBlock; Hydra's grounded)."""
        if not cfg.draft.head:
            return 1, self.family == "hydra"
        c = heads.read_config(Path(cfg.draft.head))
        if self.family == "hydra":
            return int(c.get("hydra_num_layers", 1)), bool(c.get("grounded_heads", False))
        return int(c.get("medusa_num_layers", 1)), False

    def head_seconds(self, shape: tuple[int, bool], target, device, k: int, rows: int, pick_rows: int,
                     sampled: bool) -> float:
        """Seconds of head k (of `shape`, head_shape's) over `rows` rows: its ResBlocks (dim -> dim and a bias;
        Hydra's grounded first block reads the hidden and k + 1 embeddings, (k + 2) dim wide, through two maps: its
        linear and its residual's), then its own LM head (vocab x dim; Hydra's with a bias), as linear_time counts
        weights (read once, FLOPs per row); one layer's fixed cost for their few launches (fewer than a decoder
        layer's: an overestimate rather than none); sampled, `pick_rows` rows of logits turned into probabilities.
        The token embeddings Hydra gathers and the SiLU are not counted: small beside the LM head."""
        blocks, grounded = shape
        H, V = target.dim, target.vocab_size
        wide = H * (k + 2) if grounded else H
        first = (wide * H + H) * (2 if wide != H else 1)
        params = first + (blocks - 1) * (H * H + H) + V * H + (V if self.family == "hydra" else 0)
        return cm.linear_time(device, params, rows) + device.layer_overhead_s + \
            (pick_rows * V * device.sampling_s_per_logit if sampled else 0.0)

    def predict(self, cfg, target, models, device, alpha, gamma, lookahead, summary=None) -> dict | None:
        """The draft step T_D is the mean over the gamma levels drafted of one head's work (head_seconds). A head
        keeps no KV: T_D has no term that grows with the context, and what it does grow with is the vocabulary, an
        LM head per drafted level (each head its own). A chain runs head k over the B features; in a tree Medusa's
        head k still runs over the B features (every node of a level shares them) and picks over each node of the
        level above, while Hydra's runs over each node of the level above (each its own path)."""
        B, shape = cfg.workload.B, self.head_shape(cfg)

        def proposal(sizes: list[int], sampled: bool) -> float:
            return sum(self.head_seconds(shape, target, device, k, B * (1 if self.family == "medusa" else above),
                                         B * above, sampled) for k, above in enumerate(sizes[:-1]))

        return head_prediction(cfg, target, device, alpha, gamma, proposal)
