"""Model configuration: one dataclass for the whole Llama family.

The configuration of a real checkpoint always comes from the checkpoint itself (HF `config.json`,
or the GGUF metadata that `convert_hf_checkpoint.py` turns into a `config.json`); `KNOWN_MODELS`
only serves `--random_weights` runs at the real shapes of the paper's models.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from magicdec.errors import MagicDecError


@dataclass
class ModelArgs:
    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    head_dim: int = 0  # 0 = dim // n_heads
    intermediate_size: int = 11008
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    # None, {"rope_type": "linear", "factor": f} or {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}, as in HF's `rope_scaling`.
    rope_scaling: dict | None = None
    max_seq_len: int = 4096  # the model's context (HF max_position_embeddings)
    tie_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    bos_id: int | None = 1
    eos_id: int | list[int] | None = 2
    name: str = ""

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_heads
        for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size"):
            if getattr(self, key) <= 0:
                raise MagicDecError(f"model config: {key} must be positive, got {getattr(self, key)}")
        if self.n_heads % self.n_kv_heads:
            raise MagicDecError(f"model config: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    @property
    def eos_ids(self) -> list[int]:
        if self.eos_id is None:
            return []
        return list(self.eos_id) if isinstance(self.eos_id, (list, tuple)) else [self.eos_id]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "") -> "ModelArgs":
        """Build from a transformers `config.json` dict (Llama, Mistral, Qwen2 model types)."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise MagicDecError(f"unsupported model_type {model_type!r} in config.json: magicdec runs llama, mistral and qwen2")
        n_heads = cfg["num_attention_heads"]
        scaling = cfg.get("rope_scaling") or None
        # transformers >= 5 folds rope_theta and rope_scaling into `rope_parameters`
        params = cfg.get("rope_parameters") or {}
        rope_base = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
        if scaling is None and params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling is not None:
            scaling = dict(scaling)
            scaling["rope_type"] = scaling.get("rope_type", scaling.get("type"))
            scaling.pop("type", None)
            if scaling["rope_type"] in (None, "default"):
                scaling = None
            elif scaling["rope_type"] not in ("linear", "llama3", "yarn"):
                raise MagicDecError(f"unsupported rope_scaling type {scaling['rope_type']!r}: magicdec supports linear, "
                                    "llama3 and yarn")
        return cls(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            intermediate_size=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_base=float(rope_base),
            rope_scaling=scaling,
            max_seq_len=cfg.get("max_position_embeddings", 4096),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            bos_id=cfg.get("bos_token_id"),
            eos_id=cfg.get("eos_token_id"),
            name=name or cfg.get("_name_or_path", ""),
        )

    @classmethod
    def from_checkpoint_dir(cls, directory: str | Path) -> "ModelArgs":
        path = Path(directory) / "config.json"
        if not path.is_file():
            raise MagicDecError(f"no config.json beside the checkpoint in {directory}: run convert_hf_checkpoint.py --checkpoint_dir {directory}")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise MagicDecError(f"corrupt {path}: {e}; re-download or re-convert the checkpoint") from None
        return cls.from_hf_config(cfg, name=cfg.get("_name_or_path") or Path(directory).name)

    @classmethod
    def from_name(cls, name: str) -> "ModelArgs":
        """Config of a known model, for random-weight runs at real shapes."""
        key = name.strip().rstrip("/")
        matches = [k for k in KNOWN_MODELS if k.lower() == key.lower()]
        if not matches:  # accept the part after the org, e.g. "Meta-Llama-3.1-8B"
            matches = [k for k in KNOWN_MODELS if k.split("/")[-1].lower() == key.split("/")[-1].lower()]
        if not matches:
            raise MagicDecError(f"unknown model name {name!r}; known names: {', '.join(sorted(KNOWN_MODELS))}")
        return replace(KNOWN_MODELS[matches[0]], name=matches[0])


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

_llama2_7b = ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, intermediate_size=11008, max_seq_len=4096)
_llama3_8b = ModelArgs(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
                       rope_base=500000.0, max_seq_len=8192, bos_id=128000, eos_id=128001)
_llama3_70b = replace(_llama3_8b, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, intermediate_size=28672, head_dim=0)

KNOWN_MODELS: dict[str, ModelArgs] = {
    "meta-llama/Llama-2-7b-hf": _llama2_7b,
    "meta-llama/Llama-2-13b-hf": replace(_llama2_7b, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40,
                                         intermediate_size=13824, head_dim=0),
    "meta-llama/Llama-2-70b-hf": replace(_llama2_7b, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                                         intermediate_size=28672, head_dim=0),
    "togethercomputer/LLaMA-2-7B-32K": replace(_llama2_7b, max_seq_len=32768,
                                               rope_scaling={"rope_type": "linear", "factor": 8.0}),
    # TriForce's target: Llama-2-7B with YaRN scaling to 128K (rope_theta 10000, factor 32 over 4096)
    "NousResearch/Yarn-Llama-2-7b-128k": replace(_llama2_7b, max_seq_len=131072, rope_scaling={
        "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}),
    "meta-llama/Meta-Llama-3-8B": _llama3_8b,
    "meta-llama/Meta-Llama-3-70B": _llama3_70b,
    "meta-llama/Meta-Llama-3.1-8B": replace(_llama3_8b, max_seq_len=131072, rope_scaling=dict(_LLAMA3_ROPE)),
    "meta-llama/Meta-Llama-3.1-70B": replace(_llama3_70b, max_seq_len=131072, rope_scaling=dict(_LLAMA3_ROPE)),
    # Llama-3.1-8B's standalone draft: the same tokenizer (128256), 16 layers, tied embeddings
    "meta-llama/Llama-3.2-1B": ModelArgs(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                                         intermediate_size=8192, rope_base=500000.0, max_seq_len=131072,
                                         tie_embeddings=True, bos_id=128000, eos_id=128001,
                                         rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}),
    "TinyLlama/TinyLlama_v1.1": ModelArgs(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, intermediate_size=5632,
                                          max_seq_len=2048),
    "JackFram/llama-68m": ModelArgs(dim=768, n_layers=2, n_heads=12, n_kv_heads=12, intermediate_size=3072,
                                    norm_eps=1e-6, max_seq_len=2048, bos_id=0, eos_id=2),
    "HuggingFaceTB/SmolLM2-135M": ModelArgs(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                                            intermediate_size=1536, rope_base=100000.0, max_seq_len=8192,
                                            tie_embeddings=True, bos_id=1, eos_id=2),
    "Qwen/Qwen2.5-7B": ModelArgs(vocab_size=152064, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                                 intermediate_size=18944, norm_eps=1e-6, rope_base=1000000.0, max_seq_len=32768,
                                 attention_bias=True, bos_id=None, eos_id=151643),
    "mistralai/Mistral-7B-v0.3": ModelArgs(vocab_size=32768, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                           intermediate_size=14336, rope_base=1000000.0, max_seq_len=32768),
}


def appended_for(gen_len: int, ahead: int) -> int:
    """The one rule for cache sizes: the positions generation reaches after the prompt (gen_len tokens, a
    verification's `ahead` tokens past the last kept one plus the token it adds, and a slot of slack). What the
    target's cache holds beyond the prompt, and what a selected draft cache appends."""
    return gen_len + ahead + 2


def cache_slots(prefix_len: int, gen_len: int, ahead: int) -> int:
    """Positions a cache holds for a prompt of `prefix_len` tokens and what generation appends to it (appended_for):
    the target's cache, and a draft's that keeps the whole prompt."""
    return prefix_len + appended_for(gen_len, ahead)


def check_context(config: ModelArgs, prefix_len: int, new_tokens: int, what: str, whose: str = "the model's",
                  hint: str = "") -> None:
    """The prompt and what generation adds to it (`what`, named as the sum's terms) within a model's context."""
    total = prefix_len + new_tokens
    if total > config.max_seq_len:
        raise MagicDecError(f"prefix_len + {what} = {total} exceeds {whose} context of {config.max_seq_len} tokens; "
                            f"lower --prefix_len or --gen_len{hint}")
