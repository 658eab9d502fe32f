"""KV caches. A cache owns per-layer K/V buffers and per-sequence lengths, and decides where new tokens go and
which slots a query may see; the model is the same for every cache kind.

`KVCache` is the full cache: slot s holds position s, so rollback is just setting lengths (stale slots past a
sequence's length are masked out and overwritten later). The StreamingLLM draft cache (sinks + recent window)
implements the same three methods: `write`, `attend`, and the `lengths` tensor.
"""
from __future__ import annotations

import torch

from magicdec.attention import make_attend


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
        if self.lengths.is_cuda:  # CUDA graphs must not copy the cache: its address stays fixed across replays
            for t in (*self.k, *self.v, self.lengths):
                torch._dynamo.mark_static_address(t)

    @staticmethod
    def nbytes_for(n_layers, batch_size, n_kv_heads, max_len, head_dim, dtype) -> int:
        return 2 * n_layers * batch_size * n_kv_heads * max_len * head_dim * torch.empty((), dtype=dtype).element_size()

    def positions(self, T: int) -> torch.Tensor:
        return self.lengths[:, None] + torch.arange(T, device=self.lengths.device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [B, T, Hkv, D] at each sequence's next T positions; return the layer's buffers."""
        pos = self.positions(k.shape[1])
        self.k[layer][self._rows, :, pos] = k
        self.v[layer][self._rows, :, pos] = v
        return self.k[layer], self.v[layer]

    def attend(self, T: int):
        return make_attend(self.backend, self.positions(T), None, self.max_len)

    def advance(self, n) -> None:
        """Keep n more tokens per sequence (an int, or a [B] tensor for ragged acceptance)."""
        self.lengths += n

    def rollback(self, lengths: torch.Tensor) -> None:
        self.lengths.copy_(lengths)
