"""benchmarks/planner/refit_cost_model.py on hand-written records: a device whose layers cost 90 us each beyond their bytes,
a B = 1 baseline timed on it, and speculative points whose measured speedups are what such a device gives (computed
here by hand from bytes, bandwidth and Omega_eff). Fitted to the baseline, the fixed cost comes back as 90 us and
every point's error as zero; the recorded predictions (made with 25 us) are off by what 65 us per layer changes."""
import json
from pathlib import Path

import pytest

from conftest import benchmark_script

from magicdec.config import ModelArgs

refit_cost_model = benchmark_script("planner/refit_cost_model")

L31 = ModelArgs.from_name("meta-llama/Meta-Llama-3.1-8B")
BW, FLOPS, PER_LAYER = 3e12, 7e14, 90e-6
WEIGHTS, KV_TOKEN = 2 * (8_030_261_248 - 128256 * 4096), 131072  # bytes (see test_cost_model)


def step(B, context, layer_s=PER_LAYER, T=1):
    """bytes / bandwidth + FLOPs / matmul rate (2 per weight and token, QK and PV over the context: 32 layers x 32
    heads x 128) + 32 fixed costs"""
    flops = 2 * B * T * (WEIGHTS / 2 + 2 * 32 * 32 * 128 * context)
    return (WEIGHTS + B * context * KV_TOKEN) / BW + flops / FLOPS + 32 * layer_s


def write(d: Path, verify_s: float = 0.0):
    d.mkdir()
    common = dict(model=L31.name, draft_model=None, gen_len=64, decoding="greedy")
    dm = {"bandwidth": BW, "matmul_flops": FLOPS, "layer_overhead_s": 25e-6, "ranks": 1}
    recs = {"baseline_P4096_B1_greedy": dict(method="baseline", prefix_len=4096, B=1, budget=None, gamma=None,
                                             device_model=dm, metrics={"ms_per_step": 1e3 * step(1, 4096 + 32)})}
    for P, B, gamma, omega_eff in ((4096, 1, 2, 2.4), (32768, 16, 3, 2.8)):
        ctx = P + 32
        # the draft's StreamingLLM ring reads its 512 budget slots plus 256 written ahead (runs.ring_extra_for(64, 3))
        t_t, t_d, t_v = step(B, ctx), step(B, 512 + 256), step(B, ctx, T=gamma + 1)
        measured = omega_eff / ((gamma * t_d + t_v + verify_s) / t_t)
        old = step(B, ctx, 25e-6)
        recorded = omega_eff / (gamma * step(B, 512, 25e-6) / old + step(B, ctx, 25e-6, gamma + 1) / old)
        recs[f"selfspec_P{P}_B{B}_greedy_b512_g{gamma}"] = dict(
            method="selfspec", prefix_len=P, B=B, budget=512, gamma=gamma, metrics={
                "measured_speedup": measured, "alpha": 0.8, "omega_effective": omega_eff,
                "cost_model": {"speedup_effective": recorded, "device_model": dm}})
    for name, r in recs.items():
        (d / f"{name}.json").write_text(json.dumps({"point": name, **common, **r}))


def test_refit_recovers_the_fixed_cost_and_the_measured_speedups(tmp_path, capsys):
    write(tmp_path / "l31")
    out = tmp_path / "refit.json"
    assert refit_cost_model.main([str(tmp_path / "l31"), "--output", str(out)]) == 0
    (r,) = json.loads(out.read_text())
    assert r["fitted_layer_overhead_us"] == pytest.approx(90.0, rel=1e-6)
    assert r["refitted"] == {"within_10pct": 2, "of": 2, "median_error": pytest.approx(0.0, abs=1e-9)}
    errors = {q["point"]: q["recorded_prediction"] / q["measured"] - 1 for q in r["points"]}
    # at B = 1 draft and target steps both read the weights and pay the same fixed cost: their ratio barely moves; at
    # 32K x 16 the draft's step is mostly fixed cost, and 25 us makes it look 20% cheaper than it is
    assert abs(errors["selfspec_P4096_B1_greedy_b512_g2"]) < 0.01 and errors["selfspec_P32768_B16_greedy_b512_g3"] > 0.05
    assert "| l31 | baseline_P4096_B1_greedy" in capsys.readouterr().out


def test_refit_recovers_a_fixed_cost_per_verification(tmp_path):
    """The same device, but every verification also costs 2 ms beyond its steps: fitted to the B = 1 point, T_O
    comes back as 2 ms and predicts the 32K x 16 point (a 28 ms target step) exactly, which the per-layer cost
    alone overstates by more than 3% (2 ms of a 58 ms verification)."""
    write(tmp_path / "l31", verify_s=2e-3)
    out = tmp_path / "refit.json"
    assert refit_cost_model.main([str(tmp_path / "l31"), "--output", str(out)]) == 0
    (r,) = json.loads(out.read_text())
    assert r["fitted_layer_overhead_us"] == pytest.approx(90.0, rel=1e-6)
    assert r["fitted_verify_overhead_us"] == {"selfspec": pytest.approx(2000.0, rel=1e-6)}
    assert r["refitted"]["median_error"] == pytest.approx(0.0, abs=1e-9) and r["refitted"]["within_10pct"] == 2
    q = next(q for q in r["points"] if q["point"] == "selfspec_P32768_B16_greedy_b512_g3")
    assert q["refitted_without_T_O_prediction"] > q["measured"] * 1.03


def test_unknown_model_name_is_one_line(tmp_path):
    write(tmp_path / "smol")
    f = tmp_path / "smol" / "baseline_P4096_B1_greedy.json"
    f.write_text(f.read_text().replace(L31.name, "Smollm2 135M 8k Lc100K Mix1 Ep2"))
    with pytest.raises(SystemExit) as e:
        refit_cost_model.main([str(tmp_path / "smol")])
    assert e.value.code != 0


def test_refit_recovers_the_cost_of_sampling(tmp_path):
    """Sampled decoding on the same device, each row of logits costing 200 ps per logit to sample: a sampled
    baseline step at 32K x 16 is 16 * 128256 logits slower than the greedy one, and a sampled gamma-3 verification
    samples 16 rows per draft step and 16 * 4 in its target step. Fitted to the pair of baselines, the cost comes
    back as 200 ps and predicts the sampled point exactly; without it the point is overstated."""
    d, per_logit, V = tmp_path / "l31", 200e-12, 128256
    write(d)
    common = dict(model=L31.name, draft_model=None, gen_len=64, decoding="sampled")
    ctx, B, gamma, omega_eff = 32768 + 32, 16, 3, 2.8
    rows = B * V * per_logit  # seconds to sample one token position of the batch
    recs = {"baseline_P32768_B16_greedy": dict(common, decoding="greedy", method="baseline", metrics={"ms_per_step": 1e3 * step(B, ctx)}),
            "baseline_P32768_B16_sampled": dict(common, method="baseline", metrics={"ms_per_step": 1e3 * (step(B, ctx) + rows)})}
    t_t, t_d, t_v = step(B, ctx) + rows, step(B, 512 + 256) + rows, step(B, ctx, T=gamma + 1) + (gamma + 1) * rows
    recs["selfspec_P32768_B16_sampled_b512_g3"] = dict(common, method="selfspec", budget=512, gamma=gamma, metrics={
        "measured_speedup": omega_eff / ((gamma * t_d + t_v) / t_t), "alpha": 0.8, "omega_effective": omega_eff})
    for name, r in recs.items():
        (d / f"{name}.json").write_text(json.dumps({"point": name, "prefix_len": 32768, "B": B, **r}))
    out = tmp_path / "refit.json"
    assert refit_cost_model.main([str(d), "--output", str(out)]) == 0
    (r,) = json.loads(out.read_text())
    assert r["fitted_sampling_ps_per_logit"] == pytest.approx(200.0, rel=1e-6)
    assert r["sampling_calibration_points"] == ["baseline_P32768_B16"]
    q = next(q for q in r["points"] if q["point"] == "selfspec_P32768_B16_sampled_b512_g3")
    assert q["refitted_prediction"] == pytest.approx(q["measured"], rel=1e-9)
    assert q["refitted_without_sampling_prediction"] > q["measured"] * 1.01
    assert r["refitted"]["within_10pct"] == 3
    md = tmp_path / "refit.md"  # the same numbers as a markdown section, split by decoding and batch size
    assert refit_cost_model.main([str(d), "--markdown", str(md)]) == 0
    text = md.read_text()
    assert f"--markdown {md}" in text and "| l31 | baseline_P4096_B1_greedy" in text
    assert "| l31 | sampled | 16 | 1/1 | +0.0% |" in text and "| l31 | greedy | 16 | 1/1 | +0.0% |" in text
