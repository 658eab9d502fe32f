"""Turning logits into tokens. Temperature 0 is greedy (argmax), never a division by zero.

Randomness comes from torch's global generator (seeded by the caller), which also works inside torch.compile.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Softmax of logits [..., V] after temperature, top-k and top-p (nucleus) filtering, in fp32.
    Temperature 0 is the greedy distribution: one-hot on the argmax."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Drop a token when the tokens strictly more likely already cover top_p (so the top token always stays).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row of probs [..., V]; exponential race instead of multinomial (no host sync)."""
    race = torch.empty_like(probs).exponential_(1)
    return torch.argmax(probs / race, dim=-1)


def next_token(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    return sample_from(probabilities(logits, temperature, top_p, top_k))
