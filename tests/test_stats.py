"""magicdec/decoding/stats.py: a generation's counts and their totals, against hand-written counts."""
import torch

from magicdec.decoding.stats import Counts, PhaseTimer, Stats


def test_counts_of_ragged_verifications_by_hand():
    """Two verifications of gamma 3 over B = 3 (the last sequence stopped before the second): accepted 3 (all), 1, 0
    then 2, 0. Position i is examined when the ones before it were kept (all 3 when all are kept), kept when i <
    accepted; first done after the iteration in which some sequence has n_new tokens."""
    counts, cols = Counts(3, 3, "cpu"), torch.arange(4)
    taken, examined = counts.add(3, torch.tensor([3, 1, 0]), torch.tensor([True, True, True]), cols,
                                 torch.tensor([5, 3, 2]), n_new=6)
    assert taken.tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    assert examined.tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0]]
    counts.add(3, torch.tensor([2, 0, 3]), torch.tensor([True, True, False]), cols, torch.tensor([8, 4, 2]), n_new=6)
    timer = PhaseTimer(torch.device("cpu"))
    for phase in ("draft", "verify", "other") * 2:
        timer.add(phase, 0.0, 0.5)
    s = counts.stats(3, timer, n_new=6, policy=None, stamps=[10.0, 11.0, 13.0])  # the loop's syncs: start, then 2
    assert (s.reached, s.kept) == ([5, 3, 2], [3, 2, 1]) and s.accepted == 6 and s.alpha == 6 / 10
    assert (s.sequence_reached, s.sequence_kept) == ([6, 3, 1], [5, 1, 0])
    assert (s.verifications, s.iterations, s.drafted) == (5, 2, 6)
    assert s.omega == (6 + 5) / 5
    # sequence 0 reached 6 tokens in the second iteration: tokens min(8, 6) + 4 + 2, wall seconds from the start to
    # the sync after that iteration
    assert s.first_done == {"iterations": 2, "tokens": 12, "seconds": 3.0}
    assert s.time == {"draft": 1.0, "verify": 1.0, "other": 1.0}


def test_stats_of_several_batches_add_up():
    """Stats.combine: hand-written counts of two batches side by side (their sequences one after another), the
    policy's gamma use summed and a switch-off kept if any batch switched off."""
    a = Stats(2, verifications=3, accepted=4, reached=[3, 2], kept=[2, 1], sequence_reached=[5], sequence_kept=[3],
              iterations=3, drafted=6, time={"draft": 1.0}, first_done={"tokens": 9, "seconds": 0.5},
              policy={"iterations_per_gamma": {1: 1, 2: 2}, "switched_off": False})
    b = Stats(2, verifications=2, accepted=1, reached=[2], kept=[1], sequence_reached=[2], sequence_kept=[1],
              iterations=4, drafted=4, time={"draft": 0.5, "verify": 2.0}, first_done={"tokens": 5, "seconds": 0.25},
              policy={"iterations_per_gamma": {0: 2, 2: 2}, "switched_off": True})
    s = Stats.combine([a, b])
    assert (s.verifications, s.accepted, s.iterations, s.drafted) == (5, 5, 7, 10)
    assert (s.reached, s.kept) == ([5, 2], [3, 1]) and s.alpha == 4 / 7
    assert (s.sequence_reached, s.sequence_kept) == ([5, 2], [3, 1])
    assert s.time == {"draft": 1.5, "verify": 2.0} and s.first_done == {"tokens": 14, "seconds": 0.75}
    assert s.policy["iterations_per_gamma"] == {1: 1, 2: 4, 0: 2} and s.policy["switched_off"]
    assert [p["switched_off"] for p in s.policy["batches"]] == [False, True]
