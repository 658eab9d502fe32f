"""Where each draft agrees with the target, position by position, on real batches: the record that lets any gamma
policy be replayed offline (benchmarks/planner/policy_replay.py) on the very batches a sweep times.

For every prompt offset (`--skip_tokens`) and mode, the target generates gen_len tokens one plain step at a time,
and at every position each draft budget's StreamingLLM cache, fed the same committed tokens as in
generate.Decoder, predicts the next token. Greedy: 1 where the draft's argmax is the target's token. Sampled (the
target's tokens drawn from its top-p distribution p): the chance sum(min(p, q)) that speculative sampling keeps a
token drawn from the draft's q there. A verification drafting gamma tokens from position t keeps the leading run of
agreements t, t+1, ... (greedy exactly, since a kept draft token is the target's); tests/test_acceptance_trace.py
checks that against the real decoder.

Beside the traces: each budget's profiled seconds per verification for gamma 0..max (runs.profile_gammas, as the
sweep's auto point profiles them), and, greedy, how many iterations fixed-gamma decoders and the sweep's `auto`
decoder took on each batch (one untimed run each), against which the replay is checked.

    python benchmarks/planner/acceptance_trace.py benchmarks/sweeps/smollm2.toml results/issue5/smollm2 --prefix_len 8000 \
        --B 128 --skip_tokens 8000 11000 15000 20000 --output $OUT/traces.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from magicdec import benchmark as bench  # noqa: E402
from magicdec import runs  # noqa: E402
from magicdec.errors import MagicDecError, one_line_errors  # noqa: E402
from magicdec.generate import Decoder, decode  # noqa: E402
from magicdec.planner import AutoGamma  # noqa: E402
from magicdec.sampling import next_token, probabilities, sample_from  # noqa: E402
from magicdec.sweep import MODES, Sweep, load_config  # noqa: E402


def trace(target, cache, first, prev, drafts: dict, sampling, n: int) -> tuple[torch.Tensor, dict]:
    """(tokens [B, n + 2], {label: acceptance [B, n]}): column i of a trace is about generated token i + 1 (token 0
    is `first`, from the prefill), i.e. hist column i + 2 of generate.Decoder."""
    B = first.shape[0]
    base = cache.lengths - 1
    hist = torch.zeros(B, n + 2, dtype=torch.long, device=first.device)
    hist[:, 0], hist[:, 1] = prev, first
    out = {label: torch.zeros(B, n, device=first.device) for label in drafts}
    s = sampling
    for i in range(n):
        m = i + 2  # committed entries of hist
        cache.rollback(base + m - 1)
        logits = target(hist[:, m - 1:m], cache, logits="last")[:, -1]
        p = None if s.greedy else probabilities(logits, s.temperature, s.top_p, s.top_k)
        x = logits.argmax(-1) if s.greedy else sample_from(p)
        for label, d in drafts.items():  # as Draft.propose: re-feed the last two committed tokens
            d.cache.rollback(base + m - 2)
            q_logits = d.model(hist[:, m - 2:m], d.cache, logits="last")[:, -1]
            if s.greedy:
                out[label][:, i] = (q_logits.argmax(-1) == x).float()
            else:
                out[label][:, i] = torch.minimum(p, probabilities(q_logits, s.temperature, s.top_p, s.top_k)).sum(-1)
        hist[:, m] = x
    cache.rollback(base + 1)  # back to the prompt
    return hist, out


def profile(sweep: Sweep, drafts: dict, sampling, cache, first, prev, args) -> dict:
    """{budget: {gamma: seconds per verification}}, gamma 0 the plain step, profiled as the sweep's auto point."""
    costs = {}
    for b, d in drafts.items():
        dec = Decoder(sweep.target, sampling, cuda_graphs=sweep.cuda, draft=d,
                      policy=AutoGamma(sweep.cfg["gammas"], sweep.cfg["alpha_prior"]))
        runs.profile_gammas(dec, cache, first, prev, args, [])
        costs[b] = {g: s for g, s in sorted(dec.policy.costs.items())}
    return costs


def iterations(sweep: Sweep, drafts: dict, sampling, cache, first, prev, n_new: int, fixed) -> dict:
    """Iterations (and, for auto, the gammas it used) of one untimed run of each fixed (budget, gamma) decoder and of
    the sweep's auto decoder, planned from the sweep's records and profiled on this batch."""
    out = {}
    P = int(cache.lengths[0])
    for b, g in fixed:
        dec = Decoder(sweep.target, sampling, draft=drafts[b], gamma=g, cuda_graphs=sweep.cuda)
        decode(dec, cache, first, n_new, [], prev=prev)
        cache.rollback(torch.full_like(cache.lengths, P))
        out[f"b{b} g{g}"] = {"iterations": dec.stats.iterations}
    mode = "greedy" if sampling.greedy else "sampled"
    _, chosen = sweep.plan_budget(P, first.shape[0], mode, None)
    policy, budget = sweep.auto_policy(chosen), chosen["budget"]
    dec = Decoder(sweep.target, sampling, cuda_graphs=sweep.cuda, policy=policy, draft=drafts[budget])
    runs.profile_gammas(dec, cache, first, prev, SimpleNamespace(**{**vars(sweep.args), "gen_len": n_new}), [])
    decode(dec, cache, first, n_new, [], prev=prev)
    cache.rollback(torch.full_like(cache.lengths, P))
    out["auto"] = {"iterations": dec.stats.iterations, "budget": budget, "policy": dec.stats.policy}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path)
    p.add_argument("records", type=Path, help="the sweep's records (its auto decoder, planned from them, runs on "
                   "each greedy batch too)")
    p.add_argument("--prefix_len", type=int, required=True)
    p.add_argument("--B", type=int, required=True)
    p.add_argument("--budgets", type=int, nargs="+", default=None, help="default: the config's budgets below the prefix")
    p.add_argument("--modes", nargs="+", choices=sorted(MODES), default=None, help="default: the config's modes")
    p.add_argument("--skip_tokens", type=int, nargs="+", required=True, help="one batch per prompt offset")
    p.add_argument("--no_runs", action="store_true", help="traces and profiles only, no decoder runs")
    p.add_argument("--max_minutes", type=float, default=None, help="stop before starting a batch after this long")
    p.add_argument("--output", type=Path, required=True)
    a = p.parse_args(argv)
    start = time.perf_counter()
    with one_line_errors():
        cfg = load_config(a.config)
        P, B = a.prefix_len, a.B
        budgets = a.budgets or [b for b in cfg["budgets"] if b < P]
        if any(not 0 < b < P for b in budgets):
            raise MagicDecError(f"--budgets {budgets}: every budget must be above 0 and below --prefix_len {P}")
        modes = a.modes or cfg["modes"]
        if not a.records.is_dir():
            raise MagicDecError(f"no sweep records at {a.records}: pass the sweep's output directory")
        sweep = Sweep(cfg, a.records, torch.device(
            "cuda" if torch.cuda.is_available() else "cpu"), progress=False)
        if sweep.draft_method != "selfspec":
            raise MagicDecError(f"{a.config} drafts with a draft model: traces are for self-speculation sweeps only "
                                "(drop draft / draft_name)")
        sweep.load()
        if sweep.cuda and not sweep.fits(B, P):  # weights loaded: fits() counts the caches
            raise MagicDecError(f"B={B} x prefix {P} with budgets {budgets} does not fit in this device's memory; "
                                "lower --B")
        fixed = [(b, g) for b in budgets for g in cfg["gammas"]]
        n = cfg["gen_len"] + max(cfg["gammas"]) + 1  # enough columns for the last verification's draft
        result = {"environment": sweep.env, "command": "python benchmarks/planner/acceptance_trace.py "
                  + " ".join(argv if argv is not None else sys.argv[1:]),
                  "prefix_len": P, "B": B, "gen_len": cfg["gen_len"], "gammas": cfg["gammas"], "budgets": budgets,
                  "sampling": {m: vars(MODES[m]) for m in modes}, "batches": [], "costs_s": {}}
        for skip in tqdm(a.skip_tokens, desc="batches"):
            if a.max_minutes is not None and time.perf_counter() - start > 60 * a.max_minutes:
                print(f"stopped after {a.max_minutes} minutes, before the batch at {skip}", flush=True)
                break
            args = SimpleNamespace(**{**vars(sweep.args), "B": B, "prefix_len": P, "skip_tokens": skip})
            with torch.inference_mode():
                prompts, _ = bench.load_prompts_for(args, sweep.config, sweep.checkpoint)
                prompts = prompts.to(sweep.device)
                cache, logits, _ = sweep.new_target_cache(P, prompts)
                drafts = {b: sweep.new_draft("selfspec", b, P, prompts) for b in budgets}
                for mode in modes:
                    sampling = MODES[mode]
                    torch.manual_seed(cfg["seed"])
                    first = next_token(logits, sampling.temperature, sampling.top_p, sampling.top_k)
                    cache.rollback(torch.full_like(cache.lengths, P))
                    t0 = time.perf_counter()
                    tokens, acc = trace(sweep.target, cache, first, prompts[:, -1], drafts, sampling, n)
                    row = {"skip_tokens": skip, "mode": mode, "trace_s": time.perf_counter() - t0,
                           "acceptance": {str(b): (t.int().tolist() if sampling.greedy
                                                   else (t * 1000).round().int().tolist())  # per mille
                                          for b, t in acc.items()},
                           "mean_acceptance": {str(b): float(t[:, :cfg["gen_len"] - 1].mean()) for b, t in acc.items()}}
                    if mode not in result["costs_s"]:  # profiled once per mode, on the first batch
                        result["costs_s"][mode] = {str(b): c for b, c in profile(
                            sweep, drafts, sampling, cache, first, prompts[:, -1], args).items()}
                    if sampling.greedy and not a.no_runs:
                        row["runs"] = iterations(sweep, drafts, sampling, cache, first, prompts[:, -1],
                                                 cfg["gen_len"], fixed)
                    result["batches"].append(row)
                    print(f"skip {skip} {mode}: mean acceptance " + ", ".join(
                        f"b{b} {v:.3f}" for b, v in row["mean_acceptance"].items()) + (
                        "; iterations " + ", ".join(f"{k} {v['iterations']}" for k, v in row["runs"].items())
                        if "runs" in row else ""), flush=True)
                del cache, drafts
            bench.release_memory(sweep.device)
            a.output.parent.mkdir(parents=True, exist_ok=True)  # after every batch: a time limit loses only one
            a.output.write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
