"""Sweeps: the grid a config file names, one record per point, resumed after a crash without redoing finished
points, stopped cleanly by a time limit, bad configs refused in one line."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import DATA, TINY_SWEEP, one_line_error, run_cli
from magicdec import cost_model as cm
from magicdec import sweep
from magicdec.planner import plan
from magicdec.runs import ring_extra_for

CONFIG = """
model_name = "JackFram/llama-68m"
random_weights = true
prefix_lens = [48, 96]
batch_sizes = [2]
budgets = [24, 64]
gammas = [1, 2]
methods = ["baseline", "selfspec", "longspec", "auto"]
draft_name = "JackFram/llama-68m"
modes = ["greedy"]
gen_len = 8
sinks = 4
synthetic_acceptance = {"48" = 0.9, "96" = 0.7}
"""


def expected_names():
    names = set()
    for P in (48, 96):
        names.add(f"baseline_P{P}_B2_greedy")
        names.add(f"auto_P{P}_B2_greedy")
        for method in ("selfspec", "longspec"):
            for b in (24, 64):
                if b < P:
                    names |= {f"{method}_P{P}_B2_greedy_b{b}_g{g}" for g in (1, 2)}
    return names


def records(d: Path) -> dict[str, dict]:
    return {f.stem: json.loads(f.read_text()) for f in d.glob("*.json")}


def test_sweep_crash_resume_and_time_limit(tmp_path, monkeypatch):
    cfg = sweep.load_config(_write(tmp_path, CONFIG))
    out = tmp_path / "out"
    assert sweep.Sweep(cfg, out, torch.device("cpu"), False).run(max_minutes=0) == len(expected_names())
    assert not records(out)  # a time limit already spent: nothing started

    real_write, written = sweep.Sweep.write, []

    def crashing_write(self, name, rec):
        if len(written) == 4:
            raise RuntimeError("simulated crash (a lost device, a killed call)")
        real_write(self, name, rec)
        written.append(name)

    monkeypatch.setattr(sweep.Sweep, "write", crashing_write)
    with pytest.raises(RuntimeError, match="simulated crash"):
        sweep.Sweep(cfg, out, torch.device("cpu"), False).run(max_minutes=None)
    monkeypatch.setattr(sweep.Sweep, "write", real_write)
    before = {f.name: f.stat().st_mtime_ns for f in out.glob("*.json")}
    assert len(before) == 4 and not list(out.glob(".*.tmp"))

    assert sweep.Sweep(cfg, out, torch.device("cpu"), False).run(max_minutes=None) == 0
    recs = records(out)
    assert set(recs) == expected_names()
    assert {f.name: f.stat().st_mtime_ns for f in out.glob("*.json") if f.name in before} == before  # not redone
    for name, r in recs.items():
        m = r["metrics"]
        assert r["point"] == name and r["B"] == 2 and m["decode_tokens_per_s"] > 0
        assert r["synthetic_acceptance"] == {48: 0.9, 96: 0.7}[r["prefix_len"]]
        if r["method"] in ("selfspec", "longspec"):
            assert m["measured_speedup"] > 0 and m["cost_model"]["speedup"] > 0
            assert m["speculation"]["gamma"] == r["gamma"]
            pred = m["cost_model"]  # T_O (the probed fixed cost per verification) counts in the denominator
            t_o = pred["device_model"]["verify_overhead_s"]
            assert t_o >= 0 and pred["T_O_over_T_T"] == pytest.approx(t_o / pred["T_T"])
            assert pred["speedup_effective"] == pytest.approx(m["omega_effective"] / (
                r["gamma"] * pred["T_D_over_T_T"] + pred["T_V_over_T_T"] + pred["T_O_over_T_T"]))
        if r["method"] == "auto":
            assert r["planner"]["budget"] in (24, 64) and r["budget"] == r["planner"]["budget"]
            assert r["planner"]["spread"] >= 0 and set(r["planner"]["spread_by_budget"]) == {"24", "64"}
            used = m["speculation"]["auto_gamma"]["iterations_per_gamma"]
            assert sum(used.values()) == m["iterations"] and set(map(int, used)) <= {0, 1, 2}
    assert (out / "commands.txt").read_text().count("python -m magicdec.sweep") == 3  # every run with points to do


def test_verification_probe_fits_the_fixed_cost_per_verification(tmp_path, monkeypatch):
    """The probe times gamma-1 verifications at B = 1 (draft at the smallest budget, 256 cached tokens) and fits
    T_O to them: a verification timed 0.3 ms slower than the model's draft step plus target step gives 0.3 ms, for
    the self-draft and for the standalone draft, each against its own draft's step."""
    cfg = sweep.load_config(_write(tmp_path, CONFIG))
    sw = sweep.Sweep(cfg, tmp_path / "out", torch.device("cpu"), False)
    sw.load()
    assert set(sw.verify_overhead) == {"selfspec", "longspec"}

    def timed(dec, cache, first, prev, args, eos, progress):
        assert dec.gamma == 1 and first.shape == (1,) and args.prefix_len == 256
        dec.stats.iterations = 10
        draft = sw.draft_config if dec.draft.model is not sw.target else None
        p = cm.predict(sw.config, sw.cost_device, 1, 256 + args.gen_len // 2, 1, 0.5, 24, draft, sw.ring_extra())
        return None, None, 10 * (p["T_D"] + p["T_V"] + 0.3e-3)

    monkeypatch.setattr(sweep.runs, "timed_generation", timed)
    for method in ("selfspec", "longspec"):
        assert sw.probe_verification(method, 32) == pytest.approx(0.3e-3)
        sw.verify_overhead[method] = 0.3e-3
        assert sw.device_for(method).verify_overhead_s == 0.3e-3


def test_synthetic_alpha_interpolates_in_log_prefix():
    cfg = sweep.DEFAULTS | {"synthetic_acceptance": {"4096": 0.84, "100000": 0.79}}
    assert sweep.synthetic_alpha(cfg, 1000) == 0.84 and sweep.synthetic_alpha(cfg, 200_000) == 0.79
    mid = round(math.exp((math.log(4096) + math.log(100_000)) / 2))
    assert sweep.synthetic_alpha(cfg, mid) == pytest.approx(0.815, abs=1e-4)
    assert sweep.synthetic_alpha(sweep.DEFAULTS | {"synthetic_acceptance": 0.8}, 123) == 0.8


def _write(tmp_path, text, name="sweep.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("old,new,needle", [
    ("sinks = 4", "colour = 'blue'", "unknown keys"),
    ('"longspec", "auto"]', '"medusa"]', "unknown methods ['medusa']"),
    ("gammas = [1, 2]", "gammas = [0, 1]", "gammas must be >= 1"),
    ("gen_len = 8", "gen_len = 8 8", "cannot read sweep config"),
    ("sinks = 4", "sinks = 4\nmin_seconds = -1", "min_seconds >= 0"),
    ("budgets = [24, 64]", "budgets = [24, 96]", "budgets [96] are >= every prefix_len (largest 96)"),
    ("sinks = 4", "sinks = 4\nskip_tokens = [0, 0]", "skip_tokens must be a non-negative integer or a list of distinct"),
    ("sinks = 4", "sinks = 4\nhistory = ['/no/such']", "history directories ['/no/such'] do not exist"),
    ("sinks = 4", 'sinks = 4\ndraft_policies = ["h2o"]', "draft_policies must be among"),
    ("sinks = 4", 'sinks = 4\ndraft_policies = ["snapkv"]', "budgets [24] must exceed the 32-token window"),
])
def test_bad_config_is_one_line(tmp_path, old, new, needle):
    p = run_cli(_write(tmp_path, CONFIG.replace(old, new)), "--output_dir", str(tmp_path / "o"),
                launcher=("-m", "magicdec.sweep"))
    one_line_error(p, needle)


def test_longspec_needs_a_draft_and_context_is_checked(tmp_path):
    no_draft = CONFIG.replace('draft_name = "JackFram/llama-68m"', "")
    one_line_error(run_cli(_write(tmp_path, no_draft), "--output_dir", str(tmp_path / "o"),
                           launcher=("-m", "magicdec.sweep")), "longspec needs a draft")
    too_long = CONFIG.replace("prefix_lens = [48, 96]", "prefix_lens = [48, 4096]")
    one_line_error(run_cli(_write(tmp_path, too_long, "b.toml"), "--output_dir", str(tmp_path / "o"),
                           launcher=("-m", "magicdec.sweep")), "exceeds the model's context")


def test_sweep_skips_what_the_scripts_refuse(tmp_path, monkeypatch):
    """A group runs only if its caches fit beside the weights (loaded once per sweep) with the same headroom that
    the scripts' check keeps: 6% of the device, at least 2 GiB."""
    from magicdec import benchmark as bench

    s = sweep.Sweep(sweep.load_config(_write(tmp_path, CONFIG)), tmp_path / "out", torch.device("cpu"), False)
    c = s.config
    parts = [(c, False, s.slots(96))] + [(c, False, b + s.ring_extra()) for b in (24, 64)] * 2  # selfspec + longspec
    need = bench.memory_needed(2, 8192, torch.float32, parts)
    gib = 1 << 30
    monkeypatch.setattr(bench, "total_memory", lambda device: 100 * gib)
    for spare, fits in ((0, True), (-1, False)):
        monkeypatch.setattr(bench, "available_memory", lambda device: need["total"] - need["weights"] + 6 * gib + spare)
        assert s.fits(2, 96) is fits


def test_sampled_sweeps_probe_and_model_the_sampling_cost(tmp_path):
    """A sweep with sampled decoding times its sampler at load, and its sampled points' predictions (and the
    planner's) count the rows of logits each step turns into probabilities; greedy sweeps leave it out."""
    greedy = sweep.Sweep(sweep.load_config(_write(tmp_path, CONFIG)), tmp_path / "g", torch.device("cpu"), False)
    greedy.load()
    assert greedy.cost_device.sampling_s_per_logit == 0.0
    cfg = sweep.load_config(_write(tmp_path, CONFIG.replace('modes = ["greedy"]', 'modes = ["greedy", "sampled"]')))
    sw = sweep.Sweep(cfg, tmp_path / "s", torch.device("cpu"), False)
    sw.load()
    per_logit = sw.cost_device.sampling_s_per_logit
    assert per_logit > 0
    m = {"alpha": 0.8, "omega_effective": 2.0}
    greedy_p = sw.predicted(48, 2, 24, 2, m, "selfspec", "greedy")
    sampled_p = sw.predicted(48, 2, 24, 2, m, "selfspec", "sampled")
    V = sw.config.vocab_size
    assert sampled_p["T_T"] == pytest.approx(greedy_p["T_T"] + 2 * V * per_logit)
    assert sampled_p["T_V"] == pytest.approx(greedy_p["T_V"] + 2 * 3 * V * per_logit)
    _, chosen = sw.plan_budget(48, 2, "sampled", 0.9)
    args = (sw.config, sw.device_for("longspec"), 2, 48 + cfg["gen_len"] // 2, [24], cfg["gammas"], {24: 0.9},
            sw.draft_config)  # auto drafts with the standalone draft where the sweep has one
    kw = dict(tokens=cfg["gen_len"] - 1, spread={24: chosen["spread"]}, ring_extra=sw.ring_extra())
    sampled_options = [vars(o) for o in plan(*args, **kw, sampled=True)[1]]
    assert chosen["options"] == sampled_options != [vars(o) for o in plan(*args, **kw)[1]]


BATCHES = TINY_SWEEP + f"""
tokenizer = "{DATA / 'tokenizers' / 'llama2' / 'tokenizer.model'}"
dataset = "{DATA / 'gutenberg'}"
gammas = [1, 2]
methods = ["baseline", "selfspec", "auto"]
"""  # random weights but real text: each batch of prompts differs


def per_sequence(r):
    return r["metrics"]["speculation"]["per_sequence"]


def test_several_batches_per_point_add_up_to_the_single_batch_sweeps(tmp_path):
    """skip_tokens = [0, 500] times every point on two batches of prompts: its record equals the two one-batch
    sweeps put together (fp32 greedy on the CPU, so each batch's decoding is the same in both): iterations summed,
    the sequences' acceptance side by side, tokens per verification and throughput over both batches."""
    singles, given = {}, BATCHES + "synthetic_acceptance = 0.7\n"  # a random model's own drafts all fail
    for skip in (0, 500):
        out = tmp_path / f"skip{skip}"
        cfg = sweep.load_config(_write(tmp_path, given + f"skip_tokens = {skip}\n"))
        assert sweep.Sweep(cfg, out, torch.device("cpu"), False).run(None) == 0
        singles[skip] = records(out)
    cfg = sweep.load_config(_write(tmp_path, given + "skip_tokens = [0, 500]\n"))
    out = tmp_path / "both"
    assert sweep.Sweep(cfg, out, torch.device("cpu"), False).run(None) == 0
    both = records(out)
    assert set(both) == set(singles[0]) and not list((out / ".batches").glob("*"))  # no leftover partial timings
    for name, r in both.items():
        m, one, two = r["metrics"], singles[0][name], singles[500][name]
        assert r["skip_tokens"] == [0, 500] and [b["skip_tokens"] for b in r["batches"]] == [0, 500]
        assert m["batches"] == 2 and m["generated_tokens"] == one["metrics"]["generated_tokens"] * 2
        assert [b["iterations"] for b in r["batches"]] == [one["metrics"]["iterations"], two["metrics"]["iterations"]]
        assert m["iterations"] == one["metrics"]["iterations"] + two["metrics"]["iterations"]
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


def test_several_batches_resume_where_they_stopped(tmp_path, monkeypatch):
    """A crash during the second batch keeps every point's first-batch timing; the next run times only what the
    second batch lacks and writes each record from both."""
    cfg = sweep.load_config(_write(tmp_path, BATCHES + "skip_tokens = [0, 500]\n"))
    out, real_finish, kept = tmp_path / "out", sweep.Sweep.finish, []

    def crashing_finish(self, P, B, point, partial, last, bar):
        if last and kept.count(True) == 1:  # the second point done with both batches
            raise RuntimeError("simulated crash")
        real_finish(self, P, B, point, partial, last, bar)
        kept.append(last)

    monkeypatch.setattr(sweep.Sweep, "finish", crashing_finish)
    with pytest.raises(RuntimeError, match="simulated crash"):
        sweep.Sweep(cfg, out, torch.device("cpu"), False).run(None)
    monkeypatch.setattr(sweep.Sweep, "finish", real_finish)
    first = {f.stem: json.loads(f.read_text())["batches"][0] for f in (out / ".batches").glob("*.json")}
    assert len(records(out)) == 1 and len(first) == len(sweep.points_of(cfg, 48, 2)) - 1
    assert sweep.Sweep(cfg, out, torch.device("cpu"), False).run(None) == 0
    for name, r in records(out).items():
        if name in first:  # the first batch's timing as kept before the crash, not timed again
            assert r["batches"][0]["decode_s"] == first[name]["seconds"]
        assert len(r["batches"]) == 2


def test_history_feeds_the_planner(tmp_path):
    """`history` directories count as this sweep's own earlier points for the planner (acceptance and spread per
    budget), records of another model excepted."""
    hist = tmp_path / "hist"
    hist.mkdir()
    sw = sweep.Sweep(sweep.load_config(_write(tmp_path, TINY_SWEEP)), tmp_path / "o", torch.device("cpu"), False)
    for model, alpha in ((sw.config.name, 0.6), ("another", 0.95)):
        (hist / f"{model.replace('/', '_')}.json").write_text(json.dumps({
            "model": model, "method": "selfspec", "budget": 24, "prefix_len": 48, "decoding": "greedy", "B": 2,
            "gamma": 2, "gen_len": 8, "metrics": {"alpha": alpha, "iterations": 4}}))
    cfg = sweep.load_config(_write(tmp_path, TINY_SWEEP + f'history = ["{hist}"]\n'))
    sw = sweep.Sweep(cfg, tmp_path / "o", torch.device("cpu"), False)
    sw.load()
    assert sw.plan_budget(48, 2, "greedy", None)[1]["alpha_by_budget"] == {24: 0.6}
    sw.cfg = cfg | {"history": []}
    assert sw.plan_budget(48, 2, "greedy", None)[1]["alpha_by_budget"] == {24: cfg["alpha_prior"]}


POLICY_SWEEP = """
model_name = "JackFram/llama-68m"
random_weights = true
prefix_lens = [96]
batch_sizes = [2]
budgets = [0, 48]
gammas = [2]
methods = ["baseline", "selfspec", "longspec"]
draft_name = "JackFram/llama-68m"
draft_policies = ["streaming", "snapkv", "retrieval"]
modes = ["greedy"]
gen_len = 8
sinks = 4
"""


def test_draft_policy_is_a_grid_axis(tmp_path):
    """Every policy at every budget for both drafting methods (a selection needs a budget: none at 0, the full
    draft cache), each record naming its policy, with its acceptance and the cost model counting the slots its
    draft reads."""
    out = tmp_path / "out"
    assert sweep.Sweep(sweep.load_config(_write(tmp_path, POLICY_SWEEP)), out, torch.device("cpu"), False).run(None) == 0
    recs = records(out)
    expected = {"baseline_P96_B2_greedy"} | {f"{m}_P96_B2_greedy_b{b}_g2" for m in ("selfspec", "longspec")
                                             for b in (0, 48)}
    expected |= {f"{m}_P96_B2_greedy_b48_g2_{d}" for m in ("selfspec", "longspec") for d in ("snapkv", "retrieval")}
    assert set(recs) == expected
    for name, r in recs.items():
        if r["method"] == "baseline":
            continue
        assert r["draft_policy"] == (name.split("_")[-1] if name.endswith(("snapkv", "retrieval")) else "streaming")
        assert 0 <= r["metrics"]["alpha"] <= 1 and r["metrics"]["cost_model"]["T_D"] > 0
    assert recs["longspec_P96_B2_greedy_b0_g2"]["metrics"]["alpha"] == 1.0  # its own model, full cache
    # the draft model has the target's name, seed and so weights: selecting from its own prefill keeps what
    # self-speculation selects from the target's, and accepts the same
    for suffix in ("", "_snapkv", "_retrieval"):
        assert recs[f"selfspec_P96_B2_greedy_b48_g2{suffix}"]["metrics"]["alpha"] == \
            recs[f"longspec_P96_B2_greedy_b48_g2{suffix}"]["metrics"]["alpha"]
    # a selected cache reads its budget plus what generation appends, StreamingLLM its budget plus the ring's slack
    s = sweep.Sweep(sweep.load_config(_write(tmp_path, POLICY_SWEEP)), tmp_path / "x", torch.device("cpu"), False)
    assert s.append() == 8 + 2 + 2 and s.ring_extra() == ring_extra_for(8, 2)
