"""llama2.c conversion of the real stories260K model against independent references: a float64 numpy port of
llama2.c's own forward (run.c) over the raw .bin arrays (interleaved RoPE from the file's own freq_cis tables, GQA
by sharing kv heads), and the model's known greedy output from BOS."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import STORIES
from magicdec.model.checkpoint import Llama2cTokenizer, convert_llama2c, load_state_dict
from magicdec.errors import MagicDecError
from magicdec.decoding.generate import Decoder, decode, prefill
from magicdec.model.kv_cache import KVCache
from magicdec.model.transformer import load_model

REPO = Path(__file__).resolve().parents[1]
BIN, TOK = STORIES / "stories260K.bin", STORIES / "tok512.bin"
KNOWN_TEXT = "Once upon a time, there was a little girl named Lily"

pytestmark = pytest.mark.skipif(not BIN.is_file() or not TOK.is_file(), reason=f"no stories260K in {STORIES}")


# ------------------------------------------------------------------ reference: llama2.c's forward, in float64

def read_raw(path: Path) -> tuple[dict, dict]:
    """The v0 file as run.c's checkpoint_init_weights maps it: header, then fp32 arrays one after another."""
    raw = path.read_bytes()
    dim, hidden, L, H, KV, vocab, seq = (int(x) for x in np.frombuffer(raw, "<i4", 7))
    hd = dim // H
    cfg = dict(dim=dim, hidden=hidden, L=L, H=H, KV=KV, vocab=abs(vocab), seq=seq, hd=hd)
    floats = np.frombuffer(raw, "<f4", offset=28).astype(np.float64)
    w, at = {}, 0

    def take(name, *shape):
        nonlocal at
        n = int(np.prod(shape))
        w[name] = floats[at:at + n].reshape(shape)
        at += n

    take("emb", abs(vocab), dim)
    take("rms_att", L, dim)
    take("wq", L, H * hd, dim)  # run.c's matmul(xout, x, w, n, d): xout[i] = sum_j w[i * n + j] x[j], so [out, in]
    take("wk", L, KV * hd, dim)
    take("wv", L, KV * hd, dim)
    take("wo", L, dim, H * hd)
    take("rms_ffn", L, dim)
    take("w1", L, hidden, dim)
    take("w2", L, dim, hidden)
    take("w3", L, hidden, dim)
    take("rms_final", dim)
    take("fcr", seq, hd // 2)
    take("fci", seq, hd // 2)
    if vocab > 0:  # shared classifier
        w["wcls"] = w["emb"]
    else:
        take("wcls", -vocab, dim)
    assert at == floats.size
    return cfg, w


def rmsnorm(x, g):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g


def rope_interleaved(x, fcr, fci):
    """x [T, heads, hd]: rotate each adjacent pair (x[2i], x[2i+1]) by the table's angle, as run.c does."""
    re, im = x[..., 0::2], x[..., 1::2]
    c, s = fcr[:, None, :], fci[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = re * c - im * s
    out[..., 1::2] = re * s + im * c
    return out


def reference_logits(cfg, w, tokens) -> np.ndarray:
    """Logits [T, vocab] of llama2.c's forward over `tokens` (positions 0..T-1), in float64."""
    T, H, KV, hd = len(tokens), cfg["H"], cfg["KV"], cfg["hd"]
    x = w["emb"][tokens]
    fcr, fci = w["fcr"][:T], w["fci"][:T]
    causal = np.tril(np.ones((T, T), dtype=bool))
    for l in range(cfg["L"]):
        h = rmsnorm(x, w["rms_att"][l])
        q = rope_interleaved((h @ w["wq"][l].T).reshape(T, H, hd), fcr, fci)
        k = rope_interleaved((h @ w["wk"][l].T).reshape(T, KV, hd), fcr, fci)
        v = (h @ w["wv"][l].T).reshape(T, KV, hd)
        heads = []
        for i in range(H):
            g = i // (H // KV)  # run.c: key/value head (h / kv_mul)
            att = q[:, i] @ k[:, g].T / np.sqrt(hd)
            att = np.where(causal, att, -np.inf)
            att = np.exp(att - att.max(-1, keepdims=True))
            heads.append((att / att.sum(-1, keepdims=True)) @ v[:, g])
        x = x + np.concatenate(heads, -1) @ w["wo"][l].T
        h = rmsnorm(x, w["rms_ffn"][l])
        a = h @ w["w1"][l].T
        x = x + ((a / (1 + np.exp(-a))) * (h @ w["w3"][l].T)) @ w["w2"][l].T
    return rmsnorm(x, w["rms_final"]) @ w["wcls"].T


# ------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def raw():
    return read_raw(BIN)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    return convert_llama2c(BIN, tmp_path_factory.mktemp("stories260K"), tokenizer_path=TOK)


@pytest.fixture(scope="module")
def model(converted):
    return load_model(converted, "cpu", torch.float32)


def new_cache(model, max_len) -> KVCache:
    a = model.args
    return KVCache(a.n_layers, 1, a.n_kv_heads, max_len, a.head_dim, torch.float32, "cpu")


# ------------------------------------------------------------------ tests

def test_config_and_files(converted, raw):
    cfg, _ = raw
    d = converted.parent
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.pth", "tokenizer.bin"]
    assert (d / "tokenizer.bin").read_bytes() == TOK.read_bytes()
    from magicdec.config import ModelArgs
    a = ModelArgs.from_checkpoint_dir(d)
    assert (a.dim, a.intermediate_size, a.n_layers, a.n_heads, a.n_kv_heads, a.vocab_size, a.max_seq_len) == \
        (cfg["dim"], cfg["hidden"], cfg["L"], cfg["H"], cfg["KV"], cfg["vocab"], cfg["seq"])
    assert a.tie_embeddings and a.rope_base == 10000.0 and a.norm_eps == 1e-5 and (a.bos_id, a.eos_id) == (1, 2)
    sd = load_state_dict(converted)
    assert "output.weight" not in sd and all(v.dtype == torch.float32 for v in sd.values())


def test_logits_match_llama2c_forward(model, raw):
    """Our rotate-half model on the permuted weights == llama2.c's interleaved forward on the raw ones."""
    cfg, w = raw
    tokens = [1] + torch.randint(3, cfg["vocab"], (39,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = reference_logits(cfg, w, np.array(tokens))
    with torch.inference_mode():
        ours = model(torch.tensor([tokens]), new_cache(model, 64))[0].double().numpy()
    assert np.abs(ref).max() > 1  # not a degenerate comparison
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)
    # the same logits through chunked prefill + cache (positions > 0 only work if RoPE is right)
    with torch.inference_mode():
        cache = new_cache(model, 64)
        last = prefill(model, cache, torch.tensor([tokens]), chunk=7)[0].double().numpy()
    np.testing.assert_allclose(last, ref[-1], rtol=0, atol=1e-4)


def test_greedy_from_bos_tells_the_known_story(model, raw, converted):
    n_new = 30
    with torch.inference_mode():
        cache = new_cache(model, n_new + 2)
        first = prefill(model, cache, torch.tensor([[1]]), chunk=8).argmax(-1)
        out, count = decode(Decoder(model), cache, first, n_new, eos_ids=[2])
    ids = out[0, :count[0]].tolist()
    # the reference forward agrees token for token (re-run on the whole sequence each step)
    cfg, w = raw
    seq = [1]
    for _ in range(len(ids)):
        seq.append(int(reference_logits(cfg, w, np.array(seq))[-1].argmax()))
    assert ids == seq[1:]
    tok = Llama2cTokenizer(converted.parent / "tokenizer.bin")
    text = tok.decode(ids)
    assert text.startswith(KNOWN_TEXT), text
    # encode is llama2.c's BPE: the known text tokenizes to exactly what the model generated
    assert tok.encode(KNOWN_TEXT) == [1] + ids[:len(tok.encode(KNOWN_TEXT)) - 1]
    assert tok.decode(tok.encode(KNOWN_TEXT)) == KNOWN_TEXT


def test_tokenizer_bytes_and_specials():
    tok = Llama2cTokenizer(TOK)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (512, 1, 2)
    text = "Lily said \"héllo\" 日\n"  # accented and CJK characters only exist as byte-fallback pieces here
    ids = tok.encode(text, bos=False)
    assert ids[0] != 1 and tok.decode(ids) == text
    assert tok.decode([1, *ids, 2]) == text


def one_line_error(match, fn, *args, **kw) -> str:
    with pytest.raises(MagicDecError, match=match) as e:
        fn(*args, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_corrupt_or_truncated_file(tmp_path):
    data = BIN.read_bytes()
    bad = tmp_path / "bad.bin"
    bad.write_bytes(data[:-4])
    one_line_error(r"1056536 bytes .* implies 1056540: the file is truncated", convert_llama2c, bad, tmp_path / "o")
    bad.write_bytes(data + b"\0" * 8)
    one_line_error("longer than its header implies", convert_llama2c, bad, tmp_path / "o")
    bad.write_bytes(data[:10])
    one_line_error("shorter than a llama2.c header", convert_llama2c, bad, tmp_path / "o")
    header = np.frombuffer(data[:28], "<i4").copy()
    header[3] = 0  # n_heads
    bad.write_bytes(header.tobytes() + data[28:])
    one_line_error("impossible llama2.c header", convert_llama2c, bad, tmp_path / "o")
    header[3], header[5] = 8, -512  # claims a separate classifier that the file lacks
    bad.write_bytes(header.tobytes() + data[28:])
    one_line_error("separate classifier.*truncated", convert_llama2c, bad, tmp_path / "o")
    nan = bytearray(data)
    nan[28 + 4 * 100:28 + 4 * 101] = np.array([np.nan], "<f4").tobytes()
    bad.write_bytes(bytes(nan))
    one_line_error("NaN", convert_llama2c, bad, tmp_path / "o")
    one_line_error("no llama2.c checkpoint", convert_llama2c, tmp_path / "missing.bin", tmp_path / "o")
    assert not (tmp_path / "o" / "model.pth").exists()
    # a truncated tokenizer, or one of another vocabulary
    tok = TOK.read_bytes()
    (tmp_path / "tok.bin").write_bytes(tok[:-3])
    one_line_error("truncated or corrupt", Llama2cTokenizer, tmp_path / "tok.bin")
    cut = tmp_path / "tok300.bin"
    at, n = 4, 0
    while n < 300:
        at += 8 + int(np.frombuffer(tok[at + 4:at + 8], "<i4")[0])
        n += 1
    cut.write_bytes(tok[:at])
    one_line_error("300 tokens but .* has vocab 512", convert_llama2c, BIN, tmp_path / "o", tokenizer_path=cut)
    assert not (tmp_path / "o" / "model.pth").exists()


def test_command_line(tmp_path):
    import importlib.util

    out = tmp_path / "ckpt"
    spec = importlib.util.spec_from_file_location("convert_hf_checkpoint", REPO / "convert_hf_checkpoint.py")
    convert_hf_checkpoint = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert_hf_checkpoint)
    convert_hf_checkpoint.main(["--llama2c", str(BIN), "--llama2c_tokenizer", str(TOK), "--checkpoint_dir", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.pth", "tokenizer.bin"]
    # a bad file: one line on stderr, exit status 2
    shutil.copyfile(TOK, tmp_path / "not_a_model.bin")
    r = subprocess.run([sys.executable, str(REPO / "convert_hf_checkpoint.py"), "--llama2c",
                        str(tmp_path / "not_a_model.bin"), "--checkpoint_dir", str(tmp_path / "x")],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
