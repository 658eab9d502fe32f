"""Prefill, and the one generation loop every method runs: draft gamma tokens, verify gamma+1 in one target pass,
keep a per-sequence number of them. The baseline is this loop with no draft (gamma = 0: a plain decode step)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from magicdec.kv_cache import KVCache
from magicdec.model import Transformer
from magicdec.sampling import probabilities, sample_from
from magicdec.verify import greedy_verify, speculative_sampling_verify, synthetic_verify


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Draft:
    """A draft strategy: the model that proposes tokens and the cache it reads. Self-speculation is the target's
    own weights with a StreamingCache; a standalone draft is a small model with a StreamingCache or a full KVCache."""
    model: Transformer
    cache: KVCache


def prefill(model: Transformer, cache, prompts: torch.Tensor, chunk: int, progress: bool = False) -> torch.Tensor:
    """Feed prompts [B, P] in chunks of `chunk` tokens per sequence; return the last position's logits [B, V].

    Chunking bounds activation memory for 100K-token prompts: only the final chunk computes logits, and only
    for its last position.
    """
    B, P = prompts.shape
    logits = None
    for start in tqdm(range(0, P, chunk), desc="prefill", disable=not progress, leave=False):
        piece = prompts[:, start:start + chunk]
        logits = model(piece, cache, logits="last" if start + chunk >= P else "none")
        cache.advance(piece.shape[1])
    return logits[:, -1]


class PhaseTimer:
    """Time spent per phase (draft / verify / other) without a host sync per phase: CUDA events on the GPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[str, object, object]] = []

    def stamp(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, phase: str, start, end) -> None:
        self.spans.append((phase, start, end))

    def totals(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for phase, start, end in self.spans:
            seconds = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            out[phase] = out.get(phase, 0.0) + seconds
        return out


@dataclass
class Stats:
    """Acceptance counts over all (active sequence, verification) pairs of one generation."""
    gamma: int
    verifications: int = 0
    accepted: int = 0
    reached: list[int] = field(default_factory=list)  # reached[i]: times drafted position i was examined
    kept: list[int] = field(default_factory=list)  # kept[i]: times it was accepted
    iterations: int = 0
    time: dict[str, float] = field(default_factory=dict)

    @property
    def alpha(self) -> float | None:
        """Acceptance rate: accepted / examined drafted tokens (the per-token rate of the i.i.d. model)."""
        return sum(self.kept) / sum(self.reached) if self.reached and sum(self.reached) else None

    @property
    def omega(self) -> float | None:
        """Mean tokens produced per verification (accepted + the target's own token)."""
        return (self.accepted + self.verifications) / self.verifications if self.verifications else None

    def to_dict(self) -> dict:
        return {"gamma": self.gamma, "alpha": self.alpha, "omega": self.omega, "verifications": self.verifications,
                "iterations": self.iterations, "accepted_tokens": self.accepted,
                "per_position_acceptance": [k / r if r else None for k, r in zip(self.kept, self.reached)],
                "time_s": self.time}


class Decoder:
    """Target (+ optional draft) steps, compiled with CUDA graphs when asked (`--compile`): one graph for the
    verify step (gamma+1 tokens) and two for the draft (its 2-token catch-up step, then 1-token steps)."""

    def __init__(self, model: Transformer, sampling: Sampling, compile: bool = False, draft: Draft | None = None,
                 gamma: int = 0, synthetic_acceptance: float | None = None, trace: bool = False):
        self.model, self.sampling, self.draft = model, sampling, draft
        self.trace = [] if trace else None  # per-iteration accepted counts (a host sync each: tests only)
        self.gamma = gamma if draft is not None else 0
        self.synthetic = synthetic_acceptance
        wrap = (lambda f: torch.compile(f, mode="reduce-overhead", fullgraph=True, dynamic=False)) if compile else (lambda f: f)
        self.verify_step = wrap(self._verify_step)
        self.draft_step = wrap(self._draft_step)
        self.stats = Stats(self.gamma)

    def _distribution(self, logits):
        s = self.sampling
        if s.greedy or self.synthetic is not None:
            return logits.argmax(-1)
        return probabilities(logits, s.temperature, s.top_p, s.top_k)

    def _verify_step(self, tokens, cache):
        return self._distribution(self.model(tokens, cache, logits="all"))

    def _draft_step(self, tokens, cache):
        return self._distribution(self.draft.model(tokens, cache, logits="last")[:, -1])

    def _propose(self, hist, m, base, n_new):
        """gamma draft tokens per sequence, and the draft's distributions q [B, gamma, V] when sampling."""
        cache = self.draft.cache
        # Re-feed the last two committed tokens: after full acceptance the draft has not yet seen its own last
        # token, otherwise re-writing it is a no-op. Always two keeps the shapes fixed (CUDA graphs, no host sync).
        cache.rollback(base + torch.clamp(m, max=n_new + 1) - 2)  # clamp: stopped rows stay inside the cache
        inp = hist.gather(1, torch.stack([m - 2, m - 1], dim=1))
        tokens, qs = [], []
        for _ in range(self.gamma):
            out = self.draft_step(inp, cache)
            cache.advance(inp.shape[1])
            if out.dim() == 2:  # probabilities: sample, keep q for verification
                qs.append(out.clone())
                out = sample_from(out)
            tokens.append(out.clone())
            inp = out[:, None]
        return torch.stack(tokens, 1), (torch.stack(qs, 1) if qs else None)

    def _verify(self, verified, drafted, q):
        if self.synthetic is not None:
            return synthetic_verify(verified, drafted, self.synthetic)
        if verified.dim() == 2:
            return greedy_verify(verified, drafted)
        return speculative_sampling_verify(verified, verified[:, :0] if q is None else q, drafted)

    def generate(self, cache, first: torch.Tensor, n_new: int, eos_ids=(), progress: bool = False,
                 prev: torch.Tensor | None = None):
        """Generate n_new tokens per sequence; `first` [B] is the token sampled from the prefill logits and `prev`
        [B] the prompt's last token (the draft re-feeds it). Returns ids [B, n_new] and a [B] count of tokens
        produced before stopping (EOS included); positions after a sequence stopped repeat its last token."""
        B, dev, g = first.shape[0], first.device, self.gamma
        if g and prev is None:
            raise ValueError("speculative generation needs the prompt's last token (prev)")
        hist = torch.zeros(B, n_new + g + 3, dtype=torch.long, device=dev)  # hist[:, i] is at position base + i
        hist[:, 0] = first if prev is None else prev
        hist[:, 1] = first
        base = cache.lengths - 1
        m = torch.full((B,), 2, dtype=torch.long, device=dev)  # committed entries of hist
        eos = torch.tensor(list(eos_ids), dtype=torch.long, device=dev)
        done = torch.isin(first, eos) | (n_new <= 1)
        cols = torch.arange(g + 1, device=dev)
        reached = torch.zeros(g, dtype=torch.long, device=dev)
        kept = torch.zeros(g, dtype=torch.long, device=dev)
        verifications = torch.zeros((), dtype=torch.long, device=dev)
        timer, self.stats = PhaseTimer(dev), Stats(g)
        bar = tqdm(total=n_new, desc="decode", disable=not progress, leave=False)
        progress_at = 1
        while not bool(done.all()):  # the one host sync per iteration
            t0 = timer.stamp()
            drafted, q = self._propose(hist, m, base, n_new) if g else (hist[:, :0], None)
            t1 = timer.stamp()
            verified = self.verify_step(torch.cat([hist.gather(1, (m - 1)[:, None]), drafted], 1), cache)
            accepted, nxt = self._verify(verified, drafted, q)
            t2 = timer.stamp()
            # Commit drafted[:accepted] + nxt at hist[m : m + accepted + 1]; stop a sequence at EOS or n_new.
            active = ~done
            new = torch.cat([drafted, nxt[:, None]], 1)
            new.scatter_(1, accepted[:, None], nxt[:, None])
            take = (cols[None] <= accepted[:, None]) & active[:, None]
            idx = torch.clamp(m, max=n_new)[:, None] + cols[None]  # active rows have m <= n_new; keeps stopped rows in bounds
            hist.scatter_(1, idx, torch.where(take, new, hist.gather(1, idx)))
            is_eos = torch.isin(new, eos) & take
            hit = is_eos.any(1)
            n_kept = torch.where(hit, is_eos.long().argmax(1), accepted) + 1
            m = torch.where(active, m + n_kept, m)
            done = done | hit | (m - 1 >= n_new)
            # A stopped row may have overshot n_new by up to gamma; keep its cache inside the allocated length.
            cache.rollback(base + torch.clamp(m, max=n_new + 1) - 1)
            if g:
                tried = torch.clamp(accepted, max=g - 1)  # positions examined: 0..accepted (all of them if all kept)
                reached += ((cols[None, :g] <= tried[:, None]) & active[:, None]).sum(0)
                kept += ((cols[None, :g] < accepted[:, None]) & active[:, None]).sum(0)
            verifications += active.sum()
            if self.trace is not None:
                self.trace.append(torch.where(active, accepted, -1).tolist())
            self.stats.iterations += 1
            timer.add("draft", t0, t1)
            timer.add("verify", t1, t2)
            timer.add("other", t2, timer.stamp())
            if progress:
                now = int((m - 1).clamp(max=n_new).min())
                bar.update(now - progress_at)
                progress_at = now
        bar.close()
        count = torch.clamp(m - 1, max=n_new)
        out = hist[:, 1:].gather(1, torch.minimum(torch.arange(n_new, device=dev)[None], count[:, None] - 1))
        self.stats.reached, self.stats.kept = reached.tolist(), kept.tolist()
        self.stats.accepted = sum(self.stats.kept)
        self.stats.verifications = int(verifications)
        self.stats.time = timer.totals()
        return out, count


def decode(decoder: Decoder, cache, first: torch.Tensor, n_new: int, eos_ids=(), progress: bool = False,
           prev: torch.Tensor | None = None):
    """Generate with `decoder` (see Decoder.generate); the baseline when the decoder has no draft."""
    return decoder.generate(cache, first, n_new, eos_ids, progress, prev)
