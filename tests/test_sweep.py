"""Sweeps: the grid a config file names — every registered drafter, any run option — one record per point under the
hash of its run config, resumed after a crash without redoing finished points, run again where the config changed,
stopped cleanly by a time limit, bad configs refused in one line before any work."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import BOOKS, LLAMA2_TOKENIZER, REPO, STORIES, TINY_SWEEP, needs_llama_tokenizers, one_line_error, run_here
from magicdec.analysis import cost_model as cm
from magicdec import device as dev
from magicdec import drafters, files
from magicdec.harness import sweep
CONFIG = """
model_name = "JackFram/llama-68m"
random_weights = true
prefix_len = [48, 96]
B = [2]
draft_budget = [24, 64]
gamma = [1, 2]
methods = ["baseline", "selfspec", "standalone", "auto"]
draft_name = "JackFram/llama-68m"
decoding = ["greedy"]
gen_len = 8
sinks = 4
synthetic_acceptance = {"48" = 0.9, "96" = 0.7}
"""
AUTO = '[auto]\ndrafter = "selfspec"\n'  # tables after every top-level key


@pytest.fixture(autouse=True)
def short_probes(monkeypatch):
    """The load-time probes (a B = 1 step for the fixed cost per layer, each drafter's verifications for its fixed
    cost) over a 64-token prompt and 8 tokens instead of 256 and 32: the same code, a quarter of the work (the
    probes were half of a small sweep's time on a CPU). What they fit is checked by
    test_verification_probe_fits_the_fixed_cost_per_verification, whatever their size."""
    monkeypatch.setattr(sweep, "PROBE", (64, 8))


def records(d: Path) -> dict[str, dict]:
    return {f.stem: json.loads(f.read_text()) for f in d.glob("*.json")}


def by_point(d: Path) -> dict[tuple, dict]:
    """Records by (method, label, prefix, B, decoding, gamma): what a point is, without the hash."""
    return {(r["method"], r["label"], r["prefix_len"], r["B"], r["decoding"], r["gamma"]): r
            for r in records(d).values()}


def expected_points() -> set[tuple]:
    out = set()
    for P in (48, 96):
        out |= {("baseline", "baseline", P, 2, "greedy", None), ("auto", "auto", P, 2, "greedy", None)}
        for b in (24, 64):
            if b < P:
                out |= {("selfspec", f"selfspec b{b}", P, 2, "greedy", g) for g in (1, 2)}
                out |= {("standalone", f"standalone llama-68m b{b}", P, 2, "greedy", g) for g in (1, 2)}
    return out


def _write(tmp_path, text, name="sweep.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def make(tmp_path, text, out="out", name="sweep.toml"):
    return sweep.Sweep(sweep.load_config(_write(tmp_path, text, name)), tmp_path / out, "cpu", False)


def test_sweep_crash_resume(tmp_path, monkeypatch):
    out, CONFIG_AUTO = tmp_path / "out", CONFIG + AUTO

    real_write, written = sweep.Sweep.write, []

    def crashing_write(self, name, rec):
        if len(written) == 4:
            raise RuntimeError("simulated crash (a lost device, a killed call)")
        real_write(self, name, rec)
        written.append(name)

    monkeypatch.setattr(sweep.Sweep, "write", crashing_write)
    with pytest.raises(RuntimeError, match="simulated crash"):
        make(tmp_path, CONFIG_AUTO).run(max_minutes=None)
    monkeypatch.setattr(sweep.Sweep, "write", real_write)
    before = {f.name: f.stat().st_mtime_ns for f in out.glob("*.json")}
    assert len(before) == 4 and not list(out.glob(".*.tmp"))

    assert make(tmp_path, CONFIG_AUTO).run(max_minutes=None) == 0
    recs = by_point(out)
    assert set(recs) == expected_points()
    assert {f.name: f.stat().st_mtime_ns for f in out.glob("*.json") if f.name in before} == before  # not redone
    for r in recs.values():
        m = r["metrics"]
        assert r["B"] == 2 and len(r["config_hash"]) == 12
        assert r["point"].endswith(r["config_hash"]) or r["method"] == "auto"
        check_counts(r, B=2, gen_len=8)
        if r["method"] in ("selfspec", "standalone"):
            assert r["synthetic_acceptance"] == {48: 0.9, 96: 0.7}[r["prefix_len"]]
            assert m["speculation"]["gamma"] == r["gamma"]
            check_prediction(r)
        if r["method"] == "auto":
            assert r["planner"]["budget"] in (24, 64) and r["budget"] == r["planner"]["budget"]
            assert r["planner"]["spread"] >= 0 and set(r["planner"]["spread_by_option"]) == {"24", "64"} & {
                str(b) for b in (24, 64) if b < r["prefix_len"]}
            used = m["speculation"]["auto_gamma"]["iterations_per_gamma"]
            assert sum(used.values()) == m["iterations"] and set(map(int, used)) <= {0, 1, 2}
    assert (out / "commands.txt").read_text().count("magicdec sweep") == 2  # every run with points to do


def check_counts(r: dict, B: int, gen_len: int) -> None:
    """A record's counts and speeds against what the point asked for, by hand: B sequences of gen_len tokens, the
    first from the prefill, so B (gen_len - 1) decoded in its decode seconds; alpha the sequences' kept over reached
    drafted tokens; a speculative point's measured speedup its paired baseline's seconds over its own."""
    m = r["metrics"]
    assert r["B"] == m["batch_size"] == B and r["gen_len"] == gen_len and m["generated_tokens"] == B * gen_len
    assert m["decode_tokens_per_s"] == pytest.approx(B * (gen_len - 1) / m["decode_s"], rel=1e-9)
    assert m["decode_s"] == pytest.approx(sum(b["decode_s"] for b in r["batches"]), rel=1e-9)
    if r["method"] == "baseline":
        assert m["iterations"] == gen_len - 1  # one step per decoded token
        return
    spec = m["speculation"]
    kept, reached = spec["per_sequence"]["kept"], spec["per_sequence"]["reached"]
    assert len(kept) == len(reached) == B
    assert m["alpha"] == (pytest.approx(sum(kept) / sum(reached), rel=1e-12) if sum(reached) else None)
    assert spec["accepted_tokens"] == sum(kept)
    # every verification keeps its accepted tokens and one of the target's: B (gen_len - 1) tokens at most (the last
    # verification of a sequence may run past gen_len)
    assert spec["accepted_tokens"] + spec["verifications"] >= B * (gen_len - 1)
    assert m["measured_speedup"] == pytest.approx(
        sum(b["baseline_decode_s"] for b in r["batches"]) / sum(b["decode_s"] for b in r["batches"]), rel=1e-9)


def check_prediction(r: dict) -> None:
    """The cost model's speedup written out from its step seconds and the device's fixed cost per verification
    T_O (the probe's fit): Omega(alpha, gamma) = (1 - alpha^(gamma + 1)) / (1 - alpha) tokens per gamma draft steps,
    one (gamma + 1)-token verification and T_O, over as many target steps; the effective one at the measured tokens
    per verification, B (gen_len - 1) decoded over the B sequences' iterations."""
    m, pred, gamma = r["metrics"], r["metrics"]["cost_model"], r["gamma"]
    t_t, t_d, t_v, t_o = pred["T_T"], pred["T_D"], pred["T_V"], pred["device_model"]["verify_overhead_s"]
    assert t_o >= 0 and pred["T_O"] == t_o
    a = m["alpha"]
    omega = gamma + 1 if a == 1 else (1 - a ** (gamma + 1)) / (1 - a)
    assert pred["speedup"] == pytest.approx(omega * t_t / (gamma * t_d + t_v + t_o), rel=1e-9)
    per_verification = (r["gen_len"] - 1) / m["iterations"]
    assert m["omega_effective"] == pytest.approx(per_verification, rel=1e-9)
    assert pred["speedup_effective"] == pytest.approx(per_verification * t_t / (gamma * t_d + t_v + t_o), rel=1e-9)


def test_a_changed_config_runs_again_and_old_records_move_aside(tmp_path, capsys):
    """A point's identity is its config's hash: changing gen_len or sinks reruns the points it changes (the
    baseline's too, for gen_len) instead of keeping records made under the old values, which move to stale/."""
    base = TINY_SWEEP + 'gamma = [2]\nmethods = ["baseline", "selfspec"]\n'
    out = tmp_path / "out"
    assert make(tmp_path, base).run(None) == 0
    first = records(out)
    assert len(first) == 2
    changed = make(tmp_path, base.replace("sinks = 4", "sinks = 8"))
    assert len([p for p in changed.points if not changed.recorded(p)]) == 1  # the baseline has no sinks
    assert changed.run(None) == 0
    assert "1 records of points not in this grid" in capsys.readouterr().out
    now = records(out)
    assert len(now) == 2 and set(now) != set(first) and len(list((out / "stale").glob("*.json"))) == 1
    assert next(r for r in now.values() if r["method"] == "selfspec")["sinks"] == 8
    longer = make(tmp_path, base.replace("gen_len = 8", "gen_len = 12"))
    assert not any(longer.recorded(p) for p in longer.points)


def test_verification_probe_fits_the_fixed_cost_per_verification(tmp_path, monkeypatch):
    """The probe times gamma-1 verifications at B = 1 over a short prompt and fits T_O to them: a verification timed
    0.3 ms slower than the model's draft step plus target step gives 0.3 ms, for each drafter against its own
    prediction (the standalone draft's step is its own model's, prompt lookup runs none)."""
    text = CONFIG.replace('"auto"]', '"lookup"]')  # no auto: no [auto] table
    sw = make(tmp_path, text)
    seen = {}
    real_probe = sweep.Sweep.probe

    def probe(self, cfg):
        if not cfg.drafter:
            return real_probe(self, cfg)
        models = self.engine.plan(cfg)[0]
        device = cm.Device(**(vars(self.cost_device) | {"verify_overhead_s": 0.0}))
        p = cfg.drafter.predict(cfg, self.engine.target_config, models, device, 0.5, 1, cfg.lookahead)
        seen[cfg.drafter.name] = cfg.speculation.gamma
        return p["T_D"] + p["T_V"] + 0.3e-3

    monkeypatch.setattr(sweep.Sweep, "probe", probe)
    sw.load(sw.points[0].cfg)
    assert set(sw.verify_overhead) == {"selfspec", "standalone", "lookup"} and set(seen.values()) == {(1,)}
    for name, t_o in sw.verify_overhead.items():
        assert t_o == pytest.approx(0.3e-3), name


def sweep_cli(tmp_path, text, *extra):
    if '"auto"' in text and "[auto]" not in text:
        text += AUTO
    return run_here(_write(tmp_path, text), "--output_dir", str(tmp_path / "o"), *extra,
                    launcher=("-m", "magicdec.cli", "sweep"))


@pytest.mark.parametrize("old,new,needle", [
    ("sinks = 4", "colour = 'blue'", "unknown keys ['colour']"),
    ('"standalone", "auto"]', '"quokka"]', "unknown drafter 'quokka'"),
    ("gamma = [1, 2]", "gamma = [0]", "--gamma must be at least 1"),
    ("gen_len = 8", "gen_len = 8 8", "cannot read sweep config"),
    ("B = [2]", "B = [0]", "B = 0: must be a positive integer"),
    ("B = [2]", "B = 'two'", "B = 'two': must be a number"),
    ('methods = ["baseline", "selfspec", "standalone", "auto"]', 'methods = "selfspec"', "methods must be a list"),
    ("sinks = 4", "sinks = 4\nmin_seconds = -1", "--min_seconds must be >= 0"),
    ("draft_budget = [24, 64]", "draft_budget = [96]", "method selfspec has no valid point"),
    ("sinks = 4", "sinks = 4\nskip_tokens = [0, 0]", "skip_tokens must be a non-negative integer or a list of distinct"),
    ("sinks = 4", "sinks = 4\nhistory = ['/no/such']", "history directories ['/no/such'] do not exist"),
    ("sinks = 4", 'sinks = 4\ndraft_policy = ["h2o"]', "must be one of streaming, snapkv, retrieval"),
    ("sinks = 4", "sinks = 4\n[lookup]\nngram_max = 2", "table [lookup] names no method of this sweep"),
])
def test_bad_config_is_one_line(tmp_path, old, new, needle):
    """Refused before any model is loaded: a config error costs seconds, not the minutes of the points before it."""
    assert old in CONFIG
    one_line_error(sweep_cli(tmp_path, CONFIG.replace(old, new)), needle)


def test_a_draft_and_the_context_are_checked_first(tmp_path):
    no_draft = CONFIG.replace('draft_name = "JackFram/llama-68m"', "")
    one_line_error(sweep_cli(tmp_path, no_draft), "standalone has no valid point", "--draft_name")
    too_long = CONFIG.replace("prefix_len = [48, 96]", "prefix_len = [48, 4096]")
    one_line_error(sweep_cli(tmp_path, too_long), "exceeds the model's context")


def test_an_unwritable_output_folder_is_refused_first(tmp_path):
    if os.geteuid() == 0:  # root writes anywhere: a file in the way stands in for a read-only folder
        blocker = tmp_path / "file"
        blocker.write_text("x")
        p = run_here(_write(tmp_path, CONFIG + AUTO), "--output_dir", str(blocker / "o"),
                     launcher=("-m", "magicdec.cli", "sweep"))
    else:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        p = run_here(_write(tmp_path, CONFIG + AUTO), "--output_dir", str(ro / "o"),
                     launcher=("-m", "magicdec.cli", "sweep"))
    one_line_error(p, "--output_dir", "cannot write to")


def test_sweep_skips_what_the_scripts_refuse(tmp_path, monkeypatch):
    """A point runs only if its draft caches fit beside the target's (weights loaded once) with the same headroom
    the run's check keeps: 6% of the device, at least 2 GiB; else it is recorded as skipped, and the rest of its
    group runs. A baseline that does not fit skips its whole group."""
    sw = make(tmp_path, CONFIG + AUTO)
    sw.load(sw.points[0].cfg)
    group = [p for p in sw.points if p.cfg.workload.prefix_len == 96]
    needs = {p.key: sweep.memory_needed(2, p.cfg.runtime.prefill_chunk, torch.float32,
                                        [dataclasses.replace(q, weights=False) for q in sw.engine.plan(p.cfg)[1]])
             for p in group}
    largest = max(needs, key=lambda k: needs[k]["total"])
    base = next(p.key for p in group if p.method == "baseline")
    gib = 1 << 30
    for free, skipped in ((needs[largest]["total"], set()), (needs[largest]["total"] - 1,
                                                              {k for k in needs if needs[k]["total"] == needs[largest]["total"]}),
                          (needs[base]["total"] - 1, set(needs))):
        monkeypatch.setattr(dev, "memory", lambda d, free=free: (free + 6 * gib, 100 * gib))
        assert set(sw.fits(group)) == skipped


def test_sampled_sweeps_probe_and_model_the_sampling_cost(tmp_path):
    """A sweep with sampled decoding times its sampler at load, and its sampled points' predictions count the rows
    of logits each step turns into probabilities; greedy sweeps leave it out."""
    text = TINY_SWEEP + 'gamma = [2]\nmethods = ["baseline", "selfspec"]\n'
    greedy = make(tmp_path, text, "g")
    greedy.load(greedy.points[0].cfg)
    assert greedy.cost_device.sampling_s_per_logit == 0.0
    sw = make(tmp_path, text + 'decoding = ["greedy", "sampled"]\n', "s", "b.toml")
    sw.load(sw.points[0].cfg)
    per_logit = sw.cost_device.sampling_s_per_logit
    assert per_logit > 0
    m = {"alpha": 0.8, "omega_effective": 2.0, "speculation": {"draft_steps": 2, "iterations": 1}}
    spec = {p.cfg.decoding.name: p.cfg for p in sw.points if p.method == "selfspec"}
    greedy_p, sampled_p = sw.predicted(spec["greedy"], 2, m), sw.predicted(spec["sampled"], 2, m)
    V = sw.engine.target_config.vocab_size
    assert sampled_p["T_T"] == pytest.approx(greedy_p["T_T"] + 2 * V * per_logit)
    assert sampled_p["T_V"] == pytest.approx(greedy_p["T_V"] + 2 * 3 * V * per_logit)


BATCHES = TINY_SWEEP + f"""
tokenizer = "{LLAMA2_TOKENIZER}"
dataset = "{BOOKS}"
gamma = [1, 2]
methods = ["baseline", "selfspec", "auto"]
"""  # random weights but real text: each batch of prompts differs


def per_sequence(r):
    return r["metrics"]["speculation"]["per_sequence"]


@needs_llama_tokenizers
def test_several_batches_per_point_add_up_to_the_single_batch_sweeps(tmp_path):
    """skip_tokens = [0, 500] times every point on two batches of prompts: its record equals the two one-batch
    sweeps put together (fp32 greedy on the CPU, so each batch's decoding is the same in both): iterations summed,
    the sequences' acceptance side by side, tokens per verification and throughput over both batches."""
    singles, given = {}, BATCHES + "synthetic_acceptance = 0.7\n"  # a random model's own drafts all fail
    for skip in (0, 500):
        out = f"skip{skip}"
        assert make(tmp_path, given + f"skip_tokens = {skip}\n" + AUTO, out).run(None) == 0
        singles[skip] = {k[:3] + k[4:]: r for k, r in by_point(tmp_path / out).items()}
    out = tmp_path / "both"
    assert make(tmp_path, given + "skip_tokens = [0, 500]\n" + AUTO, "both").run(None) == 0
    both = {k[:3] + k[4:]: r for k, r in by_point(out).items()}
    assert set(both) == set(singles[0]) and not list((out / ".batches").glob("*"))  # no leftover partial timings
    for name, r in both.items():
        m, one, two = r["metrics"], singles[0][name], singles[500][name]
        assert r["skip_tokens"] == [0, 500] and [b["skip_tokens"] for b in r["batches"]] == [0, 500]
        assert m["batches"] == 2 and m["generated_tokens"] == one["metrics"]["generated_tokens"] * 2
        assert m["iterations"] == sum(b["iterations"] for b in r["batches"])
        if r["method"] != "auto":  # auto picks its gammas from timings, which the machine's load moves
            assert [b["iterations"] for b in r["batches"]] == [one["metrics"]["iterations"],
                                                               two["metrics"]["iterations"]]
        assert m["decode_s"] == pytest.approx(sum(b["decode_s"] for b in r["batches"]))
        assert m["decode_tokens_per_s"] == pytest.approx(2 * 2 * 7 / m["decode_s"])  # 2 batches x B 2 x 7 decoded
        if r["method"] == "baseline":
            continue
        if r["method"] == "selfspec":  # auto's gammas may differ between the two runs' timings: compared above only
            assert per_sequence(r)["kept"] == per_sequence(one)["kept"] + per_sequence(two)["kept"]
            assert per_sequence(r)["reached"] == per_sequence(one)["reached"] + per_sequence(two)["reached"]
            assert m["alpha"] == pytest.approx(sum(per_sequence(r)["kept"]) / sum(per_sequence(r)["reached"]))
            assert 0 < m["alpha"] < 1
        assert m["omega_effective"] == pytest.approx(2 * 7 / m["iterations"])
        assert m["measured_speedup"] == pytest.approx(
            sum(b["baseline_decode_s"] for b in r["batches"]) / sum(b["decode_s"] for b in r["batches"]))
        if r["method"] == "auto":  # planned and profiled once, on the first batch; the second reuses the costs
            ag = m["speculation"]["auto_gamma"]
            assert r["auto_gamma_profile_s"] > 0 and len(ag["batches"]) == 2
            assert ag["batches"][0]["seconds_per_verification"] == ag["batches"][1]["seconds_per_verification"]
            assert sum(ag["iterations_per_gamma"].values()) == m["iterations"]


@needs_llama_tokenizers
def test_several_batches_resume_where_they_stopped(tmp_path, monkeypatch):
    """A crash during the second batch keeps every point's first-batch timing; the next run times only what the
    second batch lacks and writes each record from both."""
    text = BATCHES + "skip_tokens = [0, 500]\n" + AUTO
    out, real_finish, kept = tmp_path / "out", sweep.Sweep.finish, []

    def crashing_finish(self, point, partial, last, bar):
        if last and kept.count(True) == 1:  # the second point done with both batches
            raise RuntimeError("simulated crash")
        real_finish(self, point, partial, last, bar)
        kept.append(last)

    monkeypatch.setattr(sweep.Sweep, "finish", crashing_finish)
    sw = make(tmp_path, text)
    with pytest.raises(RuntimeError, match="simulated crash"):
        sw.run(None)
    monkeypatch.setattr(sweep.Sweep, "finish", real_finish)
    first = {f.stem: json.loads(f.read_text())["batches"][0] for f in (out / ".batches").glob("*.json")}
    assert len(records(out)) == 1 and len(first) == len(sw.points) - 1
    assert make(tmp_path, text).run(None) == 0
    for name, r in records(out).items():
        if name in first:  # the first batch's timing as kept before the crash, not timed again
            assert r["batches"][0]["decode_s"] == first[name]["seconds"]
        assert len(r["batches"]) == 2


def test_history_feeds_the_planner(tmp_path):
    """`history` directories count as this sweep's own earlier points for the planner (acceptance and spread per
    budget), records of another model excepted."""
    hist = tmp_path / "hist"
    hist.mkdir()
    text = TINY_SWEEP + 'methods = ["baseline", "auto"]\n'
    sw = make(tmp_path, text + AUTO)
    sw.load(sw.points[0].cfg)
    for model, alpha in ((sw.engine.target_config.name, 0.6), ("another", 0.95)):
        (hist / f"{model.replace('/', '_')}.json").write_text(json.dumps({
            "model": model, "method": "selfspec", "budget": 24, "prefix_len": 48, "decoding": "greedy", "B": 2,
            "gamma": 2, "gen_len": 8, "metrics": {"alpha": alpha, "iterations": 4}}))
    sw = make(tmp_path, text + f'history = ["{hist}"]\n' + AUTO, name="h.toml")
    sw.load(sw.points[0].cfg)
    auto = next(p for p in sw.points if p.method == "auto")
    assert sw.plan_budget(auto)["alpha_by_option"] == {24: 0.6}
    sw.cfg = sw.cfg | {"history": []}
    assert sw.plan_budget(auto)["alpha_by_option"] == {24: auto.cfg.speculation.alpha_prior}


def test_planner_chooses_the_draft_weight_format(tmp_path):
    """An auto point listing draft weight formats plans over (budget, format): each option's acceptance from its
    own earlier records; a copy that reads a quarter of the bytes but accepts nothing loses to bf16, one that accepts
    as much wins; the point then runs at the chosen format."""
    hist = tmp_path / "hist"
    hist.mkdir()
    text = TINY_SWEEP + 'methods = ["baseline", "auto"]\n'
    auto = AUTO + 'draft_weights = ["bf16", "int4"]\n'
    sw = make(tmp_path, text + auto)
    sw.load(sw.points[0].cfg)
    name = sw.engine.target_config.name
    point = next(p for p in sw.points if p.method == "auto")
    assert point.candidates["formats"] == ["bf16", "int4"] and point.cfg.draft.draft_weights == "int4"  # its memory

    def planned_with(alphas):
        for fmt, alpha in alphas.items():
            (hist / f"{fmt}.json").write_text(json.dumps({
                "model": name, "method": "selfspec", "budget": 24, "prefix_len": 48, "decoding": "greedy", "B": 2,
                "gamma": 2, "gen_len": 8, "config": {"draft_weights": fmt}, "metrics": {"alpha": alpha, "iterations": 4}}))
        s = make(tmp_path, text + f'history = ["{hist}"]\n' + auto, name="h.toml")
        s.load(s.points[0].cfg)
        return s.plan_budget(next(p for p in s.points if p.method == "auto"))

    lossy = planned_with({"bf16": 0.9, "int4": 0.0})
    assert lossy["alpha_by_option"] == {"24 bf16": 0.9, "24 int4": 0.0} and lossy["draft_weights"] == "bf16"
    assert planned_with({"bf16": 0.9, "int4": 0.9})["draft_weights"] == "int4"
    cfg = sweep.planned(point.cfg, lossy)
    assert (cfg.draft.draft_weights, cfg.draft.draft_budget) == ("bf16", 24)


POLICY_SWEEP = """
model_name = "JackFram/llama-68m"
random_weights = true
prefix_len = 96
B = 2
draft_budget = [0, 48]
gamma = 2
methods = ["baseline", "selfspec", "standalone"]
draft_name = "JackFram/llama-68m"
draft_policy = ["streaming", "snapkv", "retrieval"]
gen_len = 8
sinks = 4
"""


def test_draft_policy_is_a_grid_axis(tmp_path):
    """Every policy at every budget for both model drafts (a selection needs a budget, and the self-draft a budget
    below the prompt: budget 0, the full cache, is the standalone draft's streaming only), each record labelled with
    its policy, with its acceptance and the cost model counting the slots its draft reads."""
    out = tmp_path / "out"
    assert make(tmp_path, POLICY_SWEEP).run(None) == 0
    recs = {r["label"]: r for r in records(out).values()}
    expected = {"baseline", "standalone llama-68m full"} | {f"{m} b48" for m in ("selfspec", "standalone llama-68m")}
    expected |= {f"{m} {d} b48" for m in ("selfspec", "standalone llama-68m") for d in ("snapkv", "retrieval")}
    assert set(recs) == expected
    for label, r in recs.items():
        if r["method"] == "baseline":
            continue
        assert r["draft_policy"] == next((d for d in ("snapkv", "retrieval") if d in label), "streaming")
        assert 0 <= r["metrics"]["alpha"] <= 1 and r["metrics"]["cost_model"]["T_D"] > 0
    assert recs["standalone llama-68m full"]["metrics"]["alpha"] == 1.0  # its own model, full cache
    # the draft model has the target's name, seed and so weights: selecting from its own prefill keeps what
    # self-speculation selects from the target's, and accepts the same
    for policy in ("", " snapkv", " retrieval"):
        assert recs[f"selfspec{policy} b48"]["metrics"]["alpha"] == \
            recs[f"standalone llama-68m{policy} b48"]["metrics"]["alpha"]


EVERY = """
model_name = "JackFram/llama-68m"
random_weights = true
prefix_len = 96
B = 2
gamma = 2
gen_len = 8
sinks = 4
draft_budget = 48
draft_name = "JackFram/llama-68m"
synthetic_acceptance = 0.8
[hierarchy]
draft = "ngram"
synthetic_bottom = 0.6
"""


def test_every_registered_drafter_runs_in_a_sweep(tmp_path):
    """methods = every registered drafter: each gets a record with its speedup and its cost model's prediction (or
    the reason there is none), on one target and one prefill."""
    import numpy as np

    from magicdec.drafters.datastore import Datastore, suffix_array

    names = drafters.names()
    tokens = np.random.default_rng(0).integers(0, 32000, 2000).astype(np.int32)  # llama-68m's vocabulary
    Datastore(tokens, suffix_array(tokens), {"depth": 16, "vocab_size": 32000, "fingerprint": "random ids"}).save(
        tmp_path / "store.npz")
    text = f"methods = {json.dumps(['baseline', *names])}\n" + EVERY + f'[rest]\ndatastore = "{tmp_path / "store.npz"}"\n'
    text += "[lookahead]\nngram_size = 3\n"  # its tree gamma deep: a window of gamma + 3 - N >= 2 columns
    assert make(tmp_path, text).run(None) == 0
    recs = records(tmp_path / "out")
    assert {r["method"] for r in recs.values()} == {"baseline", *names}
    for r in recs.values():
        assert (r["prefix_len"], r["B"], r["gen_len"]) == (96, 2, 8), r["label"]
        check_counts(r, B=2, gen_len=8)
        if r["method"] != "baseline":
            assert r["gamma"] == 2 and r["label"].startswith(r["method"]), r["label"]
            cost = r["metrics"]["cost_model"]
            assert "speedup" in cost or "none" in cost, r["label"]


def test_interrupt_says_how_to_resume(tmp_path, monkeypatch):
    """Ctrl-C during a sweep: one line saying that running the same command again resumes, no traceback."""
    def interrupted(self, max_minutes):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep.Sweep, "run", interrupted)
    with pytest.raises(SystemExit) as e:
        sweep.main([str(_write(tmp_path, CONFIG + AUTO)), "--output_dir", str(tmp_path / "o"), "--no_progress"])
    assert e.value.code == 130


@pytest.mark.parametrize("sibling,wins", [(0.0, "chain"), (1.0, "tree")])
def test_planner_chooses_chain_or_tree(tmp_path, sibling, wins):
    """An auto point listing tree widths plans over (budget, width) with gamma: a tree whose later candidates are
    never kept yields what its chain yields at a higher verification cost, and loses at every gamma; one whose later
    candidates are always kept yields gamma + 1 per verification and wins (a GPU-like device, where the extra nodes
    cost next to nothing at this size). A planned width tree then runs under AutoGamma (gamma auto: a chain or the
    tree per verification)."""
    text = (TINY_SWEEP + 'gamma = [1, 2, 3]\nmethods = ["baseline", "auto"]\nsynthetic_acceptance = 0.8\n' + AUTO
            + f"tree_width = [1, 3]\nsynthetic_siblings = [{sibling}]\n")
    sw = make(tmp_path, text)
    sw.load(sw.points[0].cfg)
    point = next(p for p in sw.points if p.method == "auto")
    assert point.candidates["widths"] == [1, 3]
    sw.cost_device = cm.Device(bandwidth=3.0e12, matmul_flops=7e14)
    planned = sw.plan_budget(point)
    speculative = [o for o in planned["options"] if o["method"] != "baseline"]
    chain = {o["gamma"]: o["speedup"] for o in speculative if o["tree_width"] is None}
    tree = {o["gamma"]: o["speedup"] for o in speculative if o["tree_width"] == 3}
    assert set(chain) == set(tree) == {1, 2, 3}
    if wins == "chain":
        assert all(tree[g] <= chain[g] for g in chain) and planned["tree_width"] is None
    else:
        assert all(tree[g] > chain[g] for g in chain) and planned["tree_width"] == 3
        cfg = sweep.planned(point.cfg, planned)
        assert cfg.speculation.tree_width == 3 and cfg.speculation.auto
        assert sweep.room_ahead(point) >= cfg.lookahead


def test_planner_chooses_among_sequoia_trees(tmp_path):
    """An auto point listing tree_nodes plans over Sequoia's trees too (each shaped for the synthetic rates, as deep
    as the gamma): with later candidates always kept a tree beats the chain at every gamma, and more nodes yield
    more, so the planner takes a tree; the planned config drafts it at its gamma, and the caches have room for it."""
    text = (TINY_SWEEP + 'gamma = [1, 2, 3]\nmethods = ["baseline", "auto"]\nsynthetic_acceptance = 0.8\n' + AUTO
            + "tree_nodes = [0, 6, 12]\nsynthetic_siblings = [1.0]\n")
    sw = make(tmp_path, text)
    sw.load(sw.points[0].cfg)
    point = next(p for p in sw.points if p.method == "auto")
    assert point.candidates["nodes"] == [0, 6, 12]
    sw.cost_device = cm.Device(bandwidth=3.0e12, matmul_flops=7e14)
    planned = sw.plan_budget(point)
    speculative = [o for o in planned["options"] if o["method"] != "baseline"]
    by = {(o["tree_nodes"], o["gamma"]): o["speedup"] for o in speculative}
    assert set(by) == {(n, g) for n in (None, 6, 12) for g in (1, 2, 3)}
    assert all(by[(6, g)] > by[(None, g)] for g in (1, 2, 3))
    assert planned["tree_nodes"] in (6, 12) and planned["tree_width"] is None
    cfg = sweep.planned(point.cfg, planned)
    assert cfg.speculation.tree_nodes == planned["tree_nodes"] and cfg.speculation.gamma == (planned["gamma"],)
    assert cfg.speculation.drafted_tree(planned["gamma"]).size <= planned["tree_nodes"]
    assert sweep.room_ahead(point) >= cfg.lookahead


def test_chain_alpha_inverts_omega():
    """The chain acceptance a tree's yield is put in as: by hand, 1 + 0.5 + 0.25 tokens at gamma 2 is alpha 0.5."""
    assert cm.chain_alpha(1.75, 2) == pytest.approx(0.5, abs=1e-9)
    assert cm.chain_alpha(3.0, 2) == 1.0 and cm.chain_alpha(1.0, 3) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("kind", ["tree_width", "tree_nodes"])
def test_a_planned_tree_runs(tmp_path, monkeypatch, kind):
    """An auto point whose planner chose a tree (forced here: which wins depends on the CPU's measured costs) runs it:
    a width tree under AutoGamma, which verifies the tree or a chain each time (its use per width recorded), a
    Sequoia tree fixed at its nodes and planned gamma; the record says which."""
    real = sweep.Sweep.plan_budget
    size = 3 if kind == "tree_width" else 9

    def tree_chosen(self, point):
        return real(self, point) | {kind: size, "gamma": 2}

    monkeypatch.setattr(sweep.Sweep, "plan_budget", tree_chosen)
    text = (TINY_SWEEP + 'gamma = [1, 2]\nmethods = ["baseline", "auto"]\nsynthetic_acceptance = 0.8\n' + AUTO
            + f"{kind} = [{1 if kind == 'tree_width' else 0}, {size}]\nsynthetic_siblings = [0.6]\n")
    assert make(tmp_path, text).run(None) == 0
    auto = next(r for r in records(tmp_path / "out").values() if r["method"] == "auto")
    assert auto["config"][kind] == size and auto["planner"][kind] == size
    check_counts(auto, B=2, gen_len=8)
    if kind == "tree_nodes":
        assert auto["gamma"] == 2 and len(auto["metrics"]["speculation"]["per_rank"]["reached"]) >= 2
    else:
        policy = auto["metrics"]["speculation"]["auto_gamma"]
        used = sum(policy["iterations_per_gamma"].values()) + sum(policy["tree_iterations_per_gamma"].values())
        assert auto["gamma"] is None and auto["config"]["gamma"] == ["auto"] and used >= 1


# ------------------------------------------------------------------ faults: a second writer, broken records, SIGTERM
# Each stops the sweep before its models load (what is tested is which points it takes as done, and how it ends).

TWO_POINTS = TINY_SWEEP + 'gamma = [2]\nmethods = ["baseline", "selfspec"]\n'
PAUSED_AFTER_LOCK = """
from magicdec.harness import sweep
sweep.Sweep.check = lambda self, todo: reached()  # the folder locked, nothing loaded yet
"""


class Stopped(Exception):
    pass


def points_to_run(monkeypatch) -> list:
    """Make Sweep.run stop where it would load the models; the points it was about to run are appended here."""
    todo = []

    def check(self, points):
        todo.extend(points)
        raise Stopped

    monkeypatch.setattr(sweep.Sweep, "check", check)
    return todo


def recorded_by_hand(sw: sweep.Sweep, point) -> Path:
    """A whole record of `point`, as the sweep writes it (its models never loaded)."""
    sw.write(point.key, {"point": point.key, "method": point.method, "label": point.cfg.describe(),
                         "prefix_len": 48, "B": 2, "decoding": "greedy", "metrics": {"decode_tokens_per_s": 1.0}})
    return sw.out / f"{point.key}.json"


def test_a_second_sweep_into_a_folder_in_use_stops_at_once_naming_the_first(tmp_path, capsys):
    """Two sweeps into one folder would both time every point and both write its record: the second is refused in
    one line naming the first's pid, before it loads anything; once the first is gone the folder is free."""
    from test_errors import CLI, PRELUDE

    config, out = _write(tmp_path, TWO_POINTS), tmp_path / "out"
    first = subprocess.Popen([sys.executable, "-c", PRELUDE + PAUSED_AFTER_LOCK + CLI, "sweep", str(config),
                              "--output_dir", str(out), "--device", "cpu", "--no_progress"], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ | {"PYTHONPATH": str(REPO)})
    try:
        for line in first.stdout:
            if line.strip() == "reached":
                break
        with pytest.raises(SystemExit) as e:
            sweep.main([str(config), "--output_dir", str(out), "--device", "cpu", "--no_progress"])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: --output_dir {out} is in use by another sweep (pid {first.pid}): let it finish (or "
                       f"stop it: kill {first.pid}), or give this one another --output_dir"]
        assert not list(out.glob("*.json"))
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate()
    assert first.returncode == 143 and not (out / sweep.LOCK).exists()
    with files.locked(out / sweep.LOCK, lambda pid: f"still held by {pid}"):  # free: taken at once
        pass


def test_a_cut_short_or_empty_record_is_never_taken_as_done(tmp_path, capsys, monkeypatch):
    """A record cut short (a full disk, a failed copy) or emptied is moved to broken/ with a line, and its point runs
    again; a point's batches so far, likewise. A whole record is kept."""
    sw = make(tmp_path, TWO_POINTS)
    base, spec = (recorded_by_hand(sw, p) for p in sw.points)
    whole = base.read_bytes()
    todo = points_to_run(monkeypatch)
    assert sw.run(None) == 0 and todo == [] and "0 of 2 points to run" in capsys.readouterr().out
    base.write_bytes(whole[:100])
    spec.write_bytes(b"")
    with pytest.raises(Stopped):
        sw.run(None)
    said = capsys.readouterr().out
    assert f"{base}: not readable JSON (" in said and f"{spec}: not readable JSON (empty); moved to " in said
    assert "2 of 2 points to run" in said and [p.key for p in todo] == [p.key for p in sw.points]
    assert (sw.out / "broken" / base.name).read_bytes() == whole[:100] and (sw.out / "broken" / spec.name).exists()
    assert not base.exists() and not spec.exists() and not (sw.out / sweep.LOCK).exists()
    recorded_by_hand(sw, sw.points[0])
    (sw.out / ".batches").mkdir()
    (sw.out / ".batches" / spec.name).write_text('{"batches": [')  # a point's first batches, cut short
    todo.clear()
    with pytest.raises(Stopped):
        sw.run(None)
    assert [p.key for p in todo] == [sw.points[1].key] and sw.partial(sw.points[1]) == {"batches": []}
    assert (sw.out / "broken" / f"{spec.stem}.batches.json").exists()
    assert "moved to" in capsys.readouterr().out


def test_sigterm_mid_sweep_keeps_the_finished_points_and_says_how_many(tmp_path):
    from test_errors import CLI, ended_with, terminated_at

    sw = make(tmp_path, TWO_POINTS)
    done = recorded_by_hand(sw, sw.points[0])
    whole = done.read_bytes()
    p = terminated_at(PAUSED_AFTER_LOCK + CLI, ["sweep", _write(tmp_path, TWO_POINTS), "--output_dir", sw.out,
                                                "--device", "cpu", "--no_progress"])
    ended_with(p, 143, f"interrupted: 1 of 2 points done in {sw.out}; run the same command again to resume")
    assert done.read_bytes() == whole and not list(sw.out.rglob("*.tmp")) and not (sw.out / sweep.LOCK).exists()
def test_a_time_limit_shorter_than_the_set_up_still_makes_progress(tmp_path, monkeypatch, capsys):
    """The limit counts the set-up (loading, probing), but a run past it still records a point before it stops: a
    budget shorter than the set-up still records a point, so running the command again resumes further (it
    recorded nothing, and so never progressed)."""
    from magicdec.model.checkpoint import convert_llama2c

    model = convert_llama2c(STORIES / "stories260K.bin", tmp_path / "stories", STORIES / "tok512.bin")
    text = (f'model = "{model}"\ndataset = "stdlib"\nskip_tokens = 0\nprefix_len = 48\nB = 2\ngen_len = 8\n'
            'draft_budget = 24\nsinks = 4\ngamma = 2\nmethods = ["baseline", "selfspec"]\n')
    monkeypatch.setattr(sweep.Sweep, "probe", lambda self, cfg: 1e-3)  # the set-up's timing is not the point here
    assert make(tmp_path, text).run(max_minutes=1e-9) == 1
    assert [r["method"] for r in records(tmp_path / "out").values()] == ["baseline"]
    assert "past --max_minutes 1e-09: one point is recorded, then the sweep stops" in capsys.readouterr().out


@pytest.mark.parametrize("minutes", ["0", "-1", "nan", "inf"])
def test_a_time_limit_that_is_no_time_is_refused_first(tmp_path, monkeypatch, capsys, minutes):
    monkeypatch.setattr(sweep.Sweep, "run", lambda *a: pytest.fail("the sweep started"))
    with pytest.raises(SystemExit) as e:
        sweep.main([str(_write(tmp_path, CONFIG + AUTO)), "--output_dir", str(tmp_path / "o"), "--max_minutes",
                    minutes])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: --max_minutes {minutes}: give a finite positive number of minutes"), err


@pytest.mark.parametrize("old,new,needle", [
    ('"96" = 0.7}', '"abc" = 0.7}', "synthetic_acceptance = {'48': 0.9, 'abc': 0.7}: give a rate in [0, 1], or rates "
                                    "by prefix length"),
    ('"96" = 0.7}', '"96" = "high"}', "synthetic_acceptance = {'48': 0.9, '96': 'high'}"),
    ('{"48" = 0.9, "96" = 0.7}', '"x"', "synthetic_acceptance = 'x': give a rate"),
    ('methods = ["baseline", "selfspec", "standalone", "auto"]', "methods = []", "methods is empty"),
    ("", '[selfspec]\ncolour = 1\n', "[selfspec] colour is no run option (magicdec run --help), not of selfspec"),
    ("", '[selfspec]\nngram_max = 2\n', "[selfspec] ngram_max is an option of hierarchy, lookup, not of selfspec: move "
                                        "it to its method's table or drop it"),
    ("", '[baseline]\ngamma = 2\n', "[baseline] gamma is no run option (magicdec run --help), not of baseline"),
    ("", '[selfspec]\nsynthetic_acceptance = {"x" = 1}\n', "[selfspec] synthetic_acceptance = {'x': 1}"),
    ('[auto]\ndrafter = "selfspec"\n', '[auto]\ndrafter = "quokka"\n', "[auto] drafter: unknown drafter 'quokka'"),
    ('[auto]\ndrafter = "selfspec"\n', '[auto]\ndrafter = 5\n',
     "[auto] drafter = 5: name the drafter the planner plans"),
])
def test_a_sweep_file_that_would_run_something_else_is_one_line(tmp_path, old, new, needle):
    """Read in one line before anything runs: a synthetic_acceptance table that is no table of rates (a traceback),
    no methods (ran nothing, exit 0), an option in a method's table that the method does not take (dropped without a
    word)."""
    text = (CONFIG + AUTO).replace(old, new) if old else CONFIG + AUTO + new
    with pytest.raises(drafters.MagicDecError) as e:
        sweep.load_config(_write(tmp_path, text))
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_source_too_small_for_a_point_is_said_before_anything_loads(tmp_path, monkeypatch):
    """Every batch of prompts the grid takes is cut when the points are checked: a point whose B prompts of
    prefix_len the dataset does not hold fails the sweep in seconds (it came after the target had loaded, the device
    been probed and the groups before it run)."""
    from magicdec.model.checkpoint import convert_llama2c

    model = convert_llama2c(STORIES / "stories260K.bin", tmp_path / "stories", STORIES / "tok512.bin")
    (tmp_path / "book.txt").write_text("Once upon a time there was a little girl. " * 20)
    text = (f'model = "{model}"\ndataset = "{tmp_path / "book.txt"}"\nskip_tokens = 0\nprefix_len = 100\n'
            'B = [1, 8]\ngen_len = 4\nmethods = ["baseline"]\n')
    monkeypatch.setattr(sweep.Sweep, "load", lambda *a: pytest.fail("the sweep loaded its target"))
    with pytest.raises(drafters.MagicDecError) as e:
        make(tmp_path, text).run(None)
    assert "point baseline_P100_B8_greedy: " in str(e.value), str(e.value)
    assert "prompts of prefix_len 100 after skipping 0 tokens per document, but batch_size 8 were asked for" in \
        str(e.value), str(e.value)


def test_a_points_rounds_pair_across_batches_by_hand():
    """Over two batches, round r's rate is the tokens both batches decoded in their round r over their seconds; a
    batch's speedup is the median of its rounds' ratios. Worked out by hand: batch 1 rounds (100 tok, 1 s), (80 tok,
    1 s), (100 tok, 2 s); batch 2 (50 tok, 1 s) each; baseline 50 tok in 1 s every round of both."""
    def entry(rounds, first=None):
        return {"counts": [1], "seconds": rounds[0][1], "stats": dataclasses.asdict(sweep.Stats(gamma=1)), "round_s": [r[1] for r in rounds],
                "round_tokens": [(d, s, *(first or (None, None))) for d, s in rounds]}

    b1 = entry([(100, 1.0), (80, 1.0), (100, 2.0)], first=(30, 0.25)) | {
        "baseline": entry([(50, 1.0)] * 3, first=(20, 0.5))}
    b2 = entry([(50, 1.0)] * 3, first=(10, 0.25)) | {"baseline": entry([(50, 1.0)] * 3, first=(20, 0.5))}
    rates = sweep.combined([b1, b2])[4]
    assert rates == [(75.0, 80.0), (65.0, 80.0), (50.0, 80.0)]  # (150 / 2, 40 / 0.5), (130 / 2, ...), (150 / 3, ...)
    assert sweep.batch_speedup(b1) == 1.6  # ratios 2.0, 1.6, 1.0
    assert sweep.combined([b1, entry([(50, 1.0)])])[4] == [(75.0, None)]  # one round in both; no first-done span


def test_shards_split_the_grid_by_group_and_cover_it_once(tmp_path):
    """--shard I/N: every point in exactly one shard, the points of one (context, batch) together in one shard, and
    the groups dealt out in turn (here 2 contexts x 2 batches: shard 1 of 2 holds (48, 2) and (96, 2))."""
    text = CONFIG.replace("B = [2]", "B = [2, 3]") + AUTO
    whole = make(tmp_path, text).points
    shards = [sweep.Sweep(sweep.load_config(tmp_path / "sweep.toml"), tmp_path / f"o{i}", "cpu", False,
                          shard=(i, 2)).points for i in (1, 2)]
    keys = [sorted(p.key for p in s) for s in shards]
    assert sorted(keys[0] + keys[1]) == sorted(p.key for p in whole) and not set(keys[0]) & set(keys[1])
    groups = [{(p.cfg.workload.prefix_len, p.cfg.workload.B) for p in s} for s in shards]
    assert groups == [{(48, 2), (96, 2)}, {(48, 3), (96, 3)}]
    with pytest.raises(drafters.MagicDecError, match=r"--shard 5/5: the grid has 4 groups of points"):
        sweep.Sweep(sweep.load_config(tmp_path / "sweep.toml"), tmp_path / "o", "cpu", False, shard=(5, 5))


@pytest.mark.parametrize("shard", ["0/4", "5/4", "2", "a/b"])
def test_a_shard_that_is_none_is_refused_first(tmp_path, monkeypatch, capsys, shard):
    monkeypatch.setattr(sweep.Sweep, "run", lambda *a: pytest.fail("the sweep started"))
    with pytest.raises(SystemExit) as e:
        sweep.main([str(_write(tmp_path, CONFIG + AUTO)), "--output_dir", str(tmp_path / "o"), "--shard", shard])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: --shard {shard}: give I/N"), err


def test_a_resumed_sweep_whose_first_point_does_not_fit_records_it_as_skipped(tmp_path, monkeypatch):
    """The target loads for the points left, whatever their size: a sweep resumed (or a shard) whose first point left
    does not fit records it as skipped, as the first run would have (the load checked that point's whole cache and
    failed the sweep: the one-GPU atlas stopped so on resuming at 100K x 32)."""
    gib = 1 << 30
    monkeypatch.setattr(dev, "memory", lambda d: (int(2.6 * gib), 10 * gib))  # 2 GiB headroom: 0.6 GiB to use
    text = TINY_SWEEP.replace("batch_sizes = [2]", "batch_sizes = [1, 512]") + 'gamma = [2]\nmethods = ["baseline", "selfspec"]\n'
    path = _write(tmp_path, text)
    big = sweep.Sweep(sweep.load_config(path), tmp_path / "out", "cpu", False, shard=(2, 2))
    assert {p.cfg.workload.B for p in big.points} == {512}
    assert big.run(None) == 0
    assert all("skipped" in r for r in records(tmp_path / "out").values()) and len(records(tmp_path / "out")) == 2


def test_a_trees_cost_model_check_takes_its_measured_acceptance_vector(tmp_path):
    """A tree run with no --synthetic_siblings: the record's prediction is made at the run's own acceptance vector
    (rank 0 for a node's first child, rank 1 for its sibling), not left out. Prompt lookup's width-2 tree on
    stories260K (a real tiny model) over a story it retells, so both ranks keep something: Ω against the width-2 chain's yield written out by hand,
    each depth reached through the first children, a rejected first child's sibling kept at rank 1's rate and
    ending the path: 1 + sum over depths d of a^(d-1) (a + (1 - a) s)."""
    from magicdec.model.checkpoint import convert_llama2c

    model = convert_llama2c(STORIES / "stories260K.bin", tmp_path / "stories", STORIES / "tok512.bin")
    book = tmp_path / "book.txt"
    book.write_text(("Once upon a time, there was a little girl named Lily. Once upon a time, there was a little boy "
                     "named Tom. She liked to play. He liked to run. ") * 40)
    text = (f'model = "{model}"\ndataset = "{book}"\nskip_tokens = 0\nprefix_len = [96]\nB = [2]\ngen_len = 24\n'
            'gamma = 3\ndecoding = ["greedy"]\nmethods = ["baseline", "lookup"]\n[lookup]\ntree_width = 2\n')
    assert make(tmp_path, text).run(None) == 0
    (rec,) = [r for r in records(tmp_path / "out").values() if r["method"] == "lookup"]
    ranks = rec["metrics"]["speculation"]["per_rank_acceptance"]
    assert ranks is not None and ranks[0] is not None and ranks[1] is not None, ranks
    a, s = ranks[0], ranks[1]
    cost = rec["metrics"]["cost_model"]
    assert cost["omega"] == pytest.approx(1 + sum(a ** (d - 1) * (a + (1 - a) * s) for d in (1, 2, 3)))
