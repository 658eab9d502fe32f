"""How far apart two decoders measure when they should not differ, and what the sweep's pairing can resolve.

For one (prefix, B, decoding) group of a committed sweep: the baseline decoder A (captured first, as the sweep's),
the sweep's `auto` decoder (planned from the sweep's records, profiled like the sweep's), a second baseline decoder
A2 captured after it, and optionally fixed settings of the sweep's drafting method, all timed in the same interleaved rounds
(runs.timed_generations, order alternating). Greedy decoders must give A's tokens (`same_tokens_as_A`). A2 / A is the A/A noise floor of a paired ratio; auto / A with auto
off is what the sweep reports at points where the planner switched speculation off; auto / best fixed in the same
rounds is the planner check without two different baseline pairings in between.

    python benchmarks/planner/pairing_check.py benchmarks/sweeps/smollm2.toml results/issue5/smollm2 \
        --group 4096:1:greedy --group 8000:128:greedy:1024/1,1024/2 --min_seconds 3 --output results/issue5/pairing_check.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from magicdec import benchmark as bench  # noqa: E402
from magicdec import runs  # noqa: E402
from magicdec.errors import one_line_errors  # noqa: E402
from magicdec.generate import Decoder, decode  # noqa: E402
from magicdec.sampling import next_token  # noqa: E402
from magicdec.sweep import MODES, Sweep, load_config  # noqa: E402


def group_check(sweep: Sweep, P: int, B: int, mode: str, fixed: list[tuple[int, int]], repeats: int,
                min_seconds: float, skip_tokens: int | None = None) -> dict:
    cfg = sweep.cfg
    args = SimpleNamespace(**{**vars(sweep.args), "B": B, "prefix_len": P, "repeats": repeats, "min_seconds": min_seconds})
    if skip_tokens is not None:  # another batch of the same texts: each prompt ends, and goes on, elsewhere
        args.skip_tokens = skip_tokens
    sampling = MODES[mode]
    with torch.inference_mode():
        prompts, _ = bench.load_prompts_for(args, sweep.config, sweep.checkpoint)
        prompts = prompts.to(sweep.device)
        cache, logits, _ = sweep.new_target_cache(P, prompts)
        torch.manual_seed(cfg["seed"])
        first = next_token(logits, sampling.temperature, sampling.top_p, sampling.top_k)
        cache.rollback(torch.full_like(cache.lengths, P))

        decoders = {"A": Decoder(sweep.target, sampling, cuda_graphs=sweep.cuda)}
        decode(decoders["A"], cache, first, 8, [], prev=prompts[:, -1])  # captured first, as in the sweep
        cache.rollback(torch.full_like(cache.lengths, P))
        _, chosen = sweep.plan_budget(P, B, mode, None)
        policy = sweep.auto_policy(chosen)
        decoders["auto"] = Decoder(sweep.target, sampling, cuda_graphs=sweep.cuda, policy=policy,
                                   draft=sweep.new_draft(sweep.draft_method, chosen["budget"], P, prompts))
        runs.profile_gammas(decoders["auto"], cache, first, prompts[:, -1], args, [])
        for b, g in fixed:
            decoders[f"b{b} g{g}"] = Decoder(sweep.target, sampling, draft=sweep.new_draft(sweep.draft_method, b, P, prompts),
                                             gamma=g, cuda_graphs=sweep.cuda)
        decoders["A2"] = Decoder(sweep.target, sampling, cuda_graphs=sweep.cuda)
        results = runs.timed_generations(list(decoders.values()), cache, first, prompts[:, -1], args, [])
        profiled = dict(policy.costs)  # seconds per verification by gamma (0: the plain step)
        # each one's stats of its last timed run, kept before profiling auto again replaces its own
        stats = {name: dec.stats for name, dec in decoders.items()}
        cache.rollback(torch.full_like(cache.lengths, P))
        runs.profile_gammas(decoders["auto"], cache, first, prompts[:, -1], args, [])  # again: its run-to-run spread
    reference, a_rounds = results[0][0], decoders["A"].round_seconds
    # The policy's profiled seconds per verification against what the same gamma costs per iteration in a timed run
    # of a fixed-gamma decoder (and gamma 0 in A's): where they differ, auto chooses from wrong costs.
    out = {"prefix_len": P, "B": B, "decoding": mode, "skip_tokens": args.skip_tokens, "planner": chosen,
           "rounds": len(a_rounds), "profiled_seconds_per_verification": profiled,
           "profiled_again": policy.costs, "decoders": {}}
    for (name, dec), (tokens, _, secs) in zip(decoders.items(), results):
        vs_a = [a / r for a, r in zip(a_rounds, dec.round_seconds)]  # speedup over A, round by round
        out["decoders"][name] = {
            "median_s": secs, "round_s": dec.round_seconds,
            # greedy: speculation changes no token (sampled: the draws differ, so no check)
            "same_tokens_as_A": bool(torch.equal(tokens, reference)) if sampling.greedy else None,
            "gpu_phase_s": stats[name].time,
            "gamma_use": stats[name].policy and stats[name].policy["iterations_per_gamma"],
            "iterations": stats[name].iterations, "seconds_per_iteration": secs / stats[name].iterations,
            "paired_vs_A": statistics.median(vs_a), "paired_vs_A_range": [min(vs_a), max(vs_a)]}
    return out


def group_arg(text: str) -> tuple[int, int, str, list[tuple[int, int]]]:
    """PREFIX:B:MODE[:BUDGET/GAMMA,...] -> (prefix, B, mode, fixed settings)."""
    try:
        P, B, mode, *rest = text.split(":")
        fixed = [tuple(map(int, f.split("/", 1))) for f in rest[0].split(",")] if rest else []
        P, B = int(P), int(B)
        if mode not in MODES or len(rest) > 1 or any(len(f) != 2 for f in fixed):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use PREFIX:B:MODE[:BUDGET/GAMMA,...] with MODE one of "
                                         f"{sorted(MODES)}, e.g. 8000:128:greedy:1024/1,1024/2") from None
    for budget, gamma in fixed:
        if not 0 < budget < P or gamma < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: a fixed setting needs 0 < budget < prefix ({P}) and gamma >= 1, "
                                             f"got {budget}/{gamma}")
    return P, B, mode, fixed


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path)
    p.add_argument("records", type=Path, help="the sweep's records (the auto decoder is planned from them)")
    p.add_argument("--group", action="append", required=True, type=group_arg,
                   help="PREFIX:B:MODE[:BUDGET/GAMMA,...] (repeatable): fixed settings timed alongside")
    p.add_argument("--skip_tokens", type=int, nargs="+", default=[None],
                   help="run every group once per value (prompts start this many tokens into each book; default: "
                        "the config's)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--min_seconds", type=float, default=3.0)
    p.add_argument("--output", type=Path, required=True)
    a = p.parse_args(argv)
    with one_line_errors():
        sweep = Sweep(load_config(a.config), a.records, torch.device("cuda" if torch.cuda.is_available() else "cpu"),
                      progress=False)
        sweep.load()
        checks = []
        for g, skip in ((g, skip) for skip in a.skip_tokens for g in a.group):
            start = time.perf_counter()
            checks.append(group_check(sweep, *g, a.repeats, a.min_seconds, skip))
            row = checks[-1]
            print(f"{':'.join(map(str, g[:3]))} (skip_tokens {row['skip_tokens']}): {row['rounds']} rounds, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
            print("  profiled ms per verification: " + ", ".join(
                f"gamma {g} {c * 1e3:.2f} (again {row['profiled_again'][g] * 1e3:.2f})"
                for g, c in sorted(row["profiled_seconds_per_verification"].items(), key=lambda kv: str(kv[0]))), flush=True)
            for name, d in row["decoders"].items():
                print(f"  {name:10s} median {d['median_s'] * 1e3:8.2f} ms  {d['seconds_per_iteration'] * 1e3:6.2f} ms/iteration"
                      f"  paired vs A {d['paired_vs_A']:.4f} "
                      f"[{d['paired_vs_A_range'][0]:.3f}, {d['paired_vs_A_range'][1]:.3f}]  gpu {d['gpu_phase_s']}"
                      f"  gamma {d['gamma_use']}", flush=True)
            bench.release_memory(sweep.device)
            a.output.parent.mkdir(parents=True, exist_ok=True)  # after every check: a time limit loses only one
            a.output.write_text(json.dumps({"environment": sweep.env, "command": "python benchmarks/planner/pairing_check.py "
                                            + " ".join(argv if argv is not None else sys.argv[1:]),
                                            "checks": checks}, indent=1, default=str))


if __name__ == "__main__":
    main()
