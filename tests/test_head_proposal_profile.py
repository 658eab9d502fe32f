"""benchmarks/head_proposal_profile.py: a head proposal's kernels grouped by what they do, and one profiled run per
case. The groups are checked on kernel names written out by hand (CUDA's, as torch.profiler names them); the run on
the CPU (ops, not kernels: a smoke test of the script, no speed claim) profiles exactly the proposals asked for."""
from __future__ import annotations

import json

import pytest
from conftest import benchmark_script

profile = benchmark_script("head_proposal_profile")


@pytest.mark.parametrize("name, group", [
    ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<...>", "sort / scan (top-p)"),
    ("void at::native::tensor_kernel_scan_innermost_dim<float, std::plus<float> >", "sort / scan (top-p)"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "softmax / draw"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "softmax / draw"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "matmul"),
    ("_split_kv_kernel", "attention"),
    ("triton_red_fused_add_mean_mul_pow_rsqrt_0", "norm / RoPE / SwiGLU (fused)"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t>>", "reduce"),
    ("void at::native::index_elementwise_kernel<128, 4>", "gather / index / copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
])
def test_kernels_fall_in_their_groups(name, group):
    assert profile.group(name) == group


def test_a_cpu_run_profiles_the_proposals_asked_for(tmp_path):
    out = tmp_path / "p.json"
    assert profile.main(["--device", "cpu", "--cases", "tiny", "--heads", "medusa", "--head_candidates", "0", "8",
                         "--warm", "3", "--count", "2", "--gen_len", "24", "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["head"], r["head_candidates"]) for r in rows] == [("medusa", 0), ("medusa", 8)]
    for r in rows:
        e = r["eager"]
        assert e["proposals"] == 2 and e["kernel_us_per_proposal"] > 0
        assert e["kernel_us_per_proposal"] == pytest.approx(sum(g["us_per_proposal"] for g in e["groups"].values()))
        assert "cuda_graphs" not in r  # graphs need a GPU
