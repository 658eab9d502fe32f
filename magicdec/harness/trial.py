"""One trial: a batch of prompts prefilled in the target's cache, drafters prepared over it, decoders made, and timed in
interleaved rounds from the same prompt (timing.timed_generations), with the metrics a record keeps of each (a
speculative decoder's speedup the median of its rounds' ratios to the baseline's rounds). `magicdec run`, a sweep's
batch and its probes, `magicdec compare` and the benchmarks' side by side all run this one sequence; what each keeps
of it (a record, a sweep point's batches, a row, a peer's table) is its own.

    trial = build(cfg)                        # checked, the target loaded, its prompts prefilled, the drafter prepared
    result = trial.run(copy_bw=...)           # each gamma timed in turns with the baseline where the config asks
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from magicdec import device as dev
from magicdec.harness import metrics as met
from magicdec.harness import timing
from magicdec.harness.engine import Engine, first_tokens, Prefilled, target_slots
from magicdec.analysis.planner import AutoGamma
from magicdec.harness.run_config import RunConfig


@dataclass
class Timed:
    """One decoder's timed generation: the tokens and counts of its kept run (the median by rate), that run's
    seconds, and the decoder (its stats, every round's seconds and rates)."""
    decoder: object
    out: torch.Tensor
    counts: torch.Tensor
    seconds: float

    def metrics(self, B: int, baseline: dict | None = None, gamma: int = 0) -> dict:
        """Throughput (metrics.generation_metrics); a speculative decoder's acceptance and costs too, its speedup
        against `baseline` (paired by round where the baseline was timed in the same rounds)."""
        d = self.decoder
        m = met.generation_metrics(self.counts, self.seconds, B, d.stats, d.round_seconds, d.round_rates)
        if d.drafter is not None:
            m.update(met.speculation_metrics(m, d.stats, baseline, gamma))
        return m


@dataclass
class Result:
    """What a run's record keeps of its trial."""
    metrics: dict  # the baseline's, or the chosen gamma's (with `gamma`, and `gamma_chosen_by` where several ran)
    baseline: dict | None  # what the speedups were measured against
    by_gamma: dict  # gamma -> its metrics
    traces: dict  # gamma -> its acceptance trace (--save_trace)
    out: torch.Tensor  # the last timed run's tokens and counts (--save_tokens)
    counts: torch.Tensor


@dataclass
class Trial:
    """A batch of prompts on an engine's target, prefilled once: every preparation and timed generation starts from
    its prompt. `cfg` names the prompts and the batch; a batch several configs share (a sweep's points, compare's
    drafters) is made with the most `queries` any keeps and room for the longest draft any carries (`ahead`), or given
    already made (`batch`)."""
    engine: Engine
    cfg: RunConfig
    batch: Prefilled | None = None
    queries: int = 0
    ahead: int | None = None
    features: tuple | None = None
    drafter: object = None  # build's: the config's drafter, prepared over the batch
    draft_prefill_s: float | None = None
    models: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.batch is None:
            self.batch = self.engine.prefill(self.cfg, self.queries, target_slots(self.cfg, self.ahead), self.features)

    def rollback(self) -> None:
        """The target's cache back to the prompt."""
        cache = self.batch.cache
        cache.rollback(torch.full_like(cache.lengths, self.cfg.workload.prefix_len))

    def prepare(self, cfg: RunConfig, models: dict | None = None, ahead: int | None = None):
        """(the drafter `cfg` names, prepared over this batch; its preparation's seconds; its notes for the record).
        `models`: its models as engine.plan resolves them (default: resolved here)."""
        self.rollback()
        models = self.engine.plan(cfg)[0] if models is None else models
        return self.engine.prepare(cfg, self.batch, models, ahead)

    def eos(self, cfg: RunConfig) -> list[int]:
        return [] if cfg.workload.ignore_eos else self.engine.target_config.eos_ids

    def time(self, decoders: list, cfg: RunConfig | None = None, eos: list[int] | None = None,
             repeats: int | None = None, min_seconds: float | None = None, on_done=None) -> list[Timed]:
        """Each decoder warmed up, then timed in interleaved rounds from the prompt (timing.timed_generations) at
        `cfg`'s generation length, seed, rounds and progress (`repeats`, `min_seconds`: other rounds than its);
        `on_done(i, Timed)` as each is done."""
        cfg = cfg or self.cfg
        w, t = cfg.workload, cfg.timing
        self.rollback()
        first, prev = first_tokens(cfg, self.batch)
        done = None if on_done is None else (lambda i, r: on_done(i, Timed(decoders[i], *r)))
        results = timing.timed_generations(
            decoders, self.batch.cache, first, prev, w.gen_len, self.eos(cfg) if eos is None else eos, w.seed,
            cfg.runtime.graphed, t.repeats if repeats is None else repeats,
            t.min_seconds if min_seconds is None else min_seconds, cfg.output.progress, done)
        return [Timed(d, *r) for d, r in zip(decoders, results)]

    def speculate(self, cfg: RunConfig, drafter, gamma: int, policy: AutoGamma | None = None, baseline=None,
                  eos: list[int] | None = None, costs: dict | None = None):
        """`drafter`'s decoder at `gamma` timed in turns with the `baseline` decoder where one is given: (its Timed,
        the baseline's or None, the seconds --gamma auto's profile took or None). A `policy` (--gamma auto) is
        profiled on this batch first, unless given the `costs` an earlier batch profiled."""
        decoder = self.engine.decoder(cfg, drafter, gamma, policy)
        eos = self.eos(cfg) if eos is None else eos
        profile_s = None
        if policy is not None and costs is not None:
            policy.costs = costs
        elif policy is not None:
            self.rollback()
            first, prev = first_tokens(cfg, self.batch)
            profile_s = timing.profile_gammas(decoder, self.batch.cache, first, prev, cfg.workload.gen_len, eos)
        timed = self.time([decoder] + ([baseline] if baseline is not None else []), cfg, eos)
        return timed[0], (timed[1] if baseline is not None else None), profile_s

    def baseline_metrics(self, timed: Timed, copy_bw: float | None) -> dict:
        """A baseline's throughput and the bandwidth its steps achieved against the copy ceiling."""
        w, engine = self.cfg.workload, self.engine
        return timed.metrics(w.B) | met.bandwidth_metrics(engine.target, engine.target_config, w.B, w.prefix_len,
                                                          w.gen_len, engine.dtype, timed.seconds, copy_bw)

    def run(self, baseline_given: dict | None = None, copy_bw: float | None = None) -> Result:
        """The config's run: the baseline timed alone, or each gamma in turn (in rounds with the baseline where
        --baseline asks), its speedup against `baseline_given` (--baseline_json) or the baseline of its rounds; the
        gamma of the best all-reach speedup (else rate) kept."""
        cfg, spec, B = self.cfg, self.cfg.speculation, self.cfg.workload.B
        with torch.inference_mode():
            base_decoder = self.engine.decoder(cfg) if not spec.speculative or cfg.timing.baseline else None
            if not spec.speculative:
                timed, = self.time([base_decoder])
                baseline = self.baseline_metrics(timed, copy_bw)
                return Result(baseline, baseline, {}, {}, timed.out, timed.counts)
            by_gamma, traces = {}, {}
            for g in spec.gammas:
                policy = AutoGamma(range(1, g + 1), spec.alpha_prior,
                                   sibling_prior=spec.synthetic_siblings) if spec.auto else None
                timed, base, profile_s = self.speculate(cfg, self.drafter, g, policy, base_decoder)
                paired = None if base is None else self.baseline_metrics(base, copy_bw)
                by_gamma[g] = timed.metrics(B, baseline_given or paired, g)
                by_gamma[g].update(auto_gamma_profile_s=profile_s, paired_baseline=paired)
                decoder = timed.decoder
                if decoder.trace is not None:
                    traces[g] = {"gammas": decoder.trace_gammas, "accepted": decoder.trace}
                out, counts = timed.out, timed.counts
                del timed, base, decoder  # its CUDA graphs' memory goes back before the next gamma captures its own
                dev.release_memory(self.engine.device)
        best = max(by_gamma, key=lambda g: by_gamma[g].get("measured_speedup") or by_gamma[g]["decode_tokens_per_s"]
                   or 0)
        metrics = dict(by_gamma[best], gamma=best)
        if len(by_gamma) > 1:  # a selection, declared in the record: every candidate's figures stay in gamma_sweep
            metrics["gamma_chosen_by"] = (f"best of {len(by_gamma)} gammas by the all-reach speedup, each timed in "
                                          "its own rounds" + (" with the baseline" if base_decoder else ""))
        paired = metrics.pop("paired_baseline")
        return Result(metrics, baseline_given or paired, by_gamma, traces, out, counts)


def build(cfg: RunConfig, preflight=None, engine: Engine | None = None) -> Trial:
    """The composition root of one run: checks first (nothing large allocated until they pass; `preflight(engine)`
    adds the caller's), then the target, its prefilled cache and the drafter."""
    engine = engine or Engine(cfg)
    models = engine.check(cfg)
    if preflight is not None:
        preflight(engine)
    engine.prompts(cfg)  # before the weights: a source too small for B prompts of prefix_len is said first
    engine.load_target()
    queries = cfg.drafter.prefill_queries(cfg) if cfg.drafter else 0
    features = cfg.drafter.prefill_features(cfg, engine.target_config) if cfg.drafter else None
    trial = Trial(engine, cfg, queries=queries, features=features, models=models)
    if cfg.drafter:
        trial.drafter, trial.draft_prefill_s, trial.notes = trial.prepare(cfg, models)
        trial.batch.queries = trial.batch.features = None  # the selection, or the head, has read them
    return trial
