"""benchmarks/greedy_check.py's list of configurations: every registered drafter is checked or said not run with its
reason, trees where a drafter drafts them, and no configuration twice."""
from __future__ import annotations

import pytest

from conftest import benchmark_script
from magicdec import drafters

gc = benchmark_script("greedy_check")


def test_every_drafter_is_checked_or_said_not_run():
    todo, skipped = gc.cases(None)
    checked = {name for name, _ in todo}
    assert checked | set(skipped) == set(drafters.names())
    assert not checked & set(skipped)
    assert skipped == {"rest": "needs --datastore FILE"}
    assert "rest" in {name for name, _ in gc.cases("books.npz")[0]}


def test_trees_where_a_drafter_drafts_them_and_no_configuration_twice():
    todo, _ = gc.cases(None)
    for name, kind in drafters.registry().items():
        runs = [" ".join(f) for n, f in todo if n == name]
        assert any("--tree_width 2" in r for r in runs) == (kind.supports_trees and name != "rest"), name
        assert any("--tree_nodes" in r for r in runs) == kind.drafts_shaped_trees, name
    assert len({(n, tuple(f)) for n, f in todo}) == len(todo)
    hierarchy = [f for n, f in todo if n == "hierarchy"]
    assert all(("--draft" in f) != ("--draft_name" in f) for f in hierarchy)  # one bottom draft each


def test_the_self_drafts_compositions_are_checked():
    """Each low-bit draft weight format as a chain, a width-2 tree and a Sequoia tree, and each quantized KV copy:
    what the planner composes and the atlas reports."""
    runs = [" ".join(f) for n, f in gc.cases(None)[0] if n == "selfspec"]
    for fmt in ("int8", "fp8", "int4"):
        mine = [r for r in runs if f"--draft_weights {fmt}" in r]
        assert len(mine) == 3 and sum("--tree_width 2" in r for r in mine) == 1
        assert sum("--tree_nodes" in r for r in mine) == 1
    assert all(any(f"--draft_kv {kv}" in r for r in runs) for kv in ("int8", "int4"))


def test_compositions_only_are_the_self_drafts_compositions(tmp_path, monkeypatch):
    """--only compositions: the 11 compositions and nothing else; the JSON is rewritten after each configuration,
    so a run cut short keeps the ones it checked."""
    todo, _ = gc.cases(None, only="compositions")
    everything = gc.cases(None)[0]
    assert len(todo) == 11 and all(c in everything for c in todo)
    assert all(n == "selfspec" and ("--draft_weights" in f or "--draft_kv" in f) for n, f in todo)
    written = []
    calls = iter(range(100))

    def fake(argv):
        if next(calls) == 3:
            raise KeyboardInterrupt  # cut short after 2 configurations (the first call is the plain reference)
        return {"generated_ids": [[1, 2]], "metrics": {}}
    monkeypatch.setattr(gc, "quietly", fake)
    monkeypatch.setattr(gc.files, "write_json", lambda path, obj, what: written.append(len(obj["rows"])))
    with pytest.raises(KeyboardInterrupt):
        gc.main(["--device", "cpu", "--only", "compositions", "--output", str(tmp_path / "g.json")])
    assert written == [1, 2]


def test_extras_are_the_forwards_and_compositions_no_example_makes():
    """--only extras: EXTRA's options (EAGLE-2's dynamic trees among them) and COMPOSED's, each once, all of them in
    the full list, and no drafter's plain example."""
    todo, _ = gc.cases(None, only="extras")
    everything = gc.cases(None)[0]
    assert all(c in everything for c in todo) and len(todo) == len(set((n, tuple(f)) for n, f in todo))
    assert len(todo) == len(gc.EXTRA) + len(gc.COMPOSED)
    flags = [" ".join(f) for _, f in todo]
    assert sum("--dynamic_tree_nodes" in f for f in flags) == 2
    assert sum("--draft_weights" in f or "--draft_kv" in f for f in flags) == len(gc.COMPOSED)


def test_match_keeps_the_configurations_an_earlier_call_did_not_reach(tmp_path, monkeypatch):
    """--match: only the configurations whose flags contain one of the texts, in order (here the int4 weights and
    the quantized KV copies); a text no configuration holds is a one-line error before any run."""
    ran = []

    def fake(argv):
        ran.append(" ".join(argv))
        return {"generated_ids": [[1, 2]], "metrics": {}}
    monkeypatch.setattr(gc, "quietly", fake)
    out = tmp_path / "g.json"
    assert gc.main(["--device", "cpu", "--only", "extras", "--match", "draft_weights int4", "draft_kv",
                    "--output", str(out)]) == 0
    checked = ran[1:]  # the first call is the plain reference
    assert len(checked) == 5 and sum("--draft_weights int4" in r for r in checked) == 3
    assert sum("--draft_kv" in r for r in checked) == 2
    ran.clear()
    assert gc.main(["--device", "cpu", "--match", "no_such_flag", "--output", str(out)]) == 2 and not ran
