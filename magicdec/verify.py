"""Deciding how many drafted tokens to keep, per sequence, and the token that follows them.

All three rules take the target's verification output for gamma+1 positions and return (accepted [B], next [B]):
sequence b keeps drafted[b, :accepted[b]] and then `next[b]`, so it advances by accepted + 1 tokens.
"""
from __future__ import annotations

import torch

from magicdec.sampling import sample_from


def leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Number of leading True values in each row of a [B, gamma] bool tensor."""
    return mask.long().cumprod(dim=1).sum(dim=1)


def greedy_verify(best: torch.Tensor, drafted: torch.Tensor):
    """best [B, gamma+1]: the target's argmax at each verified position. Keep drafted tokens while they equal it;
    then the target's own argmax (the bonus token when all are kept). Output equals plain greedy decoding."""
    accepted = leading_true(best[:, :-1] == drafted)
    return accepted, best.gather(1, accepted[:, None])[:, 0]


def speculative_sampling_verify(p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, correct: bool = True):
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    p [B, gamma+1, V]: target probabilities at each verified position; q [B, gamma, V]: the draft's probabilities
    that drafted [B, gamma] was sampled from. Token i is kept with probability min(1, p/q); at the first rejection
    the next token is drawn from norm(max(0, p - q)), after full acceptance from p (the bonus). The result is
    distributed exactly as sampling from p. `correct=False` draws from p instead of the residual after a rejection:
    that is NOT lossless, and exists so a test can show the statistical test catches it.
    """
    B, gamma = drafted.shape
    p_d = p[:, :gamma].gather(-1, drafted[..., None])[..., 0]
    q_d = q.gather(-1, drafted[..., None])[..., 0]
    keep = torch.rand_like(p_d) * q_d < p_d  # u < p/q without dividing
    accepted = leading_true(keep)
    rows = torch.arange(B, device=p.device)
    p_next = p[rows, accepted]
    if correct:
        q_next = torch.cat([q, q.new_zeros(B, 1, q.shape[-1])], dim=1)[rows, accepted]  # zeros: the bonus uses p alone
        residual = torch.clamp(p_next - q_next, min=0)
        mass = residual.sum(-1, keepdim=True)
        p_next = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)  # mass 0 only if p == q
    return accepted, sample_from(p_next)


SYNTHETIC_DRAWS = "one uniform per (sequence, position), the same for every gamma (verify.acceptance_landscape)"


def acceptance_landscape(B: int, length: int, device, seed: int = 0) -> torch.Tensor:
    """For synthetic acceptance: one uniform number per (sequence, position), drawn once per generation from its own
    seeded generator. A drafted token at position t of sequence b is accepted iff landscape[b, t] < alpha, so every
    gamma (and the planner's per-verification choices) meets the same easy and hard positions, as it would on real
    text: comparisons across gamma are then free of the luck of separate draws (common random numbers)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    # drawn position-major, so position t gets the same numbers however long the landscape (gamma sets its length)
    return torch.rand(length, B, generator=generator, device=device).T.contiguous()


def synthetic_verify(best: torch.Tensor, drafted: torch.Tensor, alpha: float, uniforms: torch.Tensor | None = None):
    """For random-weight speed runs: keep each drafted token with probability alpha, so the real kernel work happens
    at a chosen acceptance rate. `uniforms` [B, gamma]: the landscape at the drafted positions (fresh draws from
    torch's seeded generator if None). The next token is the target's argmax."""
    if uniforms is None:
        uniforms = torch.rand(drafted.shape, device=drafted.device)
    accepted = leading_true(uniforms < alpha)
    return accepted, best.gather(1, accepted[:, None])[:, 0]
