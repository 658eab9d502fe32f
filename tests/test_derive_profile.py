"""benchmarks/derive_profile.py: a new GPU's profile takes the bandwidth, matmul rate and per-layer cost its sweeps
measured (hand-made baseline records here, their medians worked out by hand), copies the rest from the base profile
and says so; records of several GPUs, of a tensor-parallel world, or none at all are refused in one line."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from magicdec.analysis import cost_model as cm

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "derive_profile.py"
spec = importlib.util.spec_from_file_location("derive_profile", SCRIPT)
derive_profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(derive_profile)


def baseline(folder: Path, name: str, gpu: str, bandwidth: float, flops: float, overhead: float, ranks: int = 1,
             at: str = "2026-11-28T07:00:00") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps({
        "point": name, "method": "baseline", "recorded_at": at, "environment": {"gpu": gpu, "code": {"commit": "abc"}},
        "device_model": {"bandwidth": bandwidth, "matmul_flops": flops, "layer_overhead_s": overhead,
                         "ranks": ranks}}))


def test_the_measured_terms_are_the_sweeps_medians_and_the_rest_the_base_profiles(tmp_path):
    # two sweeps (three measurements: one sweep resumed), each baseline carrying its sweep's measurement
    baseline(tmp_path / "a", "b1", "NVIDIA H200", 4.0e12, 8.0e14, 5.0e-5)
    baseline(tmp_path / "a", "b2", "NVIDIA H200", 4.0e12, 8.0e14, 5.0e-5)
    baseline(tmp_path / "a", "b3", "NVIDIA H200", 4.4e12, 7.0e14, 4.0e-5, at="2026-11-28T08:00:00")
    baseline(tmp_path / "b", "b1", "NVIDIA H200", 4.2e12, 9.0e14, 6.0e-5)
    (tmp_path / "b" / "not_a_record.json").write_text("{broken")
    out = tmp_path / "h200.json"
    assert derive_profile.main([str(tmp_path / "a"), str(tmp_path / "b"), "--base", str(cm.PROFILES / "h100.json"),
                                "--output", str(out)]) == 0
    p = json.loads(out.read_text())
    base = json.loads((cm.PROFILES / "h100.json").read_text())
    # the medians of the three distinct measurements, each term on its own
    assert (p["bandwidth"], p["matmul_flops"], p["layer_overhead_s"]) == (4.2e12, 8.0e14, 5.0e-5)
    assert p["device"] == "NVIDIA H200" and p["measured"] == "2026-11-28T08:00:00"
    assert p["weight_kernels"] == base["weight_kernels"] and p["tree_verify_s"] == base["tree_verify_s"]
    assert p["derived_from"]["device"] == base["device"]
    assert {"weight_kernels", "tree_verify_s", "collective_s_per_layer", "attention_flops"} <= set(
        p["derived_from"]["terms"])
    assert not {"bandwidth", "matmul_flops", "layer_overhead_s"} & set(p["derived_from"]["terms"])
    device = cm.load_profile(out)[0]  # the planner reads it
    assert device.bandwidth == 4.2e12 and device.layer_overhead_s == 5.0e-5


@pytest.mark.parametrize("case,message", [
    ("two_gpus", "several GPUs"), ("tensor_parallel", "one-GPU sweeps"), ("none", "no baseline record"),
    ("base_gpu", "nothing to derive")])
def test_records_that_cannot_make_a_profile_are_refused_in_one_line(tmp_path, capsys, case, message):
    folder = tmp_path / "r"
    folder.mkdir()
    if case == "two_gpus":
        baseline(folder, "a", "NVIDIA H200", 4e12, 8e14, 5e-5)
        baseline(folder, "b", "NVIDIA A100-SXM4-80GB", 2e12, 3e14, 6e-5)
    elif case == "tensor_parallel":
        baseline(folder, "a", "NVIDIA H200", 4e12, 8e14, 5e-5, ranks=4)
    elif case == "base_gpu":
        baseline(folder, "a", "NVIDIA H100 80GB HBM3", 3e12, 8e14, 5e-5)
    out = tmp_path / "p.json"
    assert derive_profile.main([str(folder), "--base", str(cm.PROFILES / "h100.json"), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and not out.exists()


def test_the_committed_h200_profile_is_the_h200_sweeps_measurement():
    """magicdec/analysis/profiles/h200.json, as the command in its source made it from the records it names."""
    p = json.loads((cm.PROFILES / "h200.json").read_text())
    again = derive_profile.derive([Path(__file__).resolve().parents[1] / "results/planner_sweeps/tree_switching_h200"],
                                  json.loads((cm.PROFILES / "h100.json").read_text()), p["derived_from"]["profile"])
    assert {k: again[k] for k in ("device", "bandwidth", "matmul_flops", "layer_overhead_s")} == \
        {k: p[k] for k in ("device", "bandwidth", "matmul_flops", "layer_overhead_s")}


def test_a_kernel_table_measured_on_the_new_gpu_is_its_own(tmp_path):
    """The kernel table written into a derived profile (benchmarks/draft_weight_kernels.py --profile, here from a
    committed probe's rows) is no longer listed among the base GPU's terms."""
    baseline(tmp_path / "a", "b1", "NVIDIA H200", 4.0e12, 8.0e14, 5.0e-5)
    out = tmp_path / "h200.json"
    derive_profile.main([str(tmp_path / "a"), "--base", str(cm.PROFILES / "h100.json"), "--output", str(out)])
    assert "weight_kernels" in json.loads(out.read_text())["derived_from"]["terms"]
    kernels_spec = importlib.util.spec_from_file_location("draft_weight_kernels",
                                                          SCRIPT.parent / "draft_weight_kernels.py")
    kernels = importlib.util.module_from_spec(kernels_spec)
    kernels_spec.loader.exec_module(kernels)
    probe = Path(__file__).resolve().parents[1] / "results/draft_weights/probe/kernels_h100_all.json"
    assert kernels.main(["--from_probe", str(probe), "--profile", str(out)]) == 0
    p = json.loads(out.read_text())
    assert "weight_kernels" not in p["derived_from"]["terms"]
    assert p["derived_from"]["measured_here"] == ["weight_kernels"]
    assert p["weight_kernels"]["source"] == [str(probe)]
