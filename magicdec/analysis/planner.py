"""Decide how to decode: before a batch, the method, draft budget and gamma with the best predicted throughput —
"no speculation" included — from the cost model; while it runs (`--gamma auto`), gamma from the step times measured
on this very batch and the acceptance measured so far, switching speculation off when it stops paying.

A batch runs until its slowest sequence is done, so both compare expected finishing times, not Omega / cost: the
time until the last active sequence has all its tokens, E[max_i N_i] * c(gamma), where N_i is the number of
verifications sequence i needs for the tokens it still lacks and c(gamma) = gamma*T_D + T_V(gamma) + bookkeeping
(c(0), a plain decode step, takes exactly one step per token). At B = 1 this is Omega / cost again; at large B the
stragglers favour a shorter gamma, or none.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import torch

from magicdec.analysis import cost_model as cm
GRID = 100  # acceptance rates are looked up at steps of 1 / GRID
RATES = np.linspace(0, 1, GRID + 1)  # the grid's rates
EXACT = 32  # up to this many tokens left, the distribution of N is used itself, not a normal approximation


class Verifications:
    """Mean and variance of N_r, the verifications one sequence needs for r more tokens at acceptance rate alpha
    with draft length gamma, for every alpha on the grid: exact, from N_r = 1 + N_{r - X} (X = tokens a verification
    keeps: k with probability alpha^(k-1) (1 - alpha) for k <= gamma, gamma + 1 with probability alpha^gamma),
    since the renewal approximation r / E[X] is far off for the few tokens left near the end of a generation. Up to
    EXACT tokens left, also P(N_r <= k) itself."""

    def __init__(self):
        self.first = self.second = np.zeros((1, GRID + 1, 1))  # [gamma, alpha, r]: E[N], E[N^2]
        self.cdf = np.zeros((1, GRID + 1, EXACT + 1, EXACT + 1))  # [gamma, alpha, r, k]: P(N_r <= k)

    def _build(self, max_gamma: int, r_max: int) -> None:
        alpha = RATES[:, None]
        first = np.zeros((max_gamma + 1, GRID + 1, r_max + 1))
        second = np.zeros_like(first)
        pmf = np.zeros((max_gamma + 1, GRID + 1, EXACT + 1, EXACT + 1))  # [gamma, alpha, r, k]: P(N_r = k)
        first[0] = np.arange(r_max + 1)  # gamma 0: one token a step
        second[0] = first[0] ** 2
        pmf[0, :, np.arange(EXACT + 1), np.arange(EXACT + 1)] = 1
        for gamma in range(1, max_gamma + 1):
            k = np.arange(1, gamma + 2)
            p = alpha ** (k - 1) * (1 - alpha)
            p[:, gamma] = alpha[:, 0] ** gamma
            pmf[gamma, :, 0, 0] = 1
            for r in range(1, r_max + 1):
                before = np.maximum(r - k, 0)
                m = (p * first[gamma][:, before]).sum(1)
                first[gamma, :, r] = 1 + m
                second[gamma, :, r] = 1 + 2 * m + (p * second[gamma][:, before]).sum(1)
                if r <= EXACT:  # N_r = 1 + N_{r - X}: shift by one verification
                    pmf[gamma, :, r, 1:] = (p[:, :, None] * pmf[gamma][:, before, :-1]).sum(1)
        self.first, self.second, self.cdf = first, second, pmf.cumsum(-1)

    def cover(self, gammas: list[int], r_max: int) -> None:
        """Tables for these gammas and up to r_max tokens left (built once, grown when a longer run asks)."""
        if self.first.shape[0] <= max(gammas) or self.first.shape[2] <= r_max:
            self._build(max(max(gammas), self.first.shape[0] - 1), max(2 * r_max, 64))

    def moments(self, gammas: list[int], alpha: np.ndarray, remaining: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean and variance of N per gamma and sequence [len(gammas), n] (alpha and remaining: [n])."""
        self.cover(gammas, int(remaining.max()))
        g = np.asarray(gammas)[:, None]
        a = np.rint(alpha * GRID).astype(np.int64)[None]  # alpha in [0, 1]
        mean, sq = self.first[g, a, remaining[None]], self.second[g, a, remaining[None]]
        return mean, np.maximum(sq - mean ** 2, 0)


VERIFICATIONS = Verifications()


def expected_max(mean: np.ndarray, var: np.ndarray) -> np.ndarray:
    """E[max over the last dim of independent integer N_i], each N_i taken as normal (continuity-corrected): the
    sum over k of P(max > k), on the few k where it is neither ~1 nor ~0, in one vectorized pass."""
    if mean.shape[-1] == 1:
        return mean[..., 0]
    sd = np.maximum(np.sqrt(var), 1e-6)
    lo = np.floor(np.maximum((mean - 4 * sd).max(-1), 0))
    k = lo[..., None] + np.arange(int(((mean + 4 * sd).max(-1) - lo).max()) + 2)
    z = torch.from_numpy((k[..., None, :] + 0.5 - mean[..., None]) / sd[..., None])
    below = torch.special.ndtr(z).prod(-2).numpy()  # P(max <= k)
    return lo + (1 - below).sum(-1)


def finish_verifications(gammas: list[int], alpha: np.ndarray, remaining: np.ndarray) -> np.ndarray:
    """Expected verifications until every sequence has its remaining tokens, per gamma (alpha, remaining: [n]):
    exact while at most EXACT tokens are left (N_r <= r, so sum over k < EXACT of P(max > k)), else approximated."""
    if remaining.max() > EXACT:
        return expected_max(*VERIFICATIONS.moments(gammas, alpha, remaining))
    VERIFICATIONS.cover(gammas, int(remaining.max()))
    g, a = np.asarray(gammas)[:, None, None], np.rint(alpha * GRID).astype(np.int64)[None, :, None]
    below = VERIFICATIONS.cdf[g, a, remaining[None, :, None], np.arange(EXACT)].prod(-2)
    return (1 - below).sum(-1)


def fit_spread(points, grid=np.arange(0.0, 0.2501, 0.005)) -> float:
    """The spread of acceptance between sequences that makes the finishing-time model reproduce measured batches:
    `points` are (B, gamma, tokens, alpha, verifications) of earlier fixed-gamma runs, verifications being how many
    the batch needed until its last sequence had `tokens` more. On real text a batch's slowest sequence lags more
    than i.i.d. draws at one rate explain: rates differ between sequences, and within one, acceptance comes in runs
    (repetition loops). The spread of the per-sequence rates alone under-explains it: the fitted spread is about twice
    the measured one on SmolLM2 (results/planner_sweeps). None where no point has
    B > 1: a spread unknown, which is not a spread known to be 0 (sequences sharing one rate, as synthetic
    acceptance makes them)."""
    points = [p for p in points if p[0] > 1]
    if not points:
        return None

    def misfit(spread):
        return sum(np.log(finish_verifications([g], spread_alphas(a, spread, B), np.full(B, t))[0] / n) ** 2
                   for B, g, t, a, n in points)
    return float(min(grid, key=misfit))


def replay_finish(trace: dict, B: int, gamma: int, tokens: int, rate: float, seed: int = 0) -> tuple[int, float]:
    """(verifications until the batch's last sequence has `tokens` more, the tokens a sequence gains per
    verification on average) for a chain that replays `trace` (acceptance.load_trace's) at `rate`: the landscape a
    random-weight run draws from it (acceptance.trace_landscape, the run's seed), read as its chain rule reads it
    (a drafted token kept while the landscape at its column is below the rate; the first drafted column 2). A
    trace's sequences differ (on SmolLM2, lookup kept 0-6 tokens a verification): the slowest one sets the batch's
    end, which one rate for all (finish_verifications at spread 0) cannot show."""
    from magicdec.decoding.acceptance import trace_landscape

    land = trace_landscape(trace["gammas"], trace["accepted"], B, tokens + gamma + 3, rate, "cpu", seed).numpy()
    m, n = np.full(B, 2), np.zeros(B, dtype=np.int64)
    rows, cols = np.arange(B)[:, None], np.arange(gamma)[None, :]
    while (active := m - 2 < tokens).any():
        kept = land[rows, np.minimum(m, tokens + 1)[:, None] + cols] < rate  # a done row reads inside, as the run
        accepted = np.where(kept.all(1), gamma, kept.argmin(1))
        m, n = np.where(active, m + accepted + 1, m), n + active
    return int(n.max()), float(np.mean((m - 2) / n))


@functools.lru_cache(maxsize=64)
def normal_quantiles(n: int) -> np.ndarray:
    """n evenly spaced quantiles of the standard normal: a batch's sequences as drawn from it (n = 1: the mean)."""
    return np.array([NormalDist().inv_cdf((j + 0.5) / n) for j in range(n)])


def spread_alphas(alpha: float, spread: float, n: int) -> np.ndarray:
    """n acceptance rates spread like the sequences of a batch: normal quantiles around alpha."""
    return np.clip(alpha + spread * normal_quantiles(n), 0.0, 1.0)


def sequence_weight(alpha: float, spread: float | None, default: float = 16.0) -> float:
    """How many examined tokens a sequence's own rate must see to count as much as the batch's: the binomial
    variance of one draw over the variance between sequences (the shrinkage a normal prior gives); `default`
    where the spread is unknown (None). A spread of 0 leaves nothing to a sequence's own counts: its lag is luck,
    not a slower sequence (with the default weight instead, one unlucky sequence at synthetic acceptance switched
    speculation off and lost most of its gain: results/planner_sweeps/policy_simulation)."""
    if spread is None:
        return default
    return 1e6 if spread <= 0 else min(max(alpha * (1 - alpha) / spread ** 2, 2.0), 1e6)


@dataclass(frozen=True)
class Choice:
    method: str  # "baseline", or the drafter's name
    budget: int | None
    gamma: int
    speedup: float  # predicted, against the baseline
    draft_weights: str | None = None  # the draft's weight format, where the planner chose among formats
    tree_width: int | None = None  # candidates per drafted position, where the planner chose a token tree
    tree_nodes: int | None = None  # a Sequoia tree's nodes (--tree_nodes), where the planner chose one


def option_parts(draft) -> tuple:
    """(budget, weight format or None, tree width or None, tree nodes or None) of a draft option: a budget, or a
    tuple of them."""
    parts = tuple(draft) if isinstance(draft, tuple) else (draft,)
    return (*parts, None, None, None)[:4]


def plan(drafts, gammas, alpha: dict, predict, B: int, tokens: int = 64, spread: dict | None = None,
         method: str = "draft") -> tuple[Choice, list[Choice]]:
    """The best choice for B sequences of `tokens` new tokens each, and every option considered. `drafts`: the draft
    options, each a budget or a (budget, draft weight format[, tree width[, tree nodes]]) tuple; alpha maps each to its expected
    acceptance rate (a format's own: a 4-bit copy accepts less), `spread` to its spread between sequences
    (fit_spread; none if not given or unknown). `predict(draft, gamma)` is the drafter's cost-model prediction (its
    T_D/T_T, T_V/T_T, T_O/T_T, the format's kernel times in its T_D; a tree's verification over its nodes and its
    expected yield as omega), or None where it has none. Finishing times as in AutoGamma; a tree's yield enters them
    as the chain acceptance that yields as much (cost_model.chain_alpha)."""
    options = [Choice("baseline", None, 0, 1.0)]
    for draft in drafts:
        budget, fmt, width, nodes = option_parts(draft)
        tree = (width or 1) > 1 or bool(nodes)
        for g in sorted(gammas):
            p = predict(draft, g)
            if p is None:
                continue
            speedup = finishing_speedup(p, g, B, tokens, (spread or {}).get(draft) or 0.0,
                                        None if tree else alpha[draft])
            options.append(Choice(method, budget, g, speedup, fmt, width if (width or 1) > 1 else None, nodes or None))
    return max(options, key=lambda c: c.speedup), options


def finishing_speedup(p: dict, gamma: int, B: int, tokens: int, spread: float = 0.0,
                      alpha: float | None = None, factors: tuple[float, ...] = ()) -> float:
    """The baseline's finishing time over this option's, for B sequences of `tokens` new tokens each: `p` the
    drafter's prediction at gamma, `alpha` the chain's acceptance rate, or None to take the chain rate that yields
    p's omega (cost_model.chain_alpha: a tree's, or any drafter whose verification yields a different number of
    tokens than a chain of gamma would). `factors`: sequence b's rate is that rate times factors[b mod S] (1 at
    most; a tree's --synthetic_sequence_factors, its rates all scaled alike, taken as its chain rate scaled)."""
    a = cm.chain_alpha(p["omega"], gamma) if alpha is None else alpha
    alphas = np.clip(a * np.resize(np.asarray(factors, dtype=float), B), 0.0, 1.0) if factors else \
        spread_alphas(a, spread, B)
    n = float(finish_verifications([gamma], alphas, np.full(B, tokens))[0])
    return tokens / (n * cm.verification_cost(p, gamma))


class AutoGamma:
    """gamma for each verification of a batch, from measured seconds per verification c(gamma) (profiled on the
    batch before it is timed; c(0) is the baseline step), the acceptance measured so far and the tokens each
    sequence still needs.

    The batch's rate starts at `alpha_prior` worth `prior_weight` examined tokens, so a few unlucky first
    verifications cannot switch speculation off. Sequences differ (`spread`, fit_spread; None: unknown): each one's
    rate is the batch's, moved by what it has shown so far (sequence_weight), and spread by what it has not: before any draft
    the batch's sequences take normal quantiles of the spread around the batch's rate, a spread that narrows for each
    sequence as its own drafts are examined. The slowest sequence sets the batch's end. Switching off (gamma 0) is
    final for the batch: the draft's cache would fall behind, and the next batch plans afresh.

    Switching on must promise to finish at least `margin` sooner than plain decoding: before the first
    verification the rate is only a prior, worth less than the verification a wrong "on" wastes (at 100K x 1 a
    gamma-3 verification that keeps nothing costs 3 baseline steps), and "off" is never worse than the baseline.
    The decoder asks for each gamma while the GPU runs the verification before it, so a choice sees the numbers
    of the verification before that one (one verification stale, and no GPU time spent on choosing).

    Once on, speculation stays on while it is predicted no slower (hysteresis: a small predicted gain late in a batch
    is still a gain, and a needless switch-off has lost more than that: results/planner_sweeps).

    With a tree attached (attach_tree: --gamma auto --tree_width W) each verification is a chain or a width-W tree,
    whichever finishes the batch sooner: the tree's yield at the batch's first-candidate rate and its sibling rates,
    measured as it runs from its per-rank counts, taken as a chain's rate (chain_equivalent), its seconds per
    verification profiled like a chain's. A tree pays while many sequences need many tokens and its siblings keep
    enough; near a batch's end its wider verification can cost more than it saves."""

    def __init__(self, gammas, alpha_prior: float = 0.8, prior_weight: float = 32.0, margin: float = 0.03,
                 spread: float | None = None, sibling_prior: tuple[float, ...] = ()):
        if not gammas or min(gammas) < 1:
            raise ValueError(f"candidate gammas must be >= 1, got {gammas}")
        self.gammas = sorted(set(gammas))
        self.alpha_prior, self.prior_weight, self.margin = alpha_prior, prior_weight, margin
        self.spread = spread
        self.costs: dict[int, float] = {}
        self.forced: int | None = None  # profiling (runs.profile_gammas) runs one gamma at a time
        # a token tree the policy may verify instead of a chain (attach_tree): its width, its shape per depth, the
        # sibling rates assumed at the start, and its seconds per verification by depth (profiled like costs)
        self.width, self.tree_of, self.sibling_prior = 1, None, tuple(sibling_prior)
        self.tree_costs: dict[int, float] = {}
        self.forced_width = 1
        self.chosen_width = 1  # the width of the last choice
        self._equivalent: dict = {}  # (gamma, siblings rounded) -> a chain's rate per tree rate on the grid
        self.reset()

    def attach_tree(self, width: int, tree_of, sibling_prior=None) -> None:
        """Let each verification be a width-`width` tree instead of a chain: `tree_of(gamma)` the tree.Tree a
        proposal gamma deep fills; `sibling_prior` the later candidates' rates assumed at the start (one per
        rank past the first, the last repeated; default: the policy's own, else 0.3)."""
        self.width, self.tree_of = width, tree_of
        prior = tuple(self.sibling_prior if sibling_prior is None else sibling_prior) or (0.3,)
        self.sibling_prior = tuple(prior[min(r, len(prior) - 1)] for r in range(width - 1))
        self.reset()

    def reset(self) -> None:
        """A new batch: forget its acceptance counts, switch speculation back on."""
        self.seq_kept = self.seq_reached = np.zeros(0)
        self.batch_kept = self.batch_reached = 0.0  # the first candidates' (a chain's tokens, a tree's rank 0)
        self.rank_kept = self.rank_tried = np.zeros(max(self.width, 1))
        self.off = self.on = False
        self.history: list[int] = []
        self.tree_history: list[int] = []

    @property
    def max_gamma(self) -> int:
        return self.gammas[-1]

    @property
    def alpha(self) -> float:
        """The batch's rate for a first candidate: a chain's tokens, and a tree's rank-0 candidates."""
        return (self.batch_kept + self.prior_weight * self.alpha_prior) / (self.batch_reached + self.prior_weight)

    @property
    def siblings(self) -> tuple[float, ...]:
        """The tree's later candidates' rates (rank r: kept once the ones before it were not), from its
        verifications so far, starting at the prior."""
        w = self.prior_weight
        return tuple(float((self.rank_kept[r] + w * self.sibling_prior[r - 1]) / (self.rank_tried[r] + w))
                     for r in range(1, self.width))

    def sequence_alphas(self, n: int) -> np.ndarray:
        """Each sequence's rate as the finishing times use it (n: the batch's sequences)."""
        alpha, w = self.alpha, sequence_weight(self.alpha, self.spread)
        spread = self.spread or 0.0
        if self.seq_kept.size != n:
            return spread_alphas(alpha, spread, n)
        shown = (self.seq_kept + w * alpha) / (self.seq_reached + w)
        unshown = spread * np.sqrt(w / (w + self.seq_reached))  # the spread not yet resolved by its own drafts
        return np.clip(shown + unshown * normal_quantiles(n), 0.0, 1.0)

    def finish_times(self, remaining) -> dict[int, float]:
        """Expected seconds until every sequence has its remaining tokens, for each profiled gamma, 0 included
        (remaining: a count per sequence of the batch, 0 for those done)."""
        remaining = np.asarray(remaining, dtype=np.int64).reshape(-1)
        times = {0: int(remaining.max()) * self.costs[0]}
        gammas, active = [g for g in self.gammas if g in self.costs], remaining > 0
        if gammas and active.any():
            alpha = self.sequence_alphas(remaining.size)[active]
            verifications = finish_verifications(gammas, alpha, remaining[active]).tolist()
            times.update({g: n * self.costs[g] for g, n in zip(gammas, verifications)})
        return times

    def chain_equivalent(self, gamma: int, alphas: np.ndarray) -> np.ndarray:
        """Each rate of `alphas` (a first candidate's) as the chain rate at which gamma drafted tokens yield what
        the tree gamma deep yields at it and the current sibling rates (cost_model.chain_alpha): how the finishing
        times take a tree. A grid per depth, made again when a sibling rate moves by 0.01."""
        from magicdec.model.tree import expected_tokens

        siblings = tuple(round(r, 2) for r in self.siblings)
        key = (gamma, siblings)
        if key not in self._equivalent:
            tree = self.tree_of(gamma)
            self._equivalent[key] = np.array([cm.chain_alpha(expected_tokens(tree, (a, *siblings)), gamma)
                                              for a in RATES])
        return np.interp(alphas, RATES, self._equivalent[key])

    def tree_finish_times(self, remaining) -> dict[int, float]:
        """finish_times for the tree at each profiled depth (none without a tree)."""
        remaining = np.asarray(remaining, dtype=np.int64).reshape(-1)
        gammas, active = [g for g in self.gammas if g in self.tree_costs], remaining > 0
        if self.tree_of is None or not gammas or not active.any():
            return {}
        alpha = self.sequence_alphas(remaining.size)[active]
        out = {}
        for g in gammas:
            n = float(finish_verifications([g], self.chain_equivalent(g, alpha), remaining[active])[0])
            out[g] = n * self.tree_costs[g]
        return out

    def choose(self, remaining=(64,)) -> int:
        """The next verification's gamma (0: plain decoding); its width in `chosen_width` (1: a chain)."""
        width = 1
        if self.forced is not None:
            g, width = self.forced, self.forced_width
        elif self.off or not self.costs:
            g = 0 if self.off else self.max_gamma
        else:
            times = self.finish_times(remaining)
            trees = self.tree_finish_times(remaining)
            g = min((g for g in times if g), key=times.get, default=0)
            if trees and (not g or min(trees.values()) < times[g]):
                g = min(trees, key=trees.get)
                width, best = self.width, trees[g]
            else:
                best = times[g] if g else times[0]
            if g and best > (1 if self.on else 1 - self.margin) * times[0]:
                g, width = 0, 1
            self.off, self.on = g == 0, g > 0
        self.chosen_width = width
        return g

    def used(self, gamma: int, width: int = 1) -> None:
        """The decoder ran a verification with this gamma (it may choose one ahead and not use it)."""
        (self.tree_history if width > 1 else self.history).append(gamma)

    def observe(self, kept, reached) -> None:
        """A chain's verification: drafted tokens accepted / examined, per sequence of the batch."""
        kept = np.asarray(kept, dtype=np.float64).reshape(-1)
        reached = np.asarray(reached, dtype=np.float64).reshape(-1)
        if self.seq_kept.size != kept.size:
            self.seq_kept, self.seq_reached = np.zeros_like(kept), np.zeros_like(reached)
        self.seq_kept = self.seq_kept + kept
        self.seq_reached = self.seq_reached + reached
        self.batch_kept += float(kept.sum())
        self.batch_reached += float(reached.sum())

    def observe_tree(self, tried, kept) -> None:
        """A tree's verification: candidates tried and kept per sibling rank over the batch (tree.rank_counts).
        Rank 0 is a chain's token, so it moves the batch's rate; a sequence's own rate learns from chains only (a
        tree's path mixes ranks)."""
        tried = np.asarray(tried, dtype=np.float64).reshape(-1)[:self.width]
        kept = np.asarray(kept, dtype=np.float64).reshape(-1)[:self.width]
        self.rank_tried = self.rank_tried + np.pad(tried, (0, self.width - tried.size))
        self.rank_kept = self.rank_kept + np.pad(kept, (0, self.width - kept.size))
        self.batch_kept += float(kept[0]) if kept.size else 0.0
        self.batch_reached += float(tried[0]) if tried.size else 0.0

    def summary(self) -> dict:
        used = {g: self.history.count(g) for g in sorted(set(self.history))}
        alphas = self.sequence_alphas(self.seq_kept.size) if self.seq_kept.size else None
        out = {"candidates": self.gammas, "seconds_per_verification": self.costs, "alpha_prior": self.alpha_prior,
               "spread": self.spread, "margin": self.margin,
               "alpha_estimate": self.alpha, "iterations_per_gamma": used,
               "sequence_alpha_range": None if alphas is None else [float(alphas.min()), float(alphas.max())],
               "switched_off": self.off}
        if self.tree_of is not None:
            out |= {"tree_width": self.width, "tree_seconds_per_verification": self.tree_costs,
                    "sibling_estimate": list(self.siblings),
                    "tree_iterations_per_gamma": {g: self.tree_history.count(g)
                                                  for g in sorted(set(self.tree_history))}}
        return out


def best_tree(predict_tree, rates: tuple[float, ...], max_nodes: int = 64, max_depth: int = 8,
              sizes=(2, 4, 8, 12, 16, 24, 32, 48, 64)):
    """MagicDec's "adaptive Sequoia trees": over depths D and node budgets n, Sequoia's best tree of n nodes and D
    levels (tree.optimal_tree) under the acceptance vector `rates`, scored by the cost model's speedup,
    expected tokens / (D draft steps + its verification over n nodes). `predict_tree(tree)` is the drafter's
    cost-model prediction for that tree (cost_model.predict with tree=). Returns (best tree, its prediction), and
    every (n, D, speedup) scored."""
    from magicdec.model.tree import optimal_tree

    scored, best = [], None
    for depth in range(1, max_depth + 1):
        for n in sorted({min(s, max_nodes) for s in sizes}):
            tree = optimal_tree(rates, n, depth)
            p = predict_tree(tree)
            scored.append((tree.size, tree.depth, p["speedup"]))
            if best is None or p["speedup"] > best[1]["speedup"]:
                best = (tree, p)
    return best[0], best[1], scored
