"""magicdec plan: the ranking against kind.predict and the finishing-time rule computed here, the baseline where
nothing promises enough, every registered drafter listed, one-line errors, the JSON written whole."""
import json

import numpy as np
import pytest

from magicdec import cli, drafters
from magicdec.analysis import acceptance_inputs, cost_model as cm
from magicdec.analysis.planner import finish_verifications, spread_alphas
from magicdec.config import ModelArgs
from magicdec.errors import MagicDecError
from magicdec.harness import plan_command
from magicdec.harness.run_config import RunConfig

POINT = ["--B", "4", "--prefix_len", "32768", "--gen_len", "32", "--alpha", "0.8", "--siblings", "0.6", "0.5",
         "--gammas", "2", "4"]


def plan(argv):
    return plan_command.plan(plan_command.parser().parse_args(argv))


@pytest.fixture(scope="module")
def whole():
    return plan(POINT)


def test_ranking_is_sorted_and_its_top_is_what_the_cost_model_gives(whole):
    speedups = [r["speedup"] for r in whole["ranking"]]
    assert speedups == sorted(speedups, reverse=True)
    assert [r["rank"] for r in whole["ranking"]] == list(range(1, len(speedups) + 1))
    top = whole["ranking"][0]
    assert top["drafter"] != "baseline" and whole["choice"] == top["label"]
    # independently: the option's run config, its drafter's prediction, the batch's finishing time at each gamma
    device, overheads, _ = cm.load_profile(cm.PROFILES / "h100.json")
    device = cm.Device(**(vars(device) | {"verify_overhead_s": overheads.get(top["drafter"], 0.0)}))
    target, B, tokens = ModelArgs.from_name("meta-llama/Meta-Llama-3.1-8B"), 4, 31
    best = 0.0
    for g in (2, 4):
        opts = {"random_weights": True, "model_name": "meta-llama/Meta-Llama-3.1-8B", "B": B, "prefix_len": 32768,
                "gen_len": 32, "device": "cpu", "dtype": "bfloat16", "drafter": top["drafter"], "gamma": [g],
                "synthetic_acceptance": 0.8, "synthetic_siblings": [0.6, 0.5]} | top["config"]
        try:
            cfg = RunConfig.from_options(opts, strict=False)
            cfg.check()
        except MagicDecError:
            continue
        p = cfg.drafter.predict(cfg, target, {}, device, 0.8, g, cfg.lookahead, {"alpha_bottom_to_middle": 0.8})
        tree = cfg.speculation.tree_width > 1 or cfg.speculation.tree_nodes
        a = cm.chain_alpha(p["omega"], g) if tree else 0.8
        n = finish_verifications([g], spread_alphas(a, 0.0, B), np.full(B, tokens))[0]
        best = max(best, tokens / (n * cm.verification_cost(p, g)))
    assert top["speedup"] == pytest.approx(best, rel=1e-6)


def test_every_registered_drafter_is_listed(whole):
    listed = {r["drafter"] for r in whole["ranking"] + whole["not_ranked"]}
    assert listed == set(drafters.names()) | {"baseline"}
    standalone = [r for r in whole["not_ranked"] if r["drafter"] == "standalone"]
    assert standalone and "--draft_name" in standalone[0]["reason"]  # no draft shapes named: said, not ranked


def test_options_that_do_not_fit_are_dropped_with_the_reason():
    result = plan(["--B", "12", "--prefix_len", "32768", "--alpha", "0.8", "--gammas", "2",
                   "--only", "drafter=selfspec,draft_kv=int8", "--only", "drafter=selfspec,draft_budget=256"])
    assert [r["options"] for r in result["not_ranked"]] == ["--draft_kv int8"]
    assert result["not_ranked"][0]["reason"].startswith("does not fit in 80 GiB")
    assert [r["options"] for r in result["ranking"] if r["drafter"] != "baseline"] == ["--draft_budget 256"]
    roomier = plan(["--B", "12", "--prefix_len", "32768", "--alpha", "0.8", "--gammas", "2", "--memory_gib", "141",
                    "--only", "drafter=selfspec,draft_kv=int8"])
    assert roomier["not_ranked"] == [] and "--draft_kv int8" in [r["options"] for r in roomier["ranking"]]


def test_baseline_first_where_no_option_promises_the_margin():
    result = plan(["--B", "64", "--prefix_len", "2048", "--gen_len", "16", "--alpha", "0.1", "--gammas", "1", "2",
                   "--only", "drafter=selfspec,draft_budget=256", "--only", "drafter=lookup,ngram_max=3"])
    assert result["choice"] == "baseline" and result["ranking"][0]["speedup"] == 1.0
    assert all(r["speedup"] < plan_command.NEVER_LOSES_MARGIN for r in result["ranking"])


def test_acceptance_file_per_option_and_options_without_input(tmp_path):
    rates = tmp_path / "acceptance.json"
    rates.write_text(json.dumps({"selfspec --draft_budget 256": 0.9,
                                 "lookup": {"alpha": 0.5, "positions": [0.7, 0.4]}}))
    result = plan(["--B", "1", "--prefix_len", "8192", "--gammas", "3", "--acceptance", str(rates),
                   "--only", "drafter=selfspec,draft_budget=256", "--only", "drafter=lookup",
                   "--only", "drafter=selfspec,draft_budget=1024"])
    by_label = {r["label"]: r for r in result["ranking"]}
    assert by_label["selfspec --draft_budget 256"]["omega"] == pytest.approx(cm.omega(0.9, 3))
    assert by_label["lookup"]["omega"] == pytest.approx(1 + 0.7 + 0.7 * 0.4 + 0.7 * 0.4 * 0.5)
    assert [(r["label"], r["reason"]) for r in result["not_ranked"]] == [
        ("selfspec --draft_budget 1024", "no acceptance input")]


def test_acceptance_file_source_trace_and_meta(tmp_path, capsys):
    """An entry's source is what the acceptance column shows; its trace is a path beside the file (read only by a
    run that replays it); the producer's _meta is not read; any other key is a one-line error."""
    rates = tmp_path / "rates" / "acceptance.json"
    rates.parent.mkdir()
    rates.write_text(json.dumps({"_meta": {"command": "made by hand"},
                                 "lookup": {"alpha": 0.5, "source": "SmolLM2, 8K prompt", "trace": "t/run.json"}}))
    with pytest.raises(SystemExit):
        cli.main(["plan", "--gammas", "3", "--acceptance", str(rates), "--only", "drafter=lookup"])
    assert "t/run.json: cannot read it" in capsys.readouterr().err  # a chain's plan replays its trace
    (rates.parent / "t").mkdir()
    (rates.parent / "t" / "run.json").write_text(json.dumps({"acceptance_trace": {"gammas": [3], "accepted": [[1]]}}))
    assert cli.main(["plan", "--gammas", "3", "--acceptance", str(rates), "--only", "drafter=lookup"]) == 0
    assert "acceptance: SmolLM2, 8K prompt" in capsys.readouterr().out
    entry = acceptance_inputs.load_acceptance(rates)["lookup"]
    assert entry.source == "SmolLM2, 8K prompt" and entry.trace == rates.parent / "t" / "run.json"
    assert entry.run_options(tree=False) == {"synthetic_acceptance": 0.5, "acceptance_trace": str(entry.trace)}
    rates.write_text(json.dumps({"lookup": {"alpha": 0.5, "colour": "blue"}}))
    with pytest.raises(MagicDecError, match="'lookup': give a rate or .*, not 'colour'$"):
        acceptance_inputs.load_acceptance(rates)


@pytest.mark.parametrize("argv, message", [
    (["--alpha", "0.8", "--profile", "/no/such/profile.json"], "--profile /no/such/profile.json: cannot read it"),
    (["--alpha", "1.5"], "--alpha 1.5: an acceptance rate"),
    (["--alpha", "0.8", "--B", "0"], "--B 0: give a positive count"),
    ([], "no acceptance input: give --alpha"),
    (["--alpha", "0.8", "--only", "drafter=lookahead,tree_width=2"], "--tree_width with --drafter lookahead"),
    (["--alpha", "0.8", "--only", "drafter=eagle,draft_weights=int8"], "--draft_weights is an option of"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: " + message) and err.count("\n") == 1


def test_json_output_is_written_whole(tmp_path, capsys):
    out = tmp_path / "ranking.json"
    assert cli.main(["plan", "--alpha", "0.8", "--gammas", "3", "--output", str(out),
                     "--only", "drafter=selfspec,draft_budget=256", "--only", "drafter=lookup"]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [p.name for p in tmp_path.iterdir()] == ["ranking.json"]  # no temp file left beside it
    assert result["choice"] == result["ranking"][0]["label"] and f"choice: {result['choice']}" in printed
    assert {r["drafter"] for r in result["ranking"]} == {"baseline", "selfspec", "lookup"}


def test_the_margin_puts_the_baseline_over_a_small_predicted_gain():
    row = lambda s: {"drafter": "lookup", "label": f"lookup {s}", "speedup": s}  # noqa: E731
    ranked, _ = plan_command.rank([row(1.01), row(0.9)])
    assert [r["label"] for r in ranked] == ["baseline", "lookup 1.01", "lookup 0.9"]
    ranked, _ = plan_command.rank([row(1.03), row(0.9)])
    assert [r["label"] for r in ranked] == ["lookup 1.03", "baseline", "lookup 0.9"]


def test_a_drafter_verifying_trees_draws_its_level_rate_on_its_first_candidate(tmp_path):
    """Lookahead verifies a tree of guesses and its acceptance is measured per level: a synthetic run keeps a level
    at that level's rate only if the later guesses are never kept (every rank at the rate would keep a level more
    often), its first guess at the measured rate of each level (one rate for all drew 0.6 where 0.5 was measured)."""
    rates = tmp_path / "acceptance.json"
    rates.write_text(json.dumps({"lookahead": {"alpha": 0.6, "positions": [0.5, 0.7]}}))
    point = {"random_weights": True, "model_name": "JackFram/llama-68m", "B": 2, "prefix_len": 300, "gen_len": 10,
             "device": "cpu", "dtype": "float32"}
    planner = plan_command.Planner(point, plan_command.Inputs(cm.PROFILES / "h100.json", rates, gammas=(2,),
                                                              synthetic=True))
    cfg = planner.config("lookahead", {"ngram_size": 3, "guesses": 2}, 2, shaped=True)
    assert cfg.speculation.synthetic_acceptance == 0.6 and tuple(cfg.speculation.synthetic_siblings) == (0.0,)
    assert cfg.speculation.synthetic_positions == (0.5, 0.7)  # the first guess's rate per level
    wide = plan_command.Planner(point, plan_command.Inputs(cm.PROFILES / "h100.json", rates, gammas=(4,),
                                                           synthetic=True))  # a window of 4: still 2 levels
    ranking = wide.ranking([{"drafter": "lookahead", "ngram_size": 3, "guesses": 2}])["ranking"]
    row = next(r for r in ranking if r["drafter"] == "lookahead")
    assert row["omega"] == pytest.approx(1 + 0.5 + 0.5 * 0.7)  # its 2 levels at their rates
    chain = planner.config("lookup", {"ngram_max": 2}, 2, shaped=True)  # a chain keeps what it was given
    assert not chain.speculation.synthetic_siblings


def test_eagle2s_dynamic_tree_is_ranked_at_the_gammas_it_fits():
    """N = 4, K = 2: gamma 1 drafts 2 candidates, too few for 3 nodes (skipped, as its check fails); at gamma 2 its
    yield is the best 4-node tree's, the root's two children and the first one's first child: 1 + 0.8 (1 + 0.8) +
    0.2 x 0.6. Without the later children's rates it is listed, not ranked, saying so."""
    only = ["--only", "drafter=eagle,dynamic_tree_nodes=4,dynamic_tree_topk=2"]
    point = ["--B", "4", "--prefix_len", "32768", "--gen_len", "32", "--alpha", "0.8", "--gammas", "1", "2"]
    (row,) = [r for r in plan(point + ["--siblings", "0.6"] + only)["ranking"] if r["drafter"] == "eagle"]
    assert row["gamma"] == 2 and row["omega"] == pytest.approx(1 + 0.8 * 1.8 + 0.2 * 0.6)
    assert row["label"] == "eagle --dynamic_tree_nodes 4 --dynamic_tree_topk 2"
    (unranked,) = plan(point + only)["not_ranked"]
    assert unranked["reason"] == "no prediction: a tree needs its later candidates' rates (--siblings)"


def test_the_hierarchys_bottom_rate_reaches_its_synthetic_run(tmp_path):
    """A hierarchy entry's `bottom` (the middle's rate of the bottom's tokens) is what its random-weight run draws:
    without it such a run cannot start, and the atlas never ranked the hierarchy."""
    rates = tmp_path / "acceptance.json"
    rates.write_text(json.dumps({"hierarchy": {"alpha": 0.9, "bottom": 0.55}}))
    point = {"random_weights": True, "model_name": "JackFram/llama-68m", "B": 2, "prefix_len": 300, "gen_len": 10,
             "device": "cpu", "dtype": "float32"}
    planner = plan_command.Planner(point, plan_command.Inputs(cm.PROFILES / "h100.json", rates, gammas=(2,),
                                                              synthetic=True))
    option = {"draft": "ngram", "draft_policy": "streaming", "draft_budget": 256, "gamma_bottom": 2}
    cfg = planner.config("hierarchy", option, 2, shaped=True)
    assert cfg.speculation.synthetic_acceptance == 0.9 and cfg.draft.synthetic_bottom == 0.55
    assert "hierarchy" in {r["drafter"] for r in planner.ranking([{"drafter": "hierarchy"} | option])["ranking"]}


def test_a_trees_sequence_factors_reach_its_synthetic_run_and_not_a_chains(tmp_path, capsys):
    rates = tmp_path / "acceptance.json"
    rates.write_text(json.dumps({"lookup": {"alpha": 0.6, "siblings": [0.3], "sequence_factors": [0.5, 1.5]}}))
    point = {"random_weights": True, "model_name": "JackFram/llama-68m", "B": 2, "prefix_len": 300, "gen_len": 10,
             "device": "cpu", "dtype": "float32"}
    planner = plan_command.Planner(point, plan_command.Inputs(cm.PROFILES / "h100.json", rates, gammas=(2,),
                                                              synthetic=True))
    tree = planner.config("lookup", {"ngram_max": 2, "tree_width": 2}, 2, shaped=True)
    assert tree.speculation.synthetic_sequence_factors == (0.5, 1.5)
    assert planner.config("lookup", {"ngram_max": 2}, 2, shaped=True).speculation.synthetic_sequence_factors == ()
    rates.write_text(json.dumps({"lookup": {"alpha": 0.6, "sequence_factors": [0.5, -1]}}))
    with pytest.raises(MagicDecError, match=r"'lookup': sequence_factors \[0.5, -1\]: give a list of numbers >= 0"):
        acceptance_inputs.load_acceptance(rates)
