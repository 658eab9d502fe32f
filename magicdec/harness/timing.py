"""How generations are timed: decoders warmed up, then timed in interleaved rounds from the same prompt, each run on
the loop's own wall clock (Decoder.seconds), the run of median rate kept; and --gamma auto's profile of each
candidate."""
from __future__ import annotations

import gc
import time

import torch

from magicdec.decoding.generate import decode
from magicdec.model.tp import from_rank0

MAX_ROUNDS = 50  # timed rounds at most, whatever min_seconds asks


def warm_up_length(decoder, gen_len: int, graphed: bool) -> int:
    """Tokens a warm-up generates: every shape a timed run meets must be captured (or compiled) before timing. A
    drafter whose verification length varies (prompt lookup) has a graph per length, which only the whole run
    meets; a capture inside a timed run costs more than a small model's whole run."""
    if not graphed:
        return min(gen_len, 2)
    drafter = decoder.drafter if decoder.gamma else None
    return gen_len if drafter is not None and drafter.whole_run_warm_up else min(gen_len, 4 * (decoder.gamma + 1))


def timed_generations(decoders, cache, first, prev, gen_len: int, eos, seed: int, graphed: bool, repeats: int = 1,
                      min_seconds: float = 0.0, progress: bool = False, on_done=None):
    """(tokens, counts, seconds) of each decoder: warmed up, then rounds that time every decoder once, each from the
    prompt, until `repeats` rounds are done and every decoder has been timed for `min_seconds` in all (at most
    MAX_ROUNDS); each keeps its run of median decode rate (the slower of the middle two); `decoder.round_seconds`
    lists all of its runs in round order, `decoder.round_tokens` their decoded tokens and seconds and
    `decoder.round_rates` their decode tokens/s, all reach and first done (metrics pair them with the baseline's by
    round: the spread of a speedup).
    Interleaved, a speculative decoder and the baseline see the same state of the machine (clocks, host load,
    neighbours): timed minutes apart, the same graph on one GPU has measured further apart than the differences a
    comparison must resolve (results/planner_sweeps). The order alternates
    from round to round, so neither decoder is always the one that runs right after the host's pause between rounds.
    A run's seconds are read by its own loop (Decoder.seconds), so speedups, all-reach and first-done alike, divide
    spans of one clock. `on_done(i, result)`: called as decoder i's last run ends where the round count alone decides
    which round is the last (no min_seconds), else after the last round: a caller can show each result as it comes."""
    prompt_lengths = cache.lengths.clone()
    for decoder in decoders:
        cache.rollback(prompt_lengths)
        torch.manual_seed(seed + 1)
        decode(decoder, cache, first, warm_up_length(decoder, gen_len, graphed), eos, prev=prev)
    timings = [[] for _ in decoders]
    results = [None] * len(decoders)

    def finish(i: int) -> None:
        decoder, runs_of = decoders[i], timings[i]
        decoder.round_seconds = [r[0] for r in runs_of]
        decoder.round_tokens = [round_tokens(*r) for r in runs_of]
        decoder.round_rates = [rates_of(*r) for r in decoder.round_tokens]
        # the median by rate, not by seconds: sampled rounds that stop early decode fewer tokens in fewer seconds
        by_rate = sorted(range(len(runs_of)), key=lambda k: decoder.round_rates[k][0] or 0.0)
        seconds, decoder.stats, out, counts = runs_of[by_rate[(len(runs_of) - 1) // 2]]
        results[i] = (out, counts, seconds)
        if on_done is not None:
            on_done(i, results[i])

    while len(timings[0]) < repeats or (min(sum(r[0] for r in t) for t in timings) < min_seconds
                                        and len(timings[0]) < MAX_ROUNDS):
        last = len(timings[0]) + 1 >= repeats and min_seconds <= 0
        order = list(range(len(decoders)))
        for i in (order if len(timings[0]) % 2 == 0 else order[::-1]):
            cache.rollback(prompt_lengths)
            torch.manual_seed(seed + 1)
            out, counts = decode(decoders[i], cache, first, gen_len, eos, progress, prev)
            timings[i].append((decoders[i].seconds, decoders[i].stats, out, counts))
            if last:
                finish(i)
    for i in range(len(decoders)):
        if results[i] is None:
            finish(i)
    return results


def round_tokens(seconds: float, stats, out, counts) -> tuple[int, float, int | None, float | None]:
    """One run's decoded tokens and seconds, all reach and first done (metrics.speculation_metrics' conventions:
    each sequence's prefill token is not decoded): what rates over several batches sum."""
    first = stats.first_done or {}
    return (int((counts - 1).sum()), seconds, first["tokens"] - len(counts) if first.get("seconds") else None,
            first.get("seconds") or None)


def rates_of(decoded: int, seconds: float, first_decoded, first_seconds) -> tuple[float | None, float | None]:
    """Decode tokens/s, all reach and first done, of round_tokens' counts."""
    return (decoded / seconds if decoded and seconds else None), (first_decoded / first_seconds if first_seconds
                                                                  else None)


def timed_as_configured(decoders, cfg, cache, first, prev, eos):
    """timed_generations with a run config's generation length, seed, step mode, rounds and progress bars."""
    w, t = cfg.workload, cfg.timing
    return timed_generations(decoders, cache, first, prev, w.gen_len, eos, w.seed, cfg.runtime.graphed, t.repeats,
                             t.min_seconds, cfg.output.progress)


def profile_gammas(decoder, cache, first, prev, gen_len: int, eos, tries: int = 3) -> float:
    """--gamma auto: seconds per verification for every candidate gamma (with a tree, the tree at every depth too)
    and for the plain step (gamma 0), measured on this batch and context before it is timed, as a server profiles
    each batch shape once. Rank 0's numbers are everyone's, so all ranks choose alike. Returns the seconds profiling
    took.

    Each run length is timed `tries` times and the fastest kept, with Python's garbage collector off: a host pause
    only ever adds time, and one single timing per length let a sweep's auto point profile a verification well above
    what its timed runs took (results/planner_sweeps)."""
    policy, prompt_lengths, start = decoder.policy, cache.lengths.clone(), time.perf_counter()
    collecting = gc.isenabled()
    gc.disable()
    # the plain step, every candidate chain, and with a tree (AutoGamma.attach_tree) the tree at every depth
    shapes = [(0, 1)] + [(g, 1) for g in policy.gammas] + [(g, policy.width) for g in policy.gammas
                                                             if policy.tree_of is not None]
    try:
        for g, width in shapes:
            policy.forced, policy.forced_width = g, width
            decode(decoder, cache, first, min(gen_len, 4 * (g + 1)), eos, prev=prev)  # warm-up, capture
            cache.rollback(prompt_lengths)
            timings = []
            for n in (min(gen_len, 4 * (g + 1)), min(gen_len, 12 * (g + 1))):
                tried = []
                for _ in range(tries):
                    decode(decoder, cache, first, n, eos, prev=prev)
                    cache.rollback(prompt_lengths)
                    tried.append((decoder.seconds, decoder.stats.iterations))  # sampled tries may take other counts
                timings.append(min(tried))
            # the difference of a short and a longer run: a generation's fixed costs (setup, final sync) cancel out
            # (where the difference drowns in the noise of a tiny model's runs, the longer run's average)
            (s0, i0), (s1, i1) = timings
            (policy.tree_costs if width > 1 else policy.costs)[g] = (
                (s1 - s0) / (i1 - i0) if i1 > i0 and s1 > s0 else s1 / i1)
    finally:
        if collecting:
            gc.enable()
    policy.forced, policy.forced_width = None, 1
    policy.costs, policy.tree_costs = from_rank0([policy.costs, policy.tree_costs])
    return time.perf_counter() - start
