"""benchmarks/transformers_side_by_side.py on CPU (fp32): every greedy method of both libraries — our baseline,
self-speculation and standalone draft; transformers' dynamic and static cache, assisted generation and prompt lookup;
both batched baselines — produces exactly the tokens of transformers' plain greedy generate, computed here from the
same prompts as the independent reference, and every measurement has its tokens/s."""
from __future__ import annotations

import json

import torch
import transformers

from conftest import REPO, benchmark_script

SCRIPT = REPO / "benchmarks" / "transformers_side_by_side.py"
N = 16
SMALL = ("--random_prompts", "--prefix_lens", "64", "--batch_sizes", "1", "2", "--gen_len", str(N), "--budgets", "24",
         "--sinks", "4", "--gammas", "2", "--save_tokens")
OURS = {"baseline", "selfspec", "standalone_draft", "prompt_lookup"}
THEIRS_B1 = {"dynamic", "static", "assisted (its defaults)", "prompt_lookup"}


def run(tmp_path, capsys, *argv) -> dict:
    """The script's main in this process (its summary.json written, its table printed)."""
    verbosity = transformers.logging.get_verbosity()
    try:
        benchmark_script("transformers_side_by_side").main([*SMALL, "--device", "cpu", "--no_progress",
                                                            "--output_dir", str(tmp_path), *argv])
    finally:
        transformers.logging.set_verbosity(verbosity)
    assert "| B | prefix | library | method |" in capsys.readouterr().out  # the markdown table
    return json.loads((tmp_path / "summary.json").read_text())


def greedy_reference(hf, prompts: torch.Tensor) -> list:
    """transformers' own greedy generate, EOS ignored (all methods make N tokens)."""
    with torch.no_grad():
        out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=N, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[:, prompts.shape[1]:].tolist()


def check(summary: dict, hf) -> None:
    assert summary["environment"]["transformers"] == transformers.__version__
    records = summary["records"]
    for B in (1, 2):
        expected = greedy_reference(hf, torch.tensor(summary["prompts"][f"P64_B{B}"]))
        assert len(expected[0]) == N
        timed = [r for r in records if r["B"] == B and "tokens" in r]
        methods = {(r["library"], r["method"].split(" (gamma")[0]) for r in timed}
        if B == 1:
            assert {("magicdec", m) for m in OURS} | {("transformers", m) for m in THEIRS_B1} <= methods, methods
            assert ("transformers", "assisted") in methods  # at our best gamma
        else:
            assert methods == {("magicdec", "baseline"), ("transformers", "static")}, methods
        for r in timed:
            assert r["tokens"] == expected, (r["library"], r["method"])
            assert r["agreement_with_our_baseline"] == 1.0
            assert r["metrics"]["decode_tokens_per_s"] > 0, r
    # the interleaved rounds: each library's fastest of each kind, three rounds, every one greedy-exact
    rounds, = [r for r in records if r["method"] == "interleaved rounds"]
    methods = rounds["metrics"]["methods"]
    assert {"ours: baseline", "ours: prompt_lookup", "ours: standalone_draft"} <= set(methods), methods
    assert any(m.startswith("transformers: prompt_lookup") for m in methods)
    assert any(m.startswith("transformers: assisted") for m in methods)
    assert any(m in ("transformers: dynamic", "transformers: static") for m in methods)
    for m in methods.values():
        assert len(m["tokens_per_s"]) == 3 and m["min"] <= m["median"] <= m["max"]
        assert m["agreement_with_our_baseline"] == 1.0
    gen_len = rounds["metrics"]["methods"]["ours: baseline"]["tokens_equal_to_our_baseline"][1]
    for name, m in methods.items():  # fp32 on a CPU: both libraries agree on every token; each names its clock
        assert m["tokens_equal_to_our_baseline"] == [gen_len, gen_len]
        assert m["clock"].startswith("decode only: t(generate" if name.startswith("transformers") else
                                     "decode only: timing.timed_generations")
    lookup = rounds["metrics"]["ratios"]["ours: prompt_lookup / ours: baseline"]
    per_round = lookup["per_round"]  # ratios() is checked by hand below; here: one per round, summarized
    assert len(per_round) == 3 and (lookup["min"], lookup["median"], lookup["max"]) == tuple(sorted(per_round))
    compiled = [r for r in records if r["method"] == "static+compiled"]
    assert compiled and all("CUDA only" in r["error"] for r in compiled)  # no compile on CPU, and it says why
    assert all(r.get("error") or r["metrics"]["decode_tokens_per_s"] > 0 for r in records if r is not rounds)


def test_ratios_are_each_rounds_speeds_divided():
    """a / b per round (the same round's runs), with their median, min and max, by hand; a pair with a method not
    timed is left out."""
    script = benchmark_script("transformers_side_by_side")
    result = {"a": {"tokens_per_s": [30.0, 12.0, 50.0]}, "b": {"tokens_per_s": [10.0, 8.0, 20.0]}}
    assert script.ratios(result, [("a", "b"), ("a", "c")]) == {
        "a / b": {"per_round": [3.0, 1.5, 2.5], "median": 2.5, "min": 1.5, "max": 3.0}}


def test_checkpoint_side_by_side(tiny_hf, tmp_path, capsys):
    """A converted checkpoint: transformers loads our model.pth through the inverse rename, ours shares its tensors."""
    hf, path = tiny_hf("llama", num_hidden_layers=4)
    summary = run(tmp_path, capsys, "--model", str(path), "--draft_layers", "1")
    assert summary["random_weights"] is False and summary["draft_layers"] == 1
    check(summary, hf)


def test_random_weights_side_by_side(tmp_path, monkeypatch):
    """--random_weights: transformers' model is built at a known model's shapes (here a tiny one with Llama-3.1's
    RoPE scaling and tied embeddings, registered for the test) and ours gets its tensors by the rename. The reference
    rebuilds transformers' model from the same seed and its own config, independently of the script."""
    import importlib.util

    from magicdec.config import KNOWN_MODELS, ModelArgs

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}  # head_dim 16: every branch of the scaling is used by 64 tokens
    tiny = ModelArgs(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=96,
                     rope_base=10000.0, rope_scaling=rope, max_seq_len=512, tie_embeddings=True, bos_id=1, eos_id=2)
    monkeypatch.setitem(KNOWN_MODELS, "test/tiny-llama3", tiny)
    spec = importlib.util.spec_from_file_location("side_by_side", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    verbosity = transformers.logging.get_verbosity()
    try:
        summary = script.main([*SMALL, "--random_weights", "--model_name", "test/tiny-llama3", "--device", "cpu",
                               "--no_progress", "--output_dir", str(tmp_path)])
    finally:
        transformers.logging.set_verbosity(verbosity)
    assert summary["random_weights"] is True and summary["draft_layers"] == 1
    assert json.loads((tmp_path / "summary.json").read_text())["records"] == json.loads(json.dumps(summary["records"]))
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=96, rope_theta=10000.0,
                                      rope_scaling=dict(rope), max_position_embeddings=512, tie_word_embeddings=True,
                                      attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    check(summary, hf)


def test_agreement_counts_the_leading_tokens_equal_to_our_baseline():
    """Two rows parting from our baseline after 3 and 1 of 4 tokens: 3 and 1 equal leading tokens, mean 2 of 4."""
    import torch

    script = benchmark_script("transformers_side_by_side")
    ref = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    tokens = torch.tensor([[1, 2, 3, 9], [5, 9, 7, 8]])
    assert script.common_prefix(tokens, ref).tolist() == [3, 1]
    assert script.agreement(tokens, ref) == 0.5
