"""The trial sequence (magicdec/harness/trial.py) on a tiny random model on CPU: greedy speculation through it gives a plain
autoregressive loop's tokens; the record's speedup is the median of its rounds' paired ratios and the kept run the
median by rate, recomputed here from the rounds; an engine handed a prompt source and a model loader uses them."""
from __future__ import annotations

import statistics

import pytest
import torch

from magicdec.config import KNOWN_MODELS, ModelArgs
from magicdec.harness.engine import Engine
from magicdec.model.forward_plan import LAST_LOGITS
from magicdec.model.kv_cache import KVCache
from magicdec.harness.run_config import RunConfig
from magicdec.harness.trial import build, Trial

SHAPES = ModelArgs(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128,
                   max_seq_len=512, bos_id=1, eos_id=2)
B, PREFIX, GEN = 2, 40, 10


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setitem(KNOWN_MODELS, "test/trial-small", SHAPES)
    return {"random_weights": True, "model_name": "test/trial-small", "B": B, "prefix_len": PREFIX, "gen_len": GEN,
            "device": "cpu", "dtype": "float32", "ignore_eos": True, "progress": False}


def plain_greedy(model, prompts: torch.Tensor, n: int) -> torch.Tensor:
    """n greedy tokens, each from a fresh forward over the whole sequence so far: no cache is reused or rolled back."""
    a, seq, out = model.args, prompts, []
    for _ in range(n):
        cache = KVCache(a.n_layers, seq.shape[0], model.n_kv_heads, seq.shape[1], a.head_dim, torch.float32, "cpu")
        token = model(seq, cache, LAST_LOGITS)[:, -1].argmax(-1)
        out.append(token)
        seq = torch.cat([seq, token[:, None]], 1)
    return torch.stack(out, 1)


def test_a_speculative_trial_gives_plain_decodings_tokens_and_the_median_of_paired_rounds(small):
    cfg = RunConfig.from_options(small | {"drafter": "selfspec", "draft_budget": 16, "sinks": 4, "gamma": [2],
                                          "baseline": True, "repeats": 3})
    trial = build(cfg)
    result = trial.run()
    with torch.inference_mode():
        reference = plain_greedy(trial.engine.target, trial.batch.prompts, GEN)
    assert torch.equal(result.out[:, :GEN], reference)
    assert result.counts.tolist() == [GEN] * B
    m, base = result.metrics, result.baseline
    assert m["gamma"] == 2 and "gamma_chosen_by" not in m  # one gamma: nothing chosen
    for record in (m, base):  # each round's rate: its decoded tokens over its seconds; the kept run: the median rate
        rates, seconds = record["round_tokens_per_s"], record["round_s"]
        assert len(rates) == len(seconds) == 3
        assert rates == pytest.approx([B * (GEN - 1) / s for s in seconds])
        assert record["decode_s"] == seconds[sorted(range(3), key=lambda k: rates[k])[1]]
    ratios = [a / b for a, b in zip(m["round_tokens_per_s"], base["round_tokens_per_s"])]
    assert m["measured_speedup"] == pytest.approx(statistics.median(ratios))
    assert m["measured_speedup_range"] == pytest.approx([min(ratios), max(ratios)])


def test_a_baseline_trial_is_the_plain_loop_and_records_no_baseline(small):
    trial = build(RunConfig.from_options(small | {"repeats": 2}))
    result = trial.run()
    with torch.inference_mode():
        reference = plain_greedy(trial.engine.target, trial.batch.prompts, GEN)
    assert torch.equal(result.out[:, :GEN], reference)
    assert result.metrics is result.baseline and result.by_gamma == {}
    assert len(result.metrics["round_s"]) == 2


def test_an_engine_takes_a_prompt_source_and_a_model_loader(small):
    """The given prompts are the ones prefilled, a given loader makes each model once (the engine keeps it), and a
    given source's dataset is not the engine's to check (a dataset folder that is not there is never read)."""
    cfg = RunConfig.from_options(small | {"dataset": "/nonexistent/books"})
    given = torch.randint(3, SHAPES.vocab_size, (B, PREFIX), generator=torch.Generator().manual_seed(5))
    made = []

    def load(config, checkpoint, shard, flag):
        from magicdec.model.transformer import build_model

        made.append(flag)
        return build_model(config, "cpu", torch.float32, random_seed=0)

    engine = Engine(cfg, prompts=lambda c: (given[:c.workload.B], None, "given"), load=load)
    engine.check(cfg)
    engine.load_target()
    assert engine.load(engine.target_config, None, None, "--model") is engine.target
    assert made == ["--model"]
    trial = Trial(engine, cfg)
    assert torch.equal(trial.batch.prompts, given) and trial.batch.prompt_source == "given"
    assert trial.batch.cache.max_len >= PREFIX + GEN
