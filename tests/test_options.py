"""magicdec/options.py's option values as a command line (what `magicdec plan` prints and the greedy check runs)."""
from __future__ import annotations

from magicdec.options import as_flags


def test_as_flags_writes_switches_bare_lists_as_values_and_leaves_out_none_and_false():
    given = {"draft_budget": 256, "reindex": True, "offload": False, "head_kv": None, "eagle3_layers": [1, 2],
             "synthetic_siblings": (0.61, 0.64), "draft_policy": "snapkv"}
    assert as_flags(given) == ["--draft_budget", "256", "--reindex", "--eagle3_layers", "1", "2",
                               "--synthetic_siblings", "0.61", "0.64", "--draft_policy", "snapkv"]
    assert as_flags({}) == []
