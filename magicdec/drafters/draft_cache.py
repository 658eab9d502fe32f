"""How a self-speculation draft picks its small KV cache from the target's prefill (the research question the harness
compares on one engine). StreamingLLM (sinks + a recent window, prefilled through its own attention) is
`kv_cache.StreamingCache`; the policies here select, per layer and per KV head, which prompt positions the draft
keeps, from the keys and values the target's prefill already computed (no second prefill over the prompt):

- `SnapKV` (MagicDec's SnapKV drafter): the attention of the prompt's last `window` queries over the rest of the
  prompt, summed over those queries, average-pooled along positions (kernel 5), summed over each KV head's query
  heads (GQA group); the top (budget - window) positions per KV head, plus the `window` last prompt positions.
- `Retrieval` (TriForce's retrieval cache): the prompt before its last `window` positions in chunks of `chunk_size`;
  each chunk scored per KV head by the last prompt query against the chunk's mean key (summed over the GQA group);
  chunk 0 always kept, then the best chunks up to (budget - window) positions, plus the `window` last positions.

Both append what generation commits after the prompt (MagicDec's SnapKV draft grows by the generated tokens). Keys
keep their absolute RoPE positions, as the target stored them.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from magicdec.model.forward_plan import PLAIN, ForwardPlan
from magicdec.decoding.generate import capture, prefill
from magicdec.model.kv_cache import KVCache, StreamingCache

WINDOW = 32  # the prompt's last positions every selection keeps (SnapKV's observation window in MagicDec)
POLICIES = ("streaming", "snapkv", "retrieval")


class SnapKV:
    name = "snapkv"

    def __init__(self, budget: int, window: int = WINDOW, kernel: int = 5):
        self.budget, self.window, self.kernel = budget, window, kernel

    @property
    def queries(self) -> int:
        """How many of the prompt's last queries the selection reads."""
        return self.window

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """q [B, H, n, D]: the prompt's last n queries (after RoPE); k [B, Hkv, P, D]: the prompt's keys. Returns
        [B, Hkv, P - window]: each candidate position's score per KV head."""
        B, H, n, D = q.shape
        Hkv, P = k.shape[1], k.shape[2]
        G = H // Hkv
        # query i (at P - n + i) sees positions up to its own: only the last n columns need the causal mask
        future = torch.arange(n, device=q.device)[None, :] > torch.arange(n, device=q.device)[:, None]
        out = []
        for h in range(Hkv):  # one KV head at a time: at 32K x 13 the whole layer's fp32 attention would be 1.7 GB
            rows = q[:, h * G:(h + 1) * G].float().reshape(B, G * n, D) / math.sqrt(D)  # row g*n + i: head g, query i
            logits = torch.matmul(rows, k[:, h].float().transpose(1, 2))  # [B, G*n, P]: K^T a view, not a copy
            logits.view(B, G, n, P)[..., P - n:].masked_fill_(future, float("-inf"))
            # summed over the rows while contiguous, then cut; pooling is linear: summing the group first pools less
            out.append(self._pooled(logits.softmax(-1).sum(1)[:, :P - self.window]))  # [B, P - window]
        return torch.stack(out, 1)

    refresh_bytes_per_logit = 16  # a re-selection's softmax (read twice, written once) and its sum over positions

    def selection_bytes(self, c, B: int, prefix: int, item: int = 2) -> int:
        """Bytes one layer's selection moves: the prompt's keys converted to fp32 (read 2, write 4 bytes per element)
        and read in the matmul (4), then the fp32 attention of `window` queries of every query head over every
        position written by the matmul (4), read twice and written by the softmax (12), read by the sum (4)."""
        return (item + 8) * B * c.n_kv_heads * prefix * c.head_dim + 20 * B * c.n_heads * self.window * prefix

    def _pooled(self, attn: torch.Tensor) -> torch.Tensor:
        """Each row of attention [..., L] averaged over `kernel` neighbouring positions (zeros beyond the ends)."""
        L = attn.shape[-1]
        return F.avg_pool1d(attn.reshape(-1, 1, L), self.kernel, stride=1, padding=self.kernel // 2).view(attn.shape)

    def _top(self, s: torch.Tensor) -> torch.Tensor:
        return s.topk(self.budget - self.window, dim=-1).indices.sort(-1).values

    def select(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, budget - window] prompt positions each KV head keeps besides the window, ascending."""
        return self._top(self.scores(q, k))

    def reselect(self, logits: torch.Tensor, prompt_len: int, n_kv_heads: int) -> torch.Tensor:
        """The same choice from one query's logits [B, H, S] over a full cache (slot = position, -inf where it does
        not look): its attention over everything it sees, on the prompt's candidate positions, pooled and summed
        over each GQA group."""
        B, H, _ = logits.shape
        attn = logits.softmax(-1)[..., :prompt_len - self.window].view(B, n_kv_heads, H // n_kv_heads, -1).sum(2)
        return self._top(self._pooled(attn))


class Retrieval:
    name = "retrieval"

    def __init__(self, budget: int, chunk_size: int = 8, window: int = WINDOW):
        self.budget, self.chunk_size, self.window = budget, chunk_size, window

    queries = 1  # the prompt's last query
    refresh_bytes_per_logit = 4  # a re-selection's sum per chunk

    def selection_bytes(self, c, B: int, prefix: int, item: int = 2) -> int:
        """Bytes one layer's selection moves: the prompt's keys read once (the chunk means)."""
        return item * B * c.n_kv_heads * prefix * c.head_dim

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, chunks]: the last query against each whole chunk's mean key, summed over the GQA group."""
        B, H, _, D = q.shape
        Hkv, c = k.shape[1], self.chunk_size
        chunks = (k.shape[2] - self.window) // c
        mean_k = k[:, :, :chunks * c].view(B, Hkv, chunks, c, D).mean(3, dtype=torch.float32)  # no fp32 copy of K
        return torch.einsum("bhgd,bhcd->bhc", q[:, :, -1].float().view(B, Hkv, H // Hkv, D), mean_k)

    def select(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, budget - window] prompt positions: chunk 0, then the best-scoring chunks, ascending."""
        return self._top(self.scores(q, k))

    def reselect(self, logits: torch.Tensor, prompt_len: int, n_kv_heads: int) -> torch.Tensor:
        """The same choice from one query's logits [B, H, S] over a full cache (slot = position): a chunk's mean
        logit is the query against the chunk's mean key (scaled), summed over each GQA group."""
        B, H, _ = logits.shape
        c = self.chunk_size
        chunks = (prompt_len - self.window) // c
        s = logits[..., :chunks * c].reshape(B, n_kv_heads, H // n_kv_heads, chunks, c)
        return self._top(s.sum(2).mean(-1))

    def _top(self, s: torch.Tensor) -> torch.Tensor:
        s[..., 0] = float("inf")  # chunk 0 always kept
        n = (self.budget - self.window) // self.chunk_size
        best = s.topk(n, dim=-1).indices.sort(-1).values
        return (best[..., None] * self.chunk_size + torch.arange(self.chunk_size, device=s.device)).flatten(-2)


class SelectionCache(StreamingCache):
    """A draft cache filled from the target's prefill: `kept` slots per KV head holding the prompt positions a
    policy selected (each head its own), then a ring like StreamingLLM's holding the prompt's last `window`
    positions and what generation appends (`append` positions). The kept slots stand where StreamingLLM keeps its
    sinks and are masked as sinks are (always visible): their keys carry RoPE at their true positions already."""

    def __init__(self, n_layers, batch_size, n_kv_heads, kept: int, window: int, append: int, max_new: int, head_dim,
                 dtype, device, backend: str = "sdpa"):
        super().__init__(n_layers, batch_size, n_kv_heads, kept + window + append, kept, max_new, head_dim, dtype,
                         device, backend)
        self.recent = window

    @property
    def kept(self) -> int:
        return self.sinks

    def fill(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, recent: torch.Tensor):
        """Layer `layer` from the target's K and V of that layer ([B, Hkv, S, D]): the selected `positions`
        [B, Hkv, kept] into the kept slots, the `recent` prompt positions (the last `self.recent`) into the ring."""
        self.keep(layer, k, v, positions)
        slots = self.slots(recent)
        self.k[layer][:, :, slots] = k[:, :, recent]
        self.v[layer][:, :, slots] = v[:, :, recent]

    def keep(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """The target's keys and values at `positions` [B, Hkv, kept] into layer `layer`'s kept slots."""
        idx = positions[..., None].expand(-1, -1, -1, k.shape[-1])
        self.k[layer][:, :, :self.kept] = k.gather(2, idx)
        self.v[layer][:, :, :self.kept] = v.gather(2, idx)

    def hold(self, recent: torch.Tensor, lengths: torch.Tensor) -> None:
        """Which position each slot holds, for the mask, once every layer is filled."""
        self.key_pos.fill_(torch.iinfo(torch.long).max)
        self.key_pos[:, :self.kept] = 0  # a sink's mask: visible to every query
        self.key_pos[:, self.slots(recent)] = recent
        self.lengths.copy_(lengths)


class QueryRecorder:
    """Stands in for a cache during one forward and keeps each layer's queries (after RoPE) as attention sees them:
    the selection policies read the prompt's last queries without a second pass over the prompt."""

    def __init__(self, cache):
        self.cache, self.queries = cache, []

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def attend(self, T: int, plan: ForwardPlan = PLAIN):
        inner = self.cache.attend(T, plan)

        def attend(q, k, v, layer=None):
            self.queries.append(q)
            return inner(q, k, v, layer)
        return attend


def prefill_recording(model, cache: KVCache, prompts: torch.Tensor, n: int, chunk: int, progress: bool = False,
                      random_seed: int | None = None, desc: str = "prefill (target)"):
    """Prefill the target, its last `n` prompt tokens in a chunk of their own so their queries are kept; returns the
    last position's logits and the queries per layer ([B, H, n, D] each). With `random_seed` (random-weight speed
    runs) random KV stands in for the prefill of all but those n tokens."""
    if random_seed is None:
        prefill(model, cache, prompts[:, :-n], chunk, progress, desc)
    else:
        cache.fill_random(prompts.shape[1] - n, random_seed)
    recorder = QueryRecorder(cache)
    logits = prefill(model, recorder, prompts[:, -n:], n)
    return logits, recorder.queries


def policy_for(name: str, budget: int, chunk_size: int = 8):
    return {"snapkv": lambda: SnapKV(budget), "retrieval": lambda: Retrieval(budget, chunk_size)}[name]()


def build(policy, target: KVCache, queries: list[torch.Tensor], append: int, max_new: int = 0) -> SelectionCache:
    """The draft's cache for self-speculation under a selection policy, from the target's prefilled cache and the
    queries a QueryRecorder kept of the prompt's last tokens (one [B, H, n, D] per layer). `append` covers every
    position generation reaches, so what a forward writes never lands on a key still needed: `max_new` ring slots
    beyond it are not needed (and would be read, masked, by every draft step)."""
    B, Hkv, _, D = target.k[-1].shape
    P = int(target.lengths.max())
    cache = SelectionCache(len(target.k), B, Hkv, policy.budget - policy.window, policy.window, append, max_new, D,
                           target.k[-1].dtype, target.lengths.device, target.backend)
    recent = torch.arange(P - policy.window, P, device=target.lengths.device)
    for layer, q in enumerate(queries):
        k, v = target.layer_kv(layer)  # an offloaded layer's, copied to the device
        cache.fill(layer, k, v, policy.select(q[:, :, -policy.queries:], k[:, :, :P]), recent)
    cache.hold(recent, target.lengths)
    return cache


def select_by_own_prefill(policy, model, prompts: torch.Tensor, chunk: int, append: int, dtype, backend,
                          progress: bool = False, random_seed: int | None = None) -> SelectionCache:
    """A standalone draft's selected cache: its own prefill of the whole prompt into a full cache (freed once the
    selection is made), its last queries kept."""
    B, P = prompts.shape
    full = KVCache(model.args.n_layers, B, model.n_kv_heads, P, model.args.head_dim, dtype, prompts.device, backend)
    _, queries = prefill_recording(model, full, prompts, policy.queries, chunk, progress, random_seed, "prefill (draft)")
    return build(policy, full, queries, append)


class Refresh:
    """--refresh N: every N verifications a selected draft cache is selected again, from the attention that
    verification computed over the target's full cache anyway: the attention writes its first query's logits (the
    last committed token's) per head over every position as a side output (the plan's `scores`), and the policy picks
    the prompt positions to keep from them (`reselect`); the prompt's last window and the appended tokens stay.
    Each generation starts from the selection the prefill made, so timed runs start alike."""

    def __init__(self, policy, every: int, target: KVCache, draft: SelectionCache, n_heads: int,
                 graphed: bool = False):
        B, dev = target.lengths.shape[0], target.lengths.device
        self.policy, self.every, self.target, self.draft = policy, every, target, draft
        self.graph = False if not graphed else None  # with CUDA graphs: the re-selection captured on first use
        self.prompt_len = int(target.lengths.max())
        self.logits = [torch.empty(B, n_heads, target.max_len, dtype=torch.float32, device=dev) for _ in target.k]
        self.first = [draft.k[i][:, :, :draft.kept].clone() for i in range(len(target.k))], \
            [draft.v[i][:, :, :draft.kept].clone() for i in range(len(target.k))]
        self.count = 0

    def begin(self) -> None:
        self.count = 0
        for i, (k, v) in enumerate(zip(*self.first)):
            self.draft.k[i][:, :, :self.draft.kept] = k
            self.draft.v[i][:, :, :self.draft.kept] = v

    def due(self) -> list[torch.Tensor] | None:
        """Before a verification: the buffers its attention writes the logits to when it is an Nth, else None."""
        self.count += 1
        return self.logits if self.wrote else None

    @property
    def wrote(self) -> bool:
        """Whether the last verification (the last due()) wrote the logits: an Nth."""
        return self.count > 0 and self.count % self.every == 0

    def apply(self) -> None:
        """After it: every layer's kept positions selected again from those logits. With CUDA graphs the ~20 small
        kernels per layer are captured once and replayed; what a refresh still costs is the kernels' own time
        (results/draft_policies)."""
        if self.graph is False:
            self._reselect()
        elif self.graph is None:
            self.graph, _ = capture(self._reselect)  # its warm-up does this refresh's work
        else:
            self.graph.replay()

    def _reselect(self) -> None:
        n_kv = self.target.k[0].shape[1]
        for layer, logits in enumerate(self.logits):
            self.draft.keep(layer, self.target.k[layer], self.target.v[layer],
                            self.policy.reselect(logits, self.prompt_len, n_kv))
