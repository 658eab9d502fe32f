"""Tensor parallelism over torch.distributed (NCCL on GPU, gloo on CPU); no communication layer of our own.

Attention is split by KV head (each KV head's query heads follow it; uneven splits when the heads don't divide by
the group size), the MLP's gate/up by rows and down by columns, the LM head by vocabulary. Two all-reduces per layer
(after the attention output and after the MLP) restore the full hidden state; the vocabulary shards of the logits
are gathered, so every rank holds the same logits and takes the same decisions as one unsharded process.
Each rank keeps only its slice of every weight (sliced from the mmap'd checkpoint before it is copied).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from magicdec.config import ModelArgs
from magicdec.errors import MagicDecError


@dataclass(frozen=True)
class Shard:
    index: int  # this rank's position in its group
    size: int
    group: object  # a torch.distributed process group
    kv: tuple[int, int]  # [start, end) of the KV heads held here
    ffn: tuple[int, int]  # [start, end) of the MLP's intermediate units
    vocab: tuple[int, int]  # [start, end) of the vocabulary rows of the LM head
    vocab_max: int  # the largest vocabulary slice of the group (all_gather needs equal sizes)


def even_split(n: int, parts: int, index: int) -> tuple[int, int]:
    """Part `index` of n items cut into `parts` as evenly as possible (the first n % parts get one more)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def local_config(config: ModelArgs, ranks: list[int], rank: int) -> ModelArgs:
    """The config of `rank`'s slice of a model split over `ranks` (its KV heads, their query heads and its MLP units),
    for the memory estimate before anything is loaded."""
    from dataclasses import replace

    if len(ranks) < 2 or rank not in ranks:
        return config
    index = sorted(ranks).index(rank)
    kv0, kv1 = even_split(config.n_kv_heads, len(ranks), index)
    f0, f1 = even_split(config.intermediate_size, len(ranks), index)
    return replace(config, n_kv_heads=kv1 - kv0, n_heads=(kv1 - kv0) * (config.n_heads // config.n_kv_heads),
                   intermediate_size=f1 - f0, head_dim=config.head_dim)


def make_shard(args: ModelArgs, ranks: list[int], group) -> Shard:
    size, index = len(ranks), ranks.index(dist.get_rank())
    if args.n_kv_heads < size:
        raise MagicDecError(f"{args.name or 'the model'} has {args.n_kv_heads} KV heads, fewer than the {size} ranks "
                            f"it is split over; use at most {args.n_kv_heads} ranks for it")
    return Shard(index, size, group, even_split(args.n_kv_heads, size, index),
                 even_split(args.intermediate_size, size, index), even_split(args.vocab_size, size, index),
                 -(-args.vocab_size // size))


def slice_tensor(name: str, t: torch.Tensor, args: ModelArgs, shard: Shard | None) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name` (a view: nothing is copied yet)."""
    if shard is None:
        return t
    g, d = args.n_heads // args.n_kv_heads, args.head_dim
    (k0, k1), (f0, f1), (v0, v1) = shard.kv, shard.ffn, shard.vocab
    if name.endswith(("attention.wq.weight", "attention.wq.bias")):
        return t[k0 * g * d:k1 * g * d]
    if name.endswith(("attention.wk.weight", "attention.wv.weight", "attention.wk.bias", "attention.wv.bias")):
        return t[k0 * d:k1 * d]
    if name.endswith("attention.wo.weight"):
        return t[:, k0 * g * d:k1 * g * d]
    if name.endswith(("feed_forward.w1.weight", "feed_forward.w3.weight")):
        return t[f0:f1]
    if name.endswith("feed_forward.w2.weight"):
        return t[:, f0:f1]
    if name == "output.weight":
        return t[v0:v1]
    return t  # embeddings and norms are replicated


_INTRA_NODE = False  # ENABLE_INTRA_NODE_COMM=1 was set when the job started
_FAST: dict[int, "SymmetricAllReduce"] = {}  # process group id -> its fast all-reduce, where enabled


class SymmetricAllReduce:
    """PyTorch's symmetric-memory one-shot all-reduce: every rank reads its peers' buffers directly over NVLink in
    one kernel, instead of NCCL's ring — what decode's small (B x T x dim) all-reduces want. Multicast stays off
    (TORCH_SYMM_MEM_DISABLE_MULTICAST=1), so this is the plain peer-to-peer variant."""

    def __init__(self, group, device, dtype, capacity_bytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        self.name, self.dtype = group.group_name, dtype
        self.buf = symm_mem.empty(capacity_bytes // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buf, self.name)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.buf.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # The kernel has a barrier at both ends: no rank writes its buffer while a peer still reads the last values.
        n, ops = x.numel(), torch.ops.symm_mem
        if hasattr(ops, "one_shot_all_reduce_copy"):  # copies x into the buffer inside the kernel: one launch
            return ops.one_shot_all_reduce_copy(self.buf[:n], x.reshape(-1), "sum", self.name).view_as(x)
        self.buf[:n].copy_(x.reshape(-1))
        return ops.one_shot_all_reduce(self.buf[:n], "sum", self.name).view_as(x)


def enable_fast_all_reduce(shard: Shard | None, device: torch.device, dtype, capacity_bytes: int = 8 << 20) -> str:
    """Use SymmetricAllReduce for this shard's group where the platform has it (ENABLE_INTRA_NODE_COMM=1, as in
    the seed, on CUDA); anything larger than `capacity_bytes` (prefill chunks) still goes through NCCL. It must
    agree with NCCL on a test tensor first. Returns what all-reduces use, for the record."""
    if shard is None:
        return "none (one process)"
    backend = dist.get_backend(shard.group)
    if not (_INTRA_NODE or os.environ.get("ENABLE_INTRA_NODE_COMM") == "1"):
        return f"{backend} (set ENABLE_INTRA_NODE_COMM=1 for the symmetric-memory all-reduce)"
    if device.type != "cuda":
        return f"{backend} (symmetric memory needs CUDA)"
    try:
        fast = SymmetricAllReduce(shard.group, device, dtype, capacity_bytes)
        probe = torch.randn(4, 4096, device=device, generator=torch.Generator(device).manual_seed(dist.get_rank()))
        probe = probe.to(dtype)
        expected = probe.clone()
        dist.all_reduce(expected, group=shard.group)
        got = fast(probe)
        ok = torch.tensor(float(torch.allclose(got.float(), expected.float(), rtol=2e-2, atol=2e-2)), device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=shard.group)  # every rank agrees on the outcome
        if not ok.item():
            worst = (got.float() - expected.float()).abs().max().item()
            return (f"{backend} (symmetric-memory all-reduce disagreed with {backend}: max difference {worst:.3g} on "
                    f"rank {dist.get_rank()} of {dist.get_world_size(shard.group)}; not used)")
    except Exception as e:  # an older torch, no P2P between these GPUs, ...: say why, keep NCCL
        return f"{backend} (symmetric-memory all-reduce unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120]})"
    _FAST[id(shard.group)] = fast
    fast_us, nccl_us = (all_reduce_microseconds(f, probe) for f in (fast, lambda x: dist.all_reduce(x, group=shard.group)))
    return (f"symmetric-memory one-shot all-reduce up to {capacity_bytes >> 20} MiB, {backend} above "
            f"(a 4 x 4096 {str(dtype).removeprefix('torch.')} all-reduce: {fast_us:.1f} us vs {backend} {nccl_us:.1f} us)")


def all_reduce_microseconds(reduce, x: torch.Tensor, iters: int = 200) -> float:
    """Mean time of one all-reduce of x, back to back on the stream (what a decode step's 2 per layer see)."""
    for _ in range(10):
        reduce(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        reduce(x)
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / iters


def all_reduce(x: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    if shard is None:
        return x
    fast = _FAST.get(id(shard.group))
    if fast is not None and fast.fits(x):
        return fast(x)
    dist.all_reduce(x, group=shard.group)
    return x


def gather_vocab(logits: torch.Tensor, shard: Shard | None, vocab_size: int) -> torch.Tensor:
    """Full logits [..., V] on every rank from each rank's [..., V_local] slice."""
    if shard is None:
        return logits
    pad = shard.vocab_max - logits.shape[-1]
    if pad:
        logits = torch.nn.functional.pad(logits, (0, pad))
    parts = [torch.empty_like(logits) for _ in range(shard.size)]
    dist.all_gather(parts, logits.contiguous(), group=shard.group)
    pieces = [p[..., :even_split(vocab_size, shard.size, i)[1] - even_split(vocab_size, shard.size, i)[0]]
              for i, p in enumerate(parts)]
    return torch.cat(pieces, dim=-1)


def vocab_argmax(local: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """argmax over the whole vocabulary from each rank's slice of the logits, exchanging only (max, index) pairs.
    Ties go to the lowest global index, as torch.argmax on the full logits does: ranks hold ascending slices, and
    the first rank with the largest value wins."""
    value, index = local.float().max(dim=-1)
    if shard is None:
        return index
    index = index + shard.vocab[0]
    values, indices = [torch.empty_like(value) for _ in range(shard.size)], [torch.empty_like(index) for _ in range(shard.size)]
    dist.all_gather(values, value, group=shard.group)
    dist.all_gather(indices, index, group=shard.group)
    best = torch.stack(values).argmax(dim=0, keepdim=True)
    return torch.stack(indices).gather(0, best)[0]


def from_rank0(value):
    """Rank 0's value on every rank of a tensor-parallel run (what the ranks then do must pair: their collectives
    meet in the same order); the value itself where there is one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def init_distributed(device: torch.device) -> tuple[int, int]:
    """Join the torchrun job (rank, world size); plain `python` stays a single process (0, 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        global _INTRA_NODE
        # The seed's ENABLE_INTRA_NODE_COMM=1 asks for the fast all-reduce (enable_fast_all_reduce). Left in the
        # environment, torch 2.11's NCCL process group also reads it and fails to start its retired IntraNodeComm.
        _INTRA_NODE = os.environ.pop("ENABLE_INTRA_NODE_COMM", None) == "1" or _INTRA_NODE
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            # NVLink multicast stays off on shared hosts (see the device notes in README.md).
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def group_for(ranks: list[int], world: int):
    """The process group of `ranks` (every rank must call this, in the same order, for the same lists)."""
    if sorted(set(ranks)) != sorted(ranks) or min(ranks) < 0 or max(ranks) >= world:
        raise MagicDecError(f"ranks {ranks} are not distinct ranks of this {world}-process job")
    return dist.group.WORLD if len(ranks) == world else dist.new_group(ranks)
