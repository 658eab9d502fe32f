"""Trained draft heads — EAGLE (EAGLE-1/2), EAGLE-3, Medusa and Hydra — as torch modules, with their published
checkpoint formats. The drafters (magicdec/drafters/{eagle,medusa,hydra}.py) run them; `magicdec train-head` trains
them. Nothing here knows the generation loop.

Features: what a head reads of the target, named by their index in transformers' `output_hidden_states` tuple of the
target (`Transformer.forward` copies them when its cache asks, see forward_plan.FeatureRequest): tap i < n_layers is the
residual stream entering layer i; tap n_layers is the final norm's output (the hidden the LM head reads, HF's
`last_hidden_state`). Medusa, Hydra and EAGLE-1/2 read tap n_layers, as their code reads `outputs[0]`; EAGLE-3
reads three taps concatenated (default 2, n_layers // 2, n_layers - 3, the inputs of those layers as its modified
Llama collects them; a checkpoint's `eagle_aux_hidden_state_layer_ids` overrides them).

API (stable: magicdec/harness/train_head.py builds on it):

- `new_head(family, target_args, *, num_heads=4, num_layers=1, layers=None, draft_vocab=None, grounded=True,
  seed=0, target=None)`: a fresh head for a target (`config.ModelArgs`), initialised as the original code
  initialises it (Medusa / Hydra: each ResBlock's `linear` zero, so the block starts as the identity, and each
  head's LM head a copy of the target's where `target` (a model.Transformer) is given; EAGLE: normal(0, 0.02)
  linears, norms at one). family: "eagle" (EAGLE-1/2), "eagle3", "medusa", "hydra". num_heads: Medusa / Hydra
  heads; num_layers: ResBlocks per head, or EAGLE-1's decoder layers; layers: EAGLE-3's three taps; draft_vocab:
  EAGLE-3's reduced vocabulary size (None: the target's; the d2t map is then the identity); grounded: Hydra's heads
  see the earlier tokens (False: Medusa-like heads in Hydra's format).
- `save(head, dir)`: the family's published files (below). `load(dir, target_args, family=None)`: a head from
  them, checked against the target (one-line MagicDecError naming the problem and the fix); `family` given, files
  of another family are refused. `detect(dir)`: the family of a directory's files.
- Forwards used in training (features: the target's taps [B, T, F] at positions 0..T-1; ids [B, T] the tokens at
  those positions; `embed`: the target's token embedding, an nn.Embedding or its weight):
  - `MedusaHead.forward(features) -> [B, T, K, V]`: logits[:, t, k] predicts the token at t + k + 2 (the target's
    own LM head at t predicts t + 1).
  - `HydraHead.forward(features, ids, embed) -> [B, T, K, V]`: head k at t sees features[t] and the embeddings of
    ids[t + 1 .. t + k + 1] (grounded) and predicts ids[t + k + 2]; rows whose inputs run past T read wrapped
    positions (as the original's torch.roll) and must be masked out of a loss.
  - `EagleHead.forward(features, next_ids, embed, cache=None) -> [B, T, H]`: the pair (features[t],
    embedding of next_ids[t], the token at t + 1) at position t gives the predicted feature at t + 1 (causal over
    the T pairs; `cache`: the engine's KVCache instead, positions from it). `EagleHead.logits(hidden, lm_head)`:
    EAGLE-1 the target's LM head on it (no norm: EAGLE-1 predicts the post-norm feature), EAGLE-3 its own norm and
    LM head over its draft vocabulary; `EagleHead.to_target(ids)` maps draft-vocabulary ids to the target's
    (EAGLE-3's d2t: target = d + d2t[d]).
  - `head.family`, `head.taps(n_layers)`: the taps it reads; `head.config()`: the dict its config.json holds.

Published formats, as the original repositories write and read them:
- Medusa (FasterDecoding/Medusa, medusa_model.py, the head-only "legacy" checkpoints): `config.json` with
  `medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path`; `medusa_lm_head.pt`, the state dict of the
  `medusa_head` ModuleList: `{k}.{j}.linear.weight|bias` (ResBlock j of head k: x + SiLU(linear(x))),
  `{k}.{num_layers}.weight` (the head's LM head, no bias). Medusa-2's whole-model checkpoints are not read.
- Hydra (zankner/Hydra, hydra_model.py and hydra_heads/mlp_head.py, arch "mlp"): `config.json` with
  `hydra_num_heads`, `hydra_num_layers`, `hydra_head_arch`, `grounded_heads`, `hidden_state_offset`,
  `base_model_name_or_path`; `hydra_lm_head.pt`, the HydraMLP state dict: `hydra_mlp.{k}.0.linear.weight|bias` and
  `hydra_mlp.{k}.0.res_connection.weight|bias` (grounded: the first block maps the hidden and k + 1 embeddings,
  (k + 2) H wide, to H: res_connection(x) + SiLU(linear(x))), `hydra_mlp.{k}.{j}.linear.*` for later blocks,
  `hydra_lm_head.{k}.weight|bias` (with bias). The original also saves the target's embedding as
  `input_embed_fn.weight` (its embedding function is a registered module); it is checked against the target's
  shape if present and not written by `save`. Arches "prefix-mlp", "cross-attn", "eagle-attn" (Hydra++ variants
  with their own attention over the context) are refused with a one-line error.
- EAGLE-1/2 (SafeAILab/EAGLE, eagle/model/cnets1.py): `config.json` (a LlamaConfig: hidden_size,
  num_attention_heads, num_key_value_heads, intermediate_size, num_hidden_layers, rms_norm_eps, vocab_size,
  rope_theta, rope_scaling, max_position_embeddings, optional `bias` (fc's, default true) and `qkv_bias`);
  `pytorch_model.bin` or `model.safetensors`: `fc.weight|bias` (2H -> H over cat(embedding, feature)),
  `layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`,
  `layers.{i}.post_attention_layernorm.weight`, `layers.{i}.input_layernorm.weight` for i > 0 (layer 0 has none),
  optionally `embed_tokens.weight` (else the target's embedding, as the original loads it from the base model).
- EAGLE-3 (eagle/model/cnets.py): config.json as above plus `draft_vocab_size`, optional `target_hidden_size`;
  weights: `fc.weight` (3 target-H -> H, no bias, applied to the concatenated taps), `midlayer.hidden_norm.weight`,
  `midlayer.input_layernorm.weight` (of the embedding), `midlayer.self_attn.{q,k,v}_proj.weight` (2H wide input:
  cat(normed embedding, normed hidden)), `midlayer.self_attn.o_proj.weight`, `midlayer.mlp.*`,
  `midlayer.post_attention_layernorm.weight`, `norm.weight`, `lm_head.weight` [draft_vocab, H], `d2t` (long
  [draft_vocab]), `t2d` (bool [vocab]), optionally `embed_tokens.weight`.

What was verified against the originals: module structure, key names, config keys and the forward arithmetic were
read from the repositories' code (fetched snapshots) and are reproduced here; the tests check each forward against a
hand-written computation from the saved state dict, and EAGLE's decoder layer against transformers'
LlamaDecoderLayer. Not verified: loading a real published checkpoint (none can be downloaded here), and Hydra's
ResBlock stacks with num_layers > 1, which the original builds from one shared module repeated (`[ResBlock] * n`:
its file then holds equal tensors under each index); here each block has its own weights, so such a file loads
exactly but training unties them. Medusa's `[ResBlock] * n` likewise.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from magicdec import files
from magicdec.config import ModelArgs
from magicdec.errors import MagicDecError
from magicdec.model.forward_plan import PLAIN, ForwardPlan

FAMILIES = ("eagle", "eagle3", "medusa", "hydra")
FILES = {"medusa": "medusa_lm_head.pt", "hydra": "hydra_lm_head.pt"}
EAGLE_WEIGHTS = ("pytorch_model.bin", "model.safetensors")


def final_tap(n_layers: int) -> int:
    """The tap of the final norm's output (what the LM head reads)."""
    return n_layers


def eagle3_default_taps(n_layers: int) -> tuple[int, ...]:
    """EAGLE-3's modified Llama collects the inputs of layers 2, n // 2 and n - 3, in layer order."""
    return tuple(sorted({2, n_layers // 2, n_layers - 3}))


def embedding_of(embed, ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, embed.weight if isinstance(embed, nn.Module) else embed)


# --- Medusa ---------------------------------------------------------------------------------------------------------
class ResBlock(nn.Module):
    """Medusa's and Hydra's block: res(x) + SiLU(linear(x)), res the identity (input H wide) or, for Hydra's first
    grounded block (input wider than H), a linear map of its own."""

    def __init__(self, dim: int, in_dim: int | None = None):
        super().__init__()
        in_dim = in_dim or dim
        self.linear = nn.Linear(in_dim, dim)
        self.res_connection = nn.Linear(in_dim, dim) if in_dim != dim else nn.Identity()

    def forward(self, x):
        return self.res_connection(x) + F.silu(self.linear(x))


class MedusaHead(nn.ModuleList):
    """K heads, each num_layers ResBlocks and an LM head without bias, all over the target's last hidden state.
    A ModuleList, so its state dict is the published `medusa_lm_head.pt`'s."""
    family = "medusa"

    def __init__(self, dim: int, vocab: int, num_heads: int, num_layers: int = 1):
        super().__init__(nn.Sequential(*[ResBlock(dim) for _ in range(num_layers)], nn.Linear(dim, vocab, bias=False))
                         for _ in range(num_heads))
        self.dim, self.vocab, self.num_heads, self.num_layers = dim, vocab, num_heads, num_layers

    def taps(self, n_layers: int) -> tuple[int, ...]:
        return (final_tap(n_layers),)

    def head(self, k: int, features: torch.Tensor) -> torch.Tensor:
        """Head k's logits [..., V] from features [..., H]: the token k + 2 positions after the feature's."""
        return self[k](features)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.head(k, features) for k in range(self.num_heads)], -2)

    def config(self) -> dict:
        return {"medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers, "hidden_size": self.dim,
                "vocab_size": self.vocab, "base_model_name_or_path": ""}


# --- Hydra ----------------------------------------------------------------------------------------------------------
class HydraHead(nn.Module):
    """Hydra's "mlp" heads: head k reads the target's hidden state and (grounded) the embeddings of the token after
    it and of the k tokens drafted before its own, through ResBlocks, then an LM head with bias."""
    family = "hydra"

    def __init__(self, dim: int, vocab: int, num_heads: int, num_layers: int = 1, grounded: bool = True,
                 hidden_state_offset: int = 0):
        super().__init__()
        self.dim, self.vocab, self.num_heads, self.num_layers = dim, vocab, num_heads, num_layers
        self.grounded, self.hidden_state_offset = grounded, hidden_state_offset
        self.hydra_mlp = nn.ModuleList(
            nn.Sequential(ResBlock(dim, dim * (k + 2) if grounded else dim), *[ResBlock(dim) for _ in range(num_layers - 1)])
            for k in range(num_heads))
        self.hydra_lm_head = nn.ModuleList(nn.Linear(dim, vocab) for _ in range(num_heads))

    def taps(self, n_layers: int) -> tuple[int, ...]:
        return (final_tap(n_layers) - self.hidden_state_offset,)

    def head(self, k: int, inputs: torch.Tensor) -> torch.Tensor:
        """Head k's logits [..., V] from its input [..., (k + 2) H] (grounded: the hidden, then the embeddings of
        the k + 1 tokens after it, in order) or [..., H]."""
        return self.hydra_lm_head[k](self.hydra_mlp[k](inputs))

    def forward(self, features: torch.Tensor, ids: torch.Tensor | None = None, embed=None) -> torch.Tensor:
        if not self.grounded:
            return torch.stack([self.head(k, features) for k in range(self.num_heads)], -2)
        e = embedding_of(embed, ids).to(features.dtype)
        inputs = [features] + [torch.roll(e, -(k + 1), dims=1) for k in range(self.num_heads)]
        return torch.stack([self.head(k, torch.cat(inputs[:k + 2], -1)) for k in range(self.num_heads)], -2)

    def config(self) -> dict:
        return {"hydra_num_heads": self.num_heads, "hydra_num_layers": self.num_layers, "hydra_head_arch": "mlp",
                "grounded_heads": self.grounded, "hidden_state_offset": self.hidden_state_offset,
                "base_model_name_or_path": "", "hidden_size": self.dim, "vocab_size": self.vocab}


# --- EAGLE ----------------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        from magicdec.model.transformer import rms_norm

        return rms_norm(x, self.weight, self.eps)


class EagleAttention(nn.Module):
    def __init__(self, a: ModelArgs, in_dim: int, qkv_bias: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.q_proj = nn.Linear(in_dim, a.n_heads * a.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(in_dim, a.n_kv_heads * a.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(in_dim, a.n_kv_heads * a.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)

    def forward(self, x, cos, sin, cache, layer: int, attend):
        from magicdec.model.transformer import apply_rope

        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q = apply_rope(self.q_proj(x).view(B, T, H, D), cos, sin)
        k = apply_rope(self.k_proj(x).view(B, T, Hkv, D), cos, sin)
        v = self.v_proj(x).view(B, T, Hkv, D)
        if cache is None:  # training: causal over the T pairs
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1),
                                               is_causal=True)
        else:
            k_cache, v_cache = cache.write(layer, k, v)
            y = attend(q.transpose(1, 2), k_cache, v_cache, layer)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * D))


class EagleMLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(a.dim, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.dim, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EagleLayer(nn.Module):
    """A Llama decoder layer as EAGLE writes it. EAGLE-1/2: its first layer has no input norm (the fc output goes
    straight into attention). EAGLE-3 (`midlayer`): attention over cat(input_layernorm(embedding),
    hidden_norm(hidden)), the residual the hidden itself."""

    def __init__(self, a: ModelArgs, index: int, eagle3: bool, qkv_bias: bool = False):
        super().__init__()
        self.eagle3, self.index = eagle3, index
        self.self_attn = EagleAttention(a, 2 * a.dim if eagle3 else a.dim, qkv_bias)
        self.mlp = EagleMLP(a)
        if eagle3:
            self.hidden_norm = RMSNorm(a.dim, a.norm_eps)
        if eagle3 or index:
            self.input_layernorm = RMSNorm(a.dim, a.norm_eps)
        self.post_attention_layernorm = RMSNorm(a.dim, a.norm_eps)

    def forward(self, h, emb, cos, sin, cache, attend):
        if self.eagle3:
            x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], -1)
        else:
            x = self.input_layernorm(h) if self.index else h
        h = h + self.self_attn(x, cos, sin, cache, self.index, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleHead(nn.Module):
    """EAGLE's feature-level draft: fc over (EAGLE-1) cat(embedding of the next token, the target's feature) or
    (EAGLE-3) the target's concatenated taps, then decoder layer(s) with their own KV; the output predicts the
    target's feature one position on. `args` holds the head's own shapes (n_layers: its decoder layers)."""

    def __init__(self, args: ModelArgs, eagle3: bool, target_dim: int, vocab: int, taps: tuple[int, ...] = (),
                 draft_vocab: int | None = None, bias: bool = True, qkv_bias: bool = False, own_embedding: bool = False):
        super().__init__()
        self.args, self.eagle3, self.target_dim, self.vocab = args, eagle3, target_dim, vocab
        self.bias, self.qkv_bias, self.tap_layers = bias, qkv_bias, tuple(taps)
        self.draft_vocab = draft_vocab or vocab
        if eagle3:
            self.fc = nn.Linear(len(taps) * target_dim, args.dim, bias=False)
            self.midlayer = EagleLayer(args, 0, True, qkv_bias)
            self.norm = RMSNorm(args.dim, args.norm_eps)
            self.lm_head = nn.Linear(args.dim, self.draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool))
        else:
            self.fc = nn.Linear(2 * args.dim, args.dim, bias=bias)
            self.layers = nn.ModuleList(EagleLayer(args, i, False, qkv_bias) for i in range(args.n_layers))
        self.embed_tokens = nn.Embedding(vocab, args.dim) if own_embedding else None
        from magicdec.model.transformer import rope_inv_freq

        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    @property
    def family(self) -> str:
        return "eagle3" if self.eagle3 else "eagle"

    @property
    def blocks(self) -> list[EagleLayer]:
        return [self.midlayer] if self.eagle3 else list(self.layers)

    def taps(self, n_layers: int) -> tuple[int, ...]:
        return self.tap_layers if self.eagle3 else (final_tap(n_layers),)

    def embed(self, ids: torch.Tensor, embed=None) -> torch.Tensor:
        return self.embed_tokens(ids) if self.embed_tokens is not None else embedding_of(embed, ids)

    def forward(self, features: torch.Tensor, next_ids: torch.Tensor, embed=None, cache=None,
                positions: torch.Tensor | None = None, plan: ForwardPlan = PLAIN) -> torch.Tensor:
        """features [B, T, F]: the target's taps (F = len(taps) * target H for EAGLE-3), or the head's own
        predicted features [B, T, H] (EAGLE-3 applies fc only to the target's); next_ids [B, T]: the token one
        position after each feature's. Returns the predicted features [B, T, H] one position on. With a cache,
        `plan` says what the forward over it is (a drafted tree level's: ForwardPlan.drafting)."""
        B, T = next_ids.shape
        emb = self.embed(next_ids, embed).to(features.dtype)
        if self.eagle3:
            h = self.fc(features) if features.shape[-1] != self.args.dim else features
        else:
            h = self.fc(torch.cat([emb, features], -1))
        if cache is None:
            pos = torch.arange(T, device=h.device)[None].expand(B, T) if positions is None else positions
            attend = None
        else:
            pos, attend = cache.positions(T, plan), cache.attend(T, plan)
        angles = pos[..., None].float() * self.inv_freq
        cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
        for block in self.blocks:
            h = block(h, emb, cos, sin, cache, attend)
        return h

    def logits(self, hidden: torch.Tensor, lm_head=None) -> torch.Tensor:
        """EAGLE-1: the target's LM head (`lm_head`, a Linear or its weight) over the predicted feature; EAGLE-3:
        its own norm and LM head, over its draft vocabulary."""
        if self.eagle3:
            return self.lm_head(self.norm(hidden))
        return F.linear(hidden, lm_head.weight if isinstance(lm_head, nn.Module) else lm_head)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids to the target's (EAGLE-3's d2t); EAGLE-1's are the target's."""
        return ids + self.d2t[ids] if self.eagle3 and self.draft_vocab != self.vocab else ids

    def config(self) -> dict:
        a = self.args
        cfg = {"architectures": ["LlamaForCausalLMEagle3" if self.eagle3 else "LlamaForCausalLM"],
               "model_type": "llama", "hidden_size": a.dim, "intermediate_size": a.intermediate_size,
               "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim,
               "num_hidden_layers": a.n_layers, "rms_norm_eps": a.norm_eps, "vocab_size": self.vocab,
               "rope_theta": a.rope_base, "rope_scaling": a.rope_scaling, "max_position_embeddings": a.max_seq_len,
               "hidden_act": "silu", "bias": self.bias, "tie_word_embeddings": False}
        if self.qkv_bias:
            cfg["qkv_bias"] = True
        if self.eagle3:
            cfg["draft_vocab_size"] = self.draft_vocab
            cfg["eagle_aux_hidden_state_layer_ids"] = list(self.tap_layers)
            if self.target_dim != a.dim:
                cfg["target_hidden_size"] = self.target_dim
        return cfg


# --- fresh heads ----------------------------------------------------------------------------------------------------
def head_args(target: ModelArgs, num_layers: int = 1) -> ModelArgs:
    """An EAGLE head's shapes for a target: the target's layer shapes, `num_layers` layers."""
    from dataclasses import replace

    return replace(target, n_layers=num_layers, name="eagle-head")


def check_taps(taps, n_layers: int, what: str = "EAGLE-3") -> None:
    for t in taps:
        if not 0 <= t <= n_layers:
            raise MagicDecError(f"{what} reads the target's hidden-state layer {t}, but the target has {n_layers} "
                                f"layers (taps 0..{n_layers}): use a head made for this target, or give layers within it")


def new_head(family: str, target_args: ModelArgs, *, num_heads: int = 4, num_layers: int = 1, layers=None,
             draft_vocab: int | None = None, grounded: bool = True, seed: int = 0, target=None,
             init: str = "original") -> nn.Module:
    """A fresh head for a target, initialised as the original code does (module docstring); fp32 on the CPU.
    init "identity" (speed runs without a trained head): EAGLE-1's fc passes the target's feature through and each
    layer's output projections are zero, so the head predicts the feature it was given; a grounded Hydra head's
    first residual map passes the hidden state through and drops the embeddings. Either then drafts what the
    target's own LM head said, as a fresh Medusa head does (a random head is never accepted)."""
    if family not in FAMILIES:
        raise MagicDecError(f"unknown head family {family!r}: choose one of {', '.join(FAMILIES)}")
    if num_heads < 1 or num_layers < 1:
        raise MagicDecError(f"a head needs num_heads >= 1 and num_layers >= 1, got {num_heads} and {num_layers}")
    a = target_args
    gen = torch.Generator().manual_seed(seed)
    if family == "medusa":
        head = MedusaHead(a.dim, a.vocab_size, num_heads, num_layers)
    elif family == "hydra":
        head = HydraHead(a.dim, a.vocab_size, num_heads, num_layers, grounded)
    else:
        eagle3 = family == "eagle3"
        taps = tuple(layers) if layers is not None else (eagle3_default_taps(a.n_layers) if eagle3 else ())
        if eagle3:
            check_taps(taps, a.n_layers)
            if draft_vocab is not None and not 1 <= draft_vocab <= a.vocab_size:
                raise MagicDecError(f"EAGLE-3 draft_vocab {draft_vocab}: must be 1..{a.vocab_size} (the target's)")
        head = EagleHead(head_args(a, 1 if eagle3 else num_layers), eagle3, a.dim, a.vocab_size, taps,
                         draft_vocab if eagle3 else None)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif family in ("medusa", "hydra") and name.endswith("linear.weight"):
                p.zero_()  # the ResBlock starts as the identity, as Medusa and Hydra initialise it
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        if target is not None and family in ("medusa", "hydra"):
            for k in range(num_heads):  # each head's LM head starts as the target's (Hydra's, and Medusa's recipe)
                lm = head[k][-1] if family == "medusa" else head.hydra_lm_head[k]
                lm.weight.copy_(target.output.weight.float())
        if family == "eagle3" and head.draft_vocab != a.vocab_size:  # the d2t of the first draft_vocab ids
            head.t2d[:head.draft_vocab] = True
        if family == "hydra" and init == "identity" and grounded:  # the hidden state through, the embeddings not:
            for k in range(num_heads):  # each head starts as Medusa's does, at the target's own prediction
                res = head.hydra_mlp[k][0].res_connection.weight
                res.zero_()
                res[:, :a.dim].copy_(torch.eye(a.dim))
        if family == "eagle" and init == "identity":
            head.fc.weight.zero_()
            head.fc.weight[:, a.dim:].copy_(torch.eye(a.dim))
            for block in head.blocks:
                block.self_attn.o_proj.weight.zero_()
                block.mlp.down_proj.weight.zero_()
    return head.eval()


# --- files ----------------------------------------------------------------------------------------------------------
def save(head: nn.Module, directory) -> Path:
    """The family's published files in `directory` (created): config.json and its weights file, written together
    (files.files_into: the weights file last), so an interrupted save never leaves a config beside old weights."""
    d = Path(directory)
    weights = FILES.get(head.family) or EAGLE_WEIGHTS[0]
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    with files.files_into(d, weights, "--out") as stage:
        (stage / "config.json").write_text(json.dumps(head.config(), indent=2))
        torch.save(state, stage / weights)
    return d


def detect(directory) -> str:
    """The family of the head files in `directory`: medusa_lm_head.pt, hydra_lm_head.pt, or an EAGLE config with
    its weights (EAGLE-3 where the config names a draft vocabulary or an Eagle3 architecture)."""
    d = Path(directory)
    if not d.is_dir():
        raise MagicDecError(f"--head {d}: no such directory (a head's config.json and weights)")
    for family, name in FILES.items():
        if (d / name).is_file():
            return family
    cfg = read_config(d)
    if not any((d / n).is_file() for n in EAGLE_WEIGHTS):
        raise MagicDecError(f"--head {d} holds no head weights (medusa_lm_head.pt, hydra_lm_head.pt, "
                            "pytorch_model.bin or model.safetensors)")
    eagle3 = "draft_vocab_size" in cfg or any("eagle3" in str(x).lower() for x in cfg.get("architectures") or [])
    return "eagle3" if eagle3 else "eagle"


def read_config(d: Path) -> dict:
    path = d / "config.json"
    if not path.is_file():
        raise MagicDecError(f"--head {d} has no config.json (every head family's checkpoint carries one)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise MagicDecError(f"--head: corrupt {path} ({e}); re-save the head") from None


def read_weights(path: Path) -> dict:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a file of torch's legacy format cannot be memory-mapped
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged file, whatever the library raises
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MagicDecError(f"--head: cannot read {path} ({first}); re-save or re-download the head") from None


def load(directory, target_args: ModelArgs, family: str | None = None, dtype=torch.float32,
         check_only: bool = False) -> nn.Module:
    """A head from its published files, checked against the target, on the CPU in `dtype` (the drafter moves it).
    `check_only`: the checks alone (the files memory-mapped, nothing copied): a head on the meta device."""
    d = Path(directory)
    found = detect(d)
    if family is not None and {found, family} != {"eagle", "eagle3"} and found != family:
        raise MagicDecError(f"--head {d} holds a {found} head, not a {family} one: use --drafter {found} (or a "
                            f"{family} checkpoint)")
    cfg = read_config(d)
    a = target_args
    build = {"medusa": _medusa_from, "hydra": _hydra_from, "eagle": _eagle_from, "eagle3": _eagle_from}[found]
    head, state, ignore = build(cfg, d, a)
    _load_state(head, state, d, ignore, dtype, check_only)
    if isinstance(head, EagleHead) and not check_only:
        from magicdec.model.transformer import rope_inv_freq

        head.inv_freq = rope_inv_freq(head.args)
    return head.eval()


def _need(cfg: dict, key: str, d: Path):
    if key not in cfg:
        raise MagicDecError(f"--head {d}: config.json lacks {key!r}; re-save the head in its family's format")
    return cfg[key]


def _check_dims(d: Path, what: str, dim: int, vocab: int, a: ModelArgs, dim_key="hidden size") -> None:
    if dim != a.dim:
        raise MagicDecError(f"--head {d}: a {what} head for {dim_key} {dim}, but the target's is {a.dim}: it was "
                            "trained for another model; use a head for this target")
    if vocab != a.vocab_size:
        raise MagicDecError(f"--head {d}: a {what} head over a vocabulary of {vocab}, but the target's is "
                            f"{a.vocab_size}: it was trained for another tokenizer; use a head for this target")


def _load_state(head: nn.Module, state: dict, d: Path, ignore=(), dtype=torch.float32, check_only=False) -> None:
    state = {k: v for k, v in state.items() if k not in ignore}
    want = head.state_dict()
    missing = [k for k in want if k not in state]
    unexpected = [k for k in state if k not in want]
    if missing or unexpected:
        what = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
        raise MagicDecError(f"--head {d}: its weights do not match its config.json ({what}); re-save the head")
    for k, v in state.items():
        if tuple(v.shape) != tuple(want[k].shape):
            raise MagicDecError(f"--head {d}: {k} has shape {tuple(v.shape)}, its config.json implies "
                                f"{tuple(want[k].shape)}; re-save the head")
    if not check_only:
        head.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v.clone() for k, v in state.items()},
                             strict=True, assign=True)


def _medusa_from(cfg: dict, d: Path, a: ModelArgs) -> MedusaHead:
    state = read_weights(d / FILES["medusa"])
    n_heads, n_layers = int(_need(cfg, "medusa_num_heads", d)), int(_need(cfg, "medusa_num_layers", d))
    lm = state.get(f"0.{n_layers}.weight")
    if lm is None:
        raise MagicDecError(f"--head {d}: medusa_lm_head.pt lacks 0.{n_layers}.weight (head 0's LM head after "
                            f"{n_layers} ResBlocks); re-save the head")
    _check_dims(d, "Medusa", lm.shape[1], lm.shape[0], a)
    n_file = len({k.split(".")[0] for k in state})
    if n_file < n_heads:
        raise MagicDecError(f"--head {d}: config.json names {n_heads} Medusa heads, medusa_lm_head.pt holds {n_file}; "
                            "set medusa_num_heads to the file's count")
    with torch.device("meta"):  # a file with more heads: the first n_heads (the original loads strict=False)
        head = MedusaHead(a.dim, a.vocab_size, n_heads, n_layers)
    return head, {k: v for k, v in state.items() if int(k.split(".")[0]) < n_heads}, ()


def _hydra_from(cfg: dict, d: Path, a: ModelArgs) -> HydraHead:
    arch = cfg.get("hydra_head_arch", "mlp")
    if arch != "mlp":
        raise MagicDecError(f"--head {d}: hydra_head_arch {arch!r} is not supported (only \"mlp\", Hydra's heads over "
                            "the hidden state and the drafted tokens' embeddings)")
    state = read_weights(d / FILES["hydra"])
    lm = state.get("hydra_lm_head.0.weight")
    if lm is None:
        raise MagicDecError(f"--head {d}: hydra_lm_head.pt lacks hydra_lm_head.0.weight; re-save the head")
    _check_dims(d, "Hydra", lm.shape[1], lm.shape[0], a)
    emb = state.get("input_embed_fn.weight")
    if emb is not None and tuple(emb.shape) != (a.vocab_size, a.dim):
        raise MagicDecError(f"--head {d}: its saved embedding is {tuple(emb.shape)}, the target's "
                            f"({a.vocab_size}, {a.dim}): it was trained for another model")
    offset = int(cfg.get("hidden_state_offset", 0))
    if not 0 <= offset <= a.n_layers:
        raise MagicDecError(f"--head {d}: hidden_state_offset {offset} reads a hidden-state layer the target's "
                            f"{a.n_layers} layers do not have: use a head made for this target")
    with torch.device("meta"):
        head = HydraHead(a.dim, a.vocab_size, int(_need(cfg, "hydra_num_heads", d)),
                         int(_need(cfg, "hydra_num_layers", d)), bool(cfg.get("grounded_heads", False)), offset)
    return head, state, ("input_embed_fn.weight",)


def _eagle_from(cfg: dict, d: Path, a: ModelArgs) -> EagleHead:
    eagle3 = detect(d) == "eagle3"
    path = next(d / n for n in EAGLE_WEIGHTS if (d / n).is_file())
    state = read_weights(path)
    args = ModelArgs.from_hf_config(dict(cfg, model_type="llama"), name="eagle-head")
    if eagle3:
        args.n_layers = 1
    what = "EAGLE-3" if eagle3 else "EAGLE"
    target_dim = int(cfg.get("target_hidden_size", args.dim)) if eagle3 else args.dim
    _check_dims(d, what, target_dim, args.vocab_size, a, "target hidden size" if eagle3 else "hidden size")
    taps = ()
    if eagle3:
        taps = tuple(cfg.get("eagle_aux_hidden_state_layer_ids") or eagle3_default_taps(a.n_layers))
        check_taps(taps, a.n_layers)
        fc = state.get("fc.weight")
        if fc is not None and fc.shape[1] != len(taps) * target_dim:
            raise MagicDecError(f"--head {d}: its fc reads {fc.shape[1]} features, {len(taps)} hidden-state layers "
                                f"of the target give {len(taps) * target_dim}: it was made for another target")
    own = "embed_tokens.weight" in state
    if not own and args.dim != a.dim:
        raise MagicDecError(f"--head {d}: its hidden size {args.dim} differs from the target's {a.dim} and it has no "
                            "embed_tokens.weight of its own to embed tokens with; use a head for this target")
    draft_vocab = int(cfg.get("draft_vocab_size", args.vocab_size)) if eagle3 else None
    with torch.device("meta"):
        head = EagleHead(args, eagle3, target_dim, args.vocab_size, taps, draft_vocab, bool(cfg.get("bias", True)),
                         bool(cfg.get("qkv_bias", False)), own)
    state = dict(state)
    if eagle3 and draft_vocab == args.vocab_size:  # the original drops d2t / t2d when the vocabularies agree
        state.setdefault("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        state.setdefault("t2d", torch.ones(args.vocab_size, dtype=torch.bool))
    if eagle3:
        d2t = state.get("d2t")
        if d2t is not None and d2t.numel() == draft_vocab and draft_vocab:
            top = int((torch.arange(draft_vocab) + d2t.long()).max())
            if top >= a.vocab_size or int((torch.arange(draft_vocab) + d2t.long()).min()) < 0:
                raise MagicDecError(f"--head {d}: its d2t maps draft ids to target id {top}, outside the target's "
                                    f"vocabulary of {a.vocab_size}: it was made for another tokenizer")
    return head, state, ()


def place(head: nn.Module, device, dtype) -> nn.Module:
    """The head on a device in a dtype for inference (its RoPE frequencies kept fp32), frozen."""
    head = head.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if isinstance(head, EagleHead):
        from magicdec.model.transformer import rope_inv_freq

        head.inv_freq = rope_inv_freq(head.args).to(device)
    return head


def weight_bytes(head: nn.Module, item: int = 2) -> int:
    """Bytes of the head's own weights (the target's LM head and embedding, which it may read, not counted)."""
    return sum(p.numel() for p in head.parameters()) * item
