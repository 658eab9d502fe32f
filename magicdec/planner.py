"""Decide how to decode: before a batch, the method, draft budget and gamma with the best predicted throughput —
"no speculation" included — from the cost model; while it runs (`--gamma auto`), gamma from the step times measured
on this very batch and the acceptance measured so far, switching speculation off when it stops paying.

Throughput of one choice is tokens per verification over seconds per verification: Omega(alpha, gamma) / c(gamma),
where c(0) is a plain decode step (Omega = 1) and c(gamma) = gamma*T_D + T_V(gamma) + bookkeeping.
"""
from __future__ import annotations

from dataclasses import dataclass

from magicdec import cost_model as cm
from magicdec.config import ModelArgs


@dataclass(frozen=True)
class Choice:
    method: str  # "baseline", "selfspec" or "longspec"
    budget: int | None
    gamma: int
    speedup: float  # predicted, against the baseline


def plan(target: ModelArgs, device: cm.Device, B: int, context: int, budgets, gammas, alpha: dict[int, float],
         draft: ModelArgs | None = None) -> tuple[Choice, list[Choice]]:
    """The best choice and every option considered; alpha maps each budget to its expected acceptance rate."""
    method = "longspec" if draft is not None else "selfspec"
    options = [Choice("baseline", None, 0, 1.0)]
    for budget in budgets:
        if budget >= context:  # a draft reading the whole context saves nothing
            continue
        for g in gammas:
            s = cm.predict(target, device, B, context, g, alpha[budget], budget, draft)["speedup"]
            options.append(Choice(method, budget, g, s))
    return max(options, key=lambda c: c.speedup), options


class AutoGamma:
    """gamma for each verification of a batch, from measured seconds per verification c(gamma) (profiled on the
    batch before it is timed; c(0) is the baseline step) and the acceptance rate measured so far.

    The rate estimate starts at `alpha_prior` worth `prior_weight` examined tokens, so a few unlucky first
    verifications cannot switch speculation off. Switching off (gamma 0) is final for the batch: the draft's cache
    would fall behind, and the next batch plans afresh."""

    def __init__(self, gammas, alpha_prior: float = 0.8, prior_weight: float = 32.0):
        if not gammas or min(gammas) < 1:
            raise ValueError(f"candidate gammas must be >= 1, got {gammas}")
        self.gammas = sorted(set(gammas))
        self.alpha_prior, self.prior_weight = alpha_prior, prior_weight
        self.costs: dict[int, float] = {}
        self.forced: int | None = None  # profiling runs one gamma at a time
        self.reset()

    def reset(self) -> None:
        """A new batch: forget its acceptance counts, switch speculation back on."""
        self.kept = self.reached = 0
        self.off = False
        self.history: list[int] = []

    @property
    def max_gamma(self) -> int:
        return self.gammas[-1]

    @property
    def alpha(self) -> float:
        return (self.kept + self.prior_weight * self.alpha_prior) / (self.reached + self.prior_weight)

    def rate(self, gamma: int) -> float:
        """Predicted tokens per second per sequence with this gamma (0: the baseline)."""
        return cm.omega(self.alpha, gamma) / self.costs[gamma] if gamma else 1.0 / self.costs[0]

    def choose(self) -> int:
        if self.forced is not None:
            g = self.forced
        elif self.off or not self.costs:
            g = 0 if self.off else self.max_gamma
        else:
            g = max([0] + [g for g in self.gammas if g in self.costs], key=self.rate)
            self.off = g == 0
        self.history.append(g)
        return g

    def observe(self, kept: int, reached: int) -> None:
        """Drafted tokens accepted / examined in the last verification (all active sequences)."""
        self.kept += kept
        self.reached += reached

    def summary(self) -> dict:
        used = {g: self.history.count(g) for g in sorted(set(self.history))}
        return {"candidates": self.gammas, "seconds_per_verification": self.costs, "alpha_prior": self.alpha_prior,
                "alpha_estimate": self.alpha, "iterations_per_gamma": used,
                "switched_off": self.off}
