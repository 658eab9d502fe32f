"""magicdec run --plan and a sweep's plan points (magicdec/harness/plan_run.py) on a tiny model on the CPU: confirm K
times the planner's top K on one prefill and keeps the best measured (checked against the candidates' own rounds),
the record holds the plan record's fields, the chosen run's greedy tokens are a plain decoding loop's, auto runs the
baseline where nothing promises the margin, a trace entry is what its candidate replays, bad input is one line, and
a sweep's plan points are recorded once and resumed."""
from __future__ import annotations

import json
import statistics

import pytest
import torch

from conftest import TINY_HF, one_line_error, run_cli, run_here
from test_trial import plain_greedy
from magicdec import cli
from magicdec.analysis import cost_model as cm
from magicdec.config import KNOWN_MODELS, ModelArgs
from magicdec.harness import plan_run, sweep
from magicdec.harness.engine import Engine
from magicdec.harness.plan_command import NEVER_LOSES_MARGIN
from magicdec.harness.run_config import RunConfig

SHAPES = ModelArgs(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128,
                   max_seq_len=512, bos_id=1, eos_id=2)
B, PREFIX, GEN = 2, 300, 10
CHAIN = "selfspec --draft_policy streaming --draft_budget 256 --draft_weights bf16"
TREE = CHAIN + " --tree_width 2"
LOOKUP = "lookup --ngram_max 2 --tree_width 1"
# the plan record's keys (the atlas's contract: one object per (B, prefix_len, decoding) point)
RECORD = {"not_timed", "point", "method", "B", "prefix_len", "gen_len", "decoding", "model", "random_weights", "environment",
          "tensor_parallel", "plan", "baseline", "candidates", "choice", "planner_pick"}
PLAN = {"mode", "confirm", "selection", "profile", "acceptance", "ranking", "not_ranked", "never_loses_margin"}
ROW = {"rank", "label", "drafter", "options", "config", "gamma", "T_D_over_T_T", "T_V_over_T_T", "omega", "speedup",
       "acceptance"}
CANDIDATE = {"label", "drafter", "options", "config", "gamma", "rank", "predicted_speedup", "predicted_T_D_over_T_T",
             "predicted_T_V_over_T_T", "acceptance_source", "metrics"}
PICK = {"label", "predicted_speedup", "measured_speedup", "prediction_error"}


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setitem(KNOWN_MODELS, "test/plan-small", SHAPES)
    return ["--random_weights", "--model_name", "test/plan-small", "--B", str(B), "--prefix_len", str(PREFIX),
            "--gen_len", str(GEN), "--device", "cpu", "--dtype", "float32", "--ignore_eos", "--no_progress"]


def acceptance_file(tmp_path, entries: dict):
    path = tmp_path / "acceptance" / "rates.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"_meta": {"command": "written by the test"}} | entries))
    return path


def median_ratio(candidate: dict) -> float:
    """A candidate's all-reach speedup from its own rounds: the median of its rates over the baseline's, round by
    round (the baseline timed in turns with it)."""
    m = candidate["metrics"]
    mine, base = m["round_tokens_per_s"], m["paired_baseline"]["round_tokens_per_s"]
    return statistics.median(a / b for a, b in zip(mine, base))


def test_confirm_times_the_top_k_and_keeps_the_best_measured(small, tmp_path):
    rates = acceptance_file(tmp_path, {CHAIN: 0.8, TREE: {"alpha": 0.8, "siblings": [0.5]}, "lookahead": 0.6,
                                       LOOKUP: {"alpha": 0.7, "source": "a made-up rate"}})
    out = tmp_path / "plan.json"
    record = cli.run_record([*small, "--plan", "confirm", "3", "--plan_acceptance", str(rates), "--repeats", "2",
                             "--output", str(out), "--plan_top", "12"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(record, default=str))  # written whole
    assert set(record) == RECORD and set(record["plan"]) == PLAN
    assert (record["method"], record["B"], record["prefix_len"], record["gen_len"], record["decoding"]) == (
        "plan", B, PREFIX, GEN, "greedy")
    plan, candidates = record["plan"], record["candidates"]
    assert plan["mode"] == "confirm" and plan["confirm"] == 3 and plan["acceptance"] == str(rates)
    assert plan["selection"].startswith("best of 3 measured") and plan["never_loses_margin"] == NEVER_LOSES_MARGIN
    ranking = plan["ranking"]
    assert len(ranking) <= 12 and all(set(r) == ROW for r in ranking) and "baseline" in [r["label"] for r in ranking]
    assert [r["speedup"] for r in ranking] == sorted((r["speedup"] for r in ranking), reverse=True)
    assert plan["not_ranked"]["no acceptance input"] > 0  # every other option: counted, not ranked
    # the candidates: the best-ranked row of each of the top 3 families, in rank order, each with its prediction
    # beside its measurement
    top, families = [], []
    for r in ranking:
        f = (r["drafter"], r["config"].get("draft_weights", "bf16"),
             r["config"].get("tree_width", 1) > 1 or bool(r["config"].get("tree_nodes")))
        if r["drafter"] != "baseline" and f not in families:
            top.append(r)
            families.append(f)
    top = top[:3]
    assert [c["label"] for c in candidates] == [r["label"] for r in top]
    for c, r in zip(candidates, top):
        assert set(c) == CANDIDATE
        assert (c["predicted_speedup"], c["predicted_T_D_over_T_T"], c["gamma"]) == (r["speedup"], r["T_D_over_T_T"],
                                                                                      r["gamma"])
        assert c["config"]["drafter"] == r["drafter"] and c["config"]["gamma"] == [r["gamma"]]
        assert {k: c["config"][k] for k in r["config"]} == r["config"]  # its options, as ranked
        assert c["config"]["synthetic_acceptance"] is not None  # random weights: the ranked rate, drawn
        assert c["metrics"]["measured_speedup"] == pytest.approx(median_ratio(c))
        assert len(c["metrics"]["measured_speedup_rounds"]) == 2
    # the choice: the best measured all-reach median, or the baseline where none reached 1.0
    best = max(candidates, key=median_ratio)
    choice = record["choice"]
    if median_ratio(best) >= 1.0:
        assert choice == {"label": best["label"], "off": False, "measured_speedup": pytest.approx(median_ratio(best)),
                          "measured_speedup_first_done": best["metrics"]["measured_speedup_first_done"]}
        assert record["baseline"] == best["metrics"]["paired_baseline"]
    else:
        assert choice["off"] and choice["label"] == "baseline" and choice["measured_speedup"] == 1.0
    # the planner's pick: rank 1 and its prediction error against what it measured
    pick, first = record["planner_pick"], ranking[0]
    assert set(pick) == PICK and pick["label"] == first["label"]
    if first["drafter"] == "baseline":  # nothing promised the margin: confirmation still timed the top families
        assert pick["prediction_error"] is None
    else:
        assert first["label"] == candidates[0]["label"]
        assert pick["prediction_error"] == pytest.approx(first["speedup"] / median_ratio(candidates[0]) - 1)


def test_the_choice_is_the_best_measured_or_off():
    def made(label, m):
        return {"label": label, "metrics": {"measured_speedup": m}}

    confirm = RunConfig.from_options({"plan": ["confirm", "3"], "device": "cpu"}, strict=False)
    auto = RunConfig.from_options({"plan": ["auto"], "device": "cpu"}, strict=False)
    ran = [made("a", 0.97), made("b", 1.21), made("c", 1.08)]
    assert plan_run.choose(confirm, ran) == (ran[1], None)
    chosen, why = plan_run.choose(confirm, [made("a", 0.97), made("b", 0.99)])
    assert chosen is None and "below 1.0" in why
    assert plan_run.choose(auto, [made("a", 0.9)]) == (made("a", 0.9), None)  # auto keeps the pick made before timing
    chosen, why = plan_run.choose(auto, [])
    assert chosen is None and f"< {NEVER_LOSES_MARGIN}x" in why


def test_greedy_ids_of_every_candidate_are_plain_decodings(tiny_hf, tmp_path):
    """A checkpoint: each candidate verifies for real (the acceptance file only ranks), so each run's tokens, the
    chosen one's among them, are those of a cache-free greedy loop over the same prompts."""
    _, path = tiny_hf("llama", seed=3, num_hidden_layers=4, max_position_embeddings=1024)
    rates = acceptance_file(tmp_path, {CHAIN: 0.8, TREE: {"alpha": 0.8, "siblings": [0.5]}, LOOKUP: 0.7})
    cfg = RunConfig.from_options({"model": str(path), "B": B, "prefix_len": PREFIX, "gen_len": GEN, "device": "cpu",
                                  "dtype": "float32", "ignore_eos": True, "progress": False,
                                  "plan": ["confirm", "3"], "plan_acceptance": str(rates)})
    prompts = torch.randint(3, TINY_HF["vocab_size"], (B, PREFIX), generator=torch.Generator().manual_seed(7))
    engine = Engine(cfg, prompts=lambda c: (prompts[:c.workload.B], None, "given"))
    record, outputs = plan_run.measure(engine, cfg)
    assert sorted(outputs) == sorted([CHAIN, TREE, LOOKUP]) and not record["random_weights"]
    assert all("synthetic_acceptance" not in c["config"] or c["config"]["synthetic_acceptance"] is None
               for c in record["candidates"])
    with torch.inference_mode():
        reference = plain_greedy(engine.target, prompts, GEN)
    for label, out in outputs.items():
        assert torch.equal(out[:, :GEN], reference), label
    assert record["choice"]["label"] in outputs or record["choice"]["off"]


def test_auto_runs_the_baseline_where_nothing_promises_the_margin(small, tmp_path, capsys):
    rates = acceptance_file(tmp_path, {"lookahead": 0.01, LOOKUP: 0.01, CHAIN: 0.01})
    argv = [*small, "--plan", "auto", "--plan_acceptance", str(rates)]
    cfg = cli.config_from_argv(argv, "")
    engine = Engine(cfg)
    record, outputs = plan_run.measure(engine, cfg)
    ranking = record["plan"]["ranking"]
    assert ranking[0]["label"] == "baseline" and len(ranking) > 1
    assert all(r["speedup"] < NEVER_LOSES_MARGIN for r in ranking)
    assert record["candidates"] == [] and record["plan"]["selection"] == plan_run.AUTO
    assert record["choice"]["off"] and record["choice"]["label"] == "baseline"
    assert record["choice"]["measured_speedup"] == 1.0 and "predicts <" in record["choice"]["why"]
    assert record["planner_pick"] == {"label": "baseline", "predicted_speedup": 1.0, "measured_speedup": 1.0,
                                      "prediction_error": None}
    assert record["baseline"]["decode_tokens_per_s"] > 0
    with torch.inference_mode():  # the baseline alone: plain decoding
        assert torch.equal(outputs["baseline"][:, :GEN], plain_greedy(engine.target, engine.prompts(cfg)[0], GEN))


def test_auto_runs_the_top_choice_in_turns_with_the_baseline(small, tmp_path):
    rates = acceptance_file(tmp_path, {"lookahead": 0.9})
    # the H100's fixed costs per lookahead verification (0.7 ms, and a tree's 0.7 ms) outweigh this tiny shape's
    # step: a profile without them
    profile = json.loads((cm.PROFILES / "h100.json").read_text()) | {"verify_overhead_s": {}, "tree_verify_s": {}}
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    record = cli.run_record([*small, "--plan", "auto", "--plan_acceptance", str(rates),
                             "--plan_profile", str(tmp_path / "profile.json")])
    top = record["plan"]["ranking"][0]
    assert top["drafter"] == "lookahead" and top["speedup"] >= NEVER_LOSES_MARGIN
    assert [c["label"] for c in record["candidates"]] == [top["label"]]
    assert record["choice"]["label"] == top["label"] and not record["choice"]["off"]  # chosen before timing
    assert record["plan"]["acceptance"] == str(rates)


def test_a_trace_entry_is_what_its_candidate_replays(small, tmp_path):
    """The entry's rate is 0.3 but its trace kept every drafted token: the candidate's config names the trace (its
    path relative to the acceptance file's folder) and its measured acceptance is the trace's, 1.0, not the rate."""
    rates = acceptance_file(tmp_path, {CHAIN: {"alpha": 0.3, "trace": "traces/all_kept.json"}})
    trace = rates.parent / "traces" / "all_kept.json"
    trace.parent.mkdir()
    trace.write_text(json.dumps({"acceptance_trace": {"gammas": [2] * 6, "accepted": [[2, 2]] * 6}}))
    record = cli.run_record([*small, "--plan", "confirm", "1", "--plan_acceptance", str(rates)])
    c, = record["candidates"]
    assert c["label"] == CHAIN and c["config"]["acceptance_trace"] == str(trace)
    assert c["config"]["synthetic_acceptance"] == 0.3 and c["metrics"]["alpha"] == 1.0
    trace.unlink()  # a trace that cannot be read: one line naming the candidate and the file, before any work
    with pytest.raises(Exception, match=r"--plan: selfspec .* \(rank \d\) cannot run: --acceptance_trace .*all_kept"):
        cli.run_record([*small, "--plan", "confirm", "1", "--plan_acceptance", str(rates)])


def test_an_iid_rate_ranks_every_option_as_a_sensitivity(small, tmp_path):
    record = cli.run_record([*small, "--plan", "confirm", "1", "--synthetic_acceptance", "0.7",
                             "--synthetic_siblings", "0.4"])
    assert record["plan"]["acceptance"] == "iid α 0.7, sensitivity"
    c, = record["candidates"]
    assert c["config"]["synthetic_acceptance"] == 0.7 and c["acceptance_source"] == "iid α, sensitivity"


def test_two_ranks_time_the_same_candidates_and_rank_0_writes(tmp_path):
    """torchrun, 2 ranks (gloo): every rank times rank 0's ranking (its collectives pair), one record is written."""
    rates = acceptance_file(tmp_path, {"lookahead": 0.6})
    out = tmp_path / "runs" / "plan.json"
    out.parent.mkdir()
    p = run_cli("run", "--random_weights", "--model_name", "JackFram/llama-68m", "--B", "2", "--prefix_len", "100",
                "--gen_len", "6", "--rank_group", "0", "1", "--plan", "confirm", "2", "--plan_acceptance", str(rates),
                "--output", str(out), launcher=("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                                "-m", "magicdec.cli"))
    assert p.returncode == 0, p.stderr[-3000:]
    record = json.loads(out.read_text())
    assert [f.name for f in out.parent.iterdir()] == ["plan.json"] and p.stdout.count("wrote ") == 1
    assert record["tensor_parallel"] == {"world": 2}
    top = [r["label"] for r in record["plan"]["ranking"] if r["drafter"] != "baseline"][:1]  # one family: its best
    assert [c["label"] for c in record["candidates"]] == top


@pytest.mark.parametrize("argv, message", [
    (["--plan", "confirm", "0"], "--plan confirm 0: K must be at least 1"),
    (["--plan", "foo"], "--plan foo: give auto"),
    (["--plan", "confirm"], "--plan confirm: give confirm K"),
    (["--plan", "confirm", "x"], "--plan confirm x: give confirm K"),
    (["--plan", "auto", "extra"], "--plan auto extra: give auto"),
    (["--plan", "auto", "--drafter", "lookup"], "--drafter with --plan: the plan chooses"),
    (["--plan", "auto", "--gamma", "3"], "--gamma with --plan: the plan chooses"),
    (["--plan", "auto", "--draft_budget", "64"], "--draft_budget with --plan: the plan chooses"),
    (["--plan", "auto"], "--plan needs acceptance"),
    (["--plan", "auto", "--synthetic_acceptance", "0.8", "--plan_profile", "/no/such/profile.json"],
     "--plan_profile /no/such/profile.json: cannot read it as a device profile"),
    (["--plan", "auto", "--plan_acceptance", "/no/such/rates.json"], "--plan_acceptance /no/such/rates.json: cannot"),
    (["--plan", "auto", "--plan_acceptance", "BAD"], "--plan_acceptance BAD: cannot read it as JSON"),
    (["--plan", "auto", "--plan_acceptance", "UNKNOWN"], "'lookup': give a rate or"),
    (["--plan_acceptance", "/no/such/rates.json"], "--plan_acceptance applies to --plan runs"),
    (["--plan", "auto", "--synthetic_acceptance", "0.8", "--save_tokens"], "--save_tokens with --plan"),
])
def test_bad_input_is_one_line_before_anything_loads(argv, message, small, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Engine, "load_target", lambda self: pytest.fail("the target was loaded before the check"))
    bad, unknown = tmp_path / "bad.json", tmp_path / "unknown.json"
    bad.write_text("{not json")
    unknown.write_text(json.dumps({"lookup": {"alpha": 0.5, "colour": "blue"}}))
    argv = [{"BAD": str(bad), "UNKNOWN": str(unknown)}.get(a, a) for a in argv]
    message = message.replace("BAD", str(bad))
    with pytest.raises(SystemExit) as e:
        cli.main(["run", *small, *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err


TINY_PLAN_SWEEP = """
model_name = "test/plan-small"
random_weights = true
prefix_len = [48, 96]
B = [2]
gen_len = 6
methods = ["plan"]
[plan]
confirm = 1
acceptance = "{rates}"
top = 4
"""


def test_a_sweeps_plan_points_are_recorded_once_and_resumed(small, tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "PROBE", (64, 8))  # the load-time probes, small (as test_sweep's)
    rates = acceptance_file(tmp_path, {"lookahead": 0.6, LOOKUP: 0.5})
    path = tmp_path / "plan.toml"
    path.write_text(TINY_PLAN_SWEEP.format(rates=rates))
    out = tmp_path / "out"
    assert sweep.Sweep(sweep.load_config(path), out, "cpu", False).run(None) == 0
    recs = {f.stem: json.loads(f.read_text()) for f in out.glob("*.json")}
    assert sorted(r["prefix_len"] for r in recs.values()) == [48, 96]
    for key, r in recs.items():
        assert set(r) == RECORD | {"recorded_at"} and r["point"] == key
        assert key.startswith(f"plan_P{r['prefix_len']}_B2_greedy_")
        assert r["plan"]["mode"] == "confirm" and len(r["candidates"]) == 1 and len(r["plan"]["ranking"]) == 4
    before = {f.name: f.stat().st_mtime_ns for f in out.glob("*.json")}
    monkeypatch.setattr(plan_run, "measure", lambda *a, **k: pytest.fail("a recorded plan point ran again"))
    assert sweep.Sweep(sweep.load_config(path), out, "cpu", False).run(None) == 0
    assert {f.name: f.stat().st_mtime_ns for f in out.glob("*.json")} == before


@pytest.mark.parametrize("table, needle", [
    ("confirm = 1\ncolour = 'blue'", "[plan] colour is not a plan key"),
    ("confirm = -1", "[plan] confirm = -1: give a whole number >= 0"),
    ("confirm = 1\nacceptance = '/no/such/rates.json'", "[plan] acceptance /no/such/rates.json: cannot read"),
    ("confirm = 1\nprofile = '/no/such/profile.json'", "[plan] profile /no/such/profile.json: cannot read"),
    ("top = 3", "method plan ranks with acceptance"),  # no acceptance file, no iid rate
])
def test_a_bad_plan_table_is_one_line(table, needle, small, tmp_path):
    iid = "" if needle.startswith("method plan ranks") else "synthetic_acceptance = 0.8\n"
    path = tmp_path / "bad.toml"
    path.write_text(TINY_PLAN_SWEEP.split("[plan]")[0] + iid + "[plan]\n" + table + "\n")
    one_line_error(run_here(path, "--output_dir", str(tmp_path / "o"), launcher=("-m", "magicdec.cli", "sweep")),
                   needle)


def test_a_candidate_out_of_memory_is_listed_and_the_others_timed(small, tmp_path, monkeypatch):
    """The memory estimate let a candidate through that did not fit: it is listed as not timed, the plan goes on."""
    from magicdec.harness import trial as trial_module
    rates = acceptance_file(tmp_path, {CHAIN: 0.8, LOOKUP: 0.7})
    real, calls = trial_module.Trial.speculate, []

    def first_runs_out(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(self, *args, **kwargs)
    monkeypatch.setattr(trial_module.Trial, "speculate", first_runs_out)
    record = cli.run_record([*small, "--plan", "confirm", "2", "--plan_acceptance", str(rates), "--repeats", "2"])
    ranked = [r["label"] for r in record["plan"]["ranking"] if r["drafter"] != "baseline"]
    assert [f["label"] for f in record["not_timed"]] == ranked[:1] and "out of memory" in record["not_timed"][0]["why"]
    assert [c["label"] for c in record["candidates"]] == ranked[1:2]


def test_every_candidate_out_of_memory_runs_the_baseline_and_says_why(small, tmp_path, monkeypatch):
    from magicdec.harness import trial as trial_module
    rates = acceptance_file(tmp_path, {CHAIN: 0.8})

    def runs_out(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")
    monkeypatch.setattr(trial_module.Trial, "speculate", runs_out)
    record = cli.run_record([*small, "--plan", "confirm", "1", "--plan_acceptance", str(rates), "--repeats", "2"])
    assert record["candidates"] == [] and len(record["not_timed"]) == 1
    assert record["choice"]["off"] and "ran out of memory" in record["choice"]["why"]
    assert record["baseline"]["decode_tokens_per_s"] > 0  # timed alone


def test_a_two_rank_sweep_records_each_point_once_and_resumes(tmp_path):
    """torchrun, 2 ranks (gloo): every rank runs the sweep's points (their collectives pair), rank 0 alone holds the
    folder and writes; run again, nothing is left to run."""
    rates = acceptance_file(tmp_path, {"lookahead": 0.6})
    path = tmp_path / "plan.toml"
    path.write_text(TINY_PLAN_SWEEP.replace("test/plan-small", "JackFram/llama-68m").replace(
        "methods", "rank_group = [0, 1]\nmethods").format(rates=rates))
    out = tmp_path / "out"
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "magicdec.cli")
    p = run_cli("sweep", str(path), "--output_dir", str(out), "--device", "cpu", "--no_progress", launcher=launcher)
    assert p.returncode == 0, p.stderr[-12000:]  # a rank's traceback, not only torchrun's report
    recs = {f.stem: json.loads(f.read_text()) for f in out.glob("*.json")}
    assert sorted(r["prefix_len"] for r in recs.values()) == [48, 96]
    assert all(r["tensor_parallel"] == {"world": 2} and len(r["candidates"]) == 1 for r in recs.values())
    assert (out / "commands.txt").read_text().count("magicdec sweep") == 1
    again = run_cli("sweep", str(path), "--output_dir", str(out), "--device", "cpu", "--no_progress", launcher=launcher)
    assert again.returncode == 0 and again.stdout.count("0 of 2 points to run") == 2, again.stderr[-3000:]


def test_a_device_without_a_committed_profile_is_planned_with_the_h100s_and_says_so(capsys):
    """No committed profile names this device (a CPU here): the plan takes the H100's and says so in one line, with
    how to make one (once per process); --plan_profile is taken as given, silently."""
    cm.say_no_profile.cache_clear()  # an earlier test's plan on this CPU said it already
    cfg = RunConfig.from_options({"random_weights": True, "model_name": "JackFram/llama-68m", "device": "cpu",
                                  "plan": "auto", "synthetic_acceptance": 0.8}, strict=False)
    assert plan_run.profile_path(cfg, torch.device("cpu")) == cm.PROFILES / "h100.json"
    err = capsys.readouterr().err.strip()
    assert "no committed device profile for cpu" in err and "derive_profile.py" in err and len(err.splitlines()) == 1
    assert plan_run.profile_path(cfg, torch.device("cpu")) == cm.PROFILES / "h100.json"
    assert capsys.readouterr().err == ""  # said once
    given = RunConfig.from_options(cfg.options() | {"plan_profile": str(cm.PROFILES / "h200.json")}, strict=False)
    assert plan_run.profile_path(given, torch.device("cpu")) == cm.PROFILES / "h200.json"
    assert capsys.readouterr().err == ""
