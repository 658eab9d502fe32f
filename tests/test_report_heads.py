"""magicdec/harness/report_heads.py (`magicdec report heads-acceptance`): the heads' acceptance and speedup against the context from sweep records,
one row per (decoding, drafter) at the gamma asked for (lookup and the self-draft at theirs), each cell the record's
own α / Ω / speedup; records written here by hand."""
from __future__ import annotations

import json

from magicdec.harness import report_heads as plot
def record(folder, method, label, decoding, prefix, gamma, alpha, omega, speedup):
    r = {"method": method, "label": label, "decoding": decoding, "prefix_len": prefix, "B": 8, "gamma": gamma,
         "metrics": {"alpha": alpha, "acceptance_length": omega, "measured_speedup": speedup}}
    (folder / f"{label.replace(' ', '-')}_{prefix}_{decoding}_g{gamma}.json").write_text(json.dumps(r))


def test_rows_are_each_drafters_records_at_the_gamma_asked_for(tmp_path):
    greedy, sampled = tmp_path / "g", tmp_path / "s"
    greedy.mkdir()
    sampled.mkdir()
    (greedy / "baseline_1024.json").write_text(json.dumps({"method": "baseline", "metrics": {}}))
    record(greedy, "eagle", "eagle h", "greedy", 1024, 2, 0.5, 1.75, 1.2)
    record(greedy, "eagle", "eagle h", "greedy", 8000, 2, 0.4, 1.56, 1.1)
    record(greedy, "eagle", "eagle h", "greedy", 8000, 3, 0.9, 3.0, 9.9)  # another gamma: left out
    record(greedy, "lookup", "lookup n3", "greedy", 8000, 4, 0.6, 2.2, 1.3)  # lookup at its own gamma
    record(sampled, "hydra", "hydra h", "sampled", 1024, 2, 0.45, 1.65, 1.05)
    out = tmp_path / "acc"
    assert plot.main([str(greedy), str(sampled), "--gamma", "2", "--output", str(out)]) == 0
    lines = out.with_suffix(".md").read_text().splitlines()
    assert lines[0] == "| decoding | drafter | γ | 1024 α / Ω / speedup | 8000 α / Ω / speedup |"
    assert lines[2:] == ["| greedy | eagle h | 2 | 0.500 / 1.75 / 1.200× | 0.400 / 1.56 / 1.100× |",
                         "| greedy | lookup n3 | 4 | — | 0.600 / 2.20 / 1.300× |",
                         "| sampled | hydra h | 2 | 0.450 / 1.65 / 1.050× | — |"]
    assert out.with_suffix(".png").stat().st_size > 0
