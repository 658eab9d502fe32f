"""`magicdec plan`: every registered drafter's composed options (DrafterKind.options: cache policy, budget, weight
and KV formats, chain or tree, heads, the hierarchy's levels...) ranked by the cost model's predicted speedup for one
target shape, batch, prefix, generation length and decoding on a profiled device — no GPU needed.

Each option is checked as a run would check it (RunConfig.check; a composition that does not exist is skipped, or
when asked for with --only, a one-line error), its memory estimated as the engine does (engine.memory_needed over
Engine.plan's parts) against the device's memory, then predicted (kind.predict) at each gamma; its speedup is the
planner's finishing-time rule (planner.finishing_speedup: the baseline's time over the option's until the batch's
last sequence has its tokens), at the gamma that finishes first. The baseline is always an option (1.0), and wins
outright where no option promises NEVER_LOSES_MARGIN.

Acceptance: --alpha gives every option one iid rate (a sensitivity, labelled so); --acceptance FILE.json maps an
option's label (its drafter and flags, as printed) or a drafter's name to a rate or to its rates in detail
(magicdec/analysis/acceptance_inputs.py), shown as the option's acceptance. An option with no input is listed, not
ranked.

The Planner is made from a point (a run config's options: the target's shapes, B, lengths, decoding, device) and the
plan's inputs (profile, acceptance, memory, gammas): `magicdec plan` makes it from its flags, `magicdec run --plan`
and a sweep's plan points (plan_run.py) from their run config.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from magicdec import drafters, files
from magicdec import options as opt
from magicdec.analysis import cost_model as cm
from magicdec.analysis.acceptance_inputs import IID_LABEL, Acceptance, load_acceptance
from magicdec.analysis.planner import finishing_speedup, replay_finish
from magicdec.decoding.acceptance import load_trace
from magicdec.device import headroom_for
from magicdec.errors import MagicDecError
from magicdec.harness.engine import Engine, activation_rows, memory_needed
from magicdec.harness.run_config import RunConfig

NEVER_LOSES_MARGIN = 1.02  # below this predicted speedup for every option, the baseline is the plan's choice
GAMMAS = tuple(range(1, 9))  # the draft lengths tried per option
DEFAULT_MEMORY_GIB = 80.0  # an H100's, where the profile names no memory_gib
SHAPING_PLACEHOLDER = (0.8,)  # the rates a Sequoia tree is shaped for where its option has no acceptance input


def flags(option: dict) -> str:
    """An option's dict as the run flags that ask for it."""
    return " ".join(opt.as_flags(option))


def label(name: str, option: dict) -> str:
    return f"{name} {flags(option)}".strip()


def is_tree(option: dict) -> bool:
    """Whether an option (or a run's config) verifies token trees of its own shape: a width, Sequoia's nodes or
    EAGLE-2's dynamic tree (its acceptance, as a static tree's, is per sibling rank)."""
    return (option.get("tree_width") or 1) > 1 or bool(option.get("tree_nodes") or option.get("dynamic_tree_nodes"))


def family(drafter: str, option: dict) -> str:
    """An option's family: its drafter, its draft weights where not bf16, "tree" for a tree (a confirmation times
    one option per family, the atlas marks its winner by it)."""
    weights = option.get("draft_weights")
    return " ".join([drafter] + ([weights] if weights and weights != "bf16" else [])
                    + (["tree"] if is_tree(option) else []))


def parse_only(text: str) -> dict:
    """--only drafter=NAME,key=value,...: one composition asked for by name."""
    out = {}
    for item in filter(None, text.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise MagicDecError(f"--only {text}: give drafter=NAME,option=value,... (e.g. drafter=selfspec,"
                                "tree_width=2)")
        try:  # a number or true / false as the command line would give it; else a word
            out[key.strip()] = json.loads(value.strip())
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    if "drafter" not in out:
        raise MagicDecError(f"--only {text}: name its drafter (drafter=NAME)")
    out["drafter"] = drafters.canonical(out["drafter"])
    if out["drafter"] == "baseline":
        raise MagicDecError("--only drafter=baseline: the baseline is always an option; name a drafter")
    return out


@dataclass(frozen=True)
class Inputs:
    """What a plan ranks with besides its point."""
    profile: Path
    acceptance: Path | None = None  # per-option rates (load_acceptance)
    alpha: float | None = None  # every other option's iid rate (a sensitivity)
    siblings: tuple = ()  # with alpha: a tree's later candidates' rates
    memory_gib: float | None = None  # default: the profile's memory_gib, else DEFAULT_MEMORY_GIB
    gammas: tuple = GAMMAS
    draft_name: str | None = None  # a standalone draft's (and the hierarchy's bottom's) shapes
    synthetic: bool = False  # each option as a random-weight run draws its acceptance: one that cannot is not ranked
    ranks: int | None = None  # tensor-parallel ranks planned for from one process (default: the engine's world)


class Planner:
    """The plan's shared parts: the baseline config of the point, its engine (shapes and memory only: nothing is
    loaded), the profiled device, the acceptance inputs. `point`: run options (the target, B, prefix_len, gen_len,
    decoding, device, dtype, ...; no drafter); `engine`: the run's own, where it has one."""

    def __init__(self, point: dict, inputs: Inputs, engine: Engine | None = None):
        self.inputs = inputs
        self.device, self.overheads, profile = cm.load_profile(inputs.profile)
        memory_gib = inputs.memory_gib if inputs.memory_gib is not None else profile.get("memory_gib",
                                                                                         DEFAULT_MEMORY_GIB)
        self.memory = int(memory_gib * (1 << 30))
        self.alpha, self.siblings = inputs.alpha, tuple(inputs.siblings)
        self.acceptance = load_acceptance(inputs.acceptance)
        if inputs.alpha is None and not self.acceptance:
            raise MagicDecError("no acceptance input: give --alpha A (one iid rate for every option, a sensitivity) "
                                "or --acceptance FILE.json (rates per option label or drafter)")
        self.gammas = tuple(inputs.gammas)
        self.draft_name = inputs.draft_name
        self.base = dict(point)
        cfg = RunConfig.from_options(self.base, strict=False)
        cfg.check()
        self.engine = engine or Engine(cfg)
        self.engine.plan(cfg)  # the target's shapes and context against the point
        self.target = self.engine.target_config
        self.ranks = inputs.ranks or self.engine.world
        if self.ranks > 1:  # tensor parallelism: the work divides over the ranks
            self.device = replace(self.device, ranks=self.ranks)
        self.cfg = cfg
        self.B, self.tokens = cfg.workload.B, cfg.workload.gen_len - 1  # the first token comes from the prefill

    @classmethod
    def from_args(cls, a) -> "Planner":
        """`magicdec plan`'s: its flags' point, on the profiled device (the target's shapes in bf16)."""
        check_counts(a)
        model = {"model": a.model} if a.model else {"random_weights": True, "model_name": a.model_name}
        point = model | {"B": a.B, "prefix_len": a.prefix_len, "gen_len": a.gen_len, "temperature": a.temperature,
                         "device": "cpu", "dtype": "bfloat16", "dataset": "stdlib"}
        return cls(point, Inputs(a.profile, a.acceptance, a.alpha, tuple(a.siblings or ()), a.memory_gib,
                                 tuple(a.gammas), a.draft_name, ranks=a.ranks))

    def config(self, name: str, option: dict, gamma, strict: bool = False, shaped: bool = False) -> RunConfig:
        """The run config of one option at gamma (strict: an option its drafter does not take is an error; where
        the plan is synthetic, its acceptance as the run draws it: Acceptance.run_options)."""
        kind = drafters.get(name)
        extra = {"draft_name": self.draft_name} if self.draft_name and "draft_name" in opt.keys(kind.Config) else {}
        a = self.acceptance_of(name, option) if self.inputs.synthetic else None
        if a is not None:
            if kind.verifies_trees and not a.siblings:  # a level's rate: its first candidate carries it
                a = replace(a, siblings=(0.0,))
            extra |= a.run_options(kind.verifies_trees or is_tree(option), shaped, levels=kind.verifies_trees)
            if a.bottom is not None and "synthetic_bottom" in opt.keys(kind.Config):  # the hierarchy's second level
                extra["synthetic_bottom"] = a.bottom
        given = self.base | extra | option | {"drafter": name, "gamma": [gamma] if gamma is not None else [3]}
        if option.get("tree_nodes"):
            given.setdefault("tree_rates", self.shaping_rates(name, option))
        cfg = RunConfig.from_options(given, strict=strict)
        cfg.check()
        return cfg

    def shaping_rates(self, name: str, option: dict) -> tuple:
        a = self.acceptance_of(name, option)
        return (a.alpha, *a.siblings) if a else SHAPING_PLACEHOLDER  # no input: not ranked anyway

    @staticmethod
    @functools.lru_cache(maxsize=32)
    def trace(path: Path) -> dict:
        """A chain's recorded trace, read once per plan (each gamma of each option replays it)."""
        return load_trace(path)

    def acceptance_of(self, name: str, option: dict) -> Acceptance | None:
        for key in (label(name, option), name):
            if key in self.acceptance:
                return self.acceptance[key]
        if self.alpha is None:
            return None
        return Acceptance(self.alpha, self.siblings, bottom=self.alpha)

    def evaluate(self, name: str, option: dict) -> dict:
        """One option at its best gamma: a ranked row, or a row saying why it is not ranked (None: it does not
        exist at any gamma)."""
        kind = drafters.get(name)
        row = {"drafter": name, "options": flags(option), "label": label(name, option), "config": option}
        a = self.acceptance_of(name, option)
        tree = is_tree(option) or kind.verifies_trees
        best, reason, error = None, None, None
        for g in self.gammas:
            try:
                cfg = self.config(name, option, g)
                models, parts = self.engine.plan(cfg)
            except MagicDecError as e:
                error = error or str(e)
                continue
            need = memory_needed(self.B, activation_rows(cfg), cfg.runtime.torch_dtype, parts)
            if need["total"] / (self.ranks // self.engine.world) + headroom_for(self.memory) > self.memory:
                gib = 1 << 30
                reason = reason or f"does not fit in {self.memory / gib:g} GiB with its headroom"
                row.setdefault("memory_needed_gib", {k: round(v / gib, 2) for k, v in need.items()})
                continue
            if a is None:
                reason = "no acceptance input"
                break
            p = self.predict(kind, cfg, models, a, g)
            if p is None:
                reason = reason if reason and reason.startswith("does not fit") else \
                    "no prediction: " + ("a tree needs its later candidates' rates (--siblings)"
                                         if is_tree(cfg.options()) and not a.siblings
                                         else f"the cost model has no model of {name} here")
                continue
            if a.trace is not None and not tree:
                n, per_verification = replay_finish(self.trace(a.trace), self.B, g, self.tokens, a.alpha)
                p = p | {"omega": per_verification}
                speedup = self.tokens / (n * cm.verification_cost(p, g))
            else:  # a tree runs with its real run's spread between sequences where the entry has it
                speedup = finishing_speedup(p, g, self.B, self.tokens, factors=a.sequence_factors if tree else ())
            if best is None or speedup > best["speedup"]:
                best = {"gamma": g, "T_D_over_T_T": p["T_D_over_T_T"], "T_V_over_T_T": p["T_V_over_T_T"],
                        "omega": p["omega"], "speedup": speedup, "acceptance": a.source}
        if best is not None:
            return row | best
        return row | ({"reason": reason} if reason else {"invalid": error})

    def predict(self, kind, cfg, models, a: Acceptance, gamma: int) -> dict | None:
        """kind.predict at this acceptance: a tree's later candidates through the config's synthetic rates (as a
        random-weight run's), the hierarchy's bottom rate as its measured summary."""
        spec = replace(cfg.speculation, synthetic_siblings=a.siblings) if not kind.verifies_trees else \
            replace(cfg.speculation, synthetic_siblings=a.siblings, synthetic_positions=a.positions)  # its levels
        device = replace(self.device, verify_overhead_s=self.overheads.get(kind.name, 0.0))
        summary = {"alpha_bottom_to_middle": a.bottom} if a.bottom is not None else None
        return kind.predict(replace(cfg, speculation=spec), self.target, models, device, a.chain_alpha(gamma), gamma,
                            cfg.lookahead, summary)

    def candidates(self, only: list[dict]) -> list[tuple[str, dict]]:
        """Every drafter's options, or (--only) the compositions asked for, each checked: one-line errors."""
        if only:
            out = []
            for o in only:
                name, option = o["drafter"], {k: v for k, v in o.items() if k not in ("drafter", "gamma")}
                self.config(name, option, o.get("gamma"), strict=True)  # a composition that does not exist: its own error
                out.append((name, option))
            return out
        return [(name, o) for name, kind in drafters.registry().items()
                for o in kind.options(self.cfg, self.target, self.device)]

    def ranking(self, only: list[dict] = ()) -> dict:
        """Every option (or `only` these) evaluated and ranked: the plan's result."""
        rows = [self.evaluate(name, o) for name, o in self.candidates(only)]
        if only and all("invalid" in r for r in rows):
            raise MagicDecError(f"--only: {rows[0]['invalid']}")
        for name in sorted({r["drafter"] for r in rows}):
            own = [r for r in rows if r["drafter"] == name]
            invalid = [r for r in own if "invalid" in r]
            if self.inputs.synthetic:  # a run says why of each option it cannot run
                rows += [not_ranked(r, f"cannot run here: {r['invalid']}") for r in invalid]
            elif len(invalid) == len(own):  # a drafter none of whose options exists here says why, once
                rows.append(not_ranked(own[0], f"no option exists here: {own[0]['invalid']}"))
        rows = [r for r in rows if "invalid" not in r]
        ranked, unranked = rank(rows)
        return {"point": {k: v for k, v in self.base.items() if k not in ("device", "dtype", "dataset")}
                | {"profile": str(self.inputs.profile), "memory_gib": self.memory / (1 << 30),
                   "gammas": list(self.gammas), "tokens_timed": self.tokens},
                "never_loses_margin": NEVER_LOSES_MARGIN, "choice": ranked[0]["label"], "ranking": ranked,
                "not_ranked": unranked}


def not_ranked(row: dict, reason: str) -> dict:
    return {k: v for k, v in row.items() if k != "invalid"} | {"reason": reason}


def rank(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(ranked rows, baseline included, best first; rows not ranked). Where no option promises NEVER_LOSES_MARGIN,
    the baseline comes first."""
    ranked = [r for r in rows if "speedup" in r]
    baseline = {"drafter": "baseline", "options": "", "label": "baseline", "config": {}, "gamma": 0,
                "T_D_over_T_T": 0.0, "T_V_over_T_T": 1.0, "omega": 1.0, "speedup": 1.0, "acceptance": "-"}
    ranked.sort(key=lambda r: -r["speedup"])
    if not ranked or ranked[0]["speedup"] < NEVER_LOSES_MARGIN:
        ranked.insert(0, baseline)
    else:
        ranked.insert(next((i for i, r in enumerate(ranked) if r["speedup"] < 1.0), len(ranked)), baseline)
    return [r | {"rank": i + 1} for i, r in enumerate(ranked)], [r for r in rows if "speedup" not in r]


def plan(a) -> dict:
    only = [parse_only(o) for o in a.only or []]
    if a.output is not None:
        files.writable_folder(a.output.parent, f"--output {a.output}")
    return Planner.from_args(a).ranking(only)


def table(result: dict, top: int | None) -> str:
    head = f"{'rank':>4}  {'drafter':<10} {'γ':>2} {'T_D/T_T':>7} {'T_V/T_T':>7} {'Ω':>5} {'speedup':>7}  options"
    lines = [head]
    shown = result["ranking"] if top is None else result["ranking"][:top]
    for r in shown:
        lines.append(f"{r['rank']:>4}  {r['drafter']:<10} {r['gamma']:>2} {r['T_D_over_T_T']:>7.3f} "
                     f"{r['T_V_over_T_T']:>7.3f} {r['omega']:>5.2f} {r['speedup']:>7.3f}  {r['options']}")
    more = len(result["ranking"]) - len(shown)
    if more:
        lines.append(f"      ... {more} more ranked options (--top N, or --output FILE.json for all)")
    sources = sorted({r["acceptance"] for r in result["ranking"] if r["drafter"] != "baseline"})
    lines.append(f"acceptance: {'; '.join(sources) or '-'}")
    reasons: dict[str, list[str]] = {}
    for r in result["not_ranked"]:
        reasons.setdefault(r["reason"], []).append(r["label"])
    for reason, labels in reasons.items():
        lines.append(f"not ranked ({len(labels)}): {reason}: " + ", ".join(labels[:3]) + (" ..." if len(labels) > 3
                                                                                          else ""))
    lines.append(f"choice: {result['choice']}" + (f" (every option predicts < {NEVER_LOSES_MARGIN}x)"
                                                   if result["choice"] == "baseline" else ""))
    return "\n".join(lines)


def check_counts(a) -> None:
    for flag, value in (("--B", a.B), ("--prefix_len", a.prefix_len), ("--gen_len", a.gen_len)):
        if value < 1:
            raise MagicDecError(f"{flag} {value}: give a positive count")
    if a.ranks < 1:
        raise MagicDecError(f"--ranks {a.ranks}: give the tensor-parallel ranks planned for (1 or more)")
    if a.gen_len < 2:
        raise MagicDecError(f"--gen_len {a.gen_len}: give at least 2 (the first token comes from the prefill; the "
                            "plan times the rest)")
    if not a.gammas or min(a.gammas) < 1:
        raise MagicDecError(f"--gammas {' '.join(map(str, a.gammas))}: give draft lengths of at least 1")
    if a.alpha is not None and not 0 < a.alpha < 1:
        raise MagicDecError(f"--alpha {a.alpha}: an acceptance rate in (0, 1)")
    if any(not 0 <= s <= 1 for s in a.siblings or ()):
        raise MagicDecError(f"--siblings {' '.join(map(str, a.siblings))}: each rate must be in [0, 1]")
    if a.memory_gib is not None and not (math.isfinite(a.memory_gib) and a.memory_gib > 0):
        raise MagicDecError(f"--memory_gib {a.memory_gib}: give the device's memory in GiB (a positive number)")
    if a.top is not None and a.top < 1:
        raise MagicDecError(f"--top {a.top}: give a positive number of rows")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="magicdec plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name", default="meta-llama/Meta-Llama-3.1-8B",
                   help="the target's shapes (random weights: no checkpoint is read)")
    p.add_argument("--model", type=Path, default=None, help="a checkpoint's model.pth: its config's shapes")
    p.add_argument("--draft_name", default=None,
                   help="a standalone draft's (and the hierarchy's bottom model's) shapes; without it those options "
                        "are not ranked")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--prefix_len", type=int, default=32768)
    p.add_argument("--gen_len", type=int, default=64, help="tokens generated per sequence")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampled decoding")
    p.add_argument("--profile", type=Path, default=cm.PROFILES / "h100.json", help="the device profile")
    p.add_argument("--memory_gib", type=float, default=None,
                   help=f"the device's memory (default: the profile's memory_gib, else {DEFAULT_MEMORY_GIB:g})")
    p.add_argument("--ranks", type=int, default=1,
                   help="tensor-parallel GPUs (torchrun --nproc_per_node): weights and KV divide over them, each "
                        "forward pays the profile's all-reduces per layer, memory is per GPU")
    p.add_argument("--alpha", type=float, default=None, help=f"one acceptance rate for every option ({IID_LABEL})")
    p.add_argument("--siblings", type=float, nargs="+", default=None,
                   help="with --alpha: a tree's later candidates' rates (rank 1, 2, ...); trees need them")
    p.add_argument("--acceptance", type=Path, default=None,
                   help="JSON: option label (as printed) or drafter name -> a rate or {alpha, siblings, positions, "
                        "bottom}; over --alpha")
    p.add_argument("--gammas", type=int, nargs="+", default=list(GAMMAS), help="draft lengths tried per option")
    p.add_argument("--only", action="append", metavar="drafter=NAME,option=value,...",
                   help="rank only this composition (repeatable); one that does not exist is an error")
    p.add_argument("--top", type=int, default=20, help="rows of the ranking printed (the JSON holds all)")
    p.add_argument("--output", type=Path, default=None, help="the ranking as JSON (written atomically)")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    result = plan(a)
    print(table(result, a.top))
    if a.output is not None:
        files.write_json(a.output, result, f"--output {a.output}")
        print(f"ranking written to {a.output}")
    return 0
