"""Deciding how many drafted tokens to keep, per sequence, and the token that follows them.

All three rules take the target's verification output for gamma+1 positions and return (accepted [B], next [B]):
sequence b keeps drafted[b, :accepted[b]] and then `next[b]`, so it advances by accepted + 1 tokens.
"""
from __future__ import annotations

import functools

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


def speculative_sampling_verify(p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, correct: bool = True,
                                keep: torch.Tensor | None = None):
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    p [B, gamma+1, V]: target probabilities at each verified position; q [B, gamma, V]: the draft's probabilities
    that drafted [B, gamma] was sampled from. Token i is kept with probability min(1, p/q); at the first rejection
    the next token is drawn from norm(max(0, p - q)), after full acceptance from p (the bonus). The result is
    distributed exactly as sampling from p. `correct=False` draws from p instead of the residual after a rejection:
    that is NOT lossless, and exists so a test can show the statistical test catches it. `keep` [B, gamma] bool:
    which drafted tokens pass, decided elsewhere (synthetic acceptance of a sampled random-weight run: the same work,
    the acceptance of its coin flips).
    """
    B, gamma = drafted.shape
    p_d = p[:, :gamma].gather(-1, drafted[..., None])[..., 0]
    q_d = q.gather(-1, drafted[..., None])[..., 0]
    passed = torch.rand_like(p_d) * q_d < p_d  # u < p/q without dividing
    keep = passed if keep is None else keep
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


@functools.lru_cache(maxsize=64)
def position_rates(rates: tuple[float, ...], alpha: float, gamma: int, device: str) -> torch.Tensor:
    """[gamma]: the conditional rate of each drafted position of a verification (--synthetic_positions), `alpha`
    past the ones given; made once (a copy from the host each verification would wait for the GPU)."""
    return torch.tensor([rates[i] if i < len(rates) else alpha for i in range(gamma)], device=device)


def trace_landscape(gammas: list[int], accepted: list[list[int]], B: int, length: int, alpha: float, device,
                    seed: int = 0) -> torch.Tensor:
    """A landscape (acceptance_landscape's [B, length], read against `alpha`) that replays a recorded run: sequence
    b follows the trace's sequence b % S verification by verification, its accepted drafts at 0 (kept at any rate),
    the draft that was rejected at 1 (never kept); the positions the trace leaves open (the one after a fully kept
    draft, those past its end) are drawn so that they are kept at that sequence's own rate in the trace. At the
    recorded gammas the replay keeps exactly the recorded counts; at others it keeps each sequence's own
    per-position pattern, rate and spread from the others."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.rand(length, B, generator=gen).T.contiguous()
    for b in range(B):
        seq = [(g, a) for g, a in zip(gammas, accepted[b % len(accepted)]) if a >= 0]
        examined = sum(min(a + 1, g) for g, a in seq)
        own = sum(a for _, a in seq) / examined if examined else 0.0
        out[b] = out[b] * alpha / own if own > 0 else 1.0
        col = 2  # hist column of the first drafted token (generate.Batch)
        for g, a in seq:
            out[b, col:min(col + a, length)] = 0.0
            if a < g and col + a < length:
                out[b, col + a] = 1.0
            col += a + 1
            if col >= length:
                break
    return out.to(device)


def synthetic_verify(best: torch.Tensor, drafted: torch.Tensor, alpha, uniforms: torch.Tensor | None = None):
    """For random-weight speed runs: keep each drafted token with probability alpha, so the real kernel work happens
    at a chosen acceptance rate; alpha a number, or a [gamma] tensor of per-position conditional rates (the drafted
    token at position i kept with alpha[i] once those before it were). `uniforms` [B, gamma]: the landscape at the
    drafted positions (fresh draws from torch's seeded generator if None). The next token is the target's argmax."""
    if uniforms is None:
        uniforms = torch.rand(drafted.shape, device=drafted.device)
    accepted = leading_true(uniforms < alpha)
    return accepted, best.gather(1, accepted[:, None])[:, 0]
