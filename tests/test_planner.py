"""The planner: before a batch, the cost model's best choice (no speculation at short contexts, speculation at long
ones); during a batch (`--gamma auto`), gamma from measured costs and acceptance — the choice maximizing
Omega / cost, switching off when speculation stops paying — without changing a single generated token."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from magicdec.analysis import cost_model as cm
from magicdec.config import ModelArgs
from magicdec.drafters.model_draft import ModelDraft
from magicdec.decoding.generate import Decoder, decode, prefill
from magicdec.model.kv_cache import KVCache, StreamingCache
from magicdec.analysis.planner import AutoGamma, fit_spread, sequence_weight, spread_alphas
from magicdec.analysis.planner import plan as plan_with
from test_generate_speculative import plain_greedy, tiny_prompts

L31 = ModelArgs.from_name("meta-llama/Meta-Llama-3.1-8B")
H100 = cm.Device(bandwidth=3.0e12, matmul_flops=7e14)


def plan(target, device, B, context, budgets, gammas, alpha, tokens=64, spread=None):
    """The planner with the self-draft's cost-model prediction at each budget (what the sweep hands it)."""
    def predict(budget, gamma):
        return cm.predict(target, device, B, context, gamma, alpha[budget], budget)
    return plan_with(budgets, gammas, alpha, predict, B, tokens, spread, "selfspec")


def simulated_verifications(alpha, gamma, remaining, runs=400, seed=0) -> float:
    """Monte-Carlo reference: verifications until every sequence has its tokens, each drafted token accepted with
    its sequence's probability (a plain loop, independent of the planner's tables and normal approximation)."""
    gen = torch.Generator().manual_seed(seed)
    alpha, total = torch.as_tensor(alpha, dtype=torch.float64), 0
    for _ in range(runs):
        left, its = torch.as_tensor(remaining).clone(), 0
        while (left > 0).any():
            keep = (torch.rand(len(left), gamma, generator=gen, dtype=torch.float64) < alpha[:, None]).long().cumprod(1).sum(1)
            left, its = left - (keep + 1), its + 1
        total += its
    return total / runs


def test_plan_switches_speculation_off_at_short_context():
    alpha = {256: 0.75, 512: 0.8}
    short, _ = plan(L31, H100, 32, 1024, [256, 512], [1, 2, 3, 4], alpha)
    long, options = plan(L31, H100, 32, 100_000, [256, 512], [1, 2, 3, 4], alpha)
    assert short.method == "baseline" and short.gamma == 0
    assert long.method == "selfspec" and long.speedup > 1
    assert len(options) == 1 + 2 * 4
    # a batch waits for its slowest sequence: at B = 32 every option is below the paper's Omega-based formula
    for o in options[1:]:
        assert o.speedup < cm.predict(L31, H100, 32, 100_000, o.gamma, alpha[o.budget], o.budget)["speedup"]


def test_plan_at_batch_one_and_long_generations_is_the_paper_formula():
    """With one sequence and many tokens, verifications -> tokens / Omega (renewal theorem): the plan's speedups
    become MagicDec's Omega / (gamma T_D/T_T + T_V/T_T), computed by the cost model alone; with a fixed cost per
    verification T_O, Omega / (gamma T_D/T_T + T_V/T_T + T_O/T_T)."""
    alpha = {512: 0.8}
    for device in (H100, cm.Device(3.0e12, 7e14, verify_overhead_s=2e-3)):
        _, options = plan(L31, device, 1, 100_000, [512], [1, 2, 3, 4], alpha, tokens=4000)
        for o in options[1:]:
            p = cm.predict(L31, H100, 1, 100_000, o.gamma, 0.8, 512)
            paper = p["omega"] / (o.gamma * p["T_D_over_T_T"] + p["T_V_over_T_T"] + device.verify_overhead_s / p["T_T"])
            assert o.speedup == pytest.approx(paper, rel=0.002)


def test_fit_spread_recovers_the_spread_that_made_the_batches():
    """Batches simulated with per-sequence rates spread by 0.08 (the Monte-Carlo loop, not the planner's model):
    the fitted spread is 0.08, and about 0 for batches at one rate; batch-1 runs say nothing of it."""
    gen = torch.Generator().manual_seed(0)
    for spread in (0.0, 0.08):
        points = []
        for g in (1, 2, 4):
            rates = (0.8 + spread * torch.randn(64, generator=gen, dtype=torch.float64)).clamp(0, 1).tolist()
            points.append((64, g, 63, 0.8, simulated_verifications(rates, g, [63] * 64, runs=100, seed=g)))
        assert fit_spread(points) == pytest.approx(spread, abs=0.02)
    assert fit_spread([(1, 2, 63, 0.8, 40.0)]) is None and fit_spread([]) is None  # unknown, not 0


def test_auto_gamma_spreads_unseen_sequences_and_narrows_with_their_drafts():
    p = AutoGamma([2], alpha_prior=0.8, prior_weight=1e9, spread=0.1)
    assert p.sequence_alphas(4).tolist() == pytest.approx(spread_alphas(0.8, 0.1, 4).tolist())
    w = sequence_weight(0.8, 0.1)
    assert w == pytest.approx(16)
    p.observe([0, 400], [0, 400])  # nothing seen of the first sequence; the second keeps every draft
    first, second = p.sequence_alphas(2)
    assert first == pytest.approx(0.8 - 0.1 * 0.6745, abs=1e-3)  # the lower quantile of 2, all its spread unresolved
    assert second == pytest.approx(min((400 + w * 0.8) / (400 + w) + 0.1 * (w / (w + 400)) ** 0.5 * 0.6745, 1), abs=1e-3)
    assert sequence_weight(0.8, None) == 16  # unknown spread: the default
    assert sequence_weight(0.8, 0.0) == sequence_weight(0.8, 1e-9) == 1e6  # none: the batch's rate decides


def test_plan_with_a_spread_between_sequences():
    """A batch of 128 whose sequences' rates differ by 0.1 finishes later than an i.i.d. one (the simulation is the
    reference), so every speculative option is predicted slower, the longer drafts most."""
    a, B = 0.84, 128
    alphas = spread_alphas(a, 0.1, B)
    assert alphas.mean() == pytest.approx(a, abs=5e-3) and alphas.std() == pytest.approx(0.1, rel=0.1)  # (clipped at 1)
    _, same = plan(L31, H100, B, 32_000, [512], [1, 2, 3, 4], {512: a}, tokens=63)
    best, spread = plan(L31, H100, B, 32_000, [512], [1, 2, 3, 4], {512: a}, tokens=63, spread={512: 0.1})
    assert all(s.speedup < o.speedup for s, o in zip(spread[1:], same[1:]))
    loss = [s.speedup / o.speedup for s, o in zip(spread[1:], same[1:])]
    assert loss == sorted(loss, reverse=True)  # longer drafts lose more: the slowest sequence keeps fewer of them
    p = cm.predict(L31, H100, B, 32_000, 2, a, 512)
    simulated = simulated_verifications(alphas.tolist(), 2, [63] * B, runs=100)
    assert spread[2].speedup == pytest.approx(63 * p["T_T"] / (simulated * (2 * p["T_D"] + p["T_V"])), rel=0.04)


def policy_with(costs, alpha_prior, weight=32.0, **kw):
    p = AutoGamma([g for g in costs if g], alpha_prior, weight, **kw)
    p.costs = dict(costs)
    return p


def test_auto_gamma_maximizes_omega_over_cost():
    """One sequence, a long generation: the choice maximizing Omega / cost."""
    costs = {0: 1.0, 1: 1.3, 2: 1.6, 3: 1.9, 4: 2.2}
    p = policy_with(costs, 0.8)
    best = max(costs, key=lambda g: cm.omega(0.8, g) / costs[g] if g else 1 / costs[0])
    assert p.choose([2000]) == best == 3  # 2.95 / 1.9 beats 3.36 / 2.2
    p = policy_with(costs, 0.5)
    assert p.choose([2000]) == 1  # Omega(0.5, 1) / 1.3 = 1.15 beats 1.0 and the longer drafts


@pytest.mark.parametrize("B", [1, 16, 128])
def test_finish_times_match_simulation(B):
    """Expected verifications until the slowest of B sequences is done, against a Monte-Carlo simulation of the
    loop: identical sequences at the start of a batch, and mid-batch ones with their own acceptance rates and
    tokens left (the slowest sequence sets the end)."""
    costs = {0: 1.0, 1: 1.25, 2: 1.5, 4: 2.0}
    gen = torch.Generator().manual_seed(B)
    mixed_alpha = (0.5 + 0.45 * torch.rand(B, generator=gen, dtype=torch.float64)).tolist()
    mixed_left = torch.randint(1, 64, (B,), generator=gen).tolist()
    for alpha, left in [([0.8] * B, [64] * B), (mixed_alpha, mixed_left), ([0.8] * B, [3] * B)]:
        p = policy_with(costs, 0.8, spread=1.0)  # a huge spread: each sequence's own counts decide
        p.observe([a * 1e6 for a in alpha], [1e6] * B)  # and they pin its rate
        times = p.finish_times(left)
        assert times[0] == max(left) * costs[0]
        for g in (1, 2, 4):
            assert times[g] == pytest.approx(simulated_verifications(alpha, g, left) * costs[g], rel=0.04), (g, alpha[:2], left[:2])


def test_large_batches_wait_for_stragglers():
    costs = {0: 1.0, 1: 1.25, 2: 1.5, 3: 1.75, 4: 2.0, 5: 2.25, 6: 2.5}
    assert policy_with(costs, 0.8, 1e9).choose([64]) > policy_with(costs, 0.8, 1e9).choose([64] * 256)


def test_sequence_rates_shrink_to_the_batch_rate():
    p = AutoGamma([2], alpha_prior=0.8, prior_weight=32)  # no spread given: weight 16, no unresolved spread
    p.observe([8, 0], [8, 8])
    batch = (8 + 32 * 0.8) / (16 + 32)
    assert p.alpha == pytest.approx(batch)
    assert p.sequence_alphas(2).tolist() == pytest.approx([(8 + 16 * batch) / 24, (0 + 16 * batch) / 24])
    assert p.sequence_alphas(3).tolist() == pytest.approx([batch] * 3)  # another batch shape: the batch's rate


def test_a_known_zero_spread_reads_a_lagging_sequence_as_luck():
    """Llama-3.1-8B 32K x 4 on the H100 (profiled seconds per verification), synthetic alpha 0.81: every sequence
    accepts at one rate. One sequence rejects its first draft six times while the others keep 5 of their 6 examined
    drafts: the batch's rate falls to 0.75, still a gain for gamma 2. Told the spread is 0 (fit_spread of the
    sweep's synthetic batches), the policy gives every sequence that rate and stays on; with the spread unknown
    it reads the lagging sequence as a slow one (0.55) and switches off for good."""
    costs = {0: 13.49e-3, 2: 29.5e-3, 3: 36.6e-3, 4: 44.6e-3}
    for spread, expect in ((0.0, [2] * 7), (None, [2, 2] + [0] * 5)):
        p = AutoGamma([2, 3, 4], 0.8075, spread=spread)
        p.costs = dict(costs)
        left, used = [63] * 4, [p.choose([63] * 4)]
        for _ in range(6):
            p.observe([0, 2, 1, 2], [1, 2, 2, 2])
            left = [left[0] - 1, left[1] - 3, left[2] - 2, left[3] - 3]
            used.append(p.choose(left))
        assert used == expect
        rates = p.sequence_alphas(4)
        assert p.alpha == pytest.approx((5 * 6 + 32 * 0.8075) / (7 * 6 + 32))  # 5 of 7 drafts kept per verification
        assert (rates == pytest.approx([p.alpha] * 4, abs=1e-4)) == (spread == 0.0)


def test_auto_gamma_switches_off_when_acceptance_drops_and_stays_off():
    p = policy_with({0: 1.0, 1: 1.3, 2: 1.6, 3: 1.9}, 0.8, weight=8)
    assert p.choose() == 3
    for _ in range(10):
        p.observe(kept=0, reached=8)  # every drafted token rejected
    assert p.alpha < 0.1
    assert p.choose() == 0
    for _ in range(50):
        p.observe(kept=8, reached=8)  # even if acceptance recovers, the batch has no draft cache anymore
    assert p.choose() == 0 and p.summary()["switched_off"]
    p.reset()
    assert not p.off and p.batch_kept == p.batch_reached == 0


def test_auto_gamma_stays_off_near_break_even():
    """Llama-3.1-8B shape at 100K x 1 on an H100 (seconds per verification as profiled there), alpha 0.8: over a
    long generation gamma 3 gives 35.7 ms / Omega 2.95 = 12.09 ms per token against 12.28 ms, a 1.5% gain the alpha
    estimate cannot back. Off with the default 3% margin; with no margin the policy would gamble a verification on it.
    Over the sweep's 63 tokens the last verification's overshoot eats the gain: off either way."""
    costs = {0: 0.01228, 2: 0.03081, 3: 0.03570, 4: 0.04355}
    per_token = {g: costs[g] / cm.omega(0.8, g) for g in (2, 3, 4)}
    assert min(per_token.values()) == per_token[3] and costs[0] * 0.97 < per_token[3] < costs[0]
    assert policy_with(costs, 0.8, weight=1e9).choose([2000]) == 0
    assert policy_with(costs, 0.8, weight=1e9, margin=0.0).choose([2000]) == 3
    assert policy_with(costs, 0.8, weight=1e9, margin=0.0).choose([63]) == 0
    clear = policy_with({0: 1.0, 3: 1.9}, 0.8, weight=1e9)  # 2.95 / 1.9: 36% faster, well past the margin
    assert clear.choose([63]) == 3


def test_auto_gamma_keeps_speculating_below_the_margin_once_on():
    """Hysteresis: a predicted 1.5% gain does not switch speculation on, but does not switch it off either."""
    costs = {0: 0.01228, 3: 0.03570}
    p = policy_with(costs, 0.8, weight=1e9)
    assert p.choose([2000]) == 0
    p = policy_with({0: 1.0, 3: 1.9}, 0.8, weight=1e9)
    assert p.choose([2000]) == 3
    p.costs = costs  # the same rates, now only 1.5% ahead
    assert p.choose([2000]) == 3
    p.costs = {0: 0.01228, 3: 0.0370}  # predicted slower: off
    assert p.choose([2000]) == 0 and p.off


def test_auto_gamma_rejects_bad_candidates():
    with pytest.raises(ValueError, match=">= 1"):
        AutoGamma([0, 1])


@pytest.mark.parametrize("costs", [
    {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4},  # cheap drafts: gamma moves with the measured acceptance
    {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 9.0},  # gamma 4 never pays
    {0: 1.0, 1: 3.0, 2: 5.0, 3: 7.0, 4: 9.0},  # speculation never pays: off from the first verification
])
def test_auto_gamma_generation_equals_plain_greedy(tiny, costs):
    """Whatever gamma the policy picks per verification, switching off included, the tokens are the target's
    plain greedy ones (a hand-written loop is the reference)."""
    with torch.inference_mode():
        a, prompts, n_new = tiny.args, tiny_prompts(), 60
        B, P = prompts.shape
        cache = KVCache(a.n_layers, B, a.n_kv_heads, P + n_new + 6, a.head_dim, torch.float32, "cpu")
        draft_cache = StreamingCache(a.n_layers, B, a.n_kv_heads, 20, 4, 64, a.head_dim, torch.float32, "cpu")
        logits = prefill(tiny, cache, prompts, 64)
        prefill(tiny, draft_cache, prompts, 64)
        policy = policy_with(costs, 0.8, weight=4)
        decoder = Decoder(tiny, drafter=ModelDraft(tiny, draft_cache), policy=policy, trace=True)
        out, counts = decode(decoder, cache, logits.argmax(-1), n_new, prev=prompts[:, -1])
        assert out.tolist() == plain_greedy(tiny, prompts, n_new).tolist()
        # per-sequence acceptance (what the policy and the planner's spread read) against the per-iteration trace
        kept = [sum(max(row[b], 0) for row in decoder.trace) for b in range(B)]
        assert decoder.stats.sequence_kept == kept and sum(decoder.stats.sequence_reached) == sum(decoder.stats.reached)
        used = decoder.stats.policy["iterations_per_gamma"]
        assert sum(used.values()) == decoder.stats.iterations
        if costs[1] > 2:
            assert set(used) == {0} and decoder.stats.drafted == 0
        else:
            assert 4 not in used or costs[4] < 2  # (near the end, off may win: a few tokens left)
            assert decoder.stats.drafted == sum(g * n for g, n in used.items())
        if costs[4] < 2:
            assert len(used) > 1, used  # the tiny model's acceptance is middling: the choice moved


def test_a_replayed_trace_finishes_when_its_slowest_sequence_does():
    """By hand: one sequence keeps all 3 drafts every verification (4 tokens each), the other none (1 each). For 8
    tokens the first needs 2 verifications and the second 8; the batch of both needs 8, a batch of the first alone
    2; tokens per verification: (4 + 1) / 2."""
    from magicdec.analysis.planner import replay_finish
    trace = {"gammas": [3] * 20, "accepted": [[3] * 20, [0] * 20]}
    assert replay_finish(trace, 2, 3, 8, 0.5) == (8, pytest.approx(2.5))
    assert replay_finish({"gammas": [3] * 20, "accepted": [[3] * 20]}, 1, 3, 8, 0.5) == (2, pytest.approx(4.0))


@pytest.mark.parametrize("gamma", [3, 5])
def test_the_replay_finish_is_the_runs_own(tiny, gamma):
    """A recorded trace whose sequences differ, replayed by the decoder (synthetic acceptance at 0.5, B 5 over the
    trace's 3 sequences, at the recorded gamma and another): the planner's count of verifications is the run's."""
    from magicdec.analysis.planner import replay_finish
    from test_generate_speculative import speculate
    _, _, real = speculate(tiny, tiny, tiny_prompts(), 60, 3, budget=20, synthetic=0.7)
    replay = {"gammas": real.trace_gammas, "accepted": [list(s) for s in zip(*real.trace)]}
    _, _, run = speculate(tiny, tiny, tiny_prompts(5), 60, gamma, budget=20, synthetic=0.5, replay=replay)
    n, _ = replay_finish(replay, 5, gamma, 59, 0.5)  # the prefill gives the first of the 60 tokens
    assert n == len(run.trace)
    assert n > replay_finish(replay, 1, gamma, 59, 0.5)[0]  # the slowest of the 3 is not the first


def test_sequence_factors_spread_a_batch_and_its_slowest_sequence_sets_the_end():
    """Factors of 1 are no spread (the same as spread 0); factors 0.5 / 1.5 around a chain rate of 0.6 give the
    sequences 0.3 and 0.9, and the batch waits for the 0.3 one: by the finishing model itself at those two rates."""
    from magicdec.analysis.planner import finish_verifications, finishing_speedup
    p = {"omega": cm.omega(0.6, 3), "T_D_over_T_T": 0.1, "T_V_over_T_T": 1.1, "T_O_over_T_T": 0.0}
    assert finishing_speedup(p, 3, 2, 60, factors=(1.0, 1.0)) == pytest.approx(finishing_speedup(p, 3, 2, 60))
    spread = finishing_speedup(p, 3, 2, 60, factors=(0.5, 1.5))
    n = finish_verifications([3], np.array([0.3, 0.9]), np.full(2, 60))[0]
    assert spread == pytest.approx(60 / (n * cm.verification_cost(p, 3))) and spread < finishing_speedup(p, 3, 2, 60)


# --- chain or tree per verification (--gamma auto --tree_width W) ---------------------------------------------------
def tree_policy(costs, tree_costs, alpha_prior, siblings, weight=32.0, width=2):
    from magicdec.model.tree import Tree

    p = policy_with(costs, alpha_prior, weight)
    p.attach_tree(width, lambda g: Tree.chain_with_siblings(g, width), siblings)
    p.tree_costs = dict(tree_costs)
    return p


def test_a_tree_is_chosen_where_its_siblings_keep_enough_and_a_chain_where_they_keep_nothing():
    """Trees 5% dearer than chains of the same depth: with siblings kept at 0.9 the tree finishes a long batch
    sooner (and the choice says its width); with siblings that keep nothing it yields a chain's tokens at a higher
    cost, and the chain is chosen."""
    costs = {0: 1.0, 1: 1.2, 2: 1.4, 3: 1.6, 4: 1.8}
    tree_costs = {g: 1.05 * c for g, c in costs.items() if g}
    rich = tree_policy(costs, tree_costs, 0.6, (0.9,))
    g = rich.choose([60] * 8)
    assert g > 0 and rich.chosen_width == 2
    poor = tree_policy(costs, tree_costs, 0.6, (0.0,))
    assert poor.choose([60] * 8) > 0 and poor.chosen_width == 1


def test_the_trees_yield_is_taken_as_a_chains_rate():
    """chain_equivalent: a chain at the returned rate yields what the tree does (omega against expected_tokens,
    the tree's yield written out by hand for a width-2 chain with siblings of depth 2)."""
    p = tree_policy({0: 1.0, 1: 1.2, 2: 1.4}, {1: 1.3, 2: 1.5}, 0.7, (0.5,), weight=1e9)
    a, s = 0.6, 0.5
    level = a + (1 - a) * s  # a level is kept by the first candidate, or else by its sibling
    by_hand = 1 + level + a * level  # depth 2: the second level hangs under the chain's token only
    eq = p.chain_equivalent(2, np.array([a]))[0]
    assert cm.omega(eq, 2) == pytest.approx(by_hand, rel=2e-3)


def test_a_trees_verifications_teach_the_batch_and_sibling_rates_not_a_sequences():
    """A tree's per-rank counts move the batch's first-candidate rate and the sibling rates by their counts; a
    sequence's own rate learns from chains only (the path of a tree mixes ranks)."""
    p = tree_policy({0: 1.0, 1: 1.2}, {1: 1.3}, 0.8, (0.3,), weight=4.0)
    p.observe_tree([10, 4], [6, 2])
    assert p.alpha == pytest.approx((6 + 4 * 0.8) / (10 + 4))
    assert p.siblings == pytest.approx(((2 + 4 * 0.3) / (4 + 4),))
    assert p.seq_kept.size == 0
    p.observe([3, 1], [4, 4])
    assert p.alpha == pytest.approx((6 + 4 + 4 * 0.8) / (10 + 8 + 4)) and p.seq_kept.tolist() == [3, 1]


def test_near_a_batchs_end_the_cheaper_chain_wins():
    """Trees 10% dearer than chains, siblings kept at 0.4: while 8 sequences need 60 tokens each the tree's extra
    tokens pay for its dearer verification; 4 tokens short each, one verification of either finishes most of
    them, and the cheaper chain is chosen."""
    costs = {0: 1.0, 1: 1.15, 2: 1.3, 3: 1.45, 4: 1.6}
    tree_costs = {g: 1.1 * c for g, c in costs.items() if g}
    early, late = tree_policy(costs, tree_costs, 0.7, (0.4,)), tree_policy(costs, tree_costs, 0.7, (0.4,))
    assert early.choose([60] * 8) > 0 and early.chosen_width == 2
    assert late.choose([4] * 8) > 0 and late.chosen_width == 1


class Alternating(AutoGamma):
    """Chain and tree shapes in turn, whatever the numbers say: every switch the loop can meet."""
    SHAPES = [(2, 1), (3, 2), (1, 2), (3, 1), (2, 2), (0, 1)]

    def choose(self, remaining=(64,)) -> int:
        g, self.chosen_width = self.SHAPES[(len(self.history) + len(self.tree_history)) % len(self.SHAPES)]
        return g


@pytest.mark.parametrize("drafting", ["self", "standalone"])
def test_switching_between_chain_and_tree_equals_plain_greedy(tiny, drafting):
    """A decoder whose policy verifies chains and width-2 trees in turn (and now and then nothing) gives the
    target's plain greedy tokens (a hand-written loop is the reference): the chain is a copy of the tree drafter
    sharing its cache. The tree's per-rank counts reach the policy."""
    from test_generate_speculative import first_layers

    with torch.inference_mode():
        a, prompts, n_new = tiny.args, tiny_prompts(), 60
        B, P = prompts.shape
        draft = tiny if drafting == "self" else first_layers(tiny, 2)
        d = draft.args
        cache = KVCache(a.n_layers, B, a.n_kv_heads, P + n_new + 8, a.head_dim, torch.float32, "cpu")
        draft_cache = (StreamingCache(d.n_layers, B, d.n_kv_heads, 20, 4, 64, d.head_dim, torch.float32, "cpu")
                       if drafting == "self" else
                       KVCache(d.n_layers, B, d.n_kv_heads, P + n_new + 8, d.head_dim, torch.float32, "cpu"))
        logits = prefill(tiny, cache, prompts, 64)
        prefill(draft, draft_cache, prompts, 64)
        policy = Alternating([1, 2, 3], 0.8)
        policy.costs = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}
        decoder = Decoder(tiny, drafter=ModelDraft(draft, draft_cache).shaped(2), policy=policy, trace=True)
        out, counts = decode(decoder, cache, logits.argmax(-1), n_new, prev=prompts[:, -1])
        assert out.tolist() == plain_greedy(tiny, prompts, n_new).tolist()
        s = decoder.stats.policy
        assert s["tree_width"] == 2 and sum(s["tree_iterations_per_gamma"].values()) > 3
        assert sum(n for g, n in s["iterations_per_gamma"].items() if g) > 3
        assert policy.rank_tried[0] > 0 and policy.rank_tried[1] > 0  # the tree's counts were read


@pytest.mark.parametrize("first", ["chain", "tree"])
def test_switching_between_chain_and_tree_keeps_the_targets_distribution(tiny, first, monkeypatch):
    """Sampled (T 0.6, top-p 0.9), a policy with a 3-wide tree verifies a chain and then the tree, or the tree and
    then a chain, each one token deep, over N copies of one prompt with the first generated token fixed: the next
    two tokens follow the target's exact joint distribution p(x) p(y | x) (chi-square below its 1 - 3e-7
    quantile). The first verification drew x; the second, of the other kind and over the first's committed tokens,
    drew y wherever the first kept nothing (elsewhere y is the first's bonus). Without the correction in the second
    kind's acceptance only (a chain's next token drawn from p after a rejection, a tree's next candidate tried
    against p, not the residual), x is drawn as before and the same check fails.

    The target is the tiny model with its head scaled 2.5x: its next token at T 0.6 / top-p 0.9 then spreads over
    13 tokens, not ~120, so the pair has cells enough for the chi-square; the draft is its first two layers. A chain
    after the tree draws y for only the ~30% of sequences the tree kept nothing of, and a chain's missing
    correction shows less than a tree's: 4x as many copies."""
    import copy
    import functools

    from conftest import chi_square, fixed_first_token, prefill_copies
    from magicdec.decoding import acceptance
    from magicdec.decoding.acceptance import Acceptor
    from magicdec.decoding.sampling import Sampling, probabilities
    from test_generate_speculative import first_layers

    class InTurn(Alternating):
        SHAPES = [(1, 1), (1, 3)] if first == "chain" else [(1, 3), (1, 1)]

    N, W, n_new = 4_000 if first == "chain" else 16_000, 3, 3
    with torch.no_grad():
        target = copy.deepcopy(tiny)
        target.output.weight.mul_(2.5)
    draft = first_layers(target, 2)
    a, d, V = target.args, draft.args, target.args.vocab_size
    with torch.inference_mode():
        prompt, fixed, p = fixed_first_token(target, N)
        P, prompts = prompt.shape[1], prompt.expand(N, -1)
        cache = KVCache(a.n_layers, V, a.n_kv_heads, P + 2, a.head_dim, torch.float32, "cpu")
        prefill_copies(target, cache, prompt.expand(V, -1), 64)
        after = target(torch.stack([fixed[:1].expand(V), torch.arange(V)], 1), cache)[:, -1]  # after each x
        joint = (p[:, None] * probabilities(after, 0.6, 0.9).double()).flatten()

        def run():
            length = P + n_new + W + 2
            cache = KVCache(a.n_layers, N, a.n_kv_heads, length, a.head_dim, torch.float32, "cpu")
            draft_cache = KVCache(d.n_layers, N, d.n_kv_heads, length, d.head_dim, torch.float32, "cpu")
            prefill_copies(target, cache, prompts, 64)
            prefill_copies(draft, draft_cache, prompts, 64)
            policy = InTurn([1])
            decoder = Decoder(target, Acceptor(Sampling(0.6, 0.9)), ModelDraft(draft, draft_cache).shaped(W),
                              policy=policy)
            torch.manual_seed(0)
            out, _ = decode(decoder, cache, fixed, n_new, prev=prompts[:, -1])
            return out, policy, decoder.stats.alpha

        out, policy, alpha = run()
        assert policy.history == [1] and policy.tree_history == [1], (policy.history, policy.tree_history)
        stat, bound = chi_square(out[:, 1] * V + out[:, 2], joint)
        assert stat < bound and 0.3 < alpha < 0.9, (stat, bound, alpha)

        second = "sampling_tree_verify" if first == "chain" else "speculative_sampling_verify"
        wrong = functools.partial(getattr(acceptance, second), correct=False)  # the original, unpatched
        monkeypatch.setattr(acceptance, second, wrong)
        broken, policy, _ = run()
        assert policy.history == [1] and policy.tree_history == [1]
        assert torch.equal(broken[:, 1], out[:, 1])  # the first verification's draws, as before
        stat, bound = chi_square(broken[:, 1] * V + broken[:, 2], joint)
        assert stat > 2 * bound, (stat, bound)
