"""One run, as `magicdec run` and the seed's tests/*_benchmark.py launch it: the config checked (a --baseline_json
read against it), its trial (magicdec.harness.trial: prefill, drafter, the baseline and each gamma timed in turns), the record
written and its summary printed."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from magicdec import device as dev
from magicdec import files
from magicdec.errors import MagicDecError
from magicdec.harness.run_config import RunConfig, load_baseline
from magicdec.harness.trial import build
from magicdec.decoding.acceptance import record_fields

COMPARED = ("B", "prefix_len", "gen_len", "dataset", "skip_tokens", "seed", "ignore_eos", "temperature", "top_p",
            "top_k", "dtype", "model", "model_name", "random_weights", "tokenizer")


def read_baseline(path: Path, cfg: RunConfig, model_config) -> dict:
    """Metrics of a baseline record made with the same model, prompts, batch, decoding, dtype and device."""
    record = load_baseline(path)
    theirs, ours = record.get("config") or record.get("args") or {}, cfg.options()
    if not isinstance(theirs, dict):
        raise MagicDecError(f"--baseline_json {path}: its config is not a JSON object; give a baseline run's record")
    for key in COMPARED:
        if key in theirs and theirs.get(key) != ours.get(key) and not (key == "dataset" and "config" not in record):
            raise MagicDecError(f"--baseline_json {path} was run with {key}={theirs.get(key)}, this run has "
                                f"{ours.get(key)}; compare like with like (or time one in turns: --baseline)")
    if "config" not in record and record.get("decoding") != cfg.decoding.describe():
        raise MagicDecError(f"--baseline_json {path} was decoded {record.get('decoding')}, this run is "
                            f"{cfg.decoding.describe()}; compare like with like")
    here, there = dev.environment(cfg.runtime.torch_device), record.get("environment")
    there = there if isinstance(there, dict) else {}
    for key in ("device", "gpu"):
        if here.get(key) != there.get(key):
            raise MagicDecError(f"--baseline_json {path} was run on device {there.get(key)}, this run is on "
                                f"{here.get(key)}; compare like with like")
    if record.get("model_config") != model_config.to_dict():
        raise MagicDecError(f"--baseline_json {path} was run with another model config; compare like with like")
    return record["metrics"]


def run(cfg: RunConfig) -> dict:
    """Time `cfg` (each of its gammas in turns with a baseline where it asks for one) and return its record; with
    --plan, the plan's (plan_run)."""
    if cfg.plan.mode:
        from magicdec.harness import plan_run

        return plan_run.run(cfg)
    baseline_given = None

    def compared(engine):  # a baseline to compare with, checked before anything large is allocated
        nonlocal baseline_given
        if cfg.timing.baseline_json:
            baseline_given = read_baseline(cfg.timing.baseline_json, cfg, engine.target_config)
        for warning in cfg.warnings():  # every check passed
            print(f"note: {warning}", file=sys.stderr)

    built = build(cfg, compared)
    engine, batch = built.engine, built.batch
    w, spec = cfg.workload, cfg.speculation
    device = engine.device
    copy_bw = dev.copy_bandwidth(device)
    result = built.run(baseline_given, copy_bw)
    metrics, baseline, out, counts = result.metrics, result.baseline, result.out, result.counts
    metrics.update(prefill_s=batch.seconds, draft_prefill_s=built.draft_prefill_s,
                   copy_bandwidth_GBps=copy_bw / 1e9 if copy_bw else None,
                   peak_memory_GiB=(dev.peak_memory(device) or 0) / 2**30 or None)
    record = make_record(cfg, built, metrics, baseline if spec.speculative else None, result.by_gamma)
    if spec.speculative and cfg.output.save_trace:
        record["acceptance_trace"] = result.traces[metrics["gamma"]]
    if cfg.output.save_tokens:
        record.update(prompt_ids=batch.prompts.tolist(), generated_ids=out.tolist(), generated_counts=counts.tolist())
    if engine.world > 1:  # per-rank memory, and one writer
        peaks = [None] * engine.world
        torch.distributed.all_gather_object(peaks, metrics["peak_memory_GiB"])
        record["tensor_parallel"] = {"world": engine.world, "rank_group": list(cfg.runtime.rank_group),
                                     "all_reduce": engine.all_reduce + (f"; draft group: {built.notes['all_reduce']}"
                                                                        if "all_reduce" in built.notes else ""),
                                     "drafter": built.notes,
                                     "peak_memory_GiB_per_rank": peaks}
        if engine.rank != 0:
            return record
    print_summary(cfg, record)
    if cfg.output.printoutput and batch.tokenizer is not None:
        for b in range(w.B):
            print(f"--- sequence {b}:", batch.tokenizer.decode(out[b, :counts[b]].tolist()))
    files.write_record(cfg.output.output, record)
    return record


def writes_records() -> bool:
    """Whether this process writes what a run reports: every process but ranks 1.. of a tensor-parallel run."""
    return not (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0)


def make_record(cfg: RunConfig, built, metrics: dict, baseline: dict | None, sweep: dict) -> dict:
    engine, spec = built.engine, cfg.speculation
    offload = None
    if cfg.runtime.offload:  # the prompt KV of every offloaded layer crosses the host link once per forward
        cache = built.batch.cache
        host = sum(t.nbytes for t in (*cache.host_k, *cache.host_v))
        h2d = dev.host_to_device_bandwidth(engine.device)
        offload = {"on_chip_layers": cfg.runtime.on_chip,
                   "offloaded_layers": engine.target_config.n_layers - cfg.runtime.on_chip,
                   "host_GiB": host / 2**30, "host_to_device_GBps": h2d / 1e9 if h2d else None,
                   "copy_s_per_forward": host / h2d if h2d else None}
    record = {
        "method": spec.drafter, "label": cfg.describe(), "config": cfg.options(), "config_hash": cfg.hash(),
        "checkpoint": str(engine.checkpoint) if engine.checkpoint else None,
        "model_config": engine.target_config.to_dict(),
        "draft_models": {name: c.to_dict() for name, (c, _) in built.models.items()} or None,
        "random_weights": cfg.models.random_weights,
        "prefill": "skipped: KV caches filled with random values" if cfg.runtime.skip_prefill else "computed",
        "draft_cache": cfg.drafter.describe(cfg) if cfg.drafter else None,
        "drafter_notes": built.notes or None,  # what the drafter's preparation reported (its weights' kernels)
        "offload": offload,
        **record_fields(spec),
        "decoding": cfg.decoding.describe(), "prompt_source": built.batch.prompt_source,
        "attn_backend": engine.backend, "environment": dev.environment(engine.device),
        "metrics": metrics, "baseline_metrics": baseline,
    }
    if len(sweep) > 1:
        record["gamma_sweep"] = {str(g): m for g, m in sweep.items()}
    return record


def print_table(rows: list[tuple[str, object]]) -> None:
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        if isinstance(value, float):
            value = f"{value:.4g}"
        print(f"{key:<{width}}  {value}")


LEGEND = {"omega_effective": "tokens per verification of the whole batch (stragglers included)",
          "T_D_over_T_T": "a draft step over a baseline step", "T_V_over_T_T": "a verification over a baseline step",
          "predicted_speedup": "Omega / (gamma T_D/T_T + T_V/T_T), from the measured ratios",
          "predicted_speedup_effective": "the same with Omega_eff",
          "measured_speedup": "every sequence reaches gen_len",
          "measured_speedup_first_done": "stopped when the first sequence is done (MagicDec's convention)"}


def print_summary(cfg: RunConfig, record: dict) -> None:
    m, base, w = record["metrics"], record.get("baseline_metrics"), cfg.workload
    model = record["model_config"].get("name") or "model"
    rows = [("drafter", record["label"]), ("model", model + (" (random weights)" if cfg.models.random_weights else "")),
            ("device", record["environment"].get("gpu", cfg.runtime.device)), ("decoding", record["decoding"]),
            ("B x prefix, gen_len", f"{w.B} x {w.prefix_len}, {w.gen_len}"),
            ("prompts", record.get("prompt_source") or "n/a"),
            ("timed rounds", f"{len(m.get('round_s') or [])} (the run of median rate kept)"),
            ("prefill s", m["prefill_s"] or "skipped")]
    if m.get("draft_prefill_s") is not None:
        rows.append(("draft preparation s", m["draft_prefill_s"]))
    rows += [("decode tokens/s", m.get("decode_tokens_per_s") or 0.0), ("ms / token", m.get("ms_per_token") or 0.0)]
    if base:  # what the speedup divides by, beside the speculative numbers
        rows += [("baseline tokens/s", base.get("decode_tokens_per_s") or 0.0),
                 ("baseline ms / token", base.get("ms_per_token") or 0.0)]
    if not cfg.speculation.speculative:
        rows.append(("ms / step", m.get("ms_per_step") or 0.0))
        if m.get("copy_bandwidth_GBps"):
            rows += [("achieved GB/s", m.get("achieved_bandwidth_GBps", 0.0)), ("copy GB/s", m["copy_bandwidth_GBps"]),
                     ("fraction of copy", m.get("bandwidth_fraction_of_copy", 0.0))]
    else:
        gammas = cfg.speculation.gamma
        rows += [("gamma", " ".join(map(str, gammas)) if "gamma_sweep" not in record else
                  f"{m['gamma']} (best of {' '.join(map(str, gammas))})"),
                 ("draft", record.get("draft_cache") or "n/a"),
                 ("alpha", m["alpha"] if m["alpha"] is not None else "n/a"),
                 ("acceptance length (Omega)", m["omega"] or 0.0)]
        for key, value in ((m.get("speculation") or {}).get("drafter") or {}).items():
            rows.append((key, value if value is not None else "n/a"))
        policy = (m.get("speculation") or {}).get("auto_gamma") or {}
        used = {int(g): n for g, n in (policy.get("iterations_per_gamma") or {}).items()}  # str keys once in JSON
        if used.get(0):  # else alpha "n/a" and Omega 1 would stand there with no word why
            off = "switched off" if policy.get("switched_off") else "off at times"
            steps = ", ".join(f"gamma {g}: {n}" for g, n in sorted(used.items()))
            rows.append(("speculation", f"{off} by the --gamma auto policy: measured step times and acceptance said "
                                        f"drafting would not pay; steps per gamma: {steps}"))
        for key in LEGEND:
            if key in m:
                spread = m.get(f"{key}_range")
                rows.append((f"{key} ({LEGEND[key]})", m[key] if not spread else
                             f"{m[key]:.4g}, the median of {len(m[f'{key}_rounds'])} rounds' ratios "
                             f"[{spread[0]:.4g}-{spread[1]:.4g}]"))
        if cfg.speculation.synthetic_acceptance is not None:
            rows.append(("synthetic acceptance", cfg.speculation.synthetic_acceptance))
        for g, gm in record.get("gamma_sweep", {}).items():
            rows.append((f"gamma {g}: speedup (first done)", "{:.3f} ({:.3f})".format(
                gm.get("measured_speedup") or 0.0, gm.get("measured_speedup_first_done") or 0.0)))
    if not str(record["environment"].get("device", "")).startswith("cuda"):  # memory-bound only on a GPU
        why = "verification is compute-bound on a CPU, so " if cfg.speculation.speculative else ""
        rows.append(("note", f"CPU run: {why}timings here are no speed claim; run on a GPU"))
    print_table(rows)


def main(cfg_from_argv, rename: dict | None = None) -> None:
    """Run the config `cfg_from_argv()` parses, bad input as one line (exit 2), Ctrl-C or SIGTERM as one line (exit
    130 or 143)."""
    from magicdec.errors import one_line_errors

    with one_line_errors("interrupted: the run did not finish and wrote no record (an earlier record at its --output "
                         "is as it was); run the same command again", rename=rename):
        run(cfg_from_argv())
        gloo = torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo"
        if gloo:
            torch.distributed.barrier()  # every rank done with its collectives
    if gloo:
        # Done, and every rank past the barrier: leave without the interpreter's teardown, where a gloo group's
        # threads die (SIGABRT on some ranks), and without destroy_process_group, which still aborted a rank about
        # once in 35 runs on 2 CPU cores ("terminate called without an active exception"). An NCCL group is left to
        # the exit: tearing it down while CUDA graphs that captured its collectives still exist hung every rank on
        # 4 x H200.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
