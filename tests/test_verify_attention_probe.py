"""benchmarks/verify_attention_probe.py on the CPU: every candidate that runs here (the split-KV kernel interpreted,
FlexAttention's reference path, SDPA) agrees with float64 attention over the mask written out by hand, the check
catches a candidate that ignores the tree, and bad input is one line."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import verify_attention_probe as probe  # noqa: E402


def test_every_candidate_matches_float64_attention_for_chains_and_trees(tmp_path):
    out = tmp_path / "probe.json"
    assert probe.main(["--device", "cpu", "--shapes", "2x160", "--tokens", "1", "5", "9", "--rounds", "1",
                       "--output", str(out)]) == 0
    rec = json.loads(out.read_text())
    seen = {(r["T"], r["layout"], r["candidate"]) for r in rec["rows"]}
    for name in ("triton", "flex", "sdpa"):
        assert {(1, "chain", name), (5, "chain", name), (5, "tree", name), (9, "tree", name)} <= seen
    assert all(r["max_abs_error"] < 1e-4 and r["matches_float64"] for r in rec["rows"]), rec["rows"]
    assert rec["timing"].startswith("wall clock") and rec["environment"]


def test_the_hand_mask_is_a_tree_not_a_chain_and_a_kernel_without_it_fails_the_check():
    T, S = 9, 64
    tree = probe.tree_of(T)
    assert tree.parents == (-1, 0, 0, 0, 0, 1, 1, 1, 1)  # two depths of four candidates
    mask = probe.hand_mask(T, S, tree)
    assert mask[5, S - T + 1] and not mask[5, S - T + 2] and not mask[2, S - T + 1]  # node 5's parent is 1, not 2
    q, k, v, q_pos = probe.inputs(1, S, T, torch.device("cpu"), torch.float32)
    want = probe.reference(q, k, v, mask)
    as_chain = probe.candidates(q_pos, S, None, torch.device("cpu"))["sdpa"](q, k, v)[0].double()
    as_tree = probe.candidates(q_pos, S, probe.tree_mask(tree, q_pos), torch.device("cpu"))["sdpa"](q, k, v)[0].double()
    assert (as_tree - want).abs().max() < 1e-5 and (as_chain - want).abs().max() > 1e-2


def test_a_candidate_that_fails_is_recorded_and_the_others_are_timed(monkeypatch):
    def broken(q, k, v, layer=None):
        raise RuntimeError("no kernel for this mask")
    real = probe.candidates
    monkeypatch.setattr(probe, "candidates", lambda *a, **kw: real(*a, **kw) | {"broken": broken})
    limits = probe.cm.Device(bandwidth=1e9, matmul_flops=1e9)
    rows = probe.probe_shape(1, 64, [4], ["tree"], 1, torch.device("cpu"), torch.float32, limits, ("sdpa",))
    assert {r["candidate"]: r.get("error") for r in rows} == {"sdpa": None, "broken": "RuntimeError: no kernel for "
                                                              "this mask"}
    timed = next(r for r in rows if r["candidate"] == "sdpa")
    assert timed["matches_float64"] and timed["seconds"] > 0


def test_another_checkouts_kernel_is_checked_and_timed_beside_this_ones(tmp_path):
    """--before: a copy of this checkout's kernel file stands for an older checkout; it is loaded under its own name
    (not this package's module) and checked against float64 like every candidate."""
    old = tmp_path / "old" / "magicdec" / "model"
    old.mkdir(parents=True)
    (old / "triton_attention.py").write_text((ROOT / "magicdec" / "model" / "triton_attention.py").read_text())
    module = probe.load_before(tmp_path / "old")
    assert module.__file__ == str(old / "triton_attention.py") and module is not probe.attention
    out = tmp_path / "probe.json"
    assert probe.main(["--device", "cpu", "--shapes", "1x160", "--tokens", "5", "--layouts", "tree", "--rounds", "1",
                       "--candidates", "triton", "--before", str(tmp_path / "old"), "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["candidate"] for r in rows} == {"triton", "triton_before"}
    assert all(r["matches_float64"] for r in rows), rows


@pytest.mark.parametrize("args, says", [(["--shapes", "4by100"], "--shapes 4by100: give BxS"),
                                        (["--tokens", "65"], "1 to 64 query tokens"),
                                        (["--rounds", "0"], "--rounds 0: at least 1"),
                                        (["--before", "/nonexistent"], "--before /nonexistent: no magicdec/model")])
def test_bad_input_is_one_line(args, says):
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "verify_attention_probe.py"), "--device", "cpu",
                        *args], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and says in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
