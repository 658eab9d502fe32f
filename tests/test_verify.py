"""Acceptance rules. Speculative sampling must be lossless: whatever the draft, the tokens it produces are
distributed as the target's. Checked on small synthetic distributions with many samples, and the same check must
fail when the rejection correction (sampling from norm(max(0, p - q))) is removed."""
import pytest
import torch

from magicdec.verify import greedy_verify, leading_true, speculative_sampling_verify, synthetic_verify

V, GAMMA, N = 6, 3, 400_000


def distributions(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(GAMMA + 1, V, generator=g), -1)
    q = torch.softmax(2 * torch.randn(GAMMA, V, generator=g), -1)
    return p, q


def run(p, q, correct=True, seed=0):
    """N independent verifications; target and draft distributions do not depend on context, so the k-th
    produced token should be distributed as p[k]."""
    torch.manual_seed(seed)
    drafted = torch.stack([torch.multinomial(q[i], N, replacement=True) for i in range(GAMMA)], 1)
    accepted, nxt = speculative_sampling_verify(p.expand(N, -1, -1), q.expand(N, -1, -1), drafted, correct=correct)
    produced = torch.cat([drafted, torch.zeros(N, 1, dtype=torch.long)], 1)
    produced[torch.arange(N), accepted] = nxt
    return produced, accepted


def tv_and_bound(samples, p):
    """Total variation between the empirical and exact distribution, and a bound it exceeds with probability
    far below 1e-6: each cell's frequency is within 6 standard errors, so TV <= 0.5 * sum 6 * sqrt(p(1-p)/n)."""
    n = samples.numel()
    freq = torch.bincount(samples, minlength=V).double() / n
    bound = 0.5 * (6 * torch.sqrt(p.double() * (1 - p.double()) / n)).sum()
    return 0.5 * (freq - p.double()).abs().sum().item(), bound.item()


@pytest.mark.parametrize("seed", [0, 1])
def test_speculative_sampling_is_lossless(seed):
    p, q = distributions(seed)
    produced, accepted = run(p, q, seed=seed)
    for k in range(GAMMA + 1):  # the k-th token exists when the first k drafted tokens were kept
        tv, bound = tv_and_bound(produced[accepted >= k, k], p[k])
        assert tv < bound, (k, tv, bound)


@pytest.mark.parametrize("seed", [0, 1])
def test_check_fails_without_the_rejection_correction(seed):
    p, q = distributions(seed)
    produced, accepted = run(p, q, correct=False, seed=seed)
    tv, bound = tv_and_bound(produced[:, 0], p[0])
    assert tv > 5 * bound, (tv, bound)


def test_identical_draft_is_always_accepted():
    p, _ = distributions(2)
    produced, accepted = run(p, p[:GAMMA])
    assert (accepted == GAMMA).all()


def test_greedy_rule():
    best = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 2, 3, 4]])
    drafted = torch.tensor([[5, 6, 7], [5, 6, 7], [0, 2, 3]])
    accepted, nxt = greedy_verify(best, drafted)
    assert accepted.tolist() == [3, 1, 0]
    assert nxt.tolist() == [8, 9, 1]  # the bonus after full acceptance, else the target's correction


def test_leading_true():
    m = torch.tensor([[True, True, False, True], [False, True, True, True], [True] * 4])
    assert leading_true(m).tolist() == [2, 0, 4]


def test_synthetic_acceptance_rate():
    torch.manual_seed(0)
    alpha, n = 0.8, 200_000
    accepted, _ = synthetic_verify(torch.zeros(n, GAMMA + 1, dtype=torch.long), torch.zeros(n, GAMMA, dtype=torch.long), alpha)
    expected = alpha * (1 - alpha ** GAMMA) / (1 - alpha)  # E[kept] with i.i.d. acceptance
    assert abs(accepted.double().mean().item() - expected) < 0.01


def test_speculative_sampling_with_given_acceptance_draws_the_residual():
    """`keep` (synthetic acceptance of a sampled run) decides the kept count; the next token is still drawn as the
    lossless rule draws it: from norm(max(0, p - q)) at a rejection, from p after full acceptance."""
    V = 6
    p = torch.zeros(2, 3, V)
    p[:, :, :3] = torch.tensor([0.5, 0.3, 0.2])  # the target: tokens 0-2
    q = torch.zeros(2, 2, V)
    q[:, :, 0] = 1.0  # the draft always proposed token 0: the residual at a rejection is tokens 1-2 only
    drafted = torch.zeros(2, 2, dtype=torch.long)
    keep = torch.tensor([[False, True], [True, True]])
    torch.manual_seed(0)
    seen = {0: set(), 1: set()}
    for _ in range(200):
        accepted, nxt = speculative_sampling_verify(p, q, drafted, keep=keep)
        assert accepted.tolist() == [0, 2]
        seen[0].add(int(nxt[0]))
        seen[1].add(int(nxt[1]))
    assert seen[0] == {1, 2}  # the residual: never the rejected token 0
    assert seen[1] == {0, 1, 2}  # the bonus: from p
