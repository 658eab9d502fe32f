"""One Transformer for the whole Llama family (Llama-2/3/3.1, LLaMA-2-7B-32K, TinyLlama, llama-68m, SmolLM2,
Mistral, Qwen2). Every method — baseline, self-speculation, standalone draft — runs this one definition; what
differs between them is the KV cache passed to `forward` (see kv_cache.py).

Weights keep transformers' layout (rotate-half RoPE, no q/k permutation), so HF checkpoints load as they are.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from magicdec.model import fused, tp
from magicdec.model.attention import Attend
from magicdec.config import ModelArgs
from magicdec.errors import MagicDecError
from magicdec.model.forward_plan import PLAIN, ForwardPlan


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse RoPE frequencies, with the checkpoint's scaling (linear for LLaMA-2-7B-32K, llama3 for 3.1)."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = args.rope_scaling
    if s is None:
        pass
    elif s["rope_type"] == "linear":  # positions divided by the factor == frequencies divided by it
        inv_freq = inv_freq / s["factor"]
    elif s["rope_type"] == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, and the band in between interpolated.
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_ctx = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_ctx / lo, inv_freq / factor,
                               torch.where(wavelen < old_ctx / hi, inv_freq, interpolated))
    elif s["rope_type"] == "yarn":
        # YaRN (Peng et al. 2023): dimensions that turn more than beta_fast times over the original context keep
        # their frequency, those turning fewer than beta_slow times are slowed by `factor`, a linear ramp between
        old_ctx = s["original_max_position_embeddings"]
        fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
        turned_dim = lambda turns: d * math.log(old_ctx / (turns * 2 * math.pi)) / (2 * math.log(args.rope_base))  # noqa: E731
        lo, hi = turned_dim(fast), turned_dim(slow)
        if s.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, d - 1)
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
        inv_freq = inv_freq / s["factor"] * ramp + inv_freq * (1 - ramp)
    else:
        raise MagicDecError(f"unsupported rope scaling {s}")
    return inv_freq.float()


def rope_attention_factor(args: ModelArgs) -> float:
    """What cos and sin are multiplied by: YaRN's attention temperature (0.1 ln(factor) + 1), else 1."""
    s = args.rope_scaling
    if not s or s["rope_type"] != "yarn":
        return 1.0
    if s.get("attention_factor"):
        return float(s["attention_factor"])
    mscale = lambda m: 1.0 if s["factor"] <= 1 else 0.1 * m * math.log(s["factor"]) + 1.0  # noqa: E731
    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(s["mscale"]) / mscale(s["mscale_all_dim"])
    return mscale(1.0)


@fused.op
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos/sin: [B, T, 1, D/2] in fp32. Rotate-half convention (HF Llama)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.type_as(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32, scale in the input dtype: the order transformers uses, so bf16 runs agree.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.type_as(x)


@fused.op(kernel="magicdec.model.triton_norm.add_rms_norm")
def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """The residual stream with a sublayer's output added (delta None: nothing to add), and its RMSNorm. One kernel
    for both on the GPU (triton_norm.py): the add was a kernel of its own, twice per layer."""
    if delta is not None:
        x = x + delta
    return x, rms_norm(x, weight, eps)


@fused.op
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_rms_norm(x, None, self.weight, self.eps)[1]

    def residual(self, x: torch.Tensor, delta: torch.Tensor | None):
        """(x + delta, RMSNorm(x + delta)) in one kernel: see add_rms_norm."""
        return add_rms_norm(x, delta, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, shard: tp.Shard | None = None):
        super().__init__()
        kv0, kv1 = shard.kv if shard else (0, args.n_kv_heads)
        # Under tensor parallelism this rank holds KV heads kv0..kv1 and the query heads that share them.
        self.n_kv_heads, self.head_dim = kv1 - kv0, args.head_dim
        self.n_heads = self.n_kv_heads * (args.n_heads // args.n_kv_heads)
        q, kv = self.n_heads * args.head_dim, self.n_kv_heads * args.head_dim
        # One fused q/k/v matmul; checkpoints store wq/wk/wv apart and are fused on load.
        self.wqkv = nn.Linear(args.dim, q + 2 * kv, bias=args.attention_bias)
        self.wo = nn.Linear(q, args.dim, bias=False)
        self._register_load_state_dict_pre_hook(self._fuse_qkv)

    def _fuse_qkv(self, state_dict, prefix, *args):
        for kind in ("weight", "bias"):
            names = [f"{prefix}{w}.{kind}" for w in ("wq", "wk", "wv")]
            if names[0] in state_dict:
                state_dict[f"{prefix}wqkv.{kind}"] = torch.cat([state_dict.pop(n) for n in names])

    def forward(self, x, cos, sin, cache, layer: int, attend: Attend) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qk, v = self.wqkv(x).split([(H + Hkv) * D, Hkv * D], dim=-1)
        # q's and k's heads rotated as one tensor: one kernel, not two
        q, k = apply_rope(qk.view(B, T, H + Hkv, D), cos, sin).split([H, Hkv], dim=2)
        k_cache, v_cache = cache.write(layer, k, v.view(B, T, Hkv, D))
        y = attend(q.transpose(1, 2), k_cache, v_cache, layer)  # [B, H, T, D]
        return self.wo(y.transpose(1, 2).reshape(B, T, H * D))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, shard: tp.Shard | None = None):
        super().__init__()
        f0, f1 = shard.ffn if shard else (0, args.intermediate_size)
        self.w1 = nn.Linear(args.dim, f1 - f0, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, f1 - f0, bias=False)  # up
        self.w2 = nn.Linear(f1 - f0, args.dim, bias=False)  # down

    def forward(self, x):
        return self.w2(swiglu(self.w1(x), self.w3(x)))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, shard: tp.Shard | None = None):
        super().__init__()
        self.shard = shard
        self.attention = Attention(args, shard)
        self.feed_forward = FeedForward(args, shard)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, delta, cos, sin, cache, layer, attend):
        """x: the residual stream before the previous sublayer's output `delta` is added (the add is fused into
        this block's first norm). Returns the same pair for the next block."""
        x, h = self.attention_norm.residual(x, delta)
        # Each rank's heads / MLP units give a partial sum of the output projection: all-reduce it.
        delta = tp.all_reduce(self.attention(h, cos, sin, cache, layer, attend), self.shard)
        x, h = self.ffn_norm.residual(x, delta)
        return x, tp.all_reduce(self.feed_forward(h), self.shard)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, shard: tp.Shard | None = None):
        super().__init__()
        self.args, self.shard = args, shard
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)  # replicated: a lookup reads B rows
        self.layers = nn.ModuleList(Block(args, shard) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        v0, v1 = shard.vocab if shard else (0, args.vocab_size)
        self.output = nn.Linear(args.dim, v1 - v0, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self.rope_scale = rope_attention_factor(args)
        if args.tie_embeddings and shard is None:
            self.output.weight = self.tok_embeddings.weight

    @property
    def n_kv_heads(self) -> int:
        """KV heads held by this rank (all of them without tensor parallelism): what its caches store."""
        return self.layers[0].attention.n_kv_heads

    def forward(self, tokens: torch.Tensor, cache, plan: ForwardPlan = PLAIN) -> torch.Tensor | None:
        """Run `tokens` [B, T] as the next T tokens of each sequence in `cache`, as `plan` says (forward_plan.py).

        Sequence b's tokens take positions cache.lengths[b] + 0..T-1 and attend to that sequence's cache and
        causally to each other, so the same call does chunked prefill, 1-token decode and k-token verification (a
        token tree's nodes, or a drafted level's, take their depths' positions and see their ancestors instead).
        The cache's lengths are NOT advanced here: callers advance them (or roll back) once they know how many
        tokens to keep. Returns plan.logits' logits: "all" [B, T, V], "last" [B, 1, V], or None ("none").
        """
        B, T = tokens.shape
        logits, gather = plan.logits, plan.gather
        positions = cache.positions(T, plan)
        attend = cache.attend(T, plan)
        angles = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
        if self.rope_scale != 1.0:  # YaRN
            cos, sin = cos * self.rope_scale, sin * self.rope_scale
        x, delta = self.tok_embeddings(tokens), None
        want = plan.features  # a drafter's FeatureRequest (forward_plan.py): hidden states it reads
        taps = {}
        for i, layer in enumerate(self.layers):
            if want is not None and i in want.taps:
                taps[i] = x if delta is None else x + delta  # the residual stream entering layer i
            x, delta = layer(x, delta, cos, sin, cache, i, attend)
        normed = None
        if want is not None:
            if len(self.layers) in want.taps:  # the final norm's output, every position
                taps[len(self.layers)] = normed = self.norm.residual(x, delta)[1]
            want.out[:, :T].copy_(torch.cat([taps[t] for t in want.taps], -1))
        if logits == "none":
            return None
        if normed is not None:
            out = self.output(normed[:, -1:] if logits == "last" else normed)
            return tp.gather_vocab(out, self.shard, self.args.vocab_size) if gather else out
        if logits == "last":
            x, delta = x[:, -1:], delta[:, -1:]
        out = self.output(self.norm.residual(x, delta)[1])
        # Under tensor parallelism each rank has a vocabulary slice; plan.gather False leaves it so (tp.vocab_argmax).
        return tp.gather_vocab(out, self.shard, self.args.vocab_size) if gather else out

    def weight_bytes(self) -> int:
        """Bytes read from weights by one decode step (the embedding table is only gathered, unless it is the LM
        head too)."""
        seen, total = set(), 0
        head_is_table = getattr(self.output, "weight", None) is self.tok_embeddings.weight
        for name, p in self.named_parameters():
            if id(p) in seen or (name == "tok_embeddings.weight" and not head_is_table):
                continue
            seen.add(id(p))
            total += p.numel() * p.element_size()
        return total


def random_state_dict(args: ModelArgs, seed: int, device, dtype, shard: tp.Shard | None = None) -> dict:
    """Random weights at a model's real shapes, normal(0, 0.02) like HF's initializer, norms at 1. Each tensor has
    its own generator (seeded by seed and its name's rank in order), so every rank of a tensor-parallel job slices
    exactly the tensors one unsharded process would make."""
    from magicdec.model.checkpoint import expected_shapes

    state = {}
    for i, (name, shape) in enumerate(sorted(expected_shapes(args).items())):
        if name.endswith("norm.weight"):
            full = torch.ones(shape, device=device, dtype=dtype)
        else:
            gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + i)
            full = torch.empty(shape, device=device, dtype=dtype).normal_(0.0, 0.02, generator=gen)
        state[name] = tp.slice_tensor(name, full, args, shard).clone()  # clone: free the full tensor now
    return state


def build_model(args: ModelArgs, device, dtype, random_seed: int | None = None, shard: tp.Shard | None = None):
    """A model with random weights (real-shape speed runs); random_seed None leaves PyTorch's default init."""
    if random_seed is None:
        with torch.device(device):
            model = Transformer(args, shard).to(dtype)
    else:
        model = from_state_dict(args, random_state_dict(args, random_seed, device, dtype), device, dtype, shard,
                                "random weights")
    model.inv_freq = rope_inv_freq(args).to(device)
    return model.eval().requires_grad_(False)


def owned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it where it is a view of a larger tensor."""
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


def from_state_dict(args: ModelArgs, state: dict, device, dtype, shard: tp.Shard | None, source) -> Transformer:
    """A model from checkpoint-named tensors (sliced here for this rank when sharded), moved to device and dtype."""
    with torch.device("meta"):
        model = Transformer(args, shard)
    state = {k: v for k, v in state.items() if "rotary" not in k}
    if args.tie_embeddings and "output.weight" not in state and "tok_embeddings.weight" in state:
        state["output.weight"] = state["tok_embeddings.weight"]
    # a slice is a view that keeps its whole tensor alive: copied out, so a rank holds its shard and no more (random
    # weights are made whole on the GPU; each rank kept the whole model beside its shard, 12 GiB at Llama-3.1-8B)
    state = {k: owned(tp.slice_tensor(k, v, args, shard)) for k, v in state.items()}
    try:
        model.load_state_dict(state, assign=True, strict=True)
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else "mismatch"
        raise MagicDecError(f"checkpoint {source} does not match its config.json ({first}); re-convert it") from None
    if args.tie_embeddings and shard is None:
        model.output.weight = model.tok_embeddings.weight
    model.inv_freq = rope_inv_freq(args)  # a non-persistent buffer: still on meta after loading
    model = model.to(device=device, dtype=dtype)  # copies only this rank's slices out of the mmap'd file
    model.inv_freq = rope_inv_freq(args).to(device)  # keep fp32 whatever the model dtype
    return model.eval().requires_grad_(False)


def load_model(checkpoint: str | Path, device, dtype, shard: tp.Shard | None = None) -> Transformer:
    """Load `DIR/model.pth` (made by convert_hf_checkpoint.py) with the config in `DIR/config.json`."""
    from magicdec.model.checkpoint import load_state_dict

    checkpoint = Path(checkpoint)
    args = ModelArgs.from_checkpoint_dir(checkpoint.parent)
    return from_state_dict(args, load_state_dict(checkpoint), device, dtype, shard, checkpoint)
