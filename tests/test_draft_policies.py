"""benchmarks/draft_policies.py: teacher-forced agreement lines the draft's and the target's predictions up on the
same book tokens (a draft that is the target over a full cache agrees everywhere, sum min(p, q) = 1), generation
alpha is the decoder's, and a run writes its JSON, table and plot, which --report remakes from the JSON."""
import json

import pytest
import torch

from conftest import BOOKS, LLAMA2_TOKENIZER, benchmark_script, needs_llama_tokenizers
from magicdec.drafters.model_draft import ModelDraft
from magicdec.decoding.generate import Decoder, prefill
from magicdec.model.kv_cache import KVCache

draft_policies = benchmark_script("draft_policies")


def test_a_draft_that_is_the_target_agrees_everywhere(tiny):
    a, g = tiny.args, torch.Generator().manual_seed(0)
    text = torch.randint(0, 256, (2, 70), generator=g)
    prompts, book = text[:, :60], text[:, 60:]
    with torch.inference_mode():
        cache = KVCache(a.n_layers, 2, a.n_kv_heads, 90, a.head_dim, torch.float32, "cpu")
        full = KVCache(a.n_layers, 2, a.n_kv_heads, 90, a.head_dim, torch.float32, "cpu")
        logits = prefill(tiny, cache, prompts, 64)
        prefill(tiny, full, prompts, 64)
        out = draft_policies.teacher_forced(tiny, cache, ModelDraft(tiny, full), prompts, book, logits)
        assert out["positions"] == 20 and out["teacher_top1"] == 20
        assert out["teacher_min_pq"] == pytest.approx(20, abs=1e-4)
        assert cache.lengths.tolist() == [60, 60]  # rolled back to the prompt
        decoder = Decoder(tiny, drafter=ModelDraft(tiny, full), gamma=3)
        run = draft_policies.generated_alpha(decoder, cache, prompts, logits, gen_len=12, seed=0)
        assert run["examined"] > 0 and run["kept"] == run["examined"]


@needs_llama_tokenizers
def test_run_writes_json_table_and_plot(tmp_path):
    out = tmp_path / "dp.json"
    argv = ["--random_weights", "--model_name", "JackFram/llama-68m", "--tokenizer",
            str(LLAMA2_TOKENIZER), "--dataset", str(BOOKS),
            "--prefix_lens", "64", "--budgets", "40", "--B", "2", "--skip_tokens", "0", "--gen_len", "4",
            "--teacher", "4", "--device", "cpu", "--no_progress", "--output", str(out)]
    assert draft_policies.main(argv) == 0
    result = json.loads(out.read_text())
    assert {(r["policy"], r["budget"]) for r in result["rows"]} == {(p, 40) for p in ("streaming", "snapkv", "retrieval")}
    assert all(r["positions"] == 8 and 0 <= r["teacher_top1"] <= 8 for r in result["rows"])
    table = out.with_suffix(".md").read_text()
    assert table.count("\n") == 2 + 3 and out.with_suffix(".png").stat().st_size > 0
    out.with_suffix(".md").unlink()
    assert draft_policies.main(["--report", str(out)]) == 0 and out.with_suffix(".md").read_text() == table


@needs_llama_tokenizers
def test_quantized_copies_and_the_windows_of_equal_bytes_are_rows(tmp_path):
    """--draft_kv adds a row per copy (budget 0: the whole context); --equal_bytes the windows that read as many bytes
    (llama-68m's 64-dim rows: 36 bytes at 4 bits, 68 at 8, against 128 in bf16; a 64-token prompt)."""
    out = tmp_path / "kv.json"
    argv = ["--random_weights", "--model_name", "JackFram/llama-68m", "--tokenizer", str(LLAMA2_TOKENIZER),
            "--dataset", str(BOOKS), "--prefix_lens", "64", "--budgets", "40", "--policies", "streaming",
            "--draft_kv", "int8", "int4", "--equal_bytes", "--sinks", "4", "--B", "2", "--skip_tokens", "0",
            "--gen_len", "4", "--teacher", "4", "--device", "cpu", "--no_progress", "--output", str(out)]
    assert draft_policies.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["policy"], r["budget"]) for r in rows} == {("kv int8", 0), ("kv int4", 0), ("streaming", 40),
                                                          ("streaming", 64 * 36 // 128), ("streaming", 64 * 68 // 128)}
    assert all(r["positions"] == 8 for r in rows) and out.with_suffix(".png").stat().st_size > 0
