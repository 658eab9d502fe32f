"""benchmarks/fit_attention_rate.py: verification costs made by hand from the cost model at a known attention rate
(240 TFLOP/s, under the committed H200 profile's other terms) give that rate back, written into a copy of the profile
with its source, the other keys untouched; trees and points past the kernel's range are left out of the fit; bad
input (another GPU's records, a file that is no such record) is one line. And the committed profiles' rates are
what their committed records fit."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import benchmark_script
from magicdec.analysis import cost_model as cm
from magicdec.config import ModelArgs

fit = benchmark_script("fit_attention_rate")
ROOT = Path(__file__).resolve().parent.parent
MODEL = "meta-llama/Meta-Llama-3.1-8B"
L31 = ModelArgs.from_name(MODEL)
H200 = cm.PROFILES / "h200.json"


def records(tmp_path, rate=240e12, gpu="NVIDIA H200"):
    """A tree_verify_cost output whose chains are the model's T_V/T_T at `rate`; a tree and a flex point (max_t 16)
    far off, which the fit must not read."""
    d = replace(cm.load_profile(H200)[0], attention_flops=rate)
    points = [{"prefix": ctx, "B": B, "max_t": 64, "tree": None, "tokens": T,
               "T_V_over_T_T": cm.step_time(L31, d, B, ctx, T) / cm.step_time(L31, d, B, ctx, 1)}
              for ctx in (32768, 100_000) for B in (1, 4) for T in (1, 16, 32, 64)]
    points += [{"prefix": 32768, "B": 1, "max_t": 64, "tree": [-1, 0, 0], "tokens": 3, "T_V_over_T_T": 9.0},
               {"prefix": 32768, "B": 1, "max_t": 16, "tree": None, "tokens": 32, "T_V_over_T_T": 9.0}]
    path = tmp_path / "verify_cost.json"
    path.write_text(json.dumps({"model": MODEL, "environment": {"gpu": gpu, "code": {"commit": "abc1234"}},
                                "points": points}))
    return path


def test_the_rate_that_made_the_points_is_fitted_and_written_beside_the_other_keys(tmp_path, capsys):
    profile = tmp_path / "h200.json"
    shutil.copy(H200, profile)
    assert fit.main([str(records(tmp_path)), "--profile", str(profile), "--write"]) == 0
    assert "240 TFLOP/s" in capsys.readouterr().out
    before, after = json.loads(H200.read_text()), json.loads(profile.read_text())
    assert after["attention_flops"] == 240e12 and "abc1234" in after["attention_flops_source"]
    assert {k: v for k, v in after.items() if not k.startswith(("attention_flops", "derived_from"))} == \
        {k: v for k, v in before.items() if not k.startswith(("attention_flops", "derived_from"))}
    if before.get("derived_from"):  # a derived profile: the rate is now this GPU's own, not copied
        assert "attention_flops" not in after["derived_from"]["terms"]
        assert "attention_flops" in after["derived_from"]["measured_here"]
    assert fit.main([str(records(tmp_path)), "--profile", str(profile)]) == 0  # without --write: nothing written
    assert json.loads(profile.read_text()) == after


@pytest.mark.parametrize("make, says", [
    (lambda p: records(p, gpu="NVIDIA H100 80GB HBM3"), "measured on 'NVIDIA H100 80GB HBM3', the profile is"),
    (lambda p: (p / "x.json").write_text("{}") and p / "x.json", "not benchmarks/tree_verify_cost.py's output"),
    (lambda p: (p / "y.json").write_text("{cut") and p / "y.json", "not a readable record")])
def test_bad_input_is_one_line(tmp_path, make, says):
    path = make(tmp_path)
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fit_attention_rate.py"), str(path),
                          "--profile", str(H200)], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and says in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_the_h200_profiles_rate_is_what_its_committed_records_fit():
    """The committed H200 profile against the committed measurements its rate came from (its source names them)."""
    profile = json.loads(H200.read_text())
    named = [ROOT / w for w in profile["attention_flops_source"].split(":", 1)[0].split(", ")]
    assert all(p.is_file() for p in named), named
    model, points, _ = fit.chain_points(named, profile["device"])
    assert cm.fit_attention_flops(ModelArgs.from_name(model), cm.load_profile(H200)[0], points) == \
        profile["attention_flops"]
