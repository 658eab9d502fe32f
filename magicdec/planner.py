"""Decide how to decode: before a batch, the method, draft budget and gamma with the best predicted throughput —
"no speculation" included — from the cost model; while it runs (`--gamma auto`), gamma from the step times measured
on this very batch and the acceptance measured so far, switching speculation off when it stops paying.

Throughput of one choice is tokens per verification over seconds per verification: Omega(alpha, gamma) / c(gamma),
where c(0) is a plain decode step (Omega = 1) and c(gamma) = gamma*T_D + T_V(gamma) + bookkeeping. A batch, though,
runs until its slowest sequence is done: at run time the policy minimizes the expected time until the last of the
active sequences has its remaining tokens, which at large B favours a smaller gamma than Omega alone.
"""
from __future__ import annotations

import math

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
    would fall behind, and the next batch plans afresh.

    Speculation must promise to finish at least `margin` sooner than plain decoding: near break-even the estimate
    of alpha is worth less than the verification a wrong "on" wastes (at 100K x 1 a gamma-3 verification that keeps
    nothing costs 3 baseline steps), and the "off" choice is never worse than the baseline."""

    def __init__(self, gammas, alpha_prior: float = 0.8, prior_weight: float = 32.0, margin: float = 0.03):
        if not gammas or min(gammas) < 1:
            raise ValueError(f"candidate gammas must be >= 1, got {gammas}")
        self.gammas = sorted(set(gammas))
        self.alpha_prior, self.prior_weight, self.margin = alpha_prior, prior_weight, margin
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

    def finish_time(self, gamma: int, remaining: int, active: int) -> float:
        """Expected seconds until every one of `active` sequences has `remaining` more tokens with this gamma.

        Tokens per verification X: k with probability alpha^(k-1) (1 - alpha) for k <= gamma, gamma + 1 with
        probability alpha^gamma. The verifications a sequence needs for r tokens are about normal (renewal theory:
        mean r / E[X], variance r Var[X] / E[X]^3), and the largest of n such is about mean + sd * sqrt(2 ln n)."""
        if gamma == 0:
            return remaining * self.costs[0]
        a = self.alpha
        probs = [a ** (k - 1) * (1 - a) for k in range(1, gamma + 1)] + [a ** gamma]
        mean = sum(p * k for k, p in enumerate(probs, 1))
        var = sum(p * k * k for k, p in enumerate(probs, 1)) - mean ** 2
        iterations = remaining / mean + math.sqrt(remaining * var / mean ** 3) * math.sqrt(2 * math.log(max(active, 1)))
        return iterations * self.costs[gamma]

    def choose(self, remaining: int = 64, active: int = 1) -> int:
        if self.forced is not None:
            g = self.forced
        elif self.off or not self.costs:
            g = 0 if self.off else self.max_gamma
        else:
            timed = [g for g in self.gammas if g in self.costs]
            g = min(timed, key=lambda g: self.finish_time(g, remaining, active)) if timed else 0
            if g and self.finish_time(g, remaining, active) > (1 - self.margin) * self.finish_time(0, remaining, active):
                g = 0
            self.off = g == 0
        self.history.append(g)
        return g

    def observe(self, kept: int, reached: int) -> None:
        """Drafted tokens accepted / examined in the last verification (all active sequences)."""
        self.kept += kept
        self.reached += reached

    def summary(self) -> dict:
        used = {g: self.history.count(g) for g in sorted(set(self.history))}
        return {"candidates": self.gammas, "seconds_per_verification": self.costs, "alpha_prior": self.alpha_prior, "margin": self.margin,
                "alpha_estimate": self.alpha, "iterations_per_gamma": used,
                "switched_off": self.off}
