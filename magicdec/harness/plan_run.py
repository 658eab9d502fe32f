"""`magicdec run --plan auto | confirm K`, and a sweep's plan points: every drafter's composed options ranked by the
cost model at the run's own point (plan_command.Planner: its target, B, lengths, decoding and device), then timed on
one prefilled batch.

    auto       the top choice timed in turns with the baseline (the planner's pick, made before timing); where no
               option promises NEVER_LOSES_MARGIN, the baseline timed alone: the choice is off
    confirm K  the best-ranked option of each of the top K families (drafter, draft weight format, chain or tree),
               each prepared in turn over the same prefilled batch (one drafter alive at a time) and timed in turns
               with the baseline; the choice is the best all-reach median, or off where every one measured below 1.0

Each candidate runs the run's own workload, runtime and timing with its option's drafter options at the planner's
gamma. With random weights it draws the acceptance it was ranked at (Acceptance.run_options: a chain replays its
entry's trace, else its per-position rates; a tree its later candidates' rates); with a checkpoint its own (the
acceptance only ranked it). The record is the plan record: the ranking kept (--plan_top rows, the baseline's
included), every candidate's prediction beside its measurement, the choice, the planner's pick and its prediction
error; its `baseline` is the baseline's run paired with the choice (else with the first candidate, else timed alone).
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch

from magicdec import device as dev
from magicdec import files
from magicdec import options as opt
from magicdec.analysis import cost_model as cm
from magicdec.analysis.acceptance_inputs import load_acceptance
from magicdec.errors import MagicDecError, out_of_memory
from magicdec.harness.engine import Engine
from magicdec.harness.plan_command import NEVER_LOSES_MARGIN, Inputs, Planner, family
from magicdec.model.tp import from_rank0
from magicdec.harness.run_config import SECTIONS, RunConfig
from magicdec.harness.trial import Trial

AUTO = "the planner's top choice, made before timing"
CONFIRM = ("best of {k} measured on the same rounds: the best-ranked option of each of the planner's top {k} families "
           "(drafter, draft weight format, chain or tree), each timed in turns with the baseline")
POINT_KEYS = set().union(*(opt.keys(SECTIONS[s]) for s in ("models", "workload", "decoding", "runtime", "timing")))
TABLE_KEYS = {"confirm": "plan", "acceptance": "plan_acceptance", "profile": "plan_profile", "top": "plan_top"}


def profile_path(cfg: RunConfig, device: torch.device) -> Path:
    """--plan_profile, else this GPU's committed profile, else the H100's (cost_model.device_profile_path)."""
    if cfg.plan.plan_profile is not None:
        return cfg.plan.plan_profile
    return cm.device_profile_path(dev.environment(device).get("gpu") or device.type)


def planner_of(cfg: RunConfig, engine: Engine) -> Planner:
    """The run's point (its target, workload, decoding, runtime, timing), ranked against this device's memory."""
    point = {k: v for k, v in cfg.options().items() if k in POINT_KEYS} | {"progress": cfg.output.progress}
    spec = cfg.speculation
    memory = dev.memory(engine.device)[1] / (1 << 30) if engine.device.type == "cuda" else None
    return Planner(point, Inputs(profile_path(cfg, engine.device), cfg.plan.plan_acceptance,
                                 spec.synthetic_acceptance, spec.synthetic_siblings, memory,
                                 synthetic=cfg.models.random_weights), engine)


def chosen_rows(cfg: RunConfig, ranking: list[dict]) -> list[dict]:
    """The rows to time: auto's top choice (none where the baseline leads), or confirm's best-ranked option of each
    of the top K families: the variants of one family (n-gram sizes, budgets) rank side by side and differ less than
    the families do, so K slots of one family would confirm nothing the planner did not already say."""
    if cfg.plan.mode == "auto":
        return [] if ranking[0]["drafter"] == "baseline" else ranking[:1]
    rows, seen = [], set()
    for r in ranking:
        key = family(r["drafter"], r["config"])
        if r["drafter"] != "baseline" and key not in seen and len(rows) < cfg.plan.confirm:
            rows.append(r)
            seen.add(key)
    return rows


def candidate_config(planner: Planner, row: dict) -> RunConfig:
    """A ranked option's run config at its gamma, checked (a trace that cannot be read: one line naming it)."""
    try:
        return planner.config(row["drafter"], row["config"], row["gamma"], shaped=True)
    except MagicDecError as e:
        raise MagicDecError(f"--plan: {row['label']} (rank {row['rank']}) cannot run: {e}") from None


def measure(engine: Engine, cfg: RunConfig, point: str | None = None, eos: list[int] | None = None):
    """The plan at `cfg`'s point on `engine` (its target loaded here if it is not yet): (the plan record, each timed
    run's tokens by label, "baseline" where it ran alone). `eos`: the tokens that end a sequence (default: the
    config's)."""
    planner = planner_of(cfg, engine)
    result = from_rank0(planner.ranking())  # the ranks time the same candidates, whatever each one's memory made of it
    rows = chosen_rows(cfg, result["ranking"])
    configs = [candidate_config(planner, r) for r in rows]  # every check before the target loads
    models = [engine.plan(c)[0] for c in configs]
    engine.prompts(cfg)
    engine.load_target()
    trial = Trial(engine, cfg, queries=max((c.drafter.prefill_queries(c) for c in configs), default=0),
                  ahead=max((c.lookahead for c in configs), default=0))
    copy_bw = dev.copy_bandwidth(engine.device)
    B, candidates, outputs, alone, failed = cfg.workload.B, [], {}, None, []
    with torch.inference_mode():
        base_decoder = engine.decoder(cfg)
        if not rows:
            timed, = trial.time([base_decoder], cfg, eos)
            alone, outputs["baseline"] = trial.baseline_metrics(timed, copy_bw), timed.out.cpu()
        for row, c, m in zip(rows, configs, models):
            try:
                drafter, draft_s, _ = trial.prepare(c, m)
                timed, base, _ = trial.speculate(c, drafter, row["gamma"], None, base_decoder, eos)
            except Exception as e:  # noqa: BLE001 - a candidate the memory estimate let through: its line, not the plan's end
                if not out_of_memory(e):
                    raise
                failed.append({"label": row["label"], "rank": row["rank"], "why": f"out of memory ({type(e).__name__})"})
                drafter = timed = base = None
                dev.release_memory(engine.device)
                continue
            paired = trial.baseline_metrics(base, copy_bw)
            metrics = timed.metrics(B, paired, row["gamma"]) | {"draft_prefill_s": draft_s,
                                                                "paired_baseline": baseline_of(paired)}
            candidates.append(candidate_entry(row, c, metrics))
            outputs[row["label"]] = timed.out.cpu()
            del drafter, timed, base  # this drafter's caches (and graphs) go before the next one's are made
            dev.release_memory(engine.device)
        if rows and not candidates:  # every candidate ran out of memory: the baseline alone
            timed, = trial.time([base_decoder], cfg, eos)
            alone, outputs["baseline"] = trial.baseline_metrics(timed, copy_bw), timed.out.cpu()
    record = plan_record(cfg, engine, planner, result, candidates, alone, point) | {"not_timed": failed}
    if rows and not candidates:
        record["choice"]["why"] = "every candidate ran out of memory: the baseline runs"
    return record, outputs


def baseline_of(metrics: dict) -> dict:
    return {k: metrics.get(k) for k in ("decode_tokens_per_s", "round_tokens_per_s", "ms_per_step")}


def candidate_entry(row: dict, cfg: RunConfig, metrics: dict) -> dict:
    return {"label": row["label"], "drafter": row["drafter"], "options": row["options"], "config": cfg.options(),
            "gamma": row["gamma"], "rank": row["rank"], "predicted_speedup": row["speedup"],
            "predicted_T_D_over_T_T": row["T_D_over_T_T"], "predicted_T_V_over_T_T": row["T_V_over_T_T"],
            "acceptance_source": row["acceptance"], "metrics": metrics}


def all_reach(candidate: dict) -> float:
    return candidate["metrics"].get("measured_speedup") or 0.0


def choose(cfg: RunConfig, candidates: list[dict]) -> tuple[dict | None, str | None]:
    """(the chosen candidate, or None where the baseline runs; why it runs)."""
    if not candidates:
        return None, (f"every option predicts < {NEVER_LOSES_MARGIN}x: the baseline runs" if cfg.plan.mode == "auto"
                      else "no speculative option was ranked: the baseline runs")
    if cfg.plan.mode == "auto":
        return candidates[0], None
    best = max(candidates, key=all_reach)
    if all_reach(best) < 1.0:
        return None, "every confirmed candidate measured an all-reach median below 1.0x: the baseline runs"
    return best, None


def plan_record(cfg: RunConfig, engine: Engine, planner: Planner, result: dict, candidates: list[dict],
                alone: dict | None, point: str | None) -> dict:
    w, plan, ranking = cfg.workload, cfg.plan, result["ranking"]
    kept = ranking[:plan.plan_top]
    if all(r["drafter"] != "baseline" for r in kept):
        kept = kept + [next(r for r in ranking if r["drafter"] == "baseline")]
    choice, why = choose(cfg, candidates)
    paired = choice or (candidates[0] if candidates else None)
    alpha = planner.alpha
    iid = None if alpha is None else f"iid α {alpha:g}" + (" elsewhere" if plan.plan_acceptance else "") + \
        ", sensitivity"
    pick = ranking[0]
    timed = next((c for c in candidates if c["label"] == pick["label"]), None)
    measured = 1.0 if pick["drafter"] == "baseline" else timed and timed["metrics"].get("measured_speedup")
    return {
        "point": point, "method": "plan", "B": w.B, "prefix_len": w.prefix_len, "gen_len": w.gen_len,
        "decoding": cfg.decoding.name, "model": engine.target_config.name, "random_weights": cfg.models.random_weights,
        "environment": dev.environment(engine.device),
        "tensor_parallel": {"world": engine.world} if engine.world > 1 else None,
        "plan": {"mode": plan.mode, "confirm": plan.confirm, "selection": AUTO if plan.mode == "auto" else
                 CONFIRM.format(k=len(candidates)), "profile": str(planner.inputs.profile),
                 "acceptance": "; ".join(filter(None, [plan.plan_acceptance and str(plan.plan_acceptance), iid])),
                 "ranking": kept, "not_ranked": dict(Counter(r["reason"] for r in result["not_ranked"])),
                 "never_loses_margin": NEVER_LOSES_MARGIN},
        "baseline": paired["metrics"]["paired_baseline"] if paired else baseline_of(alone),
        "candidates": candidates,
        "choice": {"label": choice["label"] if choice else "baseline", "off": choice is None} | (
            {"why": why} if why else {}) | {
            "measured_speedup": choice["metrics"].get("measured_speedup") if choice else 1.0,
            "measured_speedup_first_done": choice["metrics"].get("measured_speedup_first_done") if choice else 1.0},
        # the baseline picked: what it measures is itself (1.0), and no speculation was predicted to be wrong about
        "planner_pick": {"label": pick["label"], "predicted_speedup": pick["speedup"], "measured_speedup": measured,
                         "prediction_error": pick["speedup"] / measured - 1
                         if measured and pick["drafter"] != "baseline" else None},
    }


def run(cfg: RunConfig) -> dict:
    """`magicdec run --plan ...`: the plan record, its table printed and the record written (rank 0)."""
    engine = Engine(cfg)
    engine.check(cfg)  # the baseline's prompts, shapes and memory, before anything large is allocated
    for warning in cfg.warnings():
        print(f"note: {warning}", file=sys.stderr)
    record, _ = measure(engine, cfg)
    if engine.rank == 0:
        print(table(record))
        files.write_record(cfg.output.output, record)
    return record


def table(record: dict) -> str:
    """The candidates' predicted and measured speedups, the choice and the planner's pick."""
    p = record["plan"]
    lines = [f"plan {p['mode']}{' ' + str(p['confirm']) if p['confirm'] else ''} at B {record['B']} x "
             f"{record['prefix_len']}, {record['gen_len']} tokens, {record['decoding']}: profile "
             f"{Path(p['profile']).name}, acceptance {p['acceptance']}",
             f"{'rank':>4}  {'γ':>2} {'predicted':>9} {'measured [min-max]':>22} {'first done':>10}  option"]
    for c in record["candidates"]:
        m = c["metrics"]
        spread = m.get("measured_speedup_range") or [float("nan")] * 2
        lines.append(f"{c['rank']:>4}  {c['gamma']:>2} {c['predicted_speedup']:>9.3f} "
                     f"{m.get('measured_speedup') or 0:>8.3f} [{spread[0]:.3f}-{spread[1]:.3f}] "
                     f"{m.get('measured_speedup_first_done') or 0:>10.3f}  {c['label']}")
    choice, pick = record["choice"], record["planner_pick"]
    lines.append(f"choice: {choice['label']}" + (f" (off: {choice['why']})" if choice["off"] else
                                                 f", {choice['measured_speedup']:.3f}x all reach, "
                                                 f"{choice['measured_speedup_first_done'] or 0:.3f}x first done"))
    lines.append(f"selection: {p['selection']}")
    error = pick["prediction_error"]
    lines.append(f"planner's pick: {pick['label']}, predicted {pick['predicted_speedup']:.3f}x"
                 + (f", measured {pick['measured_speedup']:.3f}x (error {error:+.1%})" if error is not None else ""))
    if not str(record["environment"].get("device", "")).startswith("cuda"):
        lines.append("note: CPU run: verification is compute-bound on a CPU, so these timings are no speed claim")
    return "\n".join(lines)


def line(record: dict) -> str:
    """A sweep's one line for a plan point."""
    c, pick = record["choice"], record["planner_pick"]
    return (f"{record['point']:50s} choice {c['label']} {c['measured_speedup']:.3f}x; planner's pick "
            f"{pick['label']} predicted {pick['predicted_speedup']:.3f}x")


def table_options(path, table: dict) -> dict:
    """A sweep's [plan] table as its points' run options: confirm = K (0 or absent: auto), acceptance, profile (paths
    as the sweep's others: from where it runs), top; a key it does not take is a one-line error."""
    unknown = sorted(set(table) - set(TABLE_KEYS))
    if unknown:
        raise MagicDecError(f"{path}: [plan] {unknown[0]} is not a plan key: give confirm = K (0: auto), acceptance = "
                            "\"FILE.json\", profile = \"FILE.json\", top = N")
    def count(key, least):
        n = table.get(key, least)
        if isinstance(n, bool) or not isinstance(n, int) or n < least:
            raise MagicDecError(f"{path}: [plan] {key} = {n!r}: give a whole number >= {least}"
                                + (" (the options to time; 0: auto, the top choice)" if key == "confirm" else ""))
        return n
    k, _ = count("confirm", 0), count("top", 1)
    for key, read in (("acceptance", load_acceptance), ("profile", cm.load_profile)):
        if key in table:
            if not isinstance(table[key], str):
                raise MagicDecError(f"{path}: [plan] {key} = {table[key]!r}: give a file's path")
            read(Path(table[key]), f"{path}: [plan] {key}")
    given = {TABLE_KEYS[key]: value for key, value in table.items() if key != "confirm"}
    return {"plan": ["confirm", k] if k else ["auto"]} | given
