"""The drafter protocol: what the engine, the sweep, the report and the cost model may ask of a drafter kind, with
defaults for what most kinds do not need. A kind is a stateless object (its module's DRAFTER); `prepare` returns the
runtime drafter (generate.Drafter) for one batch of prompts."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from magicdec.config import ModelArgs
from magicdec.decoding.generate import Drafter


@dataclass(frozen=True)
class ModelRef:
    """A model a drafter needs besides the target: a checkpoint, or random weights at a named model's shapes."""
    path: Path | None
    name: str | None
    flag: str  # the flag that named it, for errors


@dataclass(frozen=True)
class Part:
    """One model's share of a run's memory, estimated before anything is allocated."""
    config: ModelArgs  # its shapes (this rank's slice under tensor parallelism)
    weights: bool  # its weights are loaded for this part (the self-draft shares the target's)
    slots: int  # KV slots per sequence
    extra_bytes: int = 0  # weights it adds besides a whole model's (a quantized draft copy)
    kv_bytes: int = 0  # KV bytes per sequence besides its slots' (a quantized copy of the target's KV)


@dataclass
class PrepareContext:
    """What a drafter prepares from, for one batch of prompts: the run, the target and its prefilled cache."""
    cfg: object  # run_config.RunConfig
    target: object  # model.Transformer
    cache: object  # the target's KVCache, holding the prompts
    prompts: torch.Tensor  # [B, P] on the device
    queries: list | None  # per layer, the prompt's last queries, when prefill_queries asked for them
    lookahead: int  # the longest draft a verification can carry (gamma, with the drafter's extra)
    backend: str  # decode attention backend
    models: dict = field(default_factory=dict)  # name -> (ModelArgs, checkpoint or None) of models()
    load: object = None  # load(ModelArgs, checkpoint, shard=None) -> Transformer
    target_shard: object = None
    rank: int = 0
    world: int = 1
    notes: dict = field(default_factory=dict)  # what the record should say about the preparation
    tokenizer: object = None  # the tokenizer that cut the prompts (None: random prompt ids)
    features: torch.Tensor | None = None  # [B, n, F]: the target's hidden states a head asked for (prefill_features)
    feature_positions: torch.Tensor | None = None  # [n]: the prompt positions they are at

    @property
    def random_kv(self) -> int | None:
        """The seed for random KV in place of a prefill (random-weight speed runs), or None."""
        return self.cfg.workload.seed if self.cfg.runtime.skip_prefill else None


class DrafterKind:
    """One way of drafting. Subclasses set name, Config (a frozen dataclass of run_config options) and prepare."""
    name: str = ""
    aliases: tuple[str, ...] = ()
    description: str = ""
    Config: type = None
    # --gamma auto times the drafter's steps per candidate gamma: a drafter whose proposals vary in length runs
    # none it could time
    supports_auto_gamma: bool = True
    # --tree_width above 1: the drafter proposes token trees (Drafter.tree_for)
    supports_trees: bool = False
    # --tree_nodes: the drafter drafts any token tree level by level (a model draft: Drafter.shape)
    drafts_shaped_trees: bool = False
    # its verification is a token tree whatever its options (lookahead's guesses): its measured acceptance is a rate
    # per level, which a synthetic run gives the first candidate of each level (the later ones never kept)
    verifies_trees: bool = False
    # a flag of the seed's scripts that selects this drafter (--hierarchy), or None
    switch: str | None = None
    # options of a small valid run over a 64-token prompt (with a draft model where its Config takes `draft`): the
    # tests run every registered drafter with them, so a new drafter is checked for losslessness as it lands
    example: dict = {}
    # the configs `magicdec compare` shows side by side (over its defaults): the ones a user would ask about first
    variants: tuple[dict, ...] = ({},)

    def label(self, draft) -> str:
        """A short name for tables and plots, with what distinguishes one config from another."""
        return self.name

    def describe(self, cfg) -> str:
        """Where the draft's tokens and KV come from, for the record."""
        return self.description

    def untrained(self, cfg) -> str | None:
        """Why this config has no acceptance of its own to measure (a trained-head drafter given no trained head:
        a fresh head drafts what its initialisation says), or None. `magicdec compare` shows such a config as a row
        saying so, with no speed or prediction; a run still runs it (a speed run at random weights needs none)."""
        return None

    def check(self, cfg) -> None:
        """Checks that need no file, on the run config (cfg.draft is this kind's Config)."""
        if cfg.speculation.auto and not self.supports_auto_gamma:
            raise_auto(self.name)

    def models(self, cfg) -> dict[str, ModelRef]:
        """Models besides the target it loads, by a name of its own."""
        return {}

    def check_models(self, cfg, target: ModelArgs, models: dict) -> None:
        """Checks against the models' configs (models: name -> (ModelArgs, checkpoint or None)), before loading."""

    def memory(self, cfg, target: ModelArgs, models: dict, rank: int) -> list[Part]:
        """Its share of this rank's memory: weights it loads, KV slots per sequence (target: this rank's slice)."""
        return []

    def lookahead(self, cfg) -> int:
        """Positions beyond gamma + 1 a verification can reach past the last committed token (what the target's
        cache and a draft cache appending after the prompt hold beyond the prompt)."""
        return 0

    def prefill_queries(self, cfg) -> int:
        """How many of the prompt's last queries per layer the target's prefill keeps for it (a KV selection)."""
        return 0

    def prefill_features(self, cfg, target: ModelArgs):
        """(taps, positions [n]): the target's hidden states (heads.py's taps) a head needs of the prompt and at
        which positions, kept by the target's prefill for `prepare` (PrepareContext.features); None: none."""
        return None

    def prepare(self, cfg, ctx: PrepareContext) -> Drafter:
        raise NotImplementedError

    def options(self, cfg, target: ModelArgs, device) -> list[dict]:
        """The compositions `magicdec plan` ranks for this drafter at `cfg`'s workload (a baseline config: its
        shape, B, lengths, decoding) on `target` and the profiled `device`: each a dict of this drafter's and the
        speculation section's options (gamma left out: the planner tries its own). The planner checks each
        (RunConfig.check) and skips those that do not exist, so a grid may be a plain product."""
        return [{}]

    def predict(self, cfg, target: ModelArgs, models: dict, device, alpha: float, gamma: int, lookahead: int,
                summary: dict | None = None) -> dict | None:
        """The cost model's T_T, T_D, T_V, T_O (cost_model.predict's keys) for this drafter at one point of `cfg`
        (its workload, decoding, speculation and drafter options), at acceptance rate alpha and gamma drafted tokens
        (`lookahead`: cfg.lookahead; `summary`: the run's drafter summary, where measured), or None: no model for it
        (the report says so)."""
        return None


def raise_auto(name: str):
    from magicdec.errors import MagicDecError

    raise MagicDecError(f"--gamma auto times a draft's steps per candidate gamma, and drafter {name} has no fixed "
                        "draft steps to time: pass --gamma N (several values time each)")


class OnRanks(Drafter):
    """A drafter that runs on some ranks of a tensor-parallel job only (a standalone draft on fewer GPUs, a
    hierarchy's bottom on rank 0): its first rank broadcasts the tokens (and q) to every other rank."""

    def __init__(self, inner: Drafter | None, ranks: list[int], vocab_size: int, greedy: bool):
        self.inner, self.ranks, self.vocab_size, self.greedy = inner, ranks, vocab_size, greedy
        self.whole_run_warm_up = getattr(inner, "whole_run_warm_up", False)
        self.here = dist.get_rank() in ranks

    def begin(self) -> None:
        if self.here:
            self.inner.begin()

    def propose(self, step, hist, m, start, gamma):
        B, dev = hist.shape[0], hist.device
        if self.here:
            tokens, q = self.inner.propose(step, hist, m, start, gamma)
        else:
            tokens = torch.empty(B, gamma, dtype=torch.long, device=dev)
            q = None if self.greedy else torch.empty(B, gamma, self.vocab_size, device=dev)
        dist.broadcast(tokens, src=self.ranks[0])
        if q is not None:
            dist.broadcast(q, src=self.ranks[0])
        return tokens, q

    def verify_plan(self, cache, gamma):
        return self.inner.verify_plan(cache, gamma) if self.here else super().verify_plan(cache, gamma)

    def after_commit(self, cache):
        if self.here:
            self.inner.after_commit(cache)

    def summary(self):
        return self.inner.summary() if self.here else None
