"""A sweep file read into its grid (magicdec/harness/sweep_grid.py): synthetic rates interpolated over the context,
every committed sweep file a valid grid. The grid's points as a sweep runs them, and its bad input, are in
test_sweep.py."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from magicdec.harness import sweep_grid


def test_synthetic_alpha_interpolates_in_log_prefix():
    table = {"4096": 0.84, "100000": 0.79}
    assert sweep_grid.synthetic_alpha(table, 1000) == 0.84 and sweep_grid.synthetic_alpha(table, 200_000) == 0.79
    mid = round(math.exp((math.log(4096) + math.log(100_000)) / 2))
    assert sweep_grid.synthetic_alpha(table, mid) == pytest.approx(0.815, abs=1e-4)
    assert sweep_grid.synthetic_alpha(0.8, 123) == 0.8 and sweep_grid.synthetic_alpha(None, 123) is None


@pytest.mark.parametrize("path", sorted(Path(__file__).resolve().parents[1].glob("experiments/sweeps/*.toml")),
                         ids=lambda p: p.stem)
def test_committed_sweep_configs_load_and_name_no_private_paths(path):
    """Every committed sweep config is a valid grid, with no machine-private path (/tmp) in it."""
    assert "/tmp" not in path.read_text()
    points, _ = sweep_grid.points_of(sweep_grid.load_config(path) | {"step_mode": "eager", "device": "cpu"}, str(path))
    assert points
