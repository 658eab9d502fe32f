"""What a record says of a timed generation (magicdec/harness/metrics.py): the speedup is the median of the rounds' own
ratios to the baseline's run of the same round, with their min and max, all reach and first done alike; checked
against ratios worked out by hand."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from magicdec.harness import metrics
def stats(first_done=None):
    return SimpleNamespace(to_dict=lambda: {}, alpha=0.8, omega=3.0, iterations=10, time={"draft": 0.1, "verify": 0.5},
                           drafted=30, policy=None, first_done=first_done)


def test_speedup_is_the_median_of_the_rounds_ratios():
    """Rounds at 200 / 250 / 228.6 tokens/s against baselines of 100 / 100 / 150: the ratios are 2.0 / 2.5 / 1.52,
    their median 2.0; the kept runs' rates (228.6 over 100) would say 2.29."""
    base = metrics.generation_metrics(torch.tensor([11]), 0.1, 1, stats(), [0.1, 0.1, 1 / 15],
                                      [(100.0, None), (100.0, None), (150.0, None)])
    mine = metrics.generation_metrics(torch.tensor([241]), 1.05, 1, stats({"tokens": 121, "seconds": 0.4}),
                                      [0.8, 1.0, 1.05], [(200.0, 400.0), (250.0, 300.0), (240 / 1.05, 300.0)])
    m = metrics.speculation_metrics(mine, stats({"tokens": 121, "seconds": 0.4}), base, 3)
    assert m["measured_speedup_rounds"] == pytest.approx([2.0, 2.5, 240 / 1.05 / 150])
    assert m["measured_speedup"] == pytest.approx(2.0)
    assert m["measured_speedup_range"] == pytest.approx([240 / 1.05 / 150, 2.5])
    # first done: each round's first-done rate over the baseline's (all-reach) rate of that round: 4, 3, 2
    assert m["measured_speedup_first_done"] == pytest.approx(3.0)
    assert m["measured_speedup_first_done_range"] == pytest.approx([2.0, 4.0])


def test_without_paired_rounds_the_kept_runs_rates_divide():
    base = metrics.generation_metrics(torch.tensor([11]), 0.1, 1, stats(), [0.1])
    mine = metrics.generation_metrics(torch.tensor([241]), 1.2, 1, stats(), [1.2])
    m = metrics.speculation_metrics(mine, stats(), base, 3)
    assert m["measured_speedup"] == pytest.approx(200 / 100) and "measured_speedup_range" not in m
