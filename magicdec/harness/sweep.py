"""Resumable sweeps: a grid of runs from a TOML file, one JSON record per point, every registered drafter and every
run option the command line has.

    magicdec sweep experiments/sweeps/smollm2_cpu.toml --output_dir results/sweeps/smollm2_cpu --max_minutes 8

The file's format: magicdec/harness/sweep_grid.py (printed after this by `magicdec sweep --help`).

Per (prefix, B) the target is loaded once and each batch of prompts prefilled once; each drafter is prepared once
per batch and decoding mode; every speculative point is timed in turns with the baseline of the same mode, and its
speedup is against those interleaved baseline runs. A point is recorded under its run config's hash: a point whose
config changed is run again, and records of points no longer in the grid are moved to `stale/`; a record that cannot
be read (cut short, emptied) is moved to `broken/` and its point run again. One sweep writes into a folder at a time:
a second is refused. `--max_minutes` stops it cleanly between points once that long has passed since the command
started (loading the target and probing the device included); every run records at least one point first, so running
the same command again always resumes further. Ctrl-C or SIGTERM stops it within a point; run the same command again
to resume. `--shard I/N` runs every N-th group of points (one context and batch), from the I-th: N GPUs of one host
each run a one-GPU sweep's shard into their own folder (CUDA_VISIBLE_DEVICES=I-1), and `magicdec report` reads the
folders together.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm import tqdm

from magicdec.analysis import cost_model as cm
from magicdec import device as dev
from magicdec.model import draft_weights as dw
from magicdec import drafters
from magicdec import files
from magicdec.harness import metrics as met
from magicdec.harness import plan_run
from magicdec.model.tp import from_rank0
from magicdec import options as opt
from magicdec.harness import timing
from magicdec.harness.engine import activation_rows, Engine, memory_needed
from magicdec.errors import interrupted_as, MagicDecError, one_line_errors
from magicdec.analysis.planner import AutoGamma, fit_spread, option_parts, plan
from magicdec.files import writable_folder, write_json
from magicdec.harness.run_config import RunConfig
from magicdec.harness.plan_command import is_tree
from magicdec.decoding.stats import leading_rates
from magicdec.harness import sweep_grid
from magicdec.harness.sweep_grid import (MODES, PLANNERS, Point, batch_skips, group_key, load_config, parse_shard,
                                         planned, points_of, replace_options, room_ahead, shard_of)
from magicdec.decoding.stats import Stats
from magicdec.harness.trial import Timed, Trial
from magicdec.decoding.acceptance import record_fields

LOCK = ".sweep.lock"  # held by the sweep writing into a folder, for its whole run
PROBE = (256, 32)  # prefix and tokens of the B = 1 step the cost model's fixed cost per layer is fitted to


def timing_entry(skip: int, timed: Timed) -> dict:
    """One decoder's timed generation on one batch, as a point keeps it until its last batch."""
    d = timed.decoder
    return {"skip_tokens": skip, "counts": timed.counts.tolist(), "seconds": timed.seconds, "stats": asdict(d.stats),
            "round_s": d.round_seconds, "round_tokens": d.round_tokens}


def combined(timings: list[dict]):
    """(counts, seconds, stats, round seconds, round rates) over several batches' timings: each batch's sequences
    side by side, seconds summed, stats combined (Stats.combine), the rounds one batch after another; round r's
    rates are the tokens every batch decoded in its round r over their seconds (all reach and first done), so that
    a speedup pairs round r of the drafter with round r of the baseline."""
    counts = torch.tensor([c for t in timings for c in t["counts"]])
    stats = Stats.combine([Stats(**t["stats"]) for t in timings])
    # rounds past the fewest batches' count are left out; timings kept by an older version have no round counts
    per_round = list(zip(*[t["round_tokens"] for t in timings])) if all(t.get("round_tokens") for t in timings) else []
    rates = []
    for r in per_round:
        every_first = all(x[3] for x in r)  # first done needs every batch's first-done span
        rates.append(timing.rates_of(sum(x[0] for x in r), sum(x[1] for x in r),
                                     sum(x[2] for x in r) if every_first else None,
                                     sum(x[3] for x in r) if every_first else None))
    return counts, sum(t["seconds"] for t in timings), stats, [r for t in timings for r in t["round_s"]], rates


def batch_speedup(timing_of: dict) -> float:
    """One batch's speedup: the median of its rounds' ratios to the baseline's (its kept runs' seconds where the
    timing has no round counts)."""
    def rates(t: dict) -> list:
        return [timing.rates_of(*r)[0] for r in t.get("round_tokens") or []]

    ratios = met.round_speedups({"round_tokens_per_s": rates(timing_of)},
                                {"round_tokens_per_s": rates(timing_of["baseline"])}).get("measured_speedup_rounds")
    return statistics.median(ratios) if ratios else timing_of["baseline"]["seconds"] / timing_of["seconds"]


def spread_of(records) -> float | None:
    """The spread of acceptance between sequences (planner.fit_spread) that reproduces how far behind its slowest
    sequence each of these fixed-gamma records' batches fell."""
    return fit_spread([(r["B"], r["gamma"], r["gen_len"] - 1, b["alpha"], b["iterations"])
                       for r in records if r.get("gamma") for b in r.get("batches") or [r["metrics"]]])


class Sweep:
    def __init__(self, cfg: dict, out_dir: Path, device: str | None = None, progress: bool = True,
                 path: str = "sweep", shard: tuple[int, int] = (1, 1)):
        self.cfg, self.out, self.progress = cfg, Path(out_dir), progress
        # under torchrun every rank runs the sweep (the points' collectives need them all); rank 0 alone holds the
        # folder and writes, and its decisions (the points left, the time limit) are every rank's
        self.rank0 = int(os.environ.get("RANK", "0")) == 0
        if device is not None:
            cfg = cfg | {"device": device}
            self.cfg = cfg
        self.points, self.dropped = points_of(cfg, path)
        for method in cfg["methods"]:
            if not any(p.method == method for p in self.points):
                why = next(iter(self.dropped.get(method, {})), "")
                raise MagicDecError(f"{path}: method {method} has no valid point ({why})")
        self.points = shard_of(self.points, *shard)
        self.path = path
        self.command, self.config_text = "magicdec sweep", ""
        self.engine: Engine | None = None
        self.cost_device = None
        self.verify_overhead: dict[str, float] = {}

    # ------------------------------------------------------------------ records on disk
    def recorded(self, point: Point) -> bool:
        """Whether the point's record is there: a whole one (set_aside_broken moved any other away)."""
        return (self.out / f"{point.key}.json").exists()

    def write(self, name: str, rec: dict) -> None:
        if self.rank0:
            write_json(self.out / f"{name}.json", rec | {"recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S")})

    def set_aside_broken(self) -> int:
        """A record (or a point's batches so far) that cannot be read, cut short by a full disk or a failed copy, or
        emptied, is never taken as done: it moves to broken/, with a line saying so, and its point runs again."""
        keys, moved = {p.key for p in self.points}, 0
        for f in sorted(self.out.glob("*.json")) + sorted((self.out / ".batches").glob("*.json")):
            r, why = read_object(f)
            batches = f.parent.name == ".batches"
            if r is not None and batches and not isinstance(r.get("batches"), list):
                why = "holds no list of batches"
            elif r is not None and not batches and f.stem in keys and "point" not in r:
                why = "not a point's record"
            if why is None:
                continue
            (self.out / "broken").mkdir(exist_ok=True)
            first = self.out / "broken" / (f"{f.stem}.batches.json" if batches else f.name)
            to = next(t for n in itertools.count()
                      if not (t := first.with_suffix(f".{n}.json" if n else ".json")).exists())
            f.replace(to)
            moved += 1
            print(f"{f}: {why}; moved to {to}, and its point runs again", flush=True)
        return moved

    def retire_stale(self) -> int:
        """Records of points that are not in this grid (another config wrote them) move to stale/."""
        keep = {p.key for p in self.points}
        stale = [f for f in self.out.glob("*.json") if f.stem not in keep and is_point_record(f)]
        if stale:
            (self.out / "stale").mkdir(exist_ok=True)
            for f in stale:
                f.replace(self.out / "stale" / f.name)
            print(f"{len(stale)} records of points not in this grid (another config made them) moved to "
                  f"{self.out / 'stale'}", flush=True)
        return len(stale)

    def partial(self, point: Point) -> dict:
        """A point's timings on the batches done so far (kept across slices until its record is written)."""
        f = self.out / ".batches" / f"{point.key}.json"
        return json.loads(f.read_text()) if f.exists() else {"batches": []}

    # ------------------------------------------------------------------ the run
    def run(self, max_minutes: float | None) -> int:
        """Run every missing point (or until the time limit, past which no new point starts once one was recorded:
        a limit shorter than the set-up still makes progress); returns how many are still missing."""
        check_minutes(max_minutes)
        start = time.monotonic()
        self.recorded_now = 0
        writable_folder(self.out, "--output_dir")
        busy = (lambda pid: f"--output_dir {self.out} is in use by another sweep (pid {pid}): let it finish (or stop "
                            f"it: kill {pid}), or give this one another --output_dir")
        with (files.locked(self.out / LOCK, busy) if self.rank0 else contextlib.nullcontext()), interrupted_as(lambda: (
                f"interrupted: {sum(map(self.recorded, self.points))} of {len(self.points)} points done in {self.out}; "
                "run the same command again to resume")):
            return self.run_points(start, max_minutes)

    def run_points(self, start: float, max_minutes: float | None) -> int:
        """run()'s work, with the folder locked."""
        if self.rank0:
            self.set_aside_broken()
            self.retire_stale()
        for method, reasons in self.dropped.items():
            for why, n in reasons.items():
                print(f"{method}: {n} point(s) left out: {why}", flush=True)
        todo = [p for p in self.points if not self.recorded(p)]
        print(f"{len(todo)} of {len(self.points)} points to run", flush=True)
        if not todo:
            return 0
        self.check(todo)
        self.load(replace_options(todo[0].cfg, B=1))  # the target alone: a first point too big is fits()' to skip
        keys = from_rank0([p.key for p in todo])  # a rank that saw a record rank 0 was still setting aside
        todo = [p for p in self.points if p.key in keys]
        if max_minutes is not None and time.monotonic() - start > 60 * max_minutes:
            print(f"the set-up (loading the target, probing the device) took {(time.monotonic() - start) / 60:.1f} "
                  f"minutes, past --max_minutes {max_minutes:g}: one point is recorded, then the sweep stops",
                  flush=True)
        if self.rank0:
            files.write_text(self.out / "sweep.toml", self.config_text)  # the grid itself, beside its records
            commands = self.out / "commands.txt"  # what made these records, for the report
            made = f"{self.command}  # {self.env.get('gpu', self.env['device'])}, {time.strftime('%Y-%m-%d %H:%M')}\n"
            files.write_text(commands, (commands.read_text(errors="replace") if commands.exists() else "") + made)
        bar = tqdm(total=len(todo), desc="sweep", disable=not (self.progress and self.rank0))
        groups: dict[tuple, list[Point]] = {}
        for p in todo:
            groups.setdefault(group_key(p), []).append(p)
        for pts in groups.values():
            if self.out_of_time(start, max_minutes):
                break
            too_big = from_rank0(self.fits(pts))  # each rank's free memory differs a little
            for p in pts:
                if p.key in too_big:
                    self.write(p.key, self.meta(p) | {"skipped": too_big[p.key]})
                    self.recorded_now += 1
                    bar.update(1)
            pts = [p for p in pts if p.key not in too_big]
            if pts and not self.group(pts, bar, start, max_minutes):
                break
        bar.close()
        # rank 0's count: another rank reading the folder can run ahead of rank 0's last write and count it missing
        left = from_rank0(sum(1 for p in self.points if not self.recorded(p)))
        print(f"{left} points left" + ("; run the same command again to resume" if left else ""), flush=True)
        return left

    def out_of_time(self, start: float, max_minutes: float | None) -> bool:
        """Whether the time limit stops the sweep here: past it, and a point recorded by this run already."""
        return from_rank0(max_minutes is not None and self.recorded_now > 0
                          and time.monotonic() - start > 60 * max_minutes)

    def check(self, todo: list[Point]) -> None:
        """Every point against the models' configs (contexts, vocabularies, drafts' models), before anything loads:
        a mistake in the grid costs seconds, not the points before it."""
        self.engine = self.engine or Engine(todo[0].cfg)
        batches = set()  # each batch of prompts the points take, made once here: a source too small is said now
        for p in todo:
            try:
                self.engine.plan(p.cfg)
                for skip in batch_skips(self.cfg):
                    w = p.cfg.workload
                    if (w.B, w.prefix_len, w.dataset, skip, w.seed) not in batches:
                        batches.add((w.B, w.prefix_len, w.dataset, skip, w.seed))
                        self.engine.prompts(replace_options(p.cfg, skip_tokens=skip))
            except MagicDecError as e:
                raise MagicDecError(f"{self.path}: point {p.name}: {e}") from None

    def load(self, cfg: RunConfig) -> None:
        """The target (once), the device's measured costs and each drafter's fixed cost per verification."""
        self.engine = self.engine or Engine(cfg)
        self.engine.check(cfg)
        self.engine.load_target()
        device, dtype = self.engine.device, self.engine.dtype
        self.env = dev.environment(device)
        # the draft weight kernels' times, a tree's and the all-reduces' fixed costs, the heads' fixed costs: this GPU
        # model's committed profile (the H100's where none: cost_model.device_profile_path); the work divides over
        # the tensor-parallel ranks, and the probe's fitted overhead per layer is what is left beside the all-reduces
        profile = cm.device_profile(self.env.get("gpu") or device.type)
        self.cost_device = replace(cm.measure_device(device, dtype), weight_kernels=cm.weight_kernels_of(profile),
                                   tree_verify_s=cm.by_ranks(profile, "tree_verify_s"),
                                   collective_s_per_layer=cm.by_ranks(profile, "collective_s_per_layer"),
                                   ranks=len(cfg.runtime.rank_group), **cm.head_costs_of(profile))
        prefix, n = PROBE
        step = self.probe(replace_options(cfg, B=1, prefix_len=prefix, gen_len=n, drafter="baseline"))
        overhead = cm.fit_layer_overhead(self.engine.target_config, self.cost_device, 1, prefix + n // 2, step)
        self.cost_device = replace(self.cost_device, layer_overhead_s=overhead)
        if "sampled" in self.cfg["decoding"]:
            s = MODES["sampled"]
            self.cost_device = replace(self.cost_device, sampling_s_per_logit=cm.measure_sampling(
                device, self.engine.target_config.vocab_size, s["temperature"], s["top_p"], s["top_k"], dtype))
        for p in self.points:
            if p.cfg.drafter and p.cfg.drafter.name not in self.verify_overhead:
                self.verify_overhead[p.cfg.drafter.name] = self.probe_verification(p.cfg)

    def probe(self, cfg: RunConfig) -> float:
        """Seconds per verification (a decode step for the baseline) of `cfg` at its B and prefix over random KV
        where the sweep's KV is random, timed like a point (3 rounds, median)."""
        engine = self.engine
        models = engine.plan(cfg)[0]
        trial = Trial(engine, cfg, queries=cfg.drafter.prefill_queries(cfg) if cfg.drafter else 0)
        with torch.inference_mode():
            drafter = trial.prepare(cfg, models)[0] if cfg.drafter else None
            decoder = engine.decoder(cfg, drafter, cfg.speculation.largest)
            trial.time([decoder], cfg, eos=[], repeats=3, min_seconds=0.0)
            seconds = sorted(decoder.round_seconds)[1] / max(decoder.stats.iterations, 1)
        del decoder, drafter, trial
        dev.release_memory(engine.device)
        return seconds

    def probe_verification(self, cfg: RunConfig) -> float:
        """The cost model's fixed seconds per verification (T_O) for this drafter, fitted to gamma-1 verifications
        at B = 1 over a short prompt, its draft at the config's own options."""
        prefix, n = max(PROBE[0], 2 * getattr(cfg.draft, "draft_budget", 0) + 64), PROBE[1]
        probe = replace_options(cfg, B=1, prefix_len=prefix, gen_len=n, gamma=[1], temperature=0.0, top_p=1.0,
                                synthetic_acceptance=cfg.speculation.synthetic_acceptance)
        try:
            probe.check()
        except MagicDecError:
            return 0.0
        seconds = self.probe(probe)
        models = self.engine.plan(probe)[0]
        p = probe.drafter.predict(probe, self.engine.target_config, models, replace(self.cost_device,
                                                                                    verify_overhead_s=0.0),
                                  0.5, 1, probe.lookahead, {"alpha_bottom_to_middle": 0.5})
        if p is None:
            return 0.0
        return max(seconds - p["T_D_over_T_T"] * p["T_T"] - p["T_V"], 0.0)

    def fits(self, pts: list[Point]) -> dict[str, str]:
        """Why each point of this group that does not fit in memory does not (point key -> reason): the target's
        cache beside the point's drafter share (a batch holds one drafter at a time), weights loaded already
        counted as free. A point too big for its baseline's cache takes its group's baseline with it."""
        dw.forget_copies()  # the last group's quantized weight copy, kept for its batches
        dev.release_memory(self.engine.device)
        free = dev.memory(self.engine.device)[0] - dev.headroom(self.engine.device)
        out = {}
        for p in pts:
            w = p.cfg.workload
            parts = [replace(part, weights=False) for part in self.engine.plan(p.cfg)[1]]
            need = memory_needed(w.B, activation_rows(p.cfg), self.engine.dtype, parts)
            if need["total"] > free:
                out[p.key] = (f"B={w.B} x prefix {w.prefix_len}, {p.cfg.describe()}: does not fit in memory "
                              f"({need['total'] / 2**30:.1f} GiB needed, {free / 2**30:.1f} GiB free)")
        if any(p.method == "baseline" and p.key in out for p in pts):
            out = {p.key: out.get(p.key) or "its group's baseline does not fit in memory" for p in pts}
        return out

    def group(self, pts: list[Point], bar, start, max_minutes) -> bool:
        """Every point of one (prefix, B) group, batch by batch, then its plan points (each its own prefill of the
        first batch, the group's caches gone); False if the time ran out."""
        plans = [p for p in pts if p.method == "plan"]
        pts = [p for p in pts if p.method != "plan"]
        for k, skip in enumerate(batch_skips(self.cfg)):
            todo = [p for p in pts if len(self.partial(p)["batches"]) <= k]
            if todo and not self.batch(todo, k, skip, bar, start, max_minutes):
                return False
            dev.release_memory(self.engine.device)  # this batch's caches and graphs, before the next allocates
        for p in plans:
            if self.out_of_time(start, max_minutes):
                return False
            rec = plan_run.measure(self.engine, p.cfg, p.key, eos=[])[0]
            self.write(p.key, rec)
            self.recorded_now += 1
            tqdm.write(plan_run.line(rec))
            bar.update(1)
            dev.release_memory(self.engine.device)
        return True

    def batch(self, pts: list[Point], k: int, skip: int, bar, start, max_minutes) -> bool:
        """Time these points on batch k (prompts from `skip` tokens into each book); False if the time ran out."""
        engine, last = self.engine, k == len(batch_skips(self.cfg)) - 1
        base = pts[0].cfg
        cfg0 = replace_options(base, skip_tokens=skip)
        queries = max((p.cfg.drafter.prefill_queries(p.cfg) for p in pts if p.cfg.drafter), default=0)
        ahead = max(room_ahead(p) for p in pts)
        trial = Trial(engine, cfg0, queries=queries, ahead=ahead)
        self.prompt_source = trial.batch.prompt_source
        made, base_decoders = None, {}  # made: (key, drafter, its preparation's seconds), one drafter at a time
        pts = sorted(pts, key=lambda p: (p.method != "baseline", self.drafter_key(p.cfg)))  # one drafter alive at once
        try:
            for point in pts:
                if self.out_of_time(start, max_minutes):
                    return False
                cfg = point.cfg
                mode = cfg.decoding.name
                partial = self.partial(point)
                if mode not in base_decoders:
                    base_cfg = replace_options(cfg, drafter="baseline")
                    base_decoders[mode] = engine.decoder(base_cfg)
                with torch.inference_mode():
                    if point.method == "baseline":  # timed alone
                        timed, = trial.time([base_decoders[mode]], cfg, eos=[])
                        partial["batches"].append(timing_entry(skip, timed))
                        self.finish(point, partial, last, bar)
                        continue
                    if point.method == "auto":  # planned and profiled on the first batch, as a server does
                        if "planner" not in partial:
                            partial["planner"] = self.plan_budget(point)
                        cfg = planned(cfg, partial["planner"])
                        # a width-W tree runs under AutoGamma too (a chain or the tree per verification); a
                        # Sequoia tree, shaped for its depth, runs fixed at its planned gamma
                        policy = None if cfg.speculation.tree_nodes else AutoGamma(
                            self.gammas(point), partial["planner"]["alpha"], spread=partial["planner"]["spread"],
                            sibling_prior=cfg.speculation.synthetic_siblings)
                    else:
                        policy = None
                    key = self.drafter_key(cfg)
                    if made is None or made[0] != key:
                        # the previous drafter's caches (and a quantized weight copy) go before this one's are made:
                        # every name holding it lets go
                        made = drafter = None
                        dev.release_memory(engine.device)
                        made = (key, *trial.prepare(cfg, ahead=ahead)[:2])
                    _, drafter, draft_s = made
                    costs = partial.get("profiled_costs")  # an earlier batch's profile (JSON keys: strings)
                    timed, base_timed, profile_s = trial.speculate(
                        cfg, drafter, cfg.speculation.largest, policy, base_decoders[mode], eos=[],
                        costs=None if costs is None or not policy else {int(g): s for g, s in costs.items()})
                    if profile_s is not None:
                        partial["auto_gamma_profile_s"] = profile_s
                        partial["profiled_costs"] = policy.costs
                    entry = timing_entry(skip, timed)
                    entry["baseline"] = timing_entry(skip, base_timed)
                    entry["draft_prefill_s"] = draft_s
                    partial["batches"].append(entry)
                    del timed, base_timed
                    gc.collect()  # its CUDA graphs and their memory go now, not at some later capture
                self.finish(point, partial, last, bar)
        finally:
            base_decoders.clear()
            made = None  # free the draft caches before the next batch allocates its own
            del trial
        return True

    @staticmethod
    def drafter_key(cfg: RunConfig) -> tuple:
        """What a prepared drafter depends on: its config and the decoding mode (an auto point's budget is chosen
        later: its key is its base config's)."""
        if not cfg.drafter:
            return ("", "", "")
        return (cfg.drafter.name, json.dumps(opt.as_options(cfg.draft), sort_keys=True), cfg.decoding.name)

    @staticmethod
    def gammas(point: Point) -> list[int]:
        """An auto point's candidates: the sweep's gamma axis."""
        return point.candidates["gammas"]

    def finish(self, point: Point, partial: dict, last: bool, bar) -> None:
        """Keep this point's timings so far; after its last batch, write its record."""
        partial = json.loads(json.dumps(partial, default=str))  # one form (JSON's), whether stored or just timed
        if not last:
            if self.rank0:
                write_json(self.out / ".batches" / f"{point.key}.json", partial)
            return
        rec = self.record(point, partial)
        self.write(point.key, rec)
        self.recorded_now += 1
        self.log(rec)
        if self.rank0:
            (self.out / ".batches" / f"{point.key}.json").unlink(missing_ok=True)
        bar.update(1)

    def meta(self, point: Point) -> dict:
        """What the report reads of every point besides its metrics."""
        c, w = point.cfg, point.cfg.workload
        draft = c.draft
        return {"point": point.key, "method": point.method,
                "label": point.method if point.method in ("auto", "plan") else c.describe(),
                "decoding": c.decoding.name, "prefix_len": w.prefix_len, "B": w.B, "gen_len": w.gen_len,
                "gamma": c.speculation.gamma[0] if c.speculation.speculative and not c.speculation.auto else None,
                "budget": getattr(draft, "draft_budget", None), "draft_policy": getattr(draft, "draft_policy", None),
                "config": c.options(), "config_hash": c.hash(), "model": self.engine.target_config.name,
                "model_config": self.engine.target_config.to_dict(), "random_weights": c.models.random_weights,
                **record_fields(c.speculation),
                "sampling": {c.decoding.name: MODES[c.decoding.name]}, "skip_tokens": batch_skips(self.cfg),
                "repeats": c.timing.repeats, "min_seconds": c.timing.min_seconds,
                "sinks": getattr(draft, "sinks", None), "skip_prefill": c.runtime.skip_prefill,
                "step_mode": c.runtime.step_mode, "cuda_graphs": c.runtime.graphed,
                "prompt_source": getattr(self, "prompt_source", None), "environment": self.env}

    def record(self, point: Point, partial: dict) -> dict:
        """A point's record from its timings on every batch: throughput and acceptance over all of them (seconds
        and counts summed), each batch's own in "batches"."""
        cfg, w = point.cfg, point.cfg.workload
        if point.method == "auto":
            cfg = planned(cfg, partial["planner"])
            point = replace(point, cfg=cfg)
        timings = partial["batches"]
        counts, secs, stats, round_s, rates = combined(timings)
        m = met.generation_metrics(counts, secs, w.B, stats, round_s, rates)
        rec = self.meta(point)
        if point.method == "baseline":
            m.update(met.bandwidth_metrics(self.engine.target, self.engine.target_config, w.B, w.prefix_len, w.gen_len,
                                           self.engine.dtype, secs / len(timings), self.cost_device.bandwidth))
            ctx = w.prefix_len + w.gen_len // 2
            m["cost_model"] = {"T_T_s": cm.step_time(self.engine.target_config, self.cost_device, w.B, ctx, 1,
                                                     not cfg.decoding.greedy)}
            return rec | {"device_model": vars(self.cost_device), "metrics": m, "batches": [
                {"skip_tokens": t["skip_tokens"], "decode_s": t["seconds"], "iterations": t["stats"]["iterations"]}
                for t in timings]}
        b_counts, b_secs, b_stats, b_round_s, b_rates = combined([t["baseline"] for t in timings])
        paired = met.generation_metrics(b_counts, b_secs, w.B, b_stats, b_round_s, b_rates)
        gamma = rec["gamma"] or 0
        m.update(met.speculation_metrics(m, stats, paired, gamma))
        m["draft_prefill_s"] = timings[0].get("draft_prefill_s")
        m["cost_model"] = self.predicted(cfg, gamma, m)
        per_batch = []
        for t in timings:
            s = Stats(**t["stats"])
            per_batch.append({"skip_tokens": t["skip_tokens"], "decode_s": t["seconds"],
                              "baseline_decode_s": t["baseline"]["seconds"],
                              "measured_speedup": batch_speedup(t), "iterations": s.iterations,
                              "alpha": s.alpha, "gamma_use": s.policy and s.policy["iterations_per_gamma"]})
        return rec | {"baseline_metrics": paired, "planner": partial.get("planner"),
                      "auto_gamma_profile_s": partial.get("auto_gamma_profile_s"), "metrics": m, "batches": per_batch}

    def predicted(self, cfg: RunConfig, gamma: int, m: dict) -> dict:
        """The cost model's T_T, T_D, T_V and speedup at this point from the measured device and alpha (and, as
        `speedup_effective`, from the measured Omega_eff: tokens per verification of the whole batch, stragglers
        included, which the every-sequence-reaches-gen_len throughput follows); or why there is none."""
        if m["alpha"] is None or not gamma:
            return {"none": "no fixed gamma or no acceptance measured (--gamma auto predicts per verification)"}
        device = replace(self.cost_device, verify_overhead_s=self.verify_overhead.get(cfg.drafter.name, 0.0))
        models = self.engine.plan(cfg)[0]
        alpha, ranks = m["alpha"], tuple(leading_rates((m.get("speculation") or {}).get("per_rank_acceptance")))
        if is_tree(cfg.options()) and not cfg.speculation.synthetic_siblings and len(ranks) > 1:
            # a tree's yield rests on each sibling rank's rate: the run's own vector, as Sequoia's model takes it
            # (rank 0 for a node's first child, alpha being the path's rate), not rates nobody measured
            alpha = ranks[0]
            cfg = replace(cfg, speculation=replace(cfg.speculation, synthetic_siblings=ranks[1:]))
        pred = cfg.drafter.predict(cfg, self.engine.target_config, models, device, alpha, gamma,
                                   cfg.lookahead, (m.get("speculation") or {}).get("drafter"))
        if pred is None:
            return {"none": f"the cost model has no model of drafter {cfg.drafter.name} here"}
        steps = m["speculation"]["draft_steps"] / m["speculation"]["iterations"] if m["speculation"]["iterations"] else gamma
        cost = steps * pred["T_D_over_T_T"] + pred["T_V_over_T_T"] + pred["T_O_over_T_T"]
        return pred | {"speedup_effective": m["omega_effective"] / cost, "device_model": vars(device)}

    def plan_budget(self, point: Point) -> dict:
        """The planner's budget (and, where the point lists several, draft weight format) for an auto point:
        acceptance per option as measured by earlier points of this sweep and its `history` sweeps, else the
        prior; then the cost model's best option. Where the baseline wins, the drafter is still prepared at the best
        speculative option, for AutoGamma to switch off."""
        cfg, method = point.cfg, point.cfg.drafter.name
        w = cfg.workload
        formats, widths = point.candidates.get("formats"), point.candidates.get("widths")
        nodes = point.candidates.get("nodes")
        if widths or nodes:  # a chain, chains with siblings, Sequoia's trees (not a width and nodes at once)
            drafts = [(b, f, width, n) for b in self.budgets(point) for f in formats or [None]
                      for width in widths or [None] for n in nodes or [None] if not ((width or 1) > 1 and n)]
        else:
            drafts = [(b, f) for b in self.budgets(point) for f in formats] if formats else self.budgets(point)
        records = list(self.records())
        alpha, spread = {}, {}
        for draft in drafts:
            b, f, width, n = option_parts(draft)
            seen = [r for r in records if r.get("method") not in (*PLANNERS, None)
                    and drafters.canonical(r["method"]) == method and r.get("budget") == b
                    and r.get("prefix_len") == w.prefix_len and r.get("decoding") == cfg.decoding.name
                    and r.get("draft_policy", cfg.draft.draft_policy) == cfg.draft.draft_policy
                    and (f is None or (r.get("config") or {}).get("draft_weights", "bf16") == f)
                    and (width is None or (r.get("config") or {}).get("tree_width", 1) == width)
                    and (n is None or (r.get("config") or {}).get("tree_nodes", 0) == n)
                    and r.get("metrics", {}).get("alpha") is not None]
            synthetic = cfg.speculation.synthetic_acceptance
            alpha[draft] = synthetic if synthetic is not None else (
                sum(r["metrics"]["alpha"] for r in seen) / len(seen) if seen else cfg.speculation.alpha_prior)
            spread[draft] = spread_of(seen)
        device = replace(self.cost_device, verify_overhead_s=self.verify_overhead.get(method, 0.0))
        models = self.engine.plan(cfg)[0]

        group = point.candidates.get("draft_group")

        def predict(draft, gamma):
            b, f, width, n = option_parts(draft)
            c = planned(replace_options(cfg, gamma=[gamma]), {"budget": b, "draft_weights": f, "draft_group": group,
                                                              "tree_width": width, "tree_nodes": n, "gamma": gamma})
            return cfg.drafter.predict(c, self.engine.target_config, models, device, alpha[draft], gamma,
                                       c.lookahead)
        best, options = plan(drafts, self.gammas(point), alpha, predict, w.B, w.gen_len - 1, spread, method)
        spec = best if best.budget is not None else max(options[1:], key=lambda o: o.speedup)
        chosen = {(b, f, width if width and width > 1 else None, n or None): d for d in drafts
                  for b, f, width, n in [option_parts(d)]}
        draft = chosen[(spec.budget, spec.draft_weights, spec.tree_width, spec.tree_nodes)]
        name = lambda d: " ".join(map(str, d)) if isinstance(d, tuple) else d  # noqa: E731  (JSON keys)
        return {"predicted_best": vars(best), "budget": spec.budget, "draft_weights": spec.draft_weights,
                "draft_group": group, "tree_width": spec.tree_width, "tree_nodes": spec.tree_nodes,
                "gamma": spec.gamma,
                "alpha": alpha[draft], "alpha_by_option": {name(d): a for d, a in alpha.items()},
                "spread": spread[draft], "spread_by_option": {name(d): v for d, v in spread.items()},
                "options": [vars(o) for o in options]}

    @staticmethod
    def budgets(point: Point) -> list[int]:
        """An auto point's budgets: the sweep's draft_budget axis, those below the prefix."""
        return [b for b in point.candidates["budgets"] if b < point.cfg.workload.prefix_len]

    def records(self):
        """This sweep's records, then those of the `history` sweeps (of this model)."""
        for d in [self.out] + [Path(h) for h in self.cfg["history"]]:
            for f in sorted(d.glob("*.json")):
                try:
                    r = json.loads(f.read_text())
                except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                    continue
                if isinstance(r, dict) and (d == self.out or r.get("model") == self.engine.target_config.name):
                    yield r

    @staticmethod
    def log(rec):
        m = rec["metrics"]
        line = f"{rec['point']:50s} {m['decode_tokens_per_s'] or 0:10.0f} tok/s"
        if rec["method"] != "baseline":
            line += f"  alpha={m['alpha'] or 0:.3f} speedup={m.get('measured_speedup', 0):.3f}"
            if (m.get("cost_model") or {}).get("speedup"):
                line += f" cost-model={m['cost_model']['speedup']:.3f}"
        tqdm.write(line)


def read_object(f: Path) -> tuple[dict | None, str | None]:
    """(the JSON object in f, None), or (None, why it is not one)."""
    try:
        r = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"not readable JSON ({'empty' if f.exists() and not f.stat().st_size else str(e).splitlines()[0]})"
    return (r, None) if isinstance(r, dict) else (None, f"a JSON {type(r).__name__}, not a record")


def is_point_record(f: Path) -> bool:
    r, _ = read_object(f)
    return r is not None and "point" in r


def check_minutes(max_minutes: float | None) -> None:
    if max_minutes is not None and not (math.isfinite(max_minutes) and max_minutes > 0):
        raise MagicDecError(f"--max_minutes {max_minutes:g}: give a finite positive number of minutes (leave it out "
                            "for no limit)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="magicdec sweep", description=__doc__ + "\n" + sweep_grid.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", type=Path, help="the sweep's TOML file")
    p.add_argument("--output_dir", type=Path, required=True, help="where its records go (one JSON per point)")
    p.add_argument("--max_minutes", type=float, default=None,
                   help="start no new point once this long has passed since the command started, set-up included; at "
                        "least one point is recorded each time (run the same command again to resume)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when a GPU is visible)")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.add_argument("--shard", default="1/1",
                   help="I/N: run only every N-th group of points (the same context and batch), starting at the I-th, "
                        "into its own --output_dir: N GPUs of one host run a one-GPU sweep in N parts "
                        "(CUDA_VISIBLE_DEVICES=I-1); report reads the folders together")
    a = p.parse_args(argv)
    with one_line_errors(interrupted=f"interrupted; run the same command again to resume (records in {a.output_dir})"):
        check_minutes(a.max_minutes)
        shard = parse_shard(a.shard)
        sweep = Sweep(load_config(a.config), a.output_dir, a.device, not a.no_progress, str(a.config), shard)
        sweep.config_text = a.config.read_text()
        sweep.command = " ".join(["magicdec sweep"] + (argv if argv is not None else sys.argv[1:]))
        left = sweep.run(a.max_minutes)
        return 1 if left and a.max_minutes is None else 0


if __name__ == "__main__":
    raise SystemExit(main())
