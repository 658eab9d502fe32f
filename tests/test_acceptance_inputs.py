"""magicdec/analysis/acceptance_inputs.py: an acceptance file read into each option's Acceptance (a bare rate, or its
rates in detail), what a random-weight run draws from it, and bad input in one line naming the entry."""
from __future__ import annotations

import json

import pytest

from magicdec.analysis import cost_model as cm
from magicdec.analysis.acceptance_inputs import IID_LABEL, Acceptance, load_acceptance
from magicdec.errors import MagicDecError


def test_a_bare_rate_and_a_detailed_entry(tmp_path):
    f = tmp_path / "a.json"
    f.write_text(json.dumps({"_meta": {"anything": 1}, "lookup": 0.5,
                             "selfspec --tree_width 2": {"alpha": 0.8, "siblings": [0.4], "sequence_factors": [0.5, 1.5],
                                                         "source": "SmolLM2"},
                             "hierarchy": {"alpha": 0.9, "bottom": 0.55, "positions": [0.95, 0.9]}}))
    got = load_acceptance(f)
    assert set(got) == {"lookup", "selfspec --tree_width 2", "hierarchy"}  # _meta is not read
    assert got["lookup"] == Acceptance(0.5, source="a.json: lookup")
    tree = got["selfspec --tree_width 2"]
    assert (tree.siblings, tree.sequence_factors, tree.source) == ((0.4,), (0.5, 1.5), "SmolLM2")
    assert tree.run_options(tree=True) == {"synthetic_acceptance": 0.8, "synthetic_siblings": [0.4],
                                           "synthetic_sequence_factors": [0.5, 1.5]}
    assert tree.run_options(tree=True, shaped=False) == {"synthetic_acceptance": 0.8, "synthetic_siblings": [0.4]}
    h = got["hierarchy"]
    assert h.bottom == 0.55 and h.run_options(tree=False) == {"synthetic_acceptance": 0.9,
                                                              "synthetic_positions": [0.95, 0.9]}
    # per-position rates as the chain rate that yields as much over gamma tokens (positions past the list at alpha)
    assert h.chain_alpha(3) == pytest.approx(cm.positions_alpha((0.95, 0.9), 0.9, 3))
    assert Acceptance(0.7).source == IID_LABEL and load_acceptance(None) == {}


@pytest.mark.parametrize("given, message", [
    ({"lookup": 1.5}, "'lookup' 1.5: an acceptance rate must be a number in [0, 1]"),
    ({"lookup": True}, "an acceptance rate must be a number"),
    ({"lookup": {"siblings": [0.3]}}, "'lookup': give a rate or {"),
    ({"lookup": {"alpha": 0.5, "colour": "blue"}}, ", not 'colour'"),
    ({"lookup": {"alpha": 0.5, "siblings": 0.3}}, "give a list of rates in [0, 1]"),
    ({"lookup": {"alpha": 0.5, "trace": ""}}, "trace '': give a record's path"),
    ({"lookup": {"alpha": 0.5, "sequence_factors": [-1]}}, "sequence_factors [-1]: give a list of numbers >= 0"),
    ([0.5], "give a JSON object mapping option labels"),
])
def test_bad_entries_are_one_line_naming_the_flag_and_entry(tmp_path, given, message):
    f = tmp_path / "a.json"
    f.write_text(json.dumps(given))
    with pytest.raises(MagicDecError) as e:
        load_acceptance(f, "--plan_acceptance")
    assert message in str(e.value) and str(e.value).startswith(f"--plan_acceptance {f}") and "\n" not in str(e.value)


def test_a_file_that_is_no_json_is_one_line(tmp_path):
    f = tmp_path / "a.json"
    f.write_text("{not json")
    with pytest.raises(MagicDecError, match="--acceptance .*a.json: cannot read it as JSON"):
        load_acceptance(f)
