"""The cost model against hand-computed values and against step times measured on GPUs (committed records)."""
import json
from dataclasses import replace
from pathlib import Path

import pytest

from magicdec.analysis import cost_model as cm
from magicdec.model import draft_weights as dw
from magicdec.config import ModelArgs

RESULTS = Path(__file__).resolve().parent / "fixtures" / "records"
L31 = ModelArgs.from_name("meta-llama/Meta-Llama-3.1-8B")


def test_bytes_by_hand():
    # Llama-3.1-8B: 8.03e9 parameters; the LM head (128256 x 4096) counts once, the embedding lookup not at all.
    assert cm.weight_bytes(L31) == 2 * (8_030_261_248 - 128256 * 4096)
    assert cm.kv_bytes_per_token(L31) == 2 * 2 * 32 * 8 * 128  # 128 KiB per token


def test_omega():
    assert cm.omega(0.0, 3) == 1.0 and cm.omega(1.0, 3) == 4.0
    assert cm.omega(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)


def test_long_context_makes_speculation_pay():
    """KV reads grow with the context while the draft's stay at the budget: the speedup rises with prefix and B,
    and there is a critical length below which self-speculation loses (MagicDec's central claim)."""
    d = cm.Device(bandwidth=3e12, matmul_flops=7e14)
    s = [cm.predict(L31, d, 32, p, 3, 0.8, 512)["speedup"] for p in (2048, 8192, 32768, 100_000)]
    assert s == sorted(s) and s[0] < 1 < s[-1]
    crit = cm.critical_length(L31, d, 32, 3, 0.8, 512)
    assert cm.predict(L31, d, 32, crit, 3, 0.8, 512)["speedup"] > 1 > cm.predict(L31, d, 32, crit - 256, 3, 0.8, 512)["speedup"]


def measured(path):
    return json.loads((RESULTS / path).read_text())


@pytest.mark.parametrize("path,B,prefix,ranks", [
    ("h100_llama31_8b_baseline_B13_32k.json", 13, 32768, 1),  # copies of committed H100 records (results/)
    ("h100_llama31_8b_baseline_B8_32k.json", 8, 32768, 1),
    ("h100_llama31_8b_baseline_B7_64k.json", 7, 65536, 1),
])
def test_bandwidth_bound_steps_match_the_gpu(path, B, prefix, ranks):
    """With the copy bandwidth measured in the same run, the predicted step time of the bandwidth-bound baseline is
    within 10% of the measured one."""
    r = measured(path)
    m = r["metrics"]
    d = cm.Device(bandwidth=m.get("copy_bandwidth_GBps", r.get("copy_bandwidth_GBps")) * 1e9, matmul_flops=7e14,
                  ranks=ranks)
    predicted = cm.step_time(L31, d, B, prefix + 32)  # mid-generation context
    assert predicted == pytest.approx(m["ms_per_step"] / 1e3, rel=0.10)


def test_tensor_parallel_steps_pay_their_all_reduces_per_layer():
    """A forward on 4 ranks: the bytes and FLOPs divided by 4, plus the profile's all-reduce seconds per layer for 4
    ranks (32 layers); one rank pays none, and ranks the profile has no figure for pay none."""
    d = cm.Device(3e12, 7e14, 50e-6, collective_s_per_layer={4: 30e-6})
    one = cm.step_time(L31, d, 16, 100_000)
    assert cm.step_time(L31, replace(d, ranks=4), 16, 100_000) == pytest.approx(
        (one - 32 * 50e-6) / 4 + 32 * (50e-6 + 30e-6))
    assert cm.step_time(L31, replace(d, ranks=2), 16, 100_000) == pytest.approx((one - 32 * 50e-6) / 2 + 32 * 50e-6)


def test_the_committed_profile_reads_its_all_reduce_figure():
    device, _, raw = cm.load_profile(cm.PROFILES / "h100.json")
    assert device.collective_s_per_layer == {int(k): v for k, v in raw["collective_s_per_layer"].items()}
    assert 0 < device.collective_s_per_layer[4] < 1e-3


def test_a_trees_verification_pays_its_fixed_cost_by_ranks():
    """Device.tree_verify_s {ranks: seconds}: a tree's T_V is the step at the tree's size plus the figure for its
    ranks, one GPU's where its ranks have none (0 where neither); a chain's T_V pays none."""
    from magicdec.model.tree import Tree

    d = cm.Device(3e12, 7e14, 50e-6, tree_verify_s={1: 1e-3, 4: 3e-3})
    tree = Tree.branches(5, 2)
    assert tree.size == 11
    for ranks, extra in ((1, 1e-3), (4, 3e-3), (2, 1e-3)):
        dr = replace(d, ranks=ranks)
        assert cm.tree_verify_seconds(dr) == extra
        t = cm.predict(L31, dr, 4, 4096, 5, 0.7, 0, tree=tree, sibling_rates=(0.3,))
        assert t["T_V"] == pytest.approx(cm.step_time(L31, dr, 4, 4096, 11) + extra, rel=1e-12)
        assert t["T_V_over_T_T"] == pytest.approx(t["T_V"] / t["T_T"])
        chain = cm.predict(L31, dr, 4, 4096, 5, 0.7, 0)
        assert chain["T_V"] == cm.step_time(L31, dr, 4, 4096, 6)
        assert chain == cm.predict(L31, replace(dr, tree_verify_s={}), 4, 4096, 5, 0.7, 0)
    assert cm.tree_verify_seconds(replace(d, tree_verify_s={4: 3e-3}, ranks=2)) == 0.0
    assert cm.tree_verify_seconds(cm.Device(3e12, 7e14)) == 0.0
    bare = replace(d, tree_verify_s={})
    assert cm.predict(L31, bare, 4, 4096, 5, 0.7, 0, tree=tree, sibling_rates=(0.3,))["T_V"] == cm.step_time(
        L31, bare, 4, 4096, 11)


def test_a_profiles_tree_figures_are_keyed_by_ranks():
    assert cm.by_ranks({"tree_verify_s": {"1": 0.0007, "4": 0.0027}}, "tree_verify_s") == {1: 0.0007, 4: 0.0027}
    assert all(type(k) is int for k in cm.by_ranks({"tree_verify_s": {"2": 1}}, "tree_verify_s"))
    assert cm.by_ranks({}, "tree_verify_s") == {} and cm.by_ranks({"tree_verify_s": None}, "tree_verify_s") == {}


def test_the_committed_profile_reads_its_tree_figures():
    device, _, raw = cm.load_profile(cm.PROFILES / "h100.json")
    assert device.tree_verify_s == {int(k): v for k, v in raw["tree_verify_s"].items()}
    assert {1, 2, 4} <= set(device.tree_verify_s)
    assert all(0 < device.tree_verify_s[n] < 10e-3 for n in (1, 2, 4))
    assert 0 < device.collective_s_per_layer[2] < 1e-3


def flops(B, context, T=1):
    """Llama-3.1-8B by hand: 2 FLOPs per weight and token, and QK plus PV over the context (32 layers x 32 heads x 128)."""
    return 2 * B * T * ((8_030_261_248 - 128256 * 4096) + 2 * 32 * 32 * 128 * context)


def test_rescale_ranks_keeps_the_unmodelled_time():
    """A step measured at TP=4 moved to TP=8: the bytes and FLOPs part halves (by hand: the weights and
    2 * 8 * 128 KiB * 32 * 32768 of KV over the bandwidth, plus the FLOPs over the matmul rate), the time the model
    does not count stays."""
    d = cm.Device(bandwidth=4e12, matmul_flops=8e14)
    work = (cm.weight_bytes(L31) + 32 * 32768 * 131072) / 4e12 + flops(32, 32768) / 8e14
    measured = work / 4 + 0.002
    assert cm.rescale_ranks(measured, L31, d, 32, 32768, 1, 4, 8) == pytest.approx(work / 8 + 0.002)
    assert cm.rescale_ranks(measured, L31, d, 32, 32768, 1, 4, 4) == pytest.approx(measured)
    assert cm.rescale_ranks(work / 8, L31, d, 32, 32768, 1, 4, 8) == pytest.approx(work / 8)  # faster than the model: no negative rest


def test_step_time_adds_bytes_and_flops():
    """A verification of 5 tokens for 48 sequences over 4K: its bytes (13.6 ms at 3 TB/s) and its FLOPs (5.9 ms at
    700 TFLOP/s) are of the same order, and the step costs their sum: the larger of the two alone made such steps as
    cheap as one token's, where the H100 measured 1.13-1.33 times that (results/planner_sweeps, Llama-3.1-8B 4096 x 48,
    gamma 2-4)."""
    d = cm.Device(bandwidth=3e12, matmul_flops=7e14)
    bytes_s = (cm.weight_bytes(L31) + 48 * 4096 * 131072) / 3e12
    flops_s = flops(48, 4096, 5) / 7e14
    assert bytes_s == pytest.approx(13.59e-3, rel=0.01) and flops_s == pytest.approx(5.88e-3, rel=0.01)
    assert cm.step_time(L31, d, 48, 4096, 5) == pytest.approx(bytes_s + flops_s)


def test_fixed_cost_per_layer_fitted_to_a_measured_step():
    """Llama-3.1-8B at B = 1 over 272 cached tokens on a 3 TB/s, 700 TFLOP/s device reads 2 * (8.03e9 - 128256 *
    4096) weight bytes + 272 * 128 KiB of KV (5.0152 ms) and does 2 FLOPs per weight plus attention's (0.0216 ms):
    5.0368 ms. A measured 8.0 ms step leaves 2.9632 ms for 32 layers; a step faster than its bytes allow leaves
    nothing (never a negative cost)."""
    d = cm.Device(bandwidth=3e12, matmul_flops=7e14)
    work = (2 * (8_030_261_248 - 128256 * 4096) + 272 * 131072) / 3e12 + flops(1, 272) / 7e14
    assert work == pytest.approx(5.0368e-3, rel=1e-4)
    per_layer = cm.fit_layer_overhead(L31, d, 1, 272, 8.0e-3)
    assert per_layer == pytest.approx((8.0e-3 - work) / 32)
    fitted = cm.Device(d.bandwidth, d.matmul_flops, per_layer)
    assert cm.step_time(L31, fitted, 1, 272) == pytest.approx(8.0e-3)
    assert cm.step_time(L31, fitted, 16, 32768) == pytest.approx(
        32 * per_layer + (cm.weight_bytes(L31) + 16 * 32768 * 131072) / 3e12 + flops(16, 32768) / 7e14)
    assert cm.fit_layer_overhead(L31, d, 1, 272, 4.0e-3) == 0.0


def test_fixed_cost_per_verification():
    """Self-speculation at B = 1 over 1024 tokens, budget 256, gamma 1, on a 3 TB/s, 700 TFLOP/s device with 60 us
    per layer: by hand, a draft step reads the weights and 256 tokens of KV, the verification's target step 1024
    tokens' KV for 2 tokens. A measured verification 0.5 ms longer than those two steps fits T_O = 0.5 ms, and
    T_O enters the speedup's denominator as T_O / T_T; a verification faster than its steps fits nothing."""
    d = cm.Device(bandwidth=3e12, matmul_flops=7e14, layer_overhead_s=60e-6)
    W = 2 * (8_030_261_248 - 128256 * 4096)

    def step(context, T=1):
        return (W + context * 131072) / 3e12 + flops(1, context, T) / 7e14 + 32 * 60e-6

    t_t, t_d, t_v = step(1024), step(256), step(1024, 2)
    t_o = cm.fit_verify_overhead(L31, d, 1, 1024, 1, 256, None, t_d + t_v + 0.5e-3)
    assert t_o == pytest.approx(0.5e-3)
    p = cm.predict(L31, cm.Device(3e12, 7e14, 60e-6, verify_overhead_s=t_o), 1, 1024, 1, 0.8, 256)
    assert p["T_O_over_T_T"] == pytest.approx(0.5e-3 / t_t)
    assert p["speedup"] == pytest.approx(1.8 / ((t_d + t_v + 0.5e-3) / t_t))
    assert cm.verification_cost(p, 1) == pytest.approx((t_d + t_v + 0.5e-3) / t_t)
    assert cm.fit_verify_overhead(L31, d, 1, 1024, 1, 256, None, t_d + t_v - 1e-4) == 0.0
    # a StreamingLLM ring with 256 slots written ahead: the draft step reads 512 slots of KV, the others as before
    ring = cm.predict(L31, d, 1, 1024, 1, 0.8, 256, ring_extra=256)
    assert ring["T_D"] == pytest.approx(step(512)) and ring["T_V"] == pytest.approx(t_v)
    assert cm.predict(L31, d, 1, 1024, 1, 0.8, 0, ring_extra=256)["T_D"] == pytest.approx(t_t)  # budget 0: full cache


def test_sampled_decoding_adds_its_rows_of_logits():
    """Sampled decoding turns B rows of logits into probabilities per plain or draft step and B * (gamma + 1) per
    verification, each row vocab_size logits at the device's seconds per logit; greedy steps are unchanged."""
    d = cm.Device(bandwidth=3e12, matmul_flops=7e14, layer_overhead_s=60e-6, sampling_s_per_logit=2e-10)
    B, gamma, V = 16, 3, 128256
    greedy = cm.predict(L31, d, B, 8192, gamma, 0.8, 512)
    sampled = cm.predict(L31, d, B, 8192, gamma, 0.8, 512, sampled=True)
    assert sampled["T_T"] == pytest.approx(greedy["T_T"] + B * V * 2e-10)
    assert sampled["T_D"] == pytest.approx(greedy["T_D"] + B * V * 2e-10)
    assert sampled["T_V"] == pytest.approx(greedy["T_V"] + B * (gamma + 1) * V * 2e-10)
    assert greedy == cm.predict(L31, replace(d, sampling_s_per_logit=0.0), B, 8192, gamma, 0.8, 512)


def test_measure_sampling_is_the_samplers_seconds_per_logit(monkeypatch):
    """The probe runs the run's own sampler (sampling.next_token at the run's temperature and top-p) on whole rows of
    the vocabulary, `logits` of them in all (1M: 32 rows of 32000), once to warm up and twice timed, and divides the
    timed seconds by the calls and the logits: a clock reading 0.3 s across the two timed calls gives
    0.3 / 2 / (32 x 32000). The clock is a fake one, so the machine's speed and load do not enter the check."""
    from types import SimpleNamespace

    from magicdec import device as dev
    from magicdec.decoding import sampling
    calls, real = [], sampling.next_token

    def recording(logits, *args):
        calls.append((tuple(logits.shape), args))
        return real(logits, *args)

    readings = iter([100.0, 100.3])
    monkeypatch.setattr(sampling, "next_token", recording)
    monkeypatch.setattr(dev, "time", SimpleNamespace(perf_counter=lambda: next(readings)))
    per_logit = cm.measure_sampling("cpu", 32000, 0.6, 0.9, logits=1 << 20)
    assert calls == [((32, 32000), (0.6, 0.9, 0))] * 3
    assert per_logit == pytest.approx(0.3 / 2 / (32 * 32000), rel=1e-9)


def test_offloaded_step_is_bound_by_the_host_link():
    """Llama-2-7B (MHA: 512 KiB of KV per token) at 128K, 2 of 32 layers on chip: 30 layers' prompt KV, 60 GiB, over
    a 25 GB/s link is 2.6 s, far beyond the on-GPU step; all on chip, nothing crosses."""
    l2 = ModelArgs.from_name("meta-llama/Llama-2-7b-hf")
    d = cm.Device(bandwidth=3e12, matmul_flops=7e14)
    copy = 30 * 131072 * 2 * 2 * 4096 / 25e9  # layers x tokens x (K, V) x bf16 x 32 heads of 128
    assert cm.offloaded_step_time(l2, d, 1, 131072, 1, 2, 25e9) == pytest.approx(copy)
    assert copy == pytest.approx(2.58, rel=0.01)
    assert cm.offloaded_step_time(l2, d, 1, 131072, 1, 32, 25e9) == cm.step_time(l2, d, 1, 131072, 1)


def test_draft_weight_formats_by_measured_kernel_time():
    """A draft's weight matmuls in a low-bit format take the device's measured ratio to bf16's at the step's rows M
    (linear between measured row counts, the nearest beyond them), the KV part unchanged; past 32 rows the run uses
    the bf16 weights; without a measurement, the format's bytes over bf16's. Llama-3.1-8B per layer: qkv 6144 x 4096,
    o 4096 x 4096, gate/up 2 x 14336 x 4096, down 4096 x 14336, and the 128256 x 4096 head once."""
    d = cm.Device(bandwidth=3e12, matmul_flops=7e14, weight_kernels={"fp8": {1: 0.5, 13: 0.6, 26: 0.7}})
    assert cm.weight_time_ratio(L31, d, "fp8", 7) == pytest.approx(0.55)
    assert cm.weight_time_ratio(L31, d, "fp8", 30) == pytest.approx(0.7)
    assert cm.weight_time_ratio(L31, d, "fp8", 33) == 1.0 and cm.weight_time_ratio(L31, d, "bf16", 1) == 1.0
    shapes = [(6144, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
    bf16 = sum(2 * n * k for n, k in shapes)
    int4 = sum(n * k // 2 + 4 * n * k // 128 for n, k in shapes)  # half a byte, fp16 scale and zero per 128
    assert cm.weight_time_ratio(L31, d, "int4", 1) == pytest.approx(int4 / bf16)
    assert cm.weight_time_ratio(L31, d, "int8", 1) == pytest.approx(sum(n * k + 4 * n for n, k in shapes) / bf16)

    matmuls = cm.weight_bytes(L31) / 3e12 + 2 * 13 * cm.weight_bytes(L31, 1) / 7e14
    kv = 13 * 512 * 131072 / 3e12 + 2 * 13 * 2 * 32 * 32 * 128 * 512 / 7e14
    assert cm.step_time(L31, d, 13, 512) == pytest.approx(matmuls + kv)
    assert cm.step_time(L31, d, 13, 512, weights="fp8") == pytest.approx(0.6 * matmuls + kv)
    p = cm.predict(L31, d, 13, 32768, 3, 0.8, 512, draft_weights="fp8")
    assert p["T_D"] == pytest.approx(0.6 * matmuls + kv) and p["T_T"] == cm.step_time(L31, d, 13, 32768)


def test_committed_profile_holds_the_measured_weight_kernels():
    """The H100 profile's table covers each low-bit format at the draft step's row counts, and the sweep finds it
    by the GPU's name."""
    profile = json.loads((cm.PROFILES / "h100.json").read_text())
    table = cm.weight_kernels_of(profile)
    assert set(table) == {"int8", "fp8", "int4"} and all({1, 13} <= set(t) for t in table.values())
    assert {fmt: max(t) for fmt, t in table.items()} == {fmt: k[-1][0] for fmt, k in dw.KERNELS.items()}
    assert cm.weight_kernels_of(cm.device_profile(profile["device"])) == table


def test_attention_dots_overlap_the_reads_once_their_rate_is_measured():
    """With a measured dot rate, a step's attention takes the longer of its KV reads and its dots: Llama-3.1-8B,
    100K x 4, 64 tokens does 2 * 4 * 64 * 2 * 32 layers * 32 heads * 128 * 100K = 13.4 TFLOP of attention (103 ms at
    130 TFLOP/s) against 52.4 GB of KV (17.5 ms at 3 TB/s); one token's 0.21 TFLOP hide under the same reads. The
    fit recovers the rate that made a set of points."""
    d = cm.Device(bandwidth=3e12, matmul_flops=7e14, attention_flops=130e12)
    attn = 2 * 4 * 64 * 2 * 32 * 32 * 128 * 100_000
    weights = cm.weight_bytes(L31) / 3e12 + 2 * 4 * 64 * cm.weight_bytes(L31, 1) / 7e14
    assert cm.step_time(L31, d, 4, 100_000, 64) == pytest.approx(weights + attn / 130e12)
    reads = 4 * 100_000 * 131072 / 3e12
    one = cm.weight_bytes(L31) / 3e12 + 2 * 4 * cm.weight_bytes(L31, 1) / 7e14 + reads
    assert cm.step_time(L31, d, 4, 100_000, 1) == pytest.approx(one)
    points = [(B, ctx, T, cm.step_time(L31, d, B, ctx, T) / cm.step_time(L31, d, B, ctx, 1))
              for B in (1, 4) for ctx in (32768, 100_000) for T in (8, 32, 64)]
    assert cm.fit_attention_flops(L31, cm.Device(3e12, 7e14), points) == 130e12


def test_the_h100_profile_predicts_its_measured_verifications_within_15_percent():
    """The committed profile against the committed measurements it was fitted to (chains of 1-64 tokens)."""

    d = cm.load_profile(cm.PROFILES / "h100.json")[0]
    rows = [r for f in sorted((RESULTS.parents[2] / "results" / "trees").glob("verify_cost_h100*.json"))
            for r in json.loads(f.read_text())["points"] if r["tree"] is None and r["max_t"] == 64]
    assert len(rows) >= 20
    for r in rows:
        B, ctx, T = r["B"], r["prefix"], r["tokens"]
        predicted = cm.step_time(L31, d, B, ctx, T) / cm.step_time(L31, d, B, ctx, 1)
        assert abs(predicted / r["T_V_over_T_T"] - 1) < 0.15, r


def test_logit_rows_and_linear_time_by_hand():
    """step_time's logit_rows: the LM head's FLOPs and the sampling over those rows only, the rest of the forward
    over all B * T (a head's forward whose LM head reads one row per sequence); linear_time: weights outside a whole
    model, their bytes once and their FLOPs per row."""
    d = cm.Device(bandwidth=2e12, matmul_flops=4e14, layer_overhead_s=3e-5, sampling_s_per_logit=1e-11)
    B, T, lm = 4, 5, L31.vocab_size * L31.dim
    assert cm.step_time(L31, d, B, 4096, T, True, logit_rows=B * T) == cm.step_time(L31, d, B, 4096, T, True)
    fewer = B * (T - 1) * (2 * lm / d.matmul_flops + L31.vocab_size * d.sampling_s_per_logit)
    assert cm.step_time(L31, d, B, 4096, T, True) - cm.step_time(L31, d, B, 4096, T, True, logit_rows=B) == \
        pytest.approx(fewer, rel=1e-9)
    assert cm.linear_time(d, 1000, 8) == pytest.approx(2000 / 2e12 + 16000 / 4e14)
    assert cm.linear_time(replace(d, ranks=4), 1000, 8) == pytest.approx(cm.linear_time(d, 1000, 8) / 4)
    p = cm.predict(L31, d, B, 4096, 3, 0.8, 512)
    q = cm.with_draft_step(p, 3, 1e-3)
    assert q["T_D_over_T_T"] == pytest.approx(1e-3 / p["T_T"])
    assert q["speedup"] == pytest.approx(p["omega"] / cm.verification_cost(q, 3))
    assert cm.without_draft_steps(p, 3) == cm.with_draft_step(p, 3, 0.0)


def test_a_term_measured_on_a_derived_profiles_gpu_is_no_longer_listed_as_copied():
    """measured_here: a whole term leaves derived_from's copied terms, a part (term[key]) is listed as measured here
    and its term stays copied; a profile measured on its own GPU (no derived_from) is left as it is."""
    derived = {"bandwidth": 1.0, "derived_from": {"device": "A", "terms": ["weight_kernels", "tree_verify_s"]}}
    after = cm.measured_here(derived, ["weight_kernels", "tree_verify_s[4]"])
    assert after["derived_from"]["terms"] == ["tree_verify_s"]
    assert after["derived_from"]["measured_here"] == ["tree_verify_s[4]", "weight_kernels"]
    assert derived["derived_from"]["terms"] == ["weight_kernels", "tree_verify_s"]  # not mutated
    assert cm.measured_here({"bandwidth": 1.0}, ["weight_kernels"]) == {"bandwidth": 1.0}


def test_each_gpu_finds_its_own_profile_and_an_unknown_one_the_h100s_said_once(capsys):
    """One rule for the plan and the sweep: a GPU whose committed profile names it gets that file, any other the
    H100's, with a one-line note the first time only."""
    for path in sorted(cm.PROFILES.glob("*.json")):
        assert cm.device_profile_path(json.loads(path.read_text())["device"]) == path
    cm.say_no_profile.cache_clear()
    assert cm.device_profile_path("NVIDIA A100-SXM4-80GB") == cm.PROFILES / "h100.json"
    assert cm.device_profile_path("NVIDIA A100-SXM4-80GB") == cm.PROFILES / "h100.json"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no committed device profile for NVIDIA A100-SXM4-80GB" in err[0]
