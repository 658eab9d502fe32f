"""magicdec/decoding/acceptance.py: every acceptance rule against an independent reference. Speculative sampling, of a chain
and of a tree, must be lossless: whatever the draft, the tokens it produces are distributed as the target's (checked
on small distributions with many samples; the same check fails when the rejection correction, sampling from
norm(max(0, p - q)), is removed). Greedy acceptance against hand-written selections and walks. Each synthetic mode
of the Acceptor against the exact distribution of kept counts its rates imply."""
import pytest
import torch

from conftest import chi_square
from magicdec.decoding.acceptance import (Acceptor, SyntheticAcceptor, greedy_tree_verify, greedy_verify, leading_true,
                                 sampling_tree_verify, speculative_sampling_verify, synthetic_tree_verify,
                                 synthetic_verify)
from magicdec.decoding.generate import Batch, GraphedStep
from magicdec.decoding.sampling import Sampling
from magicdec.model.tree import Tree, path_tokens, rank_counts

# root; two children; the first with two children, the second with one; one grandchild below node 3
BRANCHY = Tree((-1, 0, 0, 1, 1, 2, 3))

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


# --- trees ----------------------------------------------------------------------------------------------------------
def walk(best, tokens, tree):
    """The greedy rule by hand: from the root, step to the child whose token is the target's argmax at its parent."""
    path, node = [0], 0
    while True:
        step = [c for c in tree.children[node] if tokens[c] == best[node]]
        if not step:
            return path, best[node]
        node = step[0]
        path.append(node)


@pytest.mark.parametrize("tree", [BRANCHY, Tree.chain(4), Tree.chain_with_siblings(3, 3)])
def test_greedy_keeps_the_longest_matching_path(tree):
    g = torch.Generator().manual_seed(0)
    B, V = 200, 3
    best = torch.randint(0, V, (B, tree.size), generator=g)
    tokens = torch.zeros(B, tree.size, dtype=torch.long)
    for i in range(tree.size):  # siblings distinct, as a draft's top-k are
        for c_rank, c in enumerate(tree.children[i]):
            tokens[:, c] = (torch.randint(0, V, (B,), generator=g) + c_rank) % V if c_rank == 0 else \
                (tokens[:, tree.children[i][0]] + c_rank) % V
    path, accepted, nxt = greedy_tree_verify(best, tokens, tree.on_device("cpu"))
    for b in range(B):
        want, want_next = walk(best[b].tolist(), tokens[b].tolist(), tree)
        assert accepted[b] == len(want) - 1 and nxt[b] == want_next
        assert path[b, :len(want)].tolist() == want and (path[b, len(want):] == want[-1]).all()
        assert path_tokens(tokens, path)[b, :len(want) - 1].tolist() == tokens[b, want[1:]].tolist()
    assert accepted.max() >= 2  # the test reached past the first level


def tables(seed, V=6):
    g = torch.Generator().manual_seed(seed)
    norm = lambda x: x / x.sum(-1, keepdim=True)  # noqa: E731
    p1, p2 = norm(torch.rand(V, generator=g) ** 3), norm(torch.rand(V, V, generator=g) ** 3)
    q1, q2 = norm(torch.rand(V, generator=g) ** 3), norm(torch.rand(V, V, generator=g) ** 3)
    return p1, p2, q1, q2


def without(q, taken):
    """q with the tokens already drawn removed, renormalized (sampling without replacement)."""
    q = q.clone()
    q[torch.arange(q.shape[0])[:, None], taken] = 0
    return q / q.sum(-1, keepdim=True)


# where the tree's sampled acceptance runs: here, and on a GPU replayed from a CUDA graph, as the decoder runs it
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def graphed_tree_verify(p, q, tokens, tree, correct):
    """sampling_tree_verify captured once into a CUDA graph and replayed twice: the replays must draw afresh (the
    device generator advances), so the two outputs differ; the second is returned."""
    step = GraphedStep(lambda p, q, tokens: sampling_tree_verify(p, q, tokens, tree, correct), warm_up=False)
    first = [t.clone() for t in step(p, q, tokens)]
    second = step(p, q, tokens)
    assert any(not torch.equal(a, b) for a, b in zip(first, second)), "a replay drew the same numbers"
    return second


def sampled_tree_run(seed, correct=True, deterministic=False, B=40_000, device="cpu", repeat=False):
    """Root with three children, each with two: candidates drawn without replacement from the draft's q (or, with
    `deterministic`, the draft's three / two likeliest, q one-hot; with `repeat` too, every node's second child the
    same token as its first, as prompt lookup's branches often are). The target's p at the root is p1, at a child
    with token x p2[x]; returns (first token, second token or -1 where only one was produced). On "cuda" the
    acceptance is replayed from a CUDA graph."""
    torch.manual_seed(seed)
    tree = Tree((-1, 0, 0, 0, 1, 1, 2, 2, 3, 3))
    p1, p2, q1, q2 = tables(seed)
    V = p1.shape[0]
    tokens = torch.zeros(B, tree.size, dtype=torch.long)
    q = torch.zeros(B, tree.size, V)

    def propose(parent_q, children):
        drawn = []
        for c in children:
            qc = without(parent_q, torch.stack(drawn, 1)) if drawn else parent_q
            tokens[:, c] = qc.argmax(-1) if deterministic else torch.multinomial(qc, 1)[:, 0]
            if repeat and len(drawn) == 1:
                tokens[:, c] = drawn[0]
            q[:, c] = qc
            drawn.append(tokens[:, c])
    propose(q1.expand(B, V), tree.children[0])
    for i in tree.children[0]:
        propose(q2[tokens[:, i]], tree.children[i])
    p = torch.zeros(B, tree.size, V)
    p[:, 0] = p1
    for i in range(1, tree.size):
        p[:, i] = p2[tokens[:, i]] if tree.depths[i] == 1 else p1  # depth 2: the third token, not checked
    q = None if deterministic else q
    if device == "cpu":
        path, accepted, nxt = sampling_tree_verify(p, q, tokens, tree.on_device("cpu"), correct)
    else:
        p, tokens, q = p.to(device), tokens.to(device), None if q is None else q.to(device)
        path, accepted, nxt = (t.cpu() for t in graphed_tree_verify(p, q, tokens, tree.on_device(device), correct))
        tokens = tokens.cpu()
    kept = path_tokens(tokens, path)  # the drafted tokens kept (padded past them), then the next one
    first = torch.where(accepted >= 1, kept[:, 0], nxt)
    second = torch.where(accepted >= 2, kept[:, 1], torch.where(accepted == 1, nxt, -1))
    return first, second, p1, p2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_sampling_keeps_the_targets_distribution(seed, deterministic, device):
    first, second, p1, p2 = sampled_tree_run(seed, deterministic=deterministic, device=device)
    stat, bound = chi_square(first, p1)
    assert stat < bound, (stat, bound)
    x = int(torch.bincount(first[second >= 0]).argmax())  # the first token most often followed by a kept one
    stat, bound = chi_square(second[(first == x) & (second >= 0)], p2[x])
    assert stat < bound, (stat, bound)


@pytest.mark.parametrize("device", DEVICES)
def test_tree_sampling_with_repeated_candidates_keeps_the_targets_distribution(device):
    """Deterministic siblings that repeat a token already rejected at their node: the repeat is rejected surely and
    the distribution stays the target's."""
    first, second, p1, p2 = sampled_tree_run(0, deterministic=True, device=device, repeat=True)
    stat, bound = chi_square(first, p1)
    assert stat < bound, (stat, bound)
    x = int(torch.bincount(first[second >= 0]).argmax())
    stat, bound = chi_square(second[(first == x) & (second >= 0)], p2[x])
    assert stat < bound, (stat, bound)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_tree_sampling_check_fails_without_the_correction(deterministic, device):
    first, _, p1, _ = sampled_tree_run(0, correct=False, deterministic=deterministic, device=device)
    stat, bound = chi_square(first, p1)
    assert stat > 5 * bound, (stat, bound)



def test_synthetic_tree_acceptance_follows_its_rates():
    """Root with three candidates kept at 0.5, then 0.3, then 0.2 once the earlier ones were not: the share of rows
    keeping one is 1 - 0.5 * 0.7 * 0.8 = 0.72, and per rank the kept over tried counts give back the rates."""
    B = 40_000
    tree = Tree.chain_with_siblings(1, 3).on_device("cpu")
    u = torch.rand(B, tree.tree.size, generator=torch.Generator().manual_seed(0))
    best = torch.zeros(B, tree.tree.size, dtype=torch.long)
    path, accepted, _ = synthetic_tree_verify(best, tree, (0.5, 0.3, 0.2), u)
    assert abs(accepted.float().mean().item() - 0.72) < 0.01
    tried, kept = rank_counts(tree, path, accepted, torch.ones(B, dtype=torch.bool))
    assert torch.allclose(kept / tried, torch.tensor([0.5, 0.3, 0.2]), atol=0.015)


# --- the Acceptor's modes ------------------------------------------------------------------------------------------
def kept_counts(rates: list[float], gamma: int) -> torch.Tensor:
    """The exact distribution of a chain verification's kept count when drafted position i is kept with rates[i]
    once those before it were: P(k) = r_0 ... r_(k-1) (1 - r_k), P(gamma) = r_0 ... r_(gamma-1)."""
    out, reach = [], 1.0
    for i in range(gamma):
        out.append(reach * (1 - rates[i]))
        reach *= rates[i]
    return torch.tensor(out + [reach], dtype=torch.float64)


def one_chain_verification(acceptor: Acceptor, B: int, gamma: int, seed: int = 0):
    """Every row's first verification of gamma drafted tokens under `acceptor`: (accepted, next, the target's ids)."""
    g = torch.Generator().manual_seed(seed)
    batch = Batch(torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long), 50, gamma, (), 0)
    acceptor.begin(B, batch.hist.shape[1], "cpu")
    best = torch.randint(0, 9, (B, gamma + 1), generator=g)
    tokens = torch.randint(0, 9, (B, gamma + 1), generator=g)
    draws = acceptor.draws(batch, tokens, None)
    accepted, nxt, path = acceptor.accept(best, tokens, None, None, draws)
    assert path is None
    return accepted, nxt, best


@pytest.mark.parametrize("positions", [(), (0.9, 0.5, 0.7)], ids=["iid", "per-position"])
def test_synthetic_chain_modes_keep_the_counts_their_rates_imply(positions):
    """iid at 0.3, and per drafted position 0.9, 0.5, 0.7 then 0.3: over 40,000 sequences' verifications of 4
    drafted tokens the kept counts follow the exact distribution (chi-square below its 1 - 3e-7 quantile), whatever
    the target said; the next token is the target's argmax after the kept ones."""
    B, gamma, rate = 40_000, 4, 0.3
    accepted, nxt, best = one_chain_verification(SyntheticAcceptor(Sampling(), rate, positions), B, gamma)
    rates = [positions[i] if i < len(positions) else rate for i in range(gamma)]
    stat, bound = chi_square(accepted, kept_counts(rates, gamma))
    assert stat < bound, (stat, bound)
    assert torch.equal(nxt, best[torch.arange(B), accepted])
    # the same check tells the modes apart: per-position counts are not iid's
    other = [rate] * gamma if positions else [0.9, 0.5, 0.7, 0.3]
    assert chi_square(accepted, kept_counts(other, gamma))[0] > 10 * bound


def test_exact_acceptance_keeps_what_the_target_says():
    """The default Acceptor is greedy: it keeps the drafted tokens equal to the target's argmax (greedy_verify's
    hand-written case) and draws nothing outside its rule."""
    acceptor = Acceptor()
    best = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 2, 3, 4]])
    tokens = torch.tensor([[0, 5, 6, 7], [0, 5, 6, 7], [0, 0, 2, 3]])
    assert acceptor.greedy and acceptor.draws(None, tokens, None) is None
    accepted, nxt, path = acceptor.accept(best, tokens, None, None, None)
    assert accepted.tolist() == [3, 1, 0] and nxt.tolist() == [8, 9, 1] and path is None


def test_synthetic_tree_mode_keeps_the_nodes_its_sibling_rates_imply():
    """A chain of 2 with a sibling beside each node (root -> 1, 2; node 1 -> 3, 4), the first candidate kept at 0.6
    and the second at 0.3 once the first was not: the last kept node follows the exact distribution: the root 0.4 x
    0.7, node 2 0.4 x 0.3, node 1 then none below it 0.6 x 0.4 x 0.7, node 3 0.6 x 0.6, node 4 0.6 x 0.4 x 0.3."""
    B = 40_000
    tree = Tree.chain_with_siblings(2, 2).on_device("cpu")
    acceptor = SyntheticAcceptor(Sampling(), 0.6, siblings=(0.3,))
    acceptor.begin(B, 10, "cpu")
    tokens = torch.zeros(B, tree.tree.size, dtype=torch.long)
    draws = acceptor.draws(None, tokens, tree)
    accepted, _, path = acceptor.accept(torch.zeros_like(tokens), tokens, None, tree, draws)
    exact = torch.tensor([0.4 * 0.7, 0.6 * 0.4 * 0.7, 0.4 * 0.3, 0.6 * 0.6, 0.6 * 0.4 * 0.3], dtype=torch.float64)
    stat, bound = chi_square(path[:, -1], exact)
    assert stat < bound, (stat, bound)
    assert torch.equal(accepted, tree.depths[path[:, -1]])


def test_a_first_candidates_rate_per_level_where_levels_are_given():
    """Per-level rates (0.9, 0.5, 0.2) for the first candidates of a chain of 3 with a never-kept sibling beside each
    (Lookahead's guesses): the kept count follows the chain's exact distribution at those rates, not the 0.6 every
    level would take without them."""
    B = 40_000
    tree = Tree.chain_with_siblings(3, 2).on_device("cpu")
    acceptor = SyntheticAcceptor(Sampling(), 0.6, positions=(0.9, 0.5, 0.2), siblings=(0.0,))
    acceptor.begin(B, 10, "cpu")
    tokens = torch.zeros(B, tree.tree.size, dtype=torch.long)
    accepted, _, _ = acceptor.accept(torch.zeros_like(tokens), tokens, None, tree, acceptor.draws(None, tokens, tree))
    stat, bound = chi_square(accepted, kept_counts([0.9, 0.5, 0.2], 3))
    assert stat < bound, (stat, bound)
    assert chi_square(accepted, kept_counts([0.6] * 3, 3))[0] > 10 * bound


def test_per_sequence_factors_scale_each_sequences_tree_rates():
    """Sequence factors (0.5, 1.5, 0): even rows keep the first candidate at 0.6 x 0.5 = 0.3 and the second at
    0.3 x 0.5 = 0.15, rows 1 mod 3 at 0.9 and 0.45, rows 2 mod 3 never (the rows cycle through the factors); each row
    group's last kept node follows the exact distribution of its own rates (the tree of the test above)."""
    B = 60_000
    tree = Tree.chain_with_siblings(2, 2).on_device("cpu")
    acceptor = SyntheticAcceptor(Sampling(), 0.6, siblings=(0.3,), factors=(0.5, 1.5, 0.0))
    acceptor.begin(B, 10, "cpu")
    tokens = torch.zeros(B, tree.tree.size, dtype=torch.long)
    draws = acceptor.draws(None, tokens, tree)
    accepted, _, path = acceptor.accept(torch.zeros_like(tokens), tokens, None, tree, draws)
    rows = torch.arange(B)
    for group, (a, s) in enumerate([(0.3, 0.15), (0.9, 0.45)]):
        exact = torch.tensor([(1 - a) * (1 - s), a * (1 - a) * (1 - s), (1 - a) * s, a * a, a * (1 - a) * s],
                             dtype=torch.float64)
        stat, bound = chi_square(path[rows % 3 == group, -1], exact)
        assert stat < bound, (group, stat, bound)
    assert accepted[rows % 3 == 2].sum() == 0


def test_a_seed_draws_the_same_acceptance_and_another_seed_another():
    """Common random numbers: the same seed draws the same landscape (every timed run alike); the seed a
    hierarchy's middle level bumps per run draws a new one."""
    acceptor = SyntheticAcceptor(Sampling(), 0.5)
    first = one_chain_verification(acceptor, 64, 3)[0]
    assert torch.equal(first, one_chain_verification(acceptor, 64, 3)[0])
    acceptor.seed += 1
    assert not torch.equal(first, one_chain_verification(acceptor, 64, 3)[0])


def test_a_sampled_tree_has_no_synthetic_form():
    from magicdec.errors import MagicDecError

    acceptor = SyntheticAcceptor(Sampling(temperature=1.0), 0.6, siblings=(0.3,))
    acceptor.begin(2, 10, "cpu")
    with pytest.raises(MagicDecError, match="drop --temperature"):
        acceptor.draws(None, torch.zeros(2, 3, dtype=torch.long), Tree.chain_with_siblings(1, 2).on_device("cpu"))


def test_the_config_picks_the_mode(tmp_path):
    """Acceptor.from_config: exact without synthetic acceptance or without a drafter; each option of the
    speculation section lands in the synthetic acceptor's mode (a trace read from its record)."""
    import json

    from magicdec.harness.run_config import Decoding, Speculation

    sampled = Decoding(temperature=0.6, top_p=0.9, top_k=5)
    exact = Acceptor.from_config(sampled, Speculation(drafter="selfspec"))
    assert type(exact) is Acceptor and exact.sampling == Sampling(0.6, 0.9, 5) and not exact.greedy
    synthetic = Speculation(drafter="selfspec", synthetic_acceptance=0.7, synthetic_positions=(0.9,))
    assert type(Acceptor.from_config(Decoding(), None)) is Acceptor  # a baseline drafts nothing
    a = Acceptor.from_config(Decoding(), synthetic)
    assert isinstance(a, SyntheticAcceptor) and (a.rate, a.positions, a.siblings, a.replay) == (0.7, (0.9,), (), None)
    record = tmp_path / "r.json"
    record.write_text(json.dumps({"acceptance_trace": {"gammas": [3, 3], "accepted": [[1, 2], [3, 0]]}}))
    a = Acceptor.from_config(Decoding(), Speculation(drafter="selfspec", synthetic_acceptance=0.7,
                                                     acceptance_trace=record, synthetic_siblings=(0.4,)))
    assert a.replay == {"gammas": [3, 3], "accepted": [[1, 3], [2, 0]]} and a.tree_rates == (0.7, 0.4)
