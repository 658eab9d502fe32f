"""Prefill and the autoregressive decode loop (the baseline). Speculative methods reuse `prefill` and `Decoder`."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from magicdec.kv_cache import KVCache
from magicdec.model import Transformer
from magicdec.sampling import next_token


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0


def prefill(model: Transformer, cache, prompts: torch.Tensor, chunk: int, progress: bool = False) -> torch.Tensor:
    """Feed prompts [B, P] in chunks of `chunk` tokens per sequence; return the last position's logits [B, V].

    Chunking bounds activation memory for 100K-token prompts: only the final chunk computes logits, and only
    for its last position.
    """
    B, P = prompts.shape
    starts = range(0, P, chunk)
    logits = None
    for start in tqdm(starts, desc="prefill", disable=not progress, leave=False):
        piece = prompts[:, start:start + chunk]
        last = start + chunk >= P
        logits = model(piece, cache, logits="last" if last else "none")
        cache.advance(piece.shape[1])
    return logits[:, -1]


class Decoder:
    """One decode step (model + sampling), optionally compiled with CUDA graphs (`--compile`).

    Compiling the step as a whole fuses the sampling ops and removes per-kernel launch gaps, which dominate
    small models and short contexts.
    """

    def __init__(self, model: Transformer, sampling: Sampling, compile: bool = False):
        self.model, self.sampling = model, sampling
        self.step = torch.compile(self._step, mode="reduce-overhead", fullgraph=True) if compile else self._step

    def _step(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        logits = self.model(tokens, cache, logits="all")[:, -1]
        s = self.sampling
        return next_token(logits, s.temperature, s.top_p, s.top_k)

    def __call__(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        out = self.step(tokens, cache)
        cache.advance(1)
        return out.clone()  # a CUDA-graph output is overwritten by the next replay


def decode(decoder: Decoder, cache: KVCache, first: torch.Tensor, n_new: int, eos_ids=(), progress=False):
    """Autoregressive loop. `first` [B] is the token sampled from the prefill logits (generated token 1).

    Returns generated ids [B, n_new] and a [B] count of tokens each sequence produced before stopping (EOS
    included); positions after a sequence's EOS hold EOS and are not counted.
    """
    B = first.shape[0]
    out = torch.empty(B, n_new, dtype=torch.long, device=first.device)
    out[:, 0] = first
    eos = torch.tensor(list(eos_ids), device=first.device, dtype=torch.long)
    done = torch.isin(first, eos) if len(eos) else torch.zeros(B, dtype=torch.bool, device=first.device)
    count = torch.ones(B, dtype=torch.long, device=first.device)
    tok = first
    for i in tqdm(range(1, n_new), desc="decode", disable=not progress, leave=False):
        tok = decoder(tok[:, None], cache)
        if len(eos):
            tok = torch.where(done, out[:, i - 1], tok)
            count += (~done).long()
            done = done | torch.isin(tok, eos)
        else:
            count += 1
        out[:, i] = tok
    return out, count
