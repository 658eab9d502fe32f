"""The target's KV cache in host memory (`--offload --on_chip N`), as TriForce runs 128K contexts on 24 GB GPUs: the
first N layers' KV stays on the GPU; every later layer's prompt KV lives in pinned host memory and is streamed to the
GPU layer by layer on a side stream, into one of two device slots (double buffering), while the layer before it
computes. A forward then reads the whole prompt KV over PCIe once, which is what bounds an offloaded step.

Positions the prompt's prefill writes go to the host (and stay there: generation never rewrites them); positions
generation writes stay on the GPU in a small per-layer tail, copied into the slot behind the prompt's. Slots and
the host store are laid out position-major ([S, B, Hkv, D]) so that a prompt prefix is one contiguous copy; attention
reads them through a [B, Hkv, S, D] view with those strides.

Without CUDA (the tests), "host" and "device" are both CPU memory and the copies are synchronous: the same code
path, minus the overlap.
"""
from __future__ import annotations

import contextlib

import torch

from magicdec.model.forward_plan import PLAIN, ForwardPlan
from magicdec.model.kv_cache import KVCache


class OffloadedCache(KVCache):
    def __init__(self, n_layers, batch_size, n_kv_heads, max_len, head_dim, dtype, device, backend: str,
                 on_chip: int, prompt_len: int):
        device = torch.device(device)
        super().__init__(on_chip, batch_size, n_kv_heads, max_len, head_dim, dtype, device, backend)
        self.on_chip, self.prompt_len, self.n_layers = on_chip, prompt_len, n_layers
        self.host_len = 0  # prompt positions the host holds (the prefill's progress)
        cuda = device.type == "cuda"
        pos_major = (max_len, batch_size, n_kv_heads, head_dim)
        off = n_layers - on_chip
        host = lambda n: [torch.zeros((n, *pos_major[1:]), dtype=dtype, pin_memory=cuda) for _ in range(off)]  # noqa: E731
        self.host_k, self.host_v = host(prompt_len), host(prompt_len)
        tail = lambda: [torch.zeros((max_len - prompt_len, *pos_major[1:]), dtype=dtype, device=device)  # noqa: E731
                        for _ in range(off)]
        self.tail_k, self.tail_v = tail(), tail()
        self.slot_k = [torch.zeros(pos_major, dtype=dtype, device=device) for _ in range(2)]
        self.slot_v = [torch.zeros(pos_major, dtype=dtype, device=device) for _ in range(2)]
        view = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731  [S, B, H, D] memory as attention's [B, H, S, D]
        # what a reader outside a forward gets for an offloaded layer: its host copy (see layer_kv for the device)
        self.k += [view(t) for t in self.host_k]
        self.v += [view(t) for t in self.host_v]
        self.fetched = [None, None]  # the layer each slot holds (or is being filled with)
        self.fetch_log: list[tuple[int, int]] = []  # (layer, slot) in order: the tests read it
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.ready = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._view = view

    @staticmethod
    def host_nbytes(n_layers, on_chip, batch_size, n_kv_heads, prompt_len, head_dim, dtype) -> int:
        return KVCache.nbytes_for(n_layers - on_chip, batch_size, n_kv_heads, prompt_len, head_dim, dtype)

    def _copies(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _prefetch(self, layer: int) -> None:
        """Start copying `layer`'s KV into slot layer % 2, once the forward no longer reads what that slot holds
        (the layer two before, whose attention is already queued on the compute stream)."""
        s, i = layer % 2, layer - self.on_chip
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with self._copies():
            n = self.host_len
            self.slot_k[s][:n].copy_(self.host_k[i][:n], non_blocking=True)
            self.slot_v[s][:n].copy_(self.host_v[i][:n], non_blocking=True)
            if n == self.prompt_len:  # generation: the positions it wrote, kept on the device
                self.slot_k[s][n:].copy_(self.tail_k[i], non_blocking=True)
                self.slot_v[s][n:].copy_(self.tail_v[i], non_blocking=True)
            if self.ready[s] is not None:
                self.ready[s].record(self.stream)
        self.fetched[s] = layer
        self.fetch_log.append((layer, s))

    def attend(self, T: int, plan: ForwardPlan = PLAIN):
        if self.on_chip == 0:  # nothing on the chip to overlap with: the first layer's copy starts now
            self._prefetch(0)
        return super().attend(T, plan)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [B, T, Hkv, D] at each sequence's next T positions; return the layer's [B, Hkv, S, D] K and V
        on the device (an offloaded layer's slot, once its copy is done). Starts the next layer's copy."""
        if self.on_chip <= layer + 1 < self.n_layers:  # the next offloaded layer's copy, while this one computes
            self._prefetch(layer + 1)
        if layer < self.on_chip:
            return super().write(layer, k, v)
        s, i = layer % 2, layer - self.on_chip
        assert self.fetched[s] == layer, f"slot {s} holds layer {self.fetched[s]}, not {layer}"
        if self.ready[s] is not None:
            torch.cuda.current_stream(k.device).wait_event(self.ready[s])
        slot_k, slot_v = self._view(self.slot_k[s]), self._view(self.slot_v[s])
        T = k.shape[1]
        pos = self.write_slots(layer, T)  # positions: a slot buffer holds every position
        slot_k[self._rows, :, pos] = k
        slot_v[self._rows, :, pos] = v
        if self.host_len < self.prompt_len:  # the prefill: uniform positions host_len..host_len+T-1, to the host
            n = self.host_len
            self.host_k[i][n:n + T].copy_(k.transpose(0, 1), non_blocking=True)
            self.host_v[i][n:n + T].copy_(v.transpose(0, 1), non_blocking=True)
        else:
            self._view(self.tail_k[i])[self._rows, :, pos - self.prompt_len] = k
            self._view(self.tail_v[i])[self._rows, :, pos - self.prompt_len] = v
        return slot_k, slot_v

    def advance(self, n) -> None:
        super().advance(n)
        if isinstance(n, int) and self.host_len < self.prompt_len:  # a prefill chunk is in
            self.host_len = min(self.host_len + n, self.prompt_len)

    def layer_kv(self, layer: int):
        """A layer's K and V as [B, Hkv, S, D] device tensors outside a forward (a selection reads them): an
        offloaded layer's are copied in whole, synchronously."""
        if layer < self.on_chip:
            return self.k[layer], self.v[layer]
        i = layer - self.on_chip
        dev = self.lengths.device
        full = [torch.cat([h.to(dev), t]) for h, t in ((self.host_k[i], self.tail_k[i]), (self.host_v[i], self.tail_v[i]))]
        return self._view(full[0]), self._view(full[1])

    def kv_at(self, layer: int, pos: torch.Tensor):
        if layer < self.on_chip:
            return super().kv_at(layer, pos)
        i, rows = layer - self.on_chip, self._rows[:, 0]
        return (self._view(self.tail_k[i])[rows, :, pos - self.prompt_len],
                self._view(self.tail_v[i])[rows, :, pos - self.prompt_len])

    def fill_random(self, length: int, seed: int) -> None:
        gen = torch.Generator(device=self.lengths.device).manual_seed(seed)
        for t in (*self.k[:self.on_chip], *self.v[:self.on_chip], *self.tail_k, *self.tail_v):
            t.normal_(generator=gen)
        # drawn on the device and copied over: the CPU draws normals far slower than a host link copies them
        for t in (*self.host_k, *self.host_v):
            for piece in t.split(max(1, (256 << 20) // (t[0].numel() * t.element_size()))):  # <= 256 MB at a time
                piece.copy_(torch.randn(piece.shape, generator=gen, device=gen.device, dtype=piece.dtype))
        self.lengths.fill_(length)
        self.host_len = self.prompt_len
