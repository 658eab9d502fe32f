"""What a record says of a timed generation: throughput, bandwidth against the copy ceiling, and for speculation the
acceptance, the measured cost ratios, the cost model's prediction from them and the measured speedups."""
from __future__ import annotations

import statistics

from magicdec.analysis import cost_model
from magicdec.model.kv_cache import KVCache


def generation_metrics(counts, seconds, B: int, stats, round_seconds, round_rates=()) -> dict:
    """Throughput of a timed generation (`seconds`: its median run; `round_seconds`: every run's, in round order;
    `round_rates`: every run's decode tokens/s, all reach and first done).
    Token 1 comes from the prefill logits, so decode produced counts - 1. Over several batches of B sequences
    (a sweep's skip_tokens list): counts side by side, seconds, stats and iterations summed over the batches."""
    decoded = int((counts - 1).sum())
    batches = len(counts) // B
    per_seq = decoded / B
    return {"decode_s": seconds, "decode_tokens_per_s": decoded / seconds if decoded and seconds else None,
            "ms_per_token": 1e3 * seconds / per_seq if per_seq else None,
            "generated_tokens": int(counts.sum()), "batch_size": B, "batches": batches,
            "iterations": stats.iterations, "decode_steps": stats.iterations,
            "ms_per_step": 1e3 * seconds / stats.iterations if stats.iterations else None,
            "time_split_s": stats.time, "round_s": round_seconds,
            "round_tokens_per_s": [r[0] for r in round_rates] or None,
            "round_tokens_per_s_first_done": [r[1] for r in round_rates] or None}


def bandwidth_metrics(model, config, B: int, prefix_len: int, gen_len: int, dtype, seconds, copy_bw) -> dict:
    """Bytes one decode step must read (weights + the KV of every sequence) over its measured time."""
    steps = gen_len - 1
    if not steps:
        return {}
    # Per rank under tensor parallelism: its weight slice and its KV heads, against its own GPU's copy bandwidth.
    kv_token = KVCache.nbytes_for(config.n_layers, 1, model.n_kv_heads, 1, config.head_dim, dtype)
    kv_read = kv_token * B * sum(prefix_len + i + 1 for i in range(steps)) / steps
    step_bytes = model.weight_bytes() + kv_read
    achieved = step_bytes / (seconds / steps)
    out = {"bytes_per_step": step_bytes, "achieved_bandwidth_GBps": achieved / 1e9}
    if copy_bw:
        out["bandwidth_fraction_of_copy"] = achieved / copy_bw
    return out


def baseline_step_seconds(baseline: dict) -> float | None:
    """T_T: one baseline decode step, on the clock the speculative phases are timed by (each phase's span: CUDA
    events on a GPU), so that T_D/T_T and T_V/T_T divide like by like; records without the split: its wall clock."""
    steps, split = baseline.get("iterations"), baseline.get("time_split_s") or {}
    if steps and split.get("verify"):
        return split["verify"] / steps
    return baseline["ms_per_step"] / 1e3 if baseline.get("ms_per_step") else None


def paired_speedups(metrics: dict, baseline: dict) -> dict:
    """Each metric's speedup as the median of the rounds' own ratios (each round's speculative run over the baseline's
    run of the same round), with their min and max: a ratio of medians would pair runs of different rounds, and a
    median chosen by seconds picks a round that decoded fewer tokens. Without paired rounds: the ratio of the kept
    runs' rates."""
    rounds = round_speedups(metrics, baseline)
    out = dict(rounds)
    for key in ("", "_first_done"):
        ratios = rounds.get(f"measured_speedup{key}_rounds")
        if ratios:
            out[f"measured_speedup{key}"] = statistics.median(ratios)
            out[f"measured_speedup{key}_range"] = [min(ratios), max(ratios)]
    return out


def round_speedups(metrics: dict, baseline: dict | None) -> dict:
    """Each timed round's speedup over the baseline's run of the same round (timing.timed_generations interleaves
    them), all reach and first done: the spread a median speedup is read with. Empty unless both were timed in the
    same rounds."""
    base = (baseline or {}).get("round_tokens_per_s") or []
    out = {}
    for key in ("", "_first_done"):
        mine = metrics.get(f"round_tokens_per_s{key}") or []
        if len(mine) == len(base) and base and all(mine) and all(base):
            out[f"measured_speedup{key}_rounds"] = [a / b for a, b in zip(mine, base)]
    return out


def speculation_metrics(metrics: dict, stats, baseline: dict | None, gamma: int) -> dict:
    """Acceptance, the measured cost ratios and the cost model's prediction Omega / (gamma*T_D/T_T + T_V/T_T)."""
    out = {"speculation": stats.to_dict()}
    alpha, omega = stats.alpha, stats.omega
    t_t = baseline_step_seconds(baseline) if baseline else None
    if t_t and stats.iterations:
        t_d = stats.time.get("draft", 0.0) / stats.drafted / t_t if stats.drafted else 0.0
        t_v = stats.time.get("verify", 0.0) / stats.iterations / t_t
        out.update(T_D_over_T_T=t_d, T_V_over_T_T=t_v)
        # --gamma auto, prompt lookup: the draft length varied, so no one formula predicts it
        fixed = stats.policy is None and stats.drafted == gamma * stats.iterations
        if alpha is not None and fixed:
            out["predicted_speedup"] = cost_model.omega(alpha, gamma) / (gamma * t_d + t_v)
    if baseline and metrics.get("decode_tokens_per_s") and baseline.get("decode_tokens_per_s"):
        out["measured_speedup"] = metrics["decode_tokens_per_s"] / baseline["decode_tokens_per_s"]
        # MagicDec's own convention (its benchmark stops at the first sequence to finish): no straggler cost
        first = stats.first_done
        if first and first["seconds"] > 0:
            first_tokens = metrics["batch_size"] * metrics["batches"]  # each batch's prefill token
            out["decode_tokens_per_s_first_done"] = (first["tokens"] - first_tokens) / first["seconds"]
            out["measured_speedup_first_done"] = out["decode_tokens_per_s_first_done"] / baseline["decode_tokens_per_s"]
    if baseline:
        out.update(paired_speedups(metrics, baseline))
    out.update(alpha=alpha, omega=omega, acceptance_length=omega)
    if metrics.get("iterations"):
        # Tokens per sequence per verification of the whole batch: the loop runs until its slowest sequence is done,
        # so stragglers make this lower than omega, and the speedup follows this one.
        decoded = metrics["generated_tokens"] / metrics["batch_size"] - metrics["batches"]
        out["omega_effective"] = decoded / metrics["iterations"]
        if "T_D_over_T_T" in out and stats.policy is None:  # draft steps per verification: gamma, or fewer (lookup)
            steps = stats.drafted / stats.iterations
            out["predicted_speedup_effective"] = out["omega_effective"] / (steps * out["T_D_over_T_T"] + out["T_V_over_T_T"])
    return out
