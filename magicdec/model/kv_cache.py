"""KV caches. A cache owns per-layer K/V buffers and per-sequence lengths, and decides where new tokens go and
which slots a query may see; the model is the same for every cache kind.

`KVCache` is the full cache: slot s holds position s, so rollback is just setting lengths (stale slots past a
sequence's length are masked out and overwritten later). The StreamingLLM draft cache (sinks + recent window)
implements the same three methods: `write`, `attend`, and the `lengths` tensor. What one forward is (a token tree's
positions and mask, a drafted level's, scores to write) comes with it in its plan (forward_plan.ForwardPlan): a cache
holds KV and its own bookkeeping only.
"""
from __future__ import annotations

import torch

from magicdec.model import fused
from magicdec.model.attention import make_attend
from magicdec.model.forward_plan import PLAIN, ForwardPlan
from magicdec.model.tree import TreeMask


@fused.op
def store_kv(k_cache, v_cache, rows, slots, k, v) -> None:
    """k, v [B, T, Hkv, D] into the [B, Hkv, S, D] buffers at each sequence's slots [B, T] (rows: [B, 1] arange).
    Fused: one kernel writes both, in place."""
    k_cache[rows, :, slots] = k
    v_cache[rows, :, slots] = v


class KVCache:
    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device, backend: str = "sdpa"):
        # One buffer per layer: a view into one big tensor makes torch.compile copy the whole cache on write.
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # tokens held per sequence
        self.max_len, self.backend = max_len, backend
        self._rows = torch.arange(batch_size, device=device)[:, None]
        self._slots = None  # where the forward in progress writes (claimed by attend: write_slots)
        if self.lengths.is_cuda:  # CUDA graphs must not copy the cache: its address stays fixed across replays
            for t in (*self.k, *self.v, self.lengths):
                torch._dynamo.mark_static_address(t)

    @staticmethod
    def nbytes_for(n_layers, batch_size, n_kv_heads, max_len, head_dim, dtype) -> int:
        return 2 * n_layers * batch_size * n_kv_heads * max_len * head_dim * torch.empty((), dtype=dtype).element_size()

    def positions(self, T: int, plan: ForwardPlan = PLAIN) -> torch.Tensor:
        """[B, T] positions of the next T tokens (a token tree's: the root's plus each node's depth)."""
        if plan.tree is not None:
            return self.lengths[:, None] + plan.tree.depths[None]
        if plan.level is not None:  # the root is the last token held
            return (self.lengths + (plan.level.depth - 1))[:, None].expand(-1, T)
        return self._next(T, plan)

    def _next(self, T: int, plan: ForwardPlan = PLAIN) -> torch.Tensor:
        """[B, T]: the next T positions after each sequence's tokens, in order (a tree's nodes: where they are
        written, whatever their positions; a drafted level's: the root's position plus their node indices)."""
        if plan.level is not None:
            return (self.lengths - 1)[:, None] + plan.level.nodes[None]
        return self.lengths[:, None] + torch.arange(T, device=self.lengths.device)

    def tree_mask(self, plan: ForwardPlan):
        """A token tree's mask for attention (tree.TreeMask), or None: a verified tree's root is the next token, a
        drafted level's the last token held."""
        if plan.tree is not None:
            return TreeMask(plan.tree.ancestors, plan.tree.bits, self.lengths)
        if plan.level is not None:
            return TreeMask(plan.level.ancestors, plan.level.bits, self.lengths - 1)
        return None

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [B, T, Hkv, D] at each sequence's next T positions; return the layer's buffers."""
        store_kv(self.k[layer], self.v[layer], self._rows, self.write_slots(layer, k.shape[1]), k, v)
        return self.k[layer], self.v[layer]

    def slots(self, pos: torch.Tensor) -> torch.Tensor:
        """Where positions pos are stored: at their own index (a ring maps them around)."""
        return pos

    def claim(self, written: torch.Tensor) -> torch.Tensor:
        """The [B, T] slots a forward writes its tokens' positions `written` to (_next's): computed once, as its
        attention is made, and kept for every layer's write (write_slots): per layer, the index arithmetic was
        several small kernels, a measurable part of an 8B self-draft's step (results/quant)."""
        self._slots = self.slots(written)
        return self._slots

    def write_slots(self, layer: int, T: int) -> torch.Tensor:
        """[B, T] slots the forward in progress writes: those its attend claimed (a forward makes its attention
        before any layer writes)."""
        if self._slots is None or self._slots.shape[1] != T:
            raise RuntimeError(f"a write of {T} tokens with no forward of {T} claiming slots: call attend(T, plan) "
                               "first, as a forward does")
        return self._slots

    def attend(self, T: int, plan: ForwardPlan = PLAIN):
        self.claim(self._next(T, plan))
        return make_attend(self.backend, self.positions(T, plan), None, self.max_len, scores=plan.scores,
                           tree=self.tree_mask(plan))

    def keep_path(self, path: torch.Tensor, root: torch.Tensor | None = None) -> None:
        """After a token tree's verification: the KV of each sequence's accepted nodes path [B, D + 1] (the root
        first; node j at position root + j) moved to the slots their positions take, root + 0..D. `root` [B]: the
        root's positions (default: lengths, where a verification writes it)."""
        at = (self.lengths if root is None else root)[:, None]
        src, dst = self.slots(at + path), self.slots(at + torch.arange(path.shape[1], device=path.device))
        for layer in range(len(self.k)):
            for buf in (self.k[layer], self.v[layer]):
                buf[self._rows, :, dst] = buf[self._rows, :, src]

    def layer_kv(self, layer: int):
        """A layer's K and V [B, Hkv, S, D] on the cache's device, outside a forward (a selection reads them)."""
        return self.k[layer], self.v[layer]

    def kv_at(self, layer: int, pos: torch.Tensor):
        """Each sequence's K and V [B, Hkv, D] at its position pos [B] (a generated one)."""
        return self.k[layer][self._rows[:, 0], :, pos], self.v[layer][self._rows[:, 0], :, pos]

    def fill_random(self, length: int, seed: int) -> None:
        """Stand in for a prefill of `length` tokens (random-weight speed runs only): random K/V, lengths set."""
        gen = torch.Generator(device=self.lengths.device).manual_seed(seed)
        for t in (*self.k, *self.v):
            t.normal_(generator=gen)
        self.lengths.fill_(length)

    def advance(self, n) -> None:
        """Keep n more tokens per sequence (an int, or a [B] tensor for ragged acceptance)."""
        self.lengths += n

    def rollback(self, lengths: torch.Tensor) -> None:
        self.lengths.copy_(lengths)


class StreamingCache(KVCache):
    """StreamingLLM cache for a draft: the first `sinks` positions plus the most recent `budget - sinks`.

    Slots [0, sinks) hold the sink positions; the rest is a ring of `window + max_new` slots indexed by position,
    so writing up to `max_new` tokens in one forward (a prefill chunk, a gamma+1 verify) never overwrites a key that
    a query of that forward, or of any forward after a rollback, still needs. Each slot remembers the position it
    holds (`key_pos`), and attention masks by position: a query at p sees the sinks and positions (p - window, p].
    The window therefore keeps rolling for any gen_len.

    By default keys keep the RoPE rotation of their absolute positions, as the target's do. With `rope` (the model's
    inverse frequencies: `--reindex`) attention sees positions inside the cache instead, as StreamingLLM and
    MagicDec's drafts do: the sinks at 0..sinks-1, the window right after them, the query last, so no query-key
    distance exceeds the budget and a draft whose trained context is shorter than the prompt reads only distances
    it was trained on. RoPE scores depend only on the query-key distance, and the window keeps its distances to the
    query, so only the sinks need to move: their keys are kept as first written (`sink_k`) and, before each
    forward's layers run, rotated on by the distance between where they sit and where the window begins. That is
    exact for the forward's last query (every decode step, and the token a draft's 2-token re-feed adds); an
    earlier query of a multi-token forward sees the sinks up to T-1 positions nearer than its own window's start,
    never past it. The prompt is prefilled through this cache (MagicDec's second, StreamingLLM-attention prefill),
    so the draft's KV is what its own attention produces.
    """

    def __init__(self, n_layers, batch_size, n_kv_heads, budget: int, sinks: int, max_new: int, head_dim, dtype,
                 device, backend: str = "sdpa", rope: torch.Tensor | None = None):
        self.sinks, self.window = sinks, budget - sinks
        self.ring = self.window + max_new
        super().__init__(n_layers, batch_size, n_kv_heads, sinks + self.ring, head_dim, dtype, device, backend)
        self.key_pos = torch.full((batch_size, sinks + self.ring), torch.iinfo(torch.long).max, dtype=torch.long,
                                  device=device)
        self.rope = rope
        if rope is not None:  # --reindex
            # every layer's sink keys as written (rotated at their own positions 0..sinks-1), and per sequence
            # whether the sink slots hold them rotated on (else they hold them as written)
            self.sink_k = torch.zeros((n_layers, batch_size, n_kv_heads, sinks, head_dim), dtype=dtype, device=device)
            self.shifted = torch.zeros(batch_size, dtype=torch.bool, device=device)
        if self.lengths.is_cuda:
            for t in (self.key_pos, *((self.sink_k, self.shifted) if rope is not None else ())):
                torch._dynamo.mark_static_address(t)

    @staticmethod
    def nbytes_for(n_layers, batch_size, n_kv_heads, budget, head_dim, dtype, max_new: int = 0) -> int:
        return KVCache.nbytes_for(n_layers, batch_size, n_kv_heads, budget + max_new, head_dim, dtype)

    def slots(self, pos: torch.Tensor) -> torch.Tensor:
        return torch.where(pos < self.sinks, pos, self.sinks + (pos - self.sinks) % self.ring)

    def take(self, source: KVCache, pos: torch.Tensor) -> None:
        """Each sequence's K and V at its generated position pos [B], every layer, from `source` (the target's full
        cache) instead of a forward of its own: what TriForce's retrieval cache does with the target's new tokens."""
        rows, slot = self._rows[:, 0], self.slots(pos)
        for layer in range(len(self.k)):
            self.k[layer][rows, :, slot], self.v[layer][rows, :, slot] = source.kv_at(layer, pos)
        self.key_pos[rows, slot] = pos

    def _reindex_sinks(self, T: int) -> None:
        """Before a forward's layers run: rotate every layer's sinks on so they sit right before the window of the
        forward's last query (right before its first query when T exceeds the window): sink j at shift + j. A
        forward that writes sink keys starts before position `sinks`, so its shift is 0 and the slots keep them as
        written until the next forward takes them in. All layers at once: per layer, a dozen small kernels were a
        large part of TinyLlama's draft step (results/draft_policies)."""
        from magicdec.model.transformer import apply_rope

        S = self.sinks
        slots = [k[:, :, :S] for k in self.k]
        held = (~self.shifted)[None, :, None, None, None]  # slots hold the keys as written: take them in
        self.sink_k.copy_(torch.where(held, torch.stack(slots), self.sink_k))
        shift = (self.lengths + min(T, self.window) - self.window - S).clamp(min=0)
        angles = shift[:, None, None, None].float() * self.rope  # [B, 1, 1, D/2]: one rotation per sequence
        torch._foreach_copy_(slots, list(apply_rope(self.sink_k, angles.cos(), angles.sin()).unbind(0)))
        self.shifted.copy_(shift > 0)

    def attend(self, T: int, plan: ForwardPlan = PLAIN):
        # Claim the new tokens' slots before any layer runs: a mask built now must already see them. A drafted
        # tree level's nodes hold the positions they are written at (root + node index), which its mask reads.
        written = self._next(T, plan)
        self.key_pos[self._rows, self.claim(written)] = written
        if self.rope is not None:
            self._reindex_sinks(T if plan.level is None else plan.level.depth)
        return make_attend(self.backend, self.positions(T, plan), self.key_pos, self.max_len, self.sinks, self.window,
                           tree=self.tree_mask(plan))

    def fill_random(self, length: int, seed: int) -> None:
        super().fill_random(length, seed)
        # The slots a real prefill would leave filled: the sinks and the last `window` positions.
        pos = torch.cat([torch.arange(min(self.sinks, length)), torch.arange(max(self.sinks, length - self.window), length)])
        pos = pos.to(self.key_pos.device)
        self.key_pos[:, self.slots(pos)] = pos
        if self.rope is not None:
            self.shifted.fill_(False)  # the random sinks stand as written
