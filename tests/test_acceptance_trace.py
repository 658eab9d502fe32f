"""benchmarks/planner/acceptance_trace.py and benchmarks/planner/policy_replay.py against the real decoder: in fp32 on the CPU, a
verification of gamma drafted tokens keeps exactly the leading run of the positions where the traced draft agreed
with the target, so replaying the trace gives the decoder's own accepted counts, iteration by iteration, for every
gamma; and the traced tokens are plain greedy decoding's."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import TINY_SWEEP, benchmark_script
from magicdec.generate import Draft, Sampling, prefill
from magicdec.kv_cache import KVCache, StreamingCache
from test_generate_speculative import plain_greedy, speculate, tiny_prompts


acceptance_trace, policy_replay = benchmark_script("planner/acceptance_trace"), benchmark_script("planner/policy_replay")


def traced(model, prompts, n, budget, sinks=4):
    a, (B, P) = model.args, prompts.shape
    cache = KVCache(a.n_layers, B, a.n_kv_heads, P + n + 4, a.head_dim, torch.float32, "cpu")
    draft_cache = StreamingCache(a.n_layers, B, a.n_kv_heads, budget, sinks, 64, a.head_dim, torch.float32, "cpu")
    logits = prefill(model, cache, prompts, 64)
    prefill(model, draft_cache, prompts, 64)
    return acceptance_trace.trace(model, cache, logits.argmax(-1), prompts[:, -1], {budget: Draft(model, draft_cache)},
                                  Sampling(), n)


def replayed_counts(trace: np.ndarray, gamma: int, tokens: int) -> list[list[int]]:
    """Per iteration, each sequence's kept drafts (-1 once done), as Decoder(trace=True) records them."""
    accept = policy_replay.traced_acceptance(trace, np.random.default_rng(0))
    made, rows = np.zeros(trace.shape[0], dtype=np.int64), []
    while (made < tokens).any():
        kept = accept(gamma, made)
        rows.append(np.where(made < tokens, kept, -1).tolist())
        made = np.where(made < tokens, made + kept + 1, made)
    return rows


@pytest.mark.parametrize("gamma", [1, 2, 4])
def test_replayed_trace_is_the_decoders_acceptance(tiny, gamma):
    n_new, budget = 40, 20
    with torch.inference_mode():
        tokens, acc = traced(tiny, tiny_prompts(), n_new + 5, budget)
        _, _, decoder = speculate(tiny, tiny, tiny_prompts(), n_new, gamma, budget)
    trace = acc[budget].numpy()
    assert 0 < trace[:, :n_new].mean() < 1  # drafts both kept and rejected: the replay has something to get right
    assert tokens[:, 1:n_new + 1].tolist() == plain_greedy(tiny, tiny_prompts(), n_new).tolist()
    assert replayed_counts(trace, gamma, n_new - 1) == decoder.trace


def test_trace_and_replay_end_to_end(tmp_path, capsys):
    """The scripts on a tiny random sweep: a trace per batch and mode, runs checked against their replay, and a
    replay per batch with every fixed setting and auto; bad input in one line."""
    config = tmp_path / "sweep.toml"
    config.write_text(TINY_SWEEP.replace("budgets = [24]", "budgets = [16, 24]").replace(
        'modes = ["greedy"]', 'modes = ["greedy", "sampled"]') + 'gammas = [1, 2]\nmethods = ["baseline", "selfspec", "auto"]\n')
    records = tmp_path / "records"
    records.mkdir()
    out = tmp_path / "traces.json"
    assert acceptance_trace.main([str(config), str(records), "--prefix_len", "48", "--B", "2", "--skip_tokens", "0",
                                  "--output", str(out)]) == 0
    d = json.loads(out.read_text())
    assert [(r["mode"], sorted(r["acceptance"])) for r in d["batches"]] == [("greedy", ["16", "24"]), ("sampled", ["16", "24"])]
    assert set(d["costs_s"]["greedy"]["24"]) == {"0", "1", "2"}
    assert set(d["batches"][0]["runs"]) == {"b16 g1", "b16 g2", "b24 g1", "b24 g2", "auto"}
    for mode in ("greedy", "sampled"):  # the auto points' plans the replay reads
        (records / f"auto_P48_B2_{mode}.json").write_text(json.dumps(
            {"planner": {"budget": 24, "alpha": 0.8, "spread": 0.05, "alpha_by_budget": {"16": 0.7, "24": 0.8},
                         "spread_by_budget": {"16": 0.06, "24": 0.05}}}))
    result = tmp_path / "replay.json"
    assert policy_replay.main([str(out), "--records", str(records), "--draws", "3", "--output", str(result)]) == 0
    r = json.loads(result.read_text())
    assert {k for b in r["batches"] for k in b["settings"]} == {"b16 g1", "b16 g2", "b24 g1", "b24 g2", "auto"}
    greedy = r["batches"][0]
    assert greedy["checks"]["b24 g2"]["device_iterations"] == greedy["checks"]["b24 g2"]["replayed_iterations"]
    other = tmp_path / "replay_b16.json"  # auto replayed at another budget
    assert policy_replay.main([str(out), "--records", str(records), "--draws", "3", "--budget", "16",
                               "--output", str(other)]) == 0
    o = json.loads(other.read_text())
    assert o["budget"] == 16 and {b["plan"]["budget"] for b in o["batches"]} == {16}
    drafted_at = d["batches"][0]["runs"]["auto"]["budget"]  # compared only where the device's auto drafted at 16
    assert ("auto" in o["batches"][0]["checks"]) == (drafted_at == 16) != ("auto" in greedy["checks"])
    for argv, needle in (([str(tmp_path / "none.json")], "no trace at"), ([str(out), "--budget", "99"], "--budget 99")):
        with pytest.raises(SystemExit) as e:
            policy_replay.main(argv + ["--records", str(records)])
        assert e.value.code == 2 and needle in capsys.readouterr().err.strip().splitlines()[-1]


def test_trace_of_a_draft_model_sweep_is_one_line(tmp_path, capsys):
    config = tmp_path / "sweep.toml"
    config.write_text(TINY_SWEEP + 'draft_name = "JackFram/llama-68m"\nmethods = ["baseline", "longspec", "auto"]\n')
    with pytest.raises(SystemExit) as e:
        acceptance_trace.main([str(config), str(tmp_path), "--prefix_len", "48", "--B", "2", "--skip_tokens", "0",
                               "--output", str(tmp_path / "t.json")])
    assert e.value.code == 2 and "self-speculation sweeps only" in capsys.readouterr().err.strip().splitlines()[-1]
