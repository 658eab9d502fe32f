"""Resumable sweeps: a grid (method x prefix x B x decoding x draft policy x budget x gamma) from a small TOML file, one JSON record
per point. Points already recorded are skipped, so a sweep resumes after a crash, and `--max_minutes` stops it
cleanly between points: a 10-minute device call runs a slice, the next call goes on.

    python -m magicdec.sweep benchmarks/sweeps/smollm2.toml --output_dir results/issue5/smollm2 --max_minutes 8

Per (prefix, B) the target is loaded once, its cache prefilled once, each draft budget's cache prefilled once; every
speculative point is timed in turns with the baseline of the same decoding mode, and its speedup is against those
interleaved baseline runs (the group's baseline record is timed alone). With `skip_tokens` a list, every point is
timed on several batches of prompts (each prefilled once, every point run on it) and its record reports all of them
together (seconds and counts summed; each batch in "batches"): one batch's best setting is partly that batch's luck
(results/issue5/replay). Methods: `baseline`, `selfspec` (the
target drafts with a small cache: each of `draft_policies`, StreamingLLM by default), `longspec` (the config's
`draft` model drafts; budget 0 = its full cache) and `auto` (the planner picks the budget from the cost model and acceptance measured so far, then gamma per
verification, 0 included: see planner.py).
Config keys: see DEFAULTS.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import tomllib
from pathlib import Path
from dataclasses import asdict, replace
from types import SimpleNamespace

import torch
from tqdm import tqdm

from magicdec import benchmark as bench
from magicdec import cost_model as cm
from magicdec import draft_cache, fused
from magicdec import runs
from magicdec.config import ModelArgs
from magicdec.errors import MagicDecError, one_line_errors
from magicdec.generate import Decoder, Draft, Sampling, prefill
from magicdec.kv_cache import KVCache
from magicdec.planner import AutoGamma, fit_spread, plan
from magicdec.sampling import next_token
from magicdec.stats import Stats
from magicdec.verify import SYNTHETIC_DRAWS

PROBE = (256, 32)  # prefix and tokens of the B = 1 step the cost model's fixed cost per layer is fitted to
MODES = {"greedy": Sampling(0.0), "sampled": Sampling(0.6, 0.9)}  # the sampled mode every real-model alpha reports
DEFAULTS = dict(
    model=None, model_name=None, random_weights=False, tokenizer=None, dataset="auto",
    skip_tokens=8000,  # where prompts start in each book; a list: every point is timed on one batch per value
    draft=None, draft_name=None,  # longspec: a draft model.pth, or its repo id for random weights
    prefix_lens=[4096], batch_sizes=[1], budgets=[256, 512], gammas=[1, 2, 3, 4], methods=["baseline", "selfspec"],
    draft_policies=["streaming"],  # selfspec / longspec: how the draft picks its cache (magicdec/draft_cache.py)
    modes=["greedy", "sampled"], gen_len=64, sinks=16, seed=0,
    repeats=1,  # timed runs per point, the median kept (small models' runs are short and noisy)
    min_seconds=0.0,  # ... and more rounds until each decoder was timed this long in all (short runs are noisy)
    synthetic_acceptance=None,  # a number, or {prefix: alpha}: interpolated in log(prefix) between given points
    alpha_prior=0.8,  # auto: acceptance assumed for a budget before any point of it was measured
    history=[],  # auto: directories of earlier sweeps' records the planner also learns acceptance and spread from
    skip_prefill=False,  # random weights only: caches filled with random KV
    prefill_backend="sdpa", fuse=True)


def load_config(path: Path) -> dict:
    try:
        given = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise MagicDecError(f"cannot read sweep config {path}: {e}") from None
    unknown = set(given) - set(DEFAULTS)
    if unknown:
        raise MagicDecError(f"unknown keys in {path}: {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    cfg = DEFAULTS | given
    bad = set(cfg["methods"]) - {"baseline", "selfspec", "longspec", "auto"}
    if bad:
        raise MagicDecError(f"unknown methods {sorted(bad)} in {path}: use baseline, selfspec, longspec, auto")
    if "longspec" in cfg["methods"] and not (cfg["draft"] or cfg["draft_name"]):
        raise MagicDecError(f"{path}: method longspec needs a draft (draft = 'DIR/model.pth', or draft_name for random weights)")
    if set(cfg["modes"]) - set(MODES):
        raise MagicDecError(f"{path}: modes must be among {list(MODES)}")
    if min(cfg["gammas"]) < 1:
        raise MagicDecError(f"{path}: gammas must be >= 1")
    bad = set(cfg["draft_policies"]) - set(draft_cache.POLICIES)
    if bad or not cfg["draft_policies"]:
        raise MagicDecError(f"{path}: draft_policies must be among {list(draft_cache.POLICIES)}, got {cfg['draft_policies']}")
    small = [b for b in cfg["budgets"] if 0 < b <= draft_cache.WINDOW]
    if small and set(cfg["draft_policies"]) - {"streaming"}:
        raise MagicDecError(f"{path}: budgets {small} must exceed the {draft_cache.WINDOW}-token window a selection "
                            "policy keeps")
    never = [b for b in cfg["budgets"] if b and b >= max(cfg["prefix_lens"])]
    if never and set(cfg["methods"]) & {"selfspec", "longspec", "auto"}:  # else its points vanish from the grid
        raise MagicDecError(f"{path}: budgets {never} are >= every prefix_len (largest {max(cfg['prefix_lens'])}): a "
                            "draft cache that holds the whole prefix saves nothing; use budgets below the prefix")
    missing = [h for h in cfg["history"] if not Path(h).is_dir()]
    if missing:
        raise MagicDecError(f"{path}: history directories {missing} do not exist: give earlier sweeps' output_dirs")
    skips = batch_skips(cfg)
    if not skips or any(not isinstance(k, int) or k < 0 for k in skips) or len(set(skips)) < len(skips):
        raise MagicDecError(f"{path}: skip_tokens must be a non-negative integer or a list of distinct ones (one batch "
                            f"of prompts each), got {cfg['skip_tokens']!r}")
    if cfg["repeats"] < 1 or cfg["min_seconds"] < 0:
        raise MagicDecError(f"{path}: repeats must be >= 1 and min_seconds >= 0 (got {cfg['repeats']}, {cfg['min_seconds']})")
    return cfg


def synthetic_alpha(cfg: dict, prefix: int) -> float | None:
    """The acceptance rate to simulate at this prefix: one number, or a table interpolated in log(prefix)."""
    given = cfg["synthetic_acceptance"]
    if given is None or isinstance(given, (int, float)):
        return given
    pts = sorted((int(k), float(v)) for k, v in given.items())
    if prefix <= pts[0][0]:
        return pts[0][1]
    for (p0, a0), (p1, a1) in zip(pts, pts[1:]):
        if prefix <= p1:
            return a0 + (a1 - a0) * (math.log(prefix) - math.log(p0)) / (math.log(p1) - math.log(p0))
    return pts[-1][1]


def point_name(method, P, B, mode, budget=None, gamma=None, policy=None) -> str:
    return (f"{method}_P{P}_B{B}_{mode}" + ("" if budget is None else f"_b{budget}")
            + ("" if gamma is None else f"_g{gamma}") + ("" if policy in (None, "streaming") else f"_{policy}"))


def prefill_chunk(B: int) -> int:
    """Prefill tokens per sequence and forward: about 16K tokens a chunk across the batch."""
    return max(16, 16384 // B)


def spread_of(records) -> float | None:
    """The spread of acceptance between sequences (planner.fit_spread) that reproduces how far behind its slowest
    sequence each of these fixed-gamma records' batches fell (every batch of a record timed on several)."""
    return fit_spread([(r["B"], r["gamma"], r["gen_len"] - 1, b["alpha"], b["iterations"])
                       for r in records if r.get("gamma") for b in r.get("batches") or [r["metrics"]]])


def points_of(cfg: dict, P: int, B: int) -> list[tuple]:
    """(method, mode, budget, gamma, draft policy) of one (prefix, B) group, baselines first: the others are timed
    against them. A selection policy needs a budget to select within (budget 0, a full draft cache, is streaming's
    only); auto drafts with StreamingLLM."""
    out = []
    for mode in cfg["modes"]:
        out.append(("baseline", mode, None, None, None))
        for method in ("selfspec", "longspec"):
            if method in cfg["methods"]:
                out += [(method, mode, b, g, d) for d in cfg["draft_policies"] for b in cfg["budgets"] if b < P
                        if b or d == "streaming" for g in cfg["gammas"]]
        if "auto" in cfg["methods"] and any(b < P for b in cfg["budgets"]):
            out.append(("auto", mode, None, None, "streaming"))
    return out


def batch_skips(cfg: dict) -> list[int]:
    """Where each batch's prompts start in the books: `skip_tokens` is one batch, or a list of several."""
    skip = cfg["skip_tokens"]
    return list(skip) if isinstance(skip, list) else [skip]


def timing(skip: int, result, decoder) -> dict:
    """One decoder's timed generation on one batch, as a point keeps it until its last batch: its median run's
    counts, seconds and stats, and every round's seconds."""
    _, counts, seconds = result
    return {"skip_tokens": skip, "counts": counts.tolist(), "seconds": seconds, "stats": asdict(decoder.stats),
            "round_s": decoder.round_seconds}


def combined(timings: list[dict]):
    """(counts, seconds, stats, round seconds) over several batches' timings: each batch's sequences side by side,
    seconds summed, stats combined (generate.Stats.combine), the rounds one batch after another."""
    counts = torch.tensor([c for t in timings for c in t["counts"]])
    stats = Stats.combine([Stats(**t["stats"]) for t in timings])
    return counts, sum(t["seconds"] for t in timings), stats, [r for t in timings for r in t["round_s"]]


class Sweep:
    def __init__(self, cfg: dict, out_dir: Path, device: torch.device, progress: bool = True):
        self.cfg, self.out, self.device, self.progress = cfg, out_dir, device, progress
        self.cuda, self.command, self.config_text = device.type == "cuda", "python -m magicdec.sweep", ""
        self.verify_overhead: dict[str, float] = {}  # method -> the cost model's T_O, probed at load
        self.backend = "triton" if self.cuda else "sdpa"  # decode attention (prefill: cfg["prefill_backend"])
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.args = SimpleNamespace(
            model=cfg["model"] and Path(cfg["model"]), model_name=cfg["model_name"], random_weights=cfg["random_weights"],
            tokenizer=cfg["tokenizer"] and Path(cfg["tokenizer"]), dataset=cfg["dataset"], skip_tokens=batch_skips(cfg)[0],
            seed=cfg["seed"], gen_len=cfg["gen_len"], repeats=cfg["repeats"], min_seconds=cfg["min_seconds"], compile=False, cuda_graphs=self.cuda, device=device,
            dtype="bfloat16" if self.cuda else "float32")
        self.config, self.checkpoint = bench.model_source(self.args)
        self.draft_config = self.draft_checkpoint = None
        if "longspec" in cfg["methods"]:
            if cfg["random_weights"]:
                self.draft_config = ModelArgs.from_name(cfg["draft_name"])
            else:
                d = SimpleNamespace(**{**vars(self.args), "model": Path(cfg["draft"])})
                self.draft_config, self.draft_checkpoint = bench.model_source(d)
        if cfg["skip_prefill"] and not cfg["random_weights"]:
            raise MagicDecError("skip_prefill fills the caches with random values: only for random_weights sweeps")
        for P in cfg["prefix_lens"]:  # every point's context, before anything is loaded
            bench.check_context(self.config, P, cfg["gen_len"] + max(cfg["gammas"]) + 1, "gen_len + gamma + 1")
            if self.draft_config is not None and not cfg["random_weights"]:  # the draft keeps absolute positions
                bench.check_context(self.draft_config, P, cfg["gen_len"] + max(cfg["gammas"]) + 1, "gen_len + gamma + 1 (draft)")
        self.draft_method = "longspec" if self.draft_config is not None else "selfspec"  # what auto drafts with
        out_dir.mkdir(parents=True, exist_ok=True)

    def recorded(self, P, B, point) -> bool:
        return (self.out / f"{point_name(point[0], P, B, *point[1:])}.json").exists()

    def done(self, name: str) -> dict | None:
        f = self.out / f"{name}.json"
        return json.loads(f.read_text()) if f.exists() else None

    def write(self, name: str, rec: dict) -> None:
        tmp = self.out / f".{name}.tmp"
        tmp.write_text(json.dumps(rec | {"recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1, default=str))
        tmp.replace(self.out / f"{name}.json")  # a crash never leaves half a record

    def slots(self, P):
        return P + self.append()

    def ring_extra(self):
        return runs.ring_extra_for(self.cfg["gen_len"], max(self.cfg["gammas"]))

    def append(self):
        """What a selected draft cache appends after the prompt: every position generation reaches."""
        return runs.appended_for(self.cfg["gen_len"], max(self.cfg["gammas"]))

    def fits(self, B: int, P: int) -> bool:
        bench.release_memory(self.device)  # before measuring free memory
        parts = [(self.config, False, self.slots(P))]
        selected = [d for d in self.cfg["draft_policies"] if d != "streaming"]
        if "selfspec" in self.cfg["methods"] or ("auto" in self.cfg["methods"] and self.draft_config is None):
            parts += [(self.config, False, b + self.ring_extra()) for b in self.cfg["budgets"] if b < P]
            parts += [(self.config, False, b + self.append()) for b in self.cfg["budgets"] if b < P for _ in selected]
        if self.draft_config is not None:
            parts += [(self.draft_config, False, b + self.ring_extra() if b else self.slots(P))
                      for b in self.cfg["budgets"] if b < P]
            parts += [(self.draft_config, False, b + self.append()) for b in self.cfg["budgets"] if 0 < b < P
                      for _ in selected]
            if selected:  # a standalone draft's own full prefill, selected from, then freed
                parts.append((self.draft_config, False, P))
        need = bench.memory_needed(B, max(16, 16384 // B), self.dtype, parts)  # weights: loaded already, so free
        return need["total"] - need["weights"] + bench.headroom(self.device) <= bench.available_memory(self.device)

    def run(self, max_minutes: float | None) -> int:
        """Run every missing point (or until the time limit); returns how many are still missing."""
        cfg, start = self.cfg, time.monotonic()
        groups = [(P, B) for P in cfg["prefix_lens"] for B in cfg["batch_sizes"]]
        todo = {(P, B): [p for p in points_of(cfg, P, B) if not self.recorded(P, B, p)] for P, B in groups}
        total = sum(map(len, todo.values()))
        print(f"{total} of {sum(len(points_of(cfg, P, B)) for P, B in groups)} points to run", flush=True)
        if not total:
            return 0
        self.load()
        (self.out / "sweep.toml").write_text(self.config_text)  # the grid itself, beside its records
        with open(self.out / "commands.txt", "a") as f:  # what made these records, for the report
            f.write(f"{self.command}  # {self.env.get('gpu', self.env['device'])}, {time.strftime('%Y-%m-%d %H:%M')}\n")
        bar = tqdm(total=total, desc="sweep", disable=not self.progress)
        for (P, B), pts in todo.items():
            if not pts:
                continue
            if max_minutes is not None and time.monotonic() - start > 60 * max_minutes:
                break
            if not self.fits(B, P):
                for p in pts:
                    self.write(point_name(p[0], P, B, *p[1:]), {"point": point_name(p[0], P, B, *p[1:]), "method": p[0],
                               "decoding": p[1], "budget": p[2], "gamma": p[3], "draft_policy": p[4],
                               "skipped": f"B={B} x prefix {P} does not fit in memory", **self.meta(P, B)})
                bar.update(len(pts))
                continue
            self.group(P, B, pts, bar, start, max_minutes)
        bar.close()
        left = sum(1 for P, B in groups for p in points_of(cfg, P, B) if not self.recorded(P, B, p))
        print(f"{left} points left" + ("; run the same command again to resume" if left else ""), flush=True)
        return left

    def load(self):
        self.target = bench.load_weights(self.args, self.config, self.checkpoint)
        self.draft_model = None
        if self.draft_config is not None:
            self.draft_model = bench.load_weights(self.args, self.draft_config, self.draft_checkpoint)
        if self.cuda and self.cfg["fuse"]:
            fused.fuse()
        self.cost_device = cm.measure_device(self.device, self.dtype)
        prefix, n = PROBE
        overhead = cm.fit_layer_overhead(self.config, self.cost_device, 1, prefix + n // 2, self.probe_step(prefix, n))
        self.cost_device = replace(self.cost_device, layer_overhead_s=overhead)
        if "sampled" in self.cfg["modes"]:
            s = MODES["sampled"]
            self.cost_device = replace(self.cost_device, sampling_s_per_logit=cm.measure_sampling(
                self.device, self.config.vocab_size, s.temperature, s.top_p, s.top_k, self.dtype))
        methods = {m for m in self.cfg["methods"] if m in ("selfspec", "longspec")}
        methods |= {self.draft_method} if "auto" in self.cfg["methods"] else set()
        self.verify_overhead = {m: self.probe_verification(m, n) for m in sorted(methods)}
        self.env = bench.environment(self.device)

    def probe_step(self, prefix: int, n: int) -> float:
        """Seconds of one plain decode step at B = 1 over `prefix` random cached tokens, timed like a baseline: the
        cost model's fixed cost per layer is fitted to it."""
        c = self.config
        args = SimpleNamespace(**{**vars(self.args), "B": 1, "prefix_len": prefix, "gen_len": n, "repeats": 3})
        with torch.inference_mode():
            cache = KVCache(c.n_layers, 1, c.n_kv_heads, prefix + n + 2, c.head_dim, self.dtype, self.device,
                            self.backend)
            cache.fill_random(prefix, self.cfg["seed"])
            dec = Decoder(self.target, MODES["greedy"], cuda_graphs=self.cuda)
            _, _, secs = runs.timed_generation(dec, cache, torch.zeros(1, dtype=torch.long, device=self.device), None,
                                               args, [], False)
            steps = dec.stats.iterations
            del dec, cache
        bench.release_memory(self.device)
        return secs / steps

    def probe_verification(self, method: str, n: int) -> float:
        """The cost model's fixed seconds per verification (T_O) for `method`, fitted to gamma-1 verifications at
        B = 1 over random cached tokens, the draft reading the sweep's smallest budget, timed like a point."""
        c, budget, backend = self.config, min(self.cfg["budgets"]), self.backend
        prefix = max(PROBE[0], 2 * budget)
        model = self.target if method == "selfspec" else self.draft_model
        args = SimpleNamespace(**{**vars(self.args), "B": 1, "prefix_len": prefix, "gen_len": n, "repeats": 3})
        with torch.inference_mode():
            cache = KVCache(c.n_layers, 1, c.n_kv_heads, prefix + n + 4, c.head_dim, self.dtype, self.device, backend)
            cache.fill_random(prefix, self.cfg["seed"])
            dc = runs.new_draft_cache(model.args, 1, model.args.n_kv_heads, budget, self.cfg["sinks"], self.ring_extra(),
                                      prefix + n + 4, self.dtype, self.device, backend)
            dc.fill_random(prefix, self.cfg["seed"] + 1)
            dec = Decoder(self.target, MODES["greedy"], draft=Draft(model, dc), gamma=1, cuda_graphs=self.cuda,
                          synthetic_acceptance=synthetic_alpha(self.cfg, prefix))
            ids = torch.zeros(1, dtype=torch.long, device=self.device)
            _, _, secs = runs.timed_generation(dec, cache, ids, ids, args, [], False)
            verification_s = secs / dec.stats.iterations
            del dec, cache, dc
        bench.release_memory(self.device)
        draft = self.draft_config if method == "longspec" else None
        return cm.fit_verify_overhead(c, self.cost_device, 1, prefix + n // 2, 1, budget or prefix, draft,
                                      verification_s, self.ring_extra() if budget else 0)

    def device_for(self, method: str) -> cm.Device:
        """The measured device with `method`'s fixed seconds per verification."""
        return replace(self.cost_device, verify_overhead_s=self.verify_overhead.get(method, 0.0))

    def meta(self, P, B) -> dict:
        return {"prefix_len": P, "B": B, "sampling": {m: vars(s) for m, s in MODES.items() if m in self.cfg["modes"]},
                "model": self.config.name, "draft_model": self.draft_config and self.draft_config.name,
                "model_config": self.config.to_dict(), "draft_config": self.draft_config and self.draft_config.to_dict(),
                "random_weights": self.cfg["random_weights"], "synthetic_acceptance": synthetic_alpha(self.cfg, P),
                "synthetic_draws": SYNTHETIC_DRAWS if synthetic_alpha(self.cfg, P) is not None else None,
                "skip_tokens": batch_skips(self.cfg), "gen_len": self.cfg["gen_len"], "repeats": self.cfg["repeats"], "min_seconds": self.cfg["min_seconds"], "sinks": self.cfg["sinks"], "skip_prefill": self.cfg["skip_prefill"],
                "cuda_graphs": self.cuda, "prompt_source": getattr(self, "prompt_source", None),
                "environment": getattr(self, "env", None)}

    def group(self, P, B, pts, bar, start, max_minutes):
        """Every point of one (prefix, B) group, batch by batch: each batch of prompts is prefilled once and every
        point still missing it is timed on it; a point's record is written after its last batch."""
        for k, skip in enumerate(batch_skips(self.cfg)):
            todo = [p for p in pts if len(self.partial(point_name(p[0], P, B, *p[1:]))["batches"]) <= k]
            if todo and not self.batch(P, B, k, skip, todo, bar, start, max_minutes):
                return
            bench.release_memory(self.device)  # this batch's caches and graphs, before the next batch allocates

    def batch(self, P, B, k, skip, pts, bar, start, max_minutes) -> bool:
        """Time these points on batch k (prompts from `skip` tokens into each book); False if the time ran out."""
        cfg, dev, c = self.cfg, self.device, self.config
        args = SimpleNamespace(**{**vars(self.args), "B": B, "prefix_len": P, "skip_tokens": skip})
        synthetic, last = synthetic_alpha(cfg, P), k == len(batch_skips(cfg)) - 1
        with torch.inference_mode():
            prompts, _ = bench.load_prompts_for(args, c, self.checkpoint)
            prompts, self.prompt_source = prompts.to(dev), args.prompt_source
            drafts = {}  # (method, budget, policy) -> Draft, made on first use

            def draft_for(method, budget, policy):
                if (method, budget, policy) not in drafts:
                    drafts[method, budget, policy] = self.new_draft(method, budget, P, prompts, policy, cache, queries)
                return drafts[method, budget, policy]

            cache, logits, queries = self.new_target_cache(P, prompts)
            base_dec = {}  # per mode: the baseline decoder, kept for pairing
            for point in pts:
                method, mode, budget, gamma, draft_policy = point
                if max_minutes is not None and time.monotonic() - start > 60 * max_minutes:
                    return False
                name = point_name(method, P, B, *point[1:])
                sampling, partial = MODES[mode], self.partial(name)
                torch.manual_seed(cfg["seed"])
                first = next_token(logits, sampling.temperature, sampling.top_p, sampling.top_k)
                cache.rollback(torch.full_like(cache.lengths, P))
                if mode not in base_dec:
                    base_dec[mode] = Decoder(self.target, sampling, cuda_graphs=self.cuda)
                if method == "baseline":  # timed alone
                    result = runs.timed_generation(base_dec[mode], cache, first, prompts[:, -1], args, [], False)
                    partial["batches"].append(timing(skip, result, base_dec[mode]))
                    self.finish(P, B, point, partial, last, bar)
                    continue
                if method == "auto":  # planned and profiled on the first batch, as a server does once per shape
                    if "planner" not in partial:
                        _, partial["planner"] = self.plan_budget(P, B, mode, synthetic)
                    policy = self.auto_policy(partial["planner"])
                    draft = draft_for(self.draft_method, partial["planner"]["budget"], "streaming")
                else:
                    policy, draft = None, draft_for(method, budget, draft_policy)
                dec = Decoder(self.target, sampling, draft=draft, gamma=gamma or 0,
                              cuda_graphs=self.cuda, synthetic_acceptance=synthetic, policy=policy)
                if policy and "profiled_costs" not in partial:
                    partial["auto_gamma_profile_s"] = runs.profile_gammas(dec, cache, first, prompts[:, -1], args, [])
                    partial["profiled_costs"] = policy.costs
                elif policy:
                    policy.costs = {int(g): s for g, s in partial["profiled_costs"].items()}  # JSON keys
                # Timed in turns with the baseline: the speedup compares runs made under the same conditions.
                result, b_result = runs.timed_generations([dec, base_dec[mode]], cache, first, prompts[:, -1], args, [])
                partial["batches"].append(timing(skip, result, dec) | {"baseline": timing(skip, b_result, base_dec[mode])})
                self.finish(P, B, point, partial, last, bar)
                del dec
                gc.collect()  # its CUDA graphs and their memory go now, not at some later capture
            base_dec.clear()
            drafts.clear()  # free the draft caches before the next batch allocates its own
            queries = None  # the recorded queries go with the batch
        return True

    def partial(self, name: str) -> dict:
        """A point's timings on the batches done so far (kept across slices until its record is written)."""
        f = self.out / ".batches" / f"{name}.json"
        return json.loads(f.read_text()) if f.exists() else {"batches": []}

    def finish(self, P, B, point, partial: dict, last: bool, bar) -> None:
        """Keep this point's timings so far; after its last batch, write its record."""
        name = point_name(point[0], P, B, *point[1:])
        partial = json.loads(json.dumps(partial, default=str))  # one form (JSON's), whether stored or just timed
        if not last:
            (self.out / ".batches").mkdir(exist_ok=True)
            tmp = self.out / ".batches" / f".{name}.tmp"
            tmp.write_text(json.dumps(partial))
            tmp.replace(self.out / ".batches" / f"{name}.json")
            return
        rec = self.record(P, B, point, partial)
        self.write(name, rec)
        self.log(rec)
        (self.out / ".batches" / f"{name}.json").unlink(missing_ok=True)
        bar.update(1)

    def record(self, P, B, point, partial: dict) -> dict:
        """A point's record from its timings on every batch: throughput and acceptance over all of them (seconds and
        counts summed), each batch's own in "batches"."""
        (method, mode, budget, gamma, draft_policy), planner = point, partial.get("planner")
        budget = planner["budget"] if planner else budget  # auto: the planner's
        args = SimpleNamespace(**{**vars(self.args), "B": B, "prefix_len": P})
        timings = partial["batches"]
        counts, secs, stats, round_s = combined(timings)
        m = runs.generation_metrics(counts, secs, args, stats, round_s)
        rec = {"point": point_name(method, P, B, *point[1:]), "method": method, "decoding": mode, "budget": budget,
               "gamma": gamma, "draft_policy": draft_policy, **self.meta(P, B)}
        if method == "baseline":
            m.update(runs.bandwidth_metrics(self.target, self.config, args, self.dtype, secs / len(timings),
                                            self.cost_device.bandwidth))
            ctx = P + args.gen_len // 2  # mid-generation context
            m["cost_model"] = {"T_T_s": cm.step_time(self.config, self.cost_device, B, ctx, 1, mode == "sampled")}
            return rec | {"device_model": vars(self.cost_device), "metrics": m, "batches": [
                {"skip_tokens": t["skip_tokens"], "decode_s": t["seconds"], "iterations": t["stats"]["iterations"]}
                for t in timings]}
        b_counts, b_secs, b_stats, b_round_s = combined([t["baseline"] for t in timings])
        paired = runs.generation_metrics(b_counts, b_secs, args, b_stats, b_round_s)
        m.update(runs.speculation_metrics(m, stats, paired, gamma or 0))
        m["cost_model"] = self.predicted(P, B, budget, gamma, m, method, mode, draft_policy)
        group_baseline = self.done(point_name("baseline", P, B, mode))
        per_batch = []
        for t in timings:
            s = Stats(**t["stats"])
            per_batch.append({"skip_tokens": t["skip_tokens"], "decode_s": t["seconds"],
                              "baseline_decode_s": t["baseline"]["seconds"],
                              "measured_speedup": t["baseline"]["seconds"] / t["seconds"], "iterations": s.iterations,
                              "alpha": s.alpha, "gamma_use": s.policy and s.policy["iterations_per_gamma"]})
        return rec | {"baseline_metrics": paired, "group_baseline_metrics": group_baseline and group_baseline["metrics"],
                      "planner": planner, "auto_gamma_profile_s": partial.get("auto_gamma_profile_s"), "metrics": m,
                      "batches": per_batch}

    def predicted(self, P, B, budget, gamma, m, method, mode, draft_policy="streaming") -> dict | None:
        """The cost model's T_T, T_D, T_V and speedup at this point, from the measured device and the measured
        alpha (and, as `speedup_effective`, from the measured Omega_eff: tokens per verification of the whole batch,
        stragglers included, which is what the every-sequence-reaches-gen_len throughput follows)."""
        if m["alpha"] is None or not gamma:
            return None
        draft = self.draft_config if method == "longspec" else None
        device = self.device_for(method)
        # the draft reads every slot of its cache: a ring's spare ones, or a selected cache's appended positions
        extra = runs.slots_beyond_budget(draft_policy, self.cfg["gen_len"], max(self.cfg["gammas"])) if budget else 0
        pred = cm.predict(self.config, device, B, P + self.cfg["gen_len"] // 2, gamma, m["alpha"],
                          budget if budget else P, draft, extra, mode == "sampled")
        return pred | {"speedup_effective": m["omega_effective"] / cm.verification_cost(pred, gamma),
                       "device_model": vars(device)}

    def new_target_cache(self, P: int, prompts: torch.Tensor):
        """The target's cache for these prompts (prefix P), prefilled (random KV for skip_prefill sweeps), the last
        position's logits, and, when a selection policy is swept, the queries of the prompt's last tokens per layer
        (self-speculation selects its draft cache from them and the target's KV)."""
        cfg, c, B = self.cfg, self.config, prompts.shape[0]
        cache = KVCache(c.n_layers, B, c.n_kv_heads, self.slots(P), c.head_dim, self.dtype, self.device,
                        cfg["prefill_backend"])
        random_kv = cfg["seed"] if cfg["skip_prefill"] else None
        queries = None
        if set(cfg["draft_policies"]) - {"streaming"} and "selfspec" in cfg["methods"]:
            logits, queries = draft_cache.prefill_recording(self.target, cache, prompts, draft_cache.WINDOW,
                                                            prefill_chunk(B), random_seed=random_kv)
        elif cfg["skip_prefill"]:
            cache.fill_random(P, cfg["seed"])
            logits = self.target(prompts[:, -1:], cache, logits="last")[:, -1]
        else:
            logits = prefill(self.target, cache, prompts, prefill_chunk(B))
        cache.backend = self.backend
        return cache, logits, queries

    def new_draft(self, method: str, budget: int, P: int, prompts: torch.Tensor, policy: str = "streaming",
                  target_cache: KVCache | None = None, queries=None) -> Draft:
        """`method`'s draft (the target itself, or the draft model) with a `budget` cache over these prompts:
        StreamingLLM's prefilled (random KV for skip_prefill sweeps), or a selection policy's, selected from the
        target's prefill (`target_cache`, holding the prompt, and its `queries`) or from the draft's own."""
        cfg, B = self.cfg, prompts.shape[0]
        model = self.target if method == "selfspec" else self.draft_model
        a = model.args
        if policy != "streaming":
            chosen = draft_cache.policy_for(policy, budget)
            if method == "selfspec":
                dc = draft_cache.build(chosen, target_cache, queries, self.append())
            else:
                dc = draft_cache.select_by_own_prefill(chosen, model, prompts, prefill_chunk(B), self.append(),
                                                       self.dtype, cfg["prefill_backend"], False,
                                                       cfg["seed"] + 1 if cfg["skip_prefill"] else None)
            dc.backend = self.backend
            return Draft(model, dc)
        dc = runs.new_draft_cache(a, B, a.n_kv_heads, budget, cfg["sinks"], self.ring_extra(), self.slots(P),
                                  self.dtype, self.device, cfg["prefill_backend"])
        draft = Draft(model, dc)
        if cfg["skip_prefill"]:
            draft.fill_random(P, cfg["seed"] + 1)
        else:
            draft.prefill(prompts, runs.draft_prefill_chunk(prefill_chunk(B), budget))
        dc.backend = self.backend
        return draft

    def plan_budget(self, P, B, mode, synthetic) -> tuple[int, dict]:
        """The planner's budget for an auto point: acceptance per budget as measured by earlier points of this sweep
        and its `history` sweeps (any batch size: what a server has seen so far), else the prior; then the cost
        model's best option."""
        method, alpha, spread, records = self.draft_method, {}, {}, list(self.records())  # read once, not per budget
        for b in self.cfg["budgets"]:
            seen = [r for r in records
                    if r.get("method") == method and r.get("budget") == b and r.get("prefix_len") == P
                    and r.get("draft_policy", "streaming") == "streaming"
                    and r.get("decoding") == mode and r.get("metrics", {}).get("alpha") is not None]
            alpha[b] = synthetic if synthetic is not None else (sum(r["metrics"]["alpha"] for r in seen) / len(seen) if seen else self.cfg["alpha_prior"])
            spread[b] = spread_of(seen)
        draft = self.draft_config if method == "longspec" else None
        best, options = plan(self.config, self.device_for(method), B, P + self.cfg["gen_len"] // 2,
                             [b for b in self.cfg["budgets"] if b < P], self.cfg["gammas"], alpha, draft,
                             tokens=self.cfg["gen_len"] - 1, spread=spread, ring_extra=self.ring_extra(),
                             sampled=mode == "sampled")
        budget = best.budget if best.budget is not None else min(b for b in self.cfg["budgets"] if b < P)
        return budget, {"predicted_best": vars(best), "budget": budget, "alpha": alpha[budget], "alpha_by_budget": alpha,
                        "spread": spread[budget], "spread_by_budget": spread, "options": [vars(o) for o in options]}

    def auto_policy(self, chosen: dict) -> AutoGamma:
        """The runtime policy of an auto point, drafting with the planner's budget: gamma per verification."""
        return AutoGamma(self.cfg["gammas"], chosen["alpha"], spread=chosen["spread"])

    def records(self):
        """This sweep's records, then those of the `history` sweeps (of this model)."""
        for d in [self.out] + [Path(h) for h in self.cfg["history"]]:
            for f in sorted(d.glob("*.json")):
                r = json.loads(f.read_text())
                if d == self.out or r.get("model") == self.config.name:
                    yield r

    @staticmethod
    def log(rec):
        m = rec["metrics"]
        line = f"{rec['point']:40s} {m['decode_tokens_per_s'] or 0:10.0f} tok/s"
        if rec["method"] != "baseline":
            line += f"  alpha={m['alpha'] or 0:.3f} speedup={m.get('measured_speedup', 0):.3f}"
            if (m.get("cost_model") or {}).get("speedup"):
                line += f" cost-model={m['cost_model']['speedup']:.3f}"
        tqdm.write(line)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path)
    p.add_argument("--output_dir", type=Path, required=True)
    p.add_argument("--max_minutes", type=float, default=None, help="stop between points after this long (resume later)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no_progress", action="store_true")
    a = p.parse_args(argv)
    with one_line_errors():
        sweep = Sweep(load_config(a.config), a.output_dir, torch.device(a.device), not a.no_progress)
        sweep.config_text = a.config.read_text()
        sweep.command = " ".join(["python -m magicdec.sweep"] + (argv if argv is not None else sys.argv[1:]))
        return 1 if sweep.run(a.max_minutes) and a.max_minutes is None else 0


if __name__ == "__main__":
    raise SystemExit(main())
