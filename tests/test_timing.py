"""Timing (magicdec/harness/timing.py): interleaved rounds until repeats and min_seconds are met, the median kept, every
round listed, the order alternating; warm-ups long enough for every shape a timed run meets; --gamma auto's profile
keeping each run length's fastest try. The runs are fakes with set durations, so no outcome depends on the machine."""
from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from magicdec.harness import timing
from magicdec.analysis.planner import AutoGamma


def fake_cache():
    return SimpleNamespace(lengths=torch.zeros(1), rollback=lambda lengths: None)


@pytest.mark.parametrize("repeats,min_seconds,run_s,rounds", [
    (3, 0.0, 0.13, 3),  # repeats alone
    (3, 1.0, 0.13, 8),  # 8 x 0.13 s is the first sum >= 1 s
    (3, 0.2, 0.13, 3),  # already long enough after the repeats
    (3, 100.0, 0.13, 50),  # capped at MAX_ROUNDS
])
def test_timing_rounds_until_min_seconds(monkeypatch, repeats, min_seconds, run_s, rounds):
    """Rounds go on past `repeats` until each decoder was timed `min_seconds` in all; the slower decoder does not
    decide alone (the faster one must reach it too), the median run is kept, every run is listed, and the order
    alternates from round to round."""
    calls = []

    def fake_decode(decoder, cache, first, n, eos, progress=False, prev=None):
        calls.append(decoder.name)
        decoder.seconds = run_s * (1.0 if decoder.name == "fast" else 2.0) * (1 + 0.01 * len(calls))
        decoder.stats = SimpleNamespace(first_done={"tokens": 12, "seconds": decoder.seconds / 2})
        return "tokens", torch.tensor([9, 9])  # two sequences, 8 decoded tokens each

    monkeypatch.setattr(timing, "decode", fake_decode)
    decoders = [SimpleNamespace(name="fast", gamma=0, stats=None), SimpleNamespace(name="slow", gamma=0, stats=None)]
    (_, _, fast_s), (_, _, slow_s) = timing.timed_generations(decoders, fake_cache(), None, None, 8, [], 0, False,
                                                              repeats, min_seconds)
    assert calls[:2] == ["fast", "slow"]  # the warm-up runs
    assert calls[2:] == (["fast", "slow", "slow", "fast"] * rounds)[:2 * rounds]
    fast_runs = [run_s * (1 + 0.01 * (i + 1)) for i, name in enumerate(calls) if name == "fast"][1:]
    assert decoders[0].round_seconds == pytest.approx(fast_runs)
    # each run's decode tokens/s, all reach (16 tokens) and first done (12 - 2 prefill tokens in half the time)
    assert len(decoders[0].round_rates) == len(fast_runs)  # pytest.approx compares flat sequences only
    for (all_reach, first_done), s in zip(decoders[0].round_rates, fast_runs):
        assert (all_reach, first_done) == pytest.approx((16 / s, 10 / (s / 2)))
    assert fast_s == pytest.approx(sorted(fast_runs)[rounds // 2])
    assert slow_s == pytest.approx(sorted(decoders[1].round_seconds)[rounds // 2])


@pytest.mark.parametrize("varying, graphs, warm", [(True, True, 20), (False, True, 12), (True, False, 2)])
def test_warm_up_meets_every_shape_of_a_varying_draft(monkeypatch, varying, graphs, warm):
    """A drafter whose verification length varies (prompt lookup, a hierarchy over it) is warmed up by the whole
    run, so every length's CUDA graph is captured before timing; other drafters by 4 (gamma + 1) tokens; eager
    runs by 2."""
    lengths = []

    def fake_decode(decoder, cache, first, n, *a, **k):
        lengths.append(n)
        decoder.seconds = 1.0
        decoder.stats = SimpleNamespace(first_done={})
        return "tokens", torch.tensor([n + 1])

    monkeypatch.setattr(timing, "decode", fake_decode)
    decoder = SimpleNamespace(gamma=2, stats=None, drafter=SimpleNamespace(whole_run_warm_up=varying))
    timing.timed_generations([decoder], fake_cache(), None, None, 20, [], 0, graphs)
    assert lengths == [warm, 20]


def test_profile_keeps_each_length_fastest_try(monkeypatch):
    """Profiling times each run length three times and keeps the fastest: a host pause (here 50 ms on the first try
    of the long gamma-1 run) only adds time, and does not reach the cost. Per gamma: short and long runs of 4 and 12
    iterations at 10 ms per iteration (20 ms per verification at gamma 1) plus 5 ms of fixed cost."""
    per_iteration = {0: 0.010, 1: 0.020}
    policy = AutoGamma([1], 0.8)
    decoder = SimpleNamespace(policy=policy, stats=SimpleNamespace(iterations=0), seconds=None)
    calls, collecting = [], []

    def decode(dec, cache, first, n, eos, prev=None):
        g = policy.forced
        dec.stats.iterations = n // (g + 1)
        calls.append((g, n))
        collecting.append(gc.isenabled())
        pause = 0.05 if (g, n, sum(c == (g, n) for c in calls)) == (1, 24, 1) else 0.0  # the first long try
        dec.seconds = 0.005 + dec.stats.iterations * per_iteration[g] + pause

    monkeypatch.setattr(timing, "decode", decode)
    timing.profile_gammas(decoder, SimpleNamespace(lengths=torch.tensor([8]), rollback=lambda lengths: None), None,
                          None, 64, [])
    assert policy.costs == pytest.approx(per_iteration) and policy.forced is None
    assert sorted(set(calls)) == [(0, 4), (0, 12), (1, 8), (1, 24)] and len(calls) == 2 * (1 + 2 * 3)
    assert not any(collecting) and gc.isenabled()  # no collection while timing; back on after


def test_a_policy_with_a_tree_profiles_the_tree_at_every_depth(monkeypatch):
    """With a tree attached the profile times the plain step, each chain, and the tree at each depth (its own
    seconds: here 1 ms more per verification than the chain of its depth)."""
    from magicdec.model.tree import Tree

    policy = AutoGamma([1, 2], 0.8)
    policy.attach_tree(2, lambda g: Tree.chain_with_siblings(g, 2))
    decoder = SimpleNamespace(policy=policy, stats=SimpleNamespace(iterations=0), seconds=None)
    calls = []

    def decode(dec, cache, first, n, eos, prev=None):
        g, w = policy.forced, policy.forced_width
        calls.append((g, w))
        dec.stats.iterations = n // (g + 1)
        dec.seconds = dec.stats.iterations * (0.010 + 0.005 * g + (0.001 if w > 1 else 0.0))

    monkeypatch.setattr(timing, "decode", decode)
    timing.profile_gammas(decoder, SimpleNamespace(lengths=torch.tensor([8]), rollback=lambda lengths: None), None,
                          None, 64, [])
    assert sorted(set(calls)) == [(0, 1), (1, 1), (1, 2), (2, 1), (2, 2)]
    assert policy.costs == pytest.approx({0: 0.010, 1: 0.015, 2: 0.020})
    assert policy.tree_costs == pytest.approx({1: 0.016, 2: 0.021})
    assert policy.forced is None and policy.forced_width == 1


def test_the_kept_run_is_the_median_by_rate_when_rounds_decode_different_counts(monkeypatch):
    """Sampled rounds that stop early decode fewer tokens in fewer seconds: the median by seconds would keep the
    round of 250 tokens/s, the median by rate is the round of 228.6 tokens/s."""
    runs = iter([(0.1, 8), (0.1, 8),  # the two warm-ups, then round 1 (fast, slow), round 2 (slow, fast), ...
                 (0.80, 160), (2.0, 250), (2.0, 250), (1.00, 250), (1.05, 240), (2.0, 250)])

    def fake_decode(decoder, cache, first, n, eos, progress=False, prev=None):
        decoder.seconds, decoded = next(runs)
        decoder.stats = SimpleNamespace(first_done=None)
        return "tokens", torch.tensor([decoded + 1])

    monkeypatch.setattr(timing, "decode", fake_decode)
    decoders = [SimpleNamespace(name="fast", gamma=0, stats=None), SimpleNamespace(name="slow", gamma=0, stats=None)]
    (_, counts, seconds), _ = timing.timed_generations(decoders, fake_cache(), None, None, 8, [], 0, False, 3)
    assert [r[0] for r in decoders[0].round_rates] == pytest.approx([200.0, 250.0, 240 / 1.05])
    assert (seconds, int(counts[0]) - 1) == (1.05, 240)
