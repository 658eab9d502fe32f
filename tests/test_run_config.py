"""The run config (magicdec/harness/run_config.py, options.py): built from option values over a script's defaults over the
dataclasses', frozen, every check that needs no file done on it, a hash of what changes a result, and a record's
config rebuilding the same run."""
from __future__ import annotations

import dataclasses
import json

import pytest

from magicdec import drafters
from magicdec.errors import MagicDecError
from magicdec.harness.run_config import RunConfig


def test_options_over_defaults_over_the_dataclasses():
    cfg = RunConfig.from_options({"drafter": "selfspec", "B": 4}, {"B": 2, "prefix_len": 999, "draft_budget": 128})
    assert cfg.workload.B == 4 and cfg.workload.prefix_len == 999 and cfg.draft.draft_budget == 128
    assert cfg.workload.gen_len == 64 and cfg.draft.sinks == 16 and cfg.speculation.gamma == (3,)
    assert cfg.runtime.device in ("cpu", "cuda") and cfg.runtime.dtype in ("float32", "bfloat16")
    assert cfg.runtime.prefill_chunk == 16384 // 4  # a device- and batch-dependent default, resolved once
    assert drafters.canonical("longspec") == "standalone"
    assert RunConfig.from_options({"drafter": "longspec", "draft_name": "x"}).speculation.drafter == "standalone"


def test_nothing_mutates_it():
    cfg = RunConfig.from_options({"drafter": "lookup"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.workload.B = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.draft.ngram_max = 1


@pytest.mark.parametrize("given,needle", [
    ({"drafter": "selfspec", "ngram_max": 2}, "--ngram_max is an option of hierarchy, lookup; this run's drafter is selfspec"),
    ({"sinks": 4}, "--sinks is an option of hierarchy, selfspec, standalone; this run's drafter is the baseline"),
    ({"gamma": [2]}, "--gamma applies to a speculative run; this is the baseline"),
    ({"drafter": "quokka"}, "unknown drafter 'quokka': choose baseline or one of"),
    ({"B": "two"}, "B = 'two': must be a number"),
    ({"B": 2.5}, "B = 2.5: must be an integer"),
    ({"drafter": "selfspec", "draft_policy": "h2o"}, "must be one of streaming, snapkv, retrieval"),
    ({"colour": "blue"}, "unknown option 'colour'"),
])
def test_bad_options_are_one_line(given, needle):
    with pytest.raises(MagicDecError, match=None) as e:
        RunConfig.from_options(given)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("given,needle", [
    ({"drafter": "selfspec", "gamma": ["auto", 3]}, "--gamma auto takes no other values"),
    ({"drafter": "lookup", "gamma": ["auto"]}, "--gamma auto times a draft's steps"),
    ({"drafter": "selfspec", "draft_budget": 4000}, "--draft_budget 4000 >= --prefix_len 4000"),
    ({"drafter": "selfspec", "draft_policy": "snapkv", "draft_budget": 32}, "must exceed the 32-token window"),
    ({"drafter": "selfspec", "refresh": 2}, "--refresh re-selects a selected cache"),
    ({"drafter": "standalone"}, "needs --draft DRAFT/model.pth"),
    ({"drafter": "hierarchy"}, "the hierarchy needs a bottom draft"),
    ({"baseline": True, "baseline_json": "b.json", "drafter": "selfspec"}, "pass one of them"),
    ({"step_mode": "compile", "device": "cpu"}, "--step_mode compile captures CUDA graphs: it needs a CUDA device"),
    ({"temperature": 0.6, "drafter": "selfspec", "synthetic_acceptance": 0.5, "tree_width": 2, "synthetic_siblings": (0.3,)},
     "a tree's sampled acceptance has no synthetic form"),
    ({"drafter": "selfspec", "synthetic_acceptance": 0.5, "synthetic_sequence_factors": (0.5,)},
     "--synthetic_sequence_factors spread a random-weight tree's rates"),
    ({"drafter": "selfspec", "synthetic_acceptance": 0.5, "tree_width": 2, "synthetic_siblings": (0.3,),
      "synthetic_sequence_factors": (0.5, -1.0)}, "each factor must be a finite number >= 0"),
    ({"on_chip": 2}, "add --offload"),
    ({"attn_backend": "warp"}, "unknown attention backend 'warp'"),
])
def test_checks_before_any_file_is_read(given, needle):
    cfg = RunConfig.from_options(given | {"device": "cpu"} if "device" not in given else given)
    with pytest.raises(MagicDecError) as e:
        cfg.check()
    assert needle in str(e.value), str(e.value)


def test_an_unwritable_output_is_refused_before_the_run(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for where in (blocker / "sub" / "r.json", tmp_path):  # a file in the way of the folder; a folder as the record
        with pytest.raises(MagicDecError, match="--output"):
            RunConfig.from_options({"output": str(where), "device": "cpu"}).check()


def test_the_hash_is_what_changes_a_result():
    base = {"drafter": "selfspec", "device": "cpu"}
    h = RunConfig.from_options(base).hash()
    assert RunConfig.from_options(base | {"output": "x.json", "printoutput": True, "progress": False}).hash() == h
    for change in ({"gen_len": 65}, {"sinks": 8}, {"temperature": 0.6}, {"gamma": [2]}, {"seed": 1}):
        assert RunConfig.from_options(base | change).hash() != h, change
    assert RunConfig.from_options(base | {"sinks": 16}).hash() == h  # a default given explicitly is the same run


def test_a_record_rebuilds_its_run(tmp_path):
    cfg = RunConfig.from_options({"drafter": "hierarchy", "draft": "ngram", "draft_policy": "retrieval",
                                  "gamma": [4], "B": 2, "device": "cpu", "output": "old.json"})
    record = tmp_path / "r.json"
    record.write_text(json.dumps({"config": cfg.options()}))
    again = RunConfig.from_record(record, {"output": "new.json"})
    assert again.hash() == cfg.hash() and again.output.output.name == "new.json"
    record.write_text(json.dumps({"method": "selfspec", "args": {}}))
    with pytest.raises(MagicDecError, match="keeps no run config"):
        RunConfig.from_record(record)


RECORD_KINDS = {  # a command line of each kind of run whose record --replay must rebuild
    "baseline": [],
    "baseline in turns": ["--drafter", "lookup", "--baseline"],
    "gamma sweep": ["--drafter", "selfspec", "--gamma", "2", "3", "4"],
    "auto gamma": ["--drafter", "selfspec", "--gamma", "auto", "--max_gamma", "4"],
    "auto gamma with a tree": ["--drafter", "selfspec", "--gamma", "auto", "--max_gamma", "4", "--tree_width", "2"],
    "synthetic acceptance": ["--drafter", "selfspec", "--synthetic_acceptance", "0.7"],
    "synthetic positions": ["--drafter", "selfspec", "--synthetic_acceptance", "0.7", "--synthetic_positions", "0.9"],
    "acceptance trace": ["--drafter", "selfspec", "--synthetic_acceptance", "0.7", "--acceptance_trace", "t.json"],
    "tree width": ["--drafter", "lookup", "--tree_width", "3"],
    "synthetic tree": ["--drafter", "selfspec", "--tree_width", "2", "--synthetic_acceptance", "0.7",
                       "--synthetic_siblings", "0.3"],
    "sequoia tree": ["--drafter", "standalone", "--draft_name", "JackFram/llama-68m", "--tree_nodes", "6",
                     "--tree_rates", "0.7", "0.3"],
    "baseline json": ["--drafter", "lookup", "--baseline_json", "b.json"],
    "hierarchy": ["--drafter", "hierarchy", "--draft", "ngram"],
    "rest": ["--drafter", "rest", "--datastore", "x.npz"],
    "standalone": ["--drafter", "standalone", "--draft_name", "JackFram/llama-68m"],
    "eagle3": ["--drafter", "eagle3", "--eagle3"],
}
# every registered drafter (those named above with the inputs they need)
RECORD_KINDS = {name: ["--drafter", name] for name in drafters.names()} | RECORD_KINDS


@pytest.mark.parametrize("kind", RECORD_KINDS)
def test_every_kind_of_record_replays(tmp_path, kind):
    """--replay rebuilds the run a record holds (its config, every option resolved as run.make_record writes it):
    the same options and hash, with output options the only ones that may change. A baseline's record holds the
    speculation options at the defaults it never applied, which its replay must not take for flags given."""
    from magicdec.cli import config_from_argv

    argv = [*RECORD_KINDS[kind], "--random_weights", "--model_name", "JackFram/llama-68m", "--device", "cpu",
            "--output", str(tmp_path / "old.json")]
    cfg = config_from_argv(argv, "run")
    record = tmp_path / "r.json"
    record.write_text(json.dumps({"method": cfg.speculation.drafter, "config": cfg.options(),
                                  "config_hash": cfg.hash()}))
    again = config_from_argv(["--replay", str(record), "--output", str(tmp_path / "new.json")], "run")
    assert again.hash() == cfg.hash() and again.options() == cfg.options() | {"output": str(tmp_path / "new.json")}
    with pytest.raises(MagicDecError, match="only output options may be added, not --gen_len"):
        config_from_argv(["--replay", str(record), "--gen_len", "9"], "run")


@pytest.mark.parametrize("content,needle", [
    ([1, 2], "holds a list, not a record"),
    ("str", "holds a string, not a record"),
    ({"method": "baseline"}, "holds no measured throughput (metrics.decode_tokens_per_s)"),
    ({"method": "baseline", "metrics": [1]}, "holds no measured throughput"),
    ({"method": "baseline", "metrics": {"decode_tokens_per_s": None}}, "holds no measured throughput"),
    ({"method": "lookup", "metrics": {"decode_tokens_per_s": 5.0}}, "is a lookup record, not a baseline"),
])
def test_a_baseline_json_that_is_no_baseline_record_is_one_line(tmp_path, content, needle):
    """Refused by the config's checks (no model read), each in one line: a JSON list or a record without metrics
    ended in a traceback, and a record without metrics was called 'decoded None'."""
    path = tmp_path / "b.json"
    path.write_text(json.dumps(content))
    cfg = RunConfig.from_options({"drafter": "lookup", "baseline_json": str(path), "device": "cpu"})
    with pytest.raises(MagicDecError) as e:
        cfg.check()
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("given,needle", [
    ({"device": "tpu"}, "'tpu' is not a device a run runs on: give cpu, cuda or cuda:N"),
    ({"device": "cuda:x"}, "'cuda:x' is not a device a run runs on"),
    ({"device": 3}, "'3' is not a device a run runs on"),
])
def test_a_device_a_run_cannot_run_on_is_one_line(given, needle):
    with pytest.raises(MagicDecError) as e:
        RunConfig.from_options(given, where="sweep.toml: ")
    assert str(e.value).startswith("sweep.toml: device = ") and needle in str(e.value), str(e.value)


def test_a_device_flag_a_run_cannot_run_on_is_an_argparse_error(capsys):
    from magicdec.cli import config_from_argv

    with pytest.raises(SystemExit) as e:
        config_from_argv(["--device", "tpu"], "run")
    assert e.value.code == 2
    assert "argument --device: 'tpu' is not a device a run runs on" in capsys.readouterr().err.splitlines()[-1]


def test_a_cuda_device_this_machine_lacks_is_one_line(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(MagicDecError, match=r"--device cuda:2: this machine has 2 CUDA device\(s\), cuda:0..cuda:1"):
        RunConfig.from_options({"device": "cuda:2"}).runtime.check(False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MagicDecError, match="no CUDA device is visible; use --device cpu"):
        RunConfig.from_options({"device": "cuda"}).runtime.check(False)


@pytest.mark.parametrize("given,needle", [
    ({"repeats": 10**9}, "--repeats 1000000000: at most 50 timed rounds"),
    ({"repeats": 51}, "--repeats 51: at most 50 timed rounds"),
    ({"min_seconds": float("inf")}, "--min_seconds must be >= 0 and finite, got inf"),
    ({"min_seconds": float("nan")}, "--min_seconds must be >= 0 and finite, got nan"),
])
def test_timing_beyond_what_a_run_times_is_one_line(given, needle):
    cfg = RunConfig.from_options(given | {"device": "cpu"})
    with pytest.raises(MagicDecError) as e:
        cfg.check()
    assert needle in str(e.value), str(e.value)
    RunConfig.from_options({"repeats": 50, "min_seconds": 1.5, "device": "cpu"}).check()  # the bounds themselves
