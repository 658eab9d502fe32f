"""The head modules and their published formats (magicdec/model/heads.py): files written by hand under the original
repositories' key names and config keys load and compute what a hand-written computation from the same tensors
does (EAGLE's decoder layer against transformers' LlamaDecoderLayer); the target exposes the hidden states a head
reads as transformers' output_hidden_states does; bad heads are refused in one line."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from magicdec.model import heads
from magicdec.config import ModelArgs
from magicdec.errors import MagicDecError

A = ModelArgs(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=96)
G = torch.Generator().manual_seed(0)


def rnd(*shape):
    return torch.randn(*shape, generator=G) * 0.1


def write(d, cfg, name, state):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    torch.save(state, d / name)
    return d


def test_medusa_file_loads_and_computes_resblocks_then_lm_head(tmp_path):
    H, V = 64, 256
    state = {}
    for k in range(2):
        state |= {f"{k}.0.linear.weight": rnd(H, H), f"{k}.0.linear.bias": rnd(H), f"{k}.1.weight": rnd(V, H)}
    d = write(tmp_path / "m", {"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "x"},
              "medusa_lm_head.pt", state)
    head = heads.load(d, A)
    x = rnd(3, H)
    for k in range(2):
        want = (x + F.silu(x @ state[f"{k}.0.linear.weight"].T + state[f"{k}.0.linear.bias"])) @ state[f"{k}.1.weight"].T
        torch.testing.assert_close(head.head(k, x), want)
    assert heads.detect(d) == "medusa"


def test_hydra_file_with_the_saved_embedding_loads(tmp_path):
    H, V = 64, 256
    state = {"input_embed_fn.weight": rnd(V, H)}
    for k in range(2):
        w = (k + 2) * H
        state |= {f"hydra_mlp.{k}.0.linear.weight": rnd(H, w), f"hydra_mlp.{k}.0.linear.bias": rnd(H),
                  f"hydra_mlp.{k}.0.res_connection.weight": rnd(H, w), f"hydra_mlp.{k}.0.res_connection.bias": rnd(H),
                  f"hydra_lm_head.{k}.weight": rnd(V, H), f"hydra_lm_head.{k}.bias": rnd(V)}
    d = write(tmp_path / "h", {"hydra_num_heads": 2, "hydra_num_layers": 1, "hydra_head_arch": "mlp",
                               "grounded_heads": True, "hidden_state_offset": 0}, "hydra_lm_head.pt", state)
    head = heads.load(d, A)
    x = rnd(3, 3 * H)
    p = "hydra_mlp.1.0."
    h = x @ state[p + "res_connection.weight"].T + state[p + "res_connection.bias"] + \
        F.silu(x @ state[p + "linear.weight"].T + state[p + "linear.bias"])
    torch.testing.assert_close(head.head(1, x), h @ state["hydra_lm_head.1.weight"].T + state["hydra_lm_head.1.bias"])


def eagle_layer_state(prefix, in_dim, H=64, I=96, Hq=4, Hkv=2, D=16, eagle3=False, first=True):
    s = {f"{prefix}self_attn.q_proj.weight": rnd(Hq * D, in_dim), f"{prefix}self_attn.k_proj.weight": rnd(Hkv * D, in_dim),
         f"{prefix}self_attn.v_proj.weight": rnd(Hkv * D, in_dim), f"{prefix}self_attn.o_proj.weight": rnd(H, Hq * D),
         f"{prefix}mlp.gate_proj.weight": rnd(I, H), f"{prefix}mlp.up_proj.weight": rnd(I, H),
         f"{prefix}mlp.down_proj.weight": rnd(H, I), f"{prefix}post_attention_layernorm.weight": 1 + rnd(H)}
    if eagle3:
        s[f"{prefix}hidden_norm.weight"] = 1 + rnd(H)
    if eagle3 or not first:
        s[f"{prefix}input_layernorm.weight"] = 1 + rnd(H)
    return s


EAGLE_CFG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
             "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "rms_norm_eps": 1e-5,
             "vocab_size": 256, "rope_theta": 10000.0, "max_position_embeddings": 512, "bias": True}


def hf_layer(state, prefix, norm=True):
    """transformers' LlamaDecoderLayer with an EAGLE layer's tensors (its input norm the identity where it has none)."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = transformers.LlamaConfig(**{k: v for k, v in EAGLE_CFG.items() if k not in ("architectures", "bias")},
                                   attn_implementation="eager")
    layer = LlamaDecoderLayer(cfg, 0)
    sd = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if not norm:
        sd["input_layernorm.weight"] = torch.ones(64)
    layer.load_state_dict(sd)
    if not norm:
        layer.input_layernorm = torch.nn.Identity()
    return layer.eval(), LlamaRotaryEmbedding(cfg)


def test_eagle1_file_matches_fc_and_transformers_layers(tmp_path):
    state = {"fc.weight": rnd(64, 128), "fc.bias": rnd(64)} | eagle_layer_state("layers.0.", 64) | \
        eagle_layer_state("layers.1.", 64, first=False)
    d = write(tmp_path / "e", EAGLE_CFG, "pytorch_model.bin", state)
    head = heads.load(d, A)
    assert heads.detect(d) == "eagle" and head.taps(4) == (4,)
    emb = rnd(256, 64)
    feats, ids = rnd(2, 7, 64), torch.randint(0, 256, (2, 7), generator=G)
    with torch.no_grad():
        h = torch.cat([emb[ids], feats], -1) @ state["fc.weight"].T + state["fc.bias"]
        pos = torch.arange(7)[None].expand(2, -1)
        mask = torch.full((7, 7), float("-inf")).triu(1)[None, None].expand(2, 1, 7, 7)
        for i in range(2):
            layer, rope = hf_layer(state, f"layers.{i}.", norm=i > 0)
            out = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rope(h, pos))
            h = out[0] if isinstance(out, tuple) else out
        torch.testing.assert_close(head(feats, ids, emb), h, rtol=1e-4, atol=1e-5)
        lm = rnd(256, 64)
        torch.testing.assert_close(head.logits(h, lm), h @ lm.T)  # EAGLE-1: the target's LM head, no norm


def rms(x, w, eps=1e-5):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_eagle3_file_computes_its_midlayer_by_hand(tmp_path):
    Vd = 100
    d2t = torch.arange(Vd) * 2 - torch.arange(Vd)  # draft id i -> target id 2i
    state = {"fc.weight": rnd(64, 3 * 64), "norm.weight": 1 + rnd(64), "lm_head.weight": rnd(Vd, 64), "d2t": d2t,
             "t2d": torch.zeros(256, dtype=torch.bool)} | eagle_layer_state("midlayer.", 128, eagle3=True)
    cfg = EAGLE_CFG | {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1, "draft_vocab_size": Vd}
    d = write(tmp_path / "e3", cfg, "pytorch_model.bin", state)
    assert heads.detect(d) == "eagle3" and heads.eagle3_default_taps(32) == (2, 16, 29)  # EAGLE-3's own choice
    one_line(lambda: heads.load(d, A), "fc reads 192 features", "2 hidden-state layers")  # at 4 layers: 1 and 2
    head = heads.load(write(tmp_path / "e3b", cfg | {"eagle_aux_hidden_state_layer_ids": [0, 1, 3]},
                            "pytorch_model.bin", state), A)
    assert head.taps(4) == (0, 1, 3)
    emb = rnd(256, 64)
    T = 5
    feats, ids = rnd(2, T, 192), torch.randint(0, 256, (2, T), generator=G)
    s = {k[len("midlayer."):]: v for k, v in state.items() if k.startswith("midlayer.")}
    h = feats @ state["fc.weight"].T
    x = torch.cat([rms(emb[ids], s["input_layernorm.weight"]), rms(h, s["hidden_norm.weight"])], -1)
    q = (x @ s["self_attn.q_proj.weight"].T).view(2, T, 4, 16).transpose(1, 2)
    k = (x @ s["self_attn.k_proj.weight"].T).view(2, T, 2, 16).transpose(1, 2)
    v = (x @ s["self_attn.v_proj.weight"].T).view(2, T, 2, 16).transpose(1, 2)
    inv = 1 / 10000 ** (torch.arange(0, 16, 2).float() / 16)
    ang = torch.arange(T)[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rot = lambda t: torch.cat([-t[..., 8:], t[..., :8]], -1)  # noqa: E731
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    att = (q @ k.transpose(-1, -2) / 4).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = (att.softmax(-1) @ v).transpose(1, 2).reshape(2, T, 64) @ s["self_attn.o_proj.weight"].T
    h = h + y
    m = rms(h, s["post_attention_layernorm.weight"])
    h = h + (F.silu(m @ s["mlp.gate_proj.weight"].T) * (m @ s["mlp.up_proj.weight"].T)) @ s["mlp.down_proj.weight"].T
    with torch.no_grad():
        out = head(feats, ids, emb)
        torch.testing.assert_close(out, h, rtol=1e-4, atol=1e-5)
        want = rms(h, state["norm.weight"]) @ state["lm_head.weight"].T
        torch.testing.assert_close(head.logits(out), want, rtol=1e-4, atol=1e-5)
        assert torch.equal(head.to_target(torch.tensor([3, 7])), torch.tensor([6, 14]))


def test_the_targets_taps_are_transformers_hidden_states(tiny_hf):
    """Tap i is transformers' output_hidden_states[i] (the input of layer i; the last, the final norm's output)."""
    from magicdec.decoding.generate import prefill_features
    from magicdec.model.kv_cache import KVCache
    from magicdec.model.transformer import load_model

    hf, path = tiny_hf("llama", seed=3, num_hidden_layers=4, max_position_embeddings=1024)
    model = load_model(path, "cpu", torch.float32)
    ids = torch.randint(0, 256, (2, 20), generator=G)
    with torch.no_grad():
        want = hf(ids, output_hidden_states=True).hidden_states
        a = model.args
        cache = KVCache(a.n_layers, 2, a.n_kv_heads, 20, a.head_dim, torch.float32, "cpu")
        _, got = prefill_features(model, cache, ids, 8, (0, 2, 4))
    torch.testing.assert_close(got, torch.cat([want[0], want[2], want[4]], -1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", heads.FAMILIES)
def test_saved_heads_load_back_identically(tmp_path, family):
    head = heads.new_head(family, A, num_heads=3, draft_vocab=100 if family == "eagle3" else None, seed=4)
    loaded = heads.load(heads.save(head, tmp_path / family), A, family)
    assert loaded.state_dict().keys() == head.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in head.state_dict().items())


def one_line(fn, *needles):
    with pytest.raises(MagicDecError) as e:
        fn()
    assert "\n" not in str(e.value)
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_bad_heads_are_refused_in_one_line(tmp_path):
    from dataclasses import replace

    for family in heads.FAMILIES:
        heads.save(heads.new_head(family, A, num_heads=2), tmp_path / family)
    wide = replace(A, dim=128, n_heads=8, n_kv_heads=4)
    for family in heads.FAMILIES:  # a head for another target
        one_line(lambda: heads.load(tmp_path / family, wide), "trained for another model")
        one_line(lambda: heads.load(tmp_path / family, replace(A, vocab_size=300)), "vocabulary")
    heads.save(heads.new_head("eagle3", A, layers=(1, 2, 3)), tmp_path / "e3")
    one_line(lambda: heads.load(tmp_path / "e3", replace(A, n_layers=2)), "layer 3", "2 layers")  # a missing layer
    one_line(lambda: heads.new_head("eagle3", A, layers=(1, 2, 9)), "layer 9")
    one_line(lambda: heads.load(tmp_path / "medusa", A, "hydra"), "medusa head, not a hydra")  # the wrong family
    one_line(lambda: heads.load(tmp_path / "nowhere", A), "no such directory")
    (tmp_path / "empty").mkdir()
    one_line(lambda: heads.load(tmp_path / "empty", A), "config.json")
    cfg = json.loads((tmp_path / "hydra" / "config.json").read_text()) | {"hydra_head_arch": "prefix-mlp"}
    (tmp_path / "hydra" / "config.json").write_text(json.dumps(cfg))
    one_line(lambda: heads.load(tmp_path / "hydra", A), "prefix-mlp")
    (tmp_path / "medusa" / "medusa_lm_head.pt").write_bytes(b"not a checkpoint")
    one_line(lambda: heads.load(tmp_path / "medusa", A), "cannot read")


@pytest.mark.parametrize("flags,needle", [
    (["--drafter", "medusa", "--num_heads", "2", "--gamma", "3"], "has 2 heads"),
    (["--drafter", "eagle", "--head_budget", "10"], "give --head_kv window"),
    (["--drafter", "eagle", "--eagle3", "--eagle3_layers", "0", "5"], "layer 5"),
    (["--drafter", "hydra", "--head", "HEAD"], "holds a medusa head"),
])
def test_bad_head_runs_are_one_line(tmp_path, flags, needle):
    from magicdec.cli import config_from_argv
    from magicdec.harness.engine import Engine

    heads.save(heads.new_head("medusa", ModelArgs.from_name("JackFram/llama-68m"), num_heads=2), tmp_path / "m")
    flags = [str(tmp_path / "m") if f == "HEAD" else f for f in flags]
    cfg = config_from_argv(["--random_weights", "--model_name", "JackFram/llama-68m", "--device", "cpu",
                            "--prefix_len", "256", "--gen_len", "16", *flags], "t")

    def plan():
        cfg.check()
        Engine(cfg).plan(cfg)
    one_line(plan, needle)
