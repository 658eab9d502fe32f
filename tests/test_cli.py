"""What a newcomer sees on the command line (issue #21): --help with defaults and a word for every flag, the summary
table (prompts, baseline beside speculation, why speculation was off, no speed claim on a CPU, the default model's
name), and one-line errors that name the bad flag, its value and the fix, before anything big is loaded."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from conftest import BOOKS, FIXTURES, LLAMA2_TOKENIZER, needs_llama_tokenizers, needs_smollm2, one_line_error, run_cli
from magicdec import drafters, options
from magicdec.model.checkpoint import SMOLLM2_NAME
from magicdec.cli import run_parser, run_record
from magicdec.config import ModelArgs
from magicdec.harness.engine import ModelRef, resolve_model
from magicdec.harness.run import print_summary
from magicdec.harness.run_config import RunConfig

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = {m: REPO / "tests" / f"{m}_benchmark.py" for m in ("baseline", "selfspec", "longspec")}
LLAMA68M = ("--random_weights", "--model_name", "JackFram/llama-68m", "--prefix_len", "16", "--gen_len", "2")
TEXT = ("--tokenizer", str(LLAMA2_TOKENIZER), "--dataset", str(BOOKS), "--B", "1", "--prefix_len", "32",
        "--gen_len", "4")


# ------------------------------------------------------------------ --help

@pytest.mark.parametrize("script", ["baseline", "selfspec", "longspec"])
def test_help_shows_defaults_and_what_each_flag_does(script):
    p = run_parser("x")
    text = " ".join(p.format_help().split())  # unwrapped
    for action in p._actions:
        assert action.help, f"{action.option_strings} has no help text"
    for flag, default in (("--B", "1"), ("--prefix_len", "4000"), ("--gen_len", "64"), ("--skip_tokens", "8000"),
                          ("--top_p", "1.0"), ("--top_k", "0"), ("--seed", "0"), ("--rank_group", "0"),
                          ("--gamma", "3"), ("--draft_budget", "256")):
        help_of = next(a.help for a in p._actions if flag in a.option_strings)
        assert f"(default: {default})" in help_of, flag
    assert "triton" in next(a.help for a in p._actions if "--attn_backend" in a.option_strings)
    assert ".txt file" in next(a.help for a in p._actions if "--dataset" in a.option_strings)
    assert "issue #" not in text and "seed's" not in text
    assert "(default: None)" not in text and "(default: False)" not in text
    for name in drafters.names():  # every drafter has a group of its own flags
        assert f"drafter {name}" in text
    p = run_cli(SCRIPTS[script], "--help")
    assert p.returncode == 0 and "(default: 4000)" in p.stdout, p.stderr


def test_help_lists_an_option_of_several_drafters_once_with_its_drafters():
    """An option two drafters share is one flag in a group of its own, naming every drafter that takes it; each
    drafter's group lists its own options and names the shared ones it takes, so none reads as another's."""
    p = run_parser("x")
    groups = {g.title: [a for a in g._group_actions] for g in p._action_groups}
    shared = groups["options of several drafters"]
    by_key = {}
    for name, kind in drafters.registry().items():
        for key in options.keys(kind.Config):
            by_key.setdefault(key, []).append(name)
    assert sorted(a.dest for a in shared) == sorted(k for k, names in by_key.items() if len(names) > 1)
    for action in shared:
        assert action.help.split(" [", 1)[1].startswith(", ".join(by_key[action.dest]) + "]"), action.dest
    sinks = next(a for a in shared if a.dest == "sinks")
    assert "[hierarchy, selfspec, standalone]" in sinks.help
    for name, kind in drafters.registry().items():
        title = next(t for t in groups if t.startswith(f"drafter {name}"))
        assert {a.dest for a in groups[title]} == {k for k in options.keys(kind.Config) if by_key[k] == [name]}
        description = next(g.description for g in p._action_groups if g.title == title)
        assert ("--sinks" in description) == ("sinks" in options.keys(kind.Config)), name


def test_a_script_shows_the_defaults_it_applies():
    """TriForce's script applies TriForce's defaults: its --help says so, not self-speculation's."""
    p = run_cli(REPO / "tests" / "triforce_benchmark.py", "--help")
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())
    assert "--prefill N --prefix_len N" in text and "(default: hierarchy)" in text and "(default: retrieval)" in text


def test_lookup_help_offers_no_auto():
    """--gamma auto is refused by prompt lookup: its help says so, and its run says so in one line naming the fix."""
    help_text = " ".join(run_cli(REPO / "tests" / "lookup_benchmark.py", "--help").stdout.split())
    refused = sorted(n for n, kind in drafters.registry().items() if not kind.supports_auto_gamma)
    assert {"lookup", "hierarchy"} <= set(refused)  # the list below is the registry's, not empty
    assert f"'auto' (not for {', '.join(refused)})" in help_text
    one_line_error(run_cli(REPO / "tests" / "lookup_benchmark.py", *LLAMA68M, "--gamma", "auto"), "--gamma auto",
                   "--gamma N")


def test_triforce_errors_name_triforce_flags():
    """TriForce's script reports a problem with the flag its user typed: --prefill, not --prefix_len."""
    msg = one_line_error(run_cli(REPO / "tests" / "triforce_benchmark.py", *LLAMA68M, "--prefill", "3000",
                                 "--budget", "512"), "exceeds the model's context of 2048")
    assert "--prefill" in msg and "--prefix_len" not in msg


def test_interrupt_is_one_line(monkeypatch, capsys):
    """Ctrl-C during a run: one line saying nothing was written, exit status 130, no traceback."""
    from magicdec.harness import run
    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "run", interrupted)
    with pytest.raises(SystemExit) as e:
        run.main(lambda: RunConfig.from_options({"device": "cpu"}))
    assert e.value.code == 130 and capsys.readouterr().err.strip() == (
        "interrupted: the run did not finish and wrote no record (an earlier record at its --output is as it was); run "
        "the same command again")


def test_magicdec_command_lists_its_commands():
    import subprocess

    p = subprocess.run([sys.executable, "-m", "magicdec", "--help"], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0 and all(c in p.stdout for c in ("run", "compare", "sweep", "report", "reproduce"))
    p = subprocess.run([sys.executable, "-m", "magicdec", "nonsense"], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 2 and "unknown command 'nonsense'" in p.stderr


# Packages a plain install (`pip install -e .`) does not bring: optional kernels and what only the tests install.
NOT_RUNTIME = ("triton", "gemlite", "flash_attn", "accelerate", "google.protobuf", "pytest")
RUNTIME_ONLY = """
import contextlib, io, json, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # `import name` now fails, as where it is not installed
from magicdec import cli, drafters, options
from magicdec.cli import run_record
for command in cli.COMMANDS:
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        cli.main([command, "--help"])
    assert "usage:" in out.getvalue(), command
given = json.loads(sys.argv[2])
for name in drafters.names():
    kind = drafters.get(name)
    flags = dict(kind.example) | {k: v for k, v in given.items() if k in options.keys(kind.Config)}
    record = run_record(["--drafter", name, *sys.argv[3:], *[x for k, v in flags.items() for x in (f"--{k}", str(v))]])
    assert record["metrics"]["speculation"]["iterations"] > 0, name
    print("RAN", name)
"""


@needs_smollm2
def test_runtime_requirements_alone_run_every_command_and_drafter(smol_dir, tmp_path):
    """With every optional kernel and test-only package unimportable (as after `pip install -e .` alone), every
    command's --help works and every registered drafter runs on a CPU (SmolLM2, real text): no module imports
    triton, gemlite or flash-attn where it is not used."""
    import json
    import subprocess

    from magicdec.drafters.datastore import main as datastore

    store = tmp_path / "books.npz"
    datastore(["--books", str(FIXTURES / "gutenberg" / "pg2701.txt"), "--tokenizer", str(smol_dir), "--output",
               str(store)])
    given = {"draft": str(smol_dir / "model.pth"), "datastore": str(store)}
    run = ["--model", str(smol_dir / "model.pth"), "--dataset", str(BOOKS), "--skip_tokens", "0", "--prefix_len",
           "64", "--gen_len", "6", "--device", "cpu", "--no_progress"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", RUNTIME_ONLY, ",".join(NOT_RUNTIME), json.dumps(given), *run],
                       capture_output=True, text=True, cwd=REPO, env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    assert [line[4:] for line in p.stdout.splitlines() if line.startswith("RAN ")] == drafters.names()


# ------------------------------------------------------------------ one-line errors naming the flag

@pytest.mark.parametrize("flag,value,fix", [("--temperature", "-1", ">= 0"), ("--top_p", "1.5", "(0, 1]"),
                                            ("--top_k", "-5", ">= 0")])
def test_sampling_flags_name_themselves(flag, value, fix):
    msg = one_line_error(run_cli(SCRIPTS["baseline"], *LLAMA68M, flag, value), flag, value, fix)
    others = {"--temperature", "--top_p", "--top_k"} - {flag}
    assert not any(o in msg for o in others), msg  # one flag's problem, not a list of all three


def test_rank_group_must_count_from_zero():
    msg = one_line_error(run_cli(SCRIPTS["baseline"], *LLAMA68M, "--rank_group", "1"),
                         "--rank_group 1", "0..N-1", "use --rank_group 0")
    assert "nproc_per_node=1" not in msg  # that is what is running


def test_model_dir_without_model_pth(tmp_path):
    one_line_error(run_cli(SCRIPTS["baseline"], "--model", str(tmp_path)),
                   f"--model {tmp_path} is a directory without model.pth", "convert_hf_checkpoint.py --checkpoint_dir")
    one_line_error(run_cli(SCRIPTS["longspec"], "--target", str(tmp_path), "--model", str(tmp_path / "x.pth")),
                   f"--target {tmp_path} is a directory without model.pth")  # the seed's flag, as the user typed it


@needs_llama_tokenizers
def test_model_dir_holding_model_pth(tiny_hf, tmp_path):
    """--model DIR and --target DIR: the dir convert_hf_checkpoint.py --checkpoint_dir wrote model.pth into."""
    _, path = tiny_hf("llama", vocab_size=32000)
    config, ckpt = resolve_model(ModelRef(path.parent, None, "--model"), False)
    assert ckpt == path and config.dim == 64
    record = run_record(["--model", str(path.parent), *TEXT, "--device", "cpu", "--no_progress"])
    assert record["config"]["model"] == str(path.parent) and record["metrics"]["generated_tokens"] == 4


def damaged_copy(tiny_hf, d: Path, how: str) -> Path:
    """config.json of a real tiny checkpoint beside a model.pth cut in half or replaced by random bytes."""
    _, path = tiny_hf("llama", vocab_size=32000)
    d.mkdir()
    shutil.copy(path.parent / "config.json", d / "config.json")
    data = path.read_bytes()
    (d / "model.pth").write_bytes(data[: len(data) // 2] if how == "truncated" else os.urandom(1 << 16))
    return d / "model.pth"


def test_truncated_checkpoint(tiny_hf, tmp_path):
    bad = damaged_copy(tiny_hf, tmp_path / "ckpt", "truncated")
    msg = one_line_error(run_cli(SCRIPTS["baseline"], "--model", str(bad), *TEXT[2:]),
                         "--model", "truncated or corrupt", "re-run convert_hf_checkpoint.py --checkpoint_dir")
    assert "miniz" not in msg and "central directory" not in msg
    assert len(msg.replace(str(bad.parent), "DIR")) < 150, msg


def test_random_bytes_checkpoint(tiny_hf, tmp_path):
    bad = damaged_copy(tiny_hf, tmp_path / "ckpt", "random")
    msg = one_line_error(run_cli(SCRIPTS["baseline"], "--model", str(bad.parent), *TEXT[2:]),
                         "--model", "not a PyTorch checkpoint", "re-run convert_hf_checkpoint.py --checkpoint_dir")
    assert "_use_new_zipfile_serialization" not in msg


# ------------------------------------------------------------------ the summary table

def summary(capsys, method="selfspec", device="cpu", **metrics) -> dict[str, str]:
    """print_summary's rows of a made-up record, as {key: value}."""
    m = {"prefill_s": 1.0, "decode_tokens_per_s": 90.0, "ms_per_token": 11.1, "alpha": 0.8, "omega": 3.0,
         "measured_speedup": 1.5} | metrics
    record = {"metrics": m, "decoding": "greedy", "environment": {"device": device}, "label": method,
              "model_config": {"name": SMOLLM2_NAME},
              "prompt_source": "Python stdlib pydoc_data.topics documentation text (not PG-19)",
              "baseline_metrics": {"decode_tokens_per_s": 60.0, "ms_per_token": 16.7} if method != "baseline" else None}
    print_summary(RunConfig.from_options({"drafter": method, "device": "cpu"}), record)
    return rows_of(capsys.readouterr().out)


def rows_of(out: str) -> dict[str, str]:
    """{key: value} of a printed table (keys may hold single spaces; two or more separate the value)."""
    return {k.strip(): v.strip() for k, _, v in (line.partition("  ") for line in out.splitlines())}


def test_summary_rows(capsys):
    rows = summary(capsys)
    assert rows["prompts"].startswith("Python stdlib") and "not PG-19" in rows["prompts"]
    assert rows["baseline tokens/s"] == "60" and rows["baseline ms / token"] == "16.7" and rows["ms / token"] == "11.1"
    assert "no speed claim" in rows["note"] and "compute-bound" in rows["note"] and "GPU" in rows["note"]
    assert "speculation" not in rows
    assert rows["B x prefix, gen_len"] == "1 x 4000, 64" and rows["timed rounds"].startswith("0")
    assert rows["acceptance length (Omega)"] == "3" and rows["measured_speedup (every sequence reaches gen_len)"] == "1.5"
    assert "no speed claim" in summary(capsys, method="baseline")["note"]
    assert "baseline ms / token" not in summary(capsys, method="baseline")
    assert "note" not in summary(capsys, device="cuda")  # a GPU's numbers are what the harness is for


def test_summary_says_why_speculation_was_off(capsys):
    """--gamma auto chose gamma 0 throughout: alpha n/a and Omega 1 get a row saying the policy switched it off
    (iterations_per_gamma keys are ints in the run, strings once the record went through JSON)."""
    for used in ({0: 63}, {"0": 63}):
        policy = {"switched_off": True, "iterations_per_gamma": used}
        rows = summary(capsys, alpha=None, omega=1.0, speculation={"auto_gamma": policy})
        assert rows["alpha"] == "n/a" and rows["speculation"].startswith("switched off by the --gamma auto policy")
        assert "gamma 0: 63" in rows["speculation"]
    rows = summary(capsys, speculation={"auto_gamma": {"switched_off": False, "iterations_per_gamma": {0: 5, 2: 20}}})
    assert rows["speculation"].startswith("off at times") and "gamma 2: 20" in rows["speculation"]
    rows = summary(capsys, speculation={"auto_gamma": {"switched_off": False, "iterations_per_gamma": {2: 20}}})
    assert "speculation" not in rows


def test_summary_of_a_real_run(capsys):
    """A speculative run with --baseline prints the new rows from its own record."""
    record = run_record([*LLAMA68M[:3], "--drafter", "selfspec", "--device", "cpu", "--no_progress", "--B", "1",
                         "--prefix_len", "48", "--gen_len", "8", "--draft_budget", "24", "--sinks", "4", "--gamma", "2",
                         "--baseline"])
    rows = rows_of(capsys.readouterr().out)
    assert rows["baseline ms / token"] == f"{record['baseline_metrics']['ms_per_token']:.4g}"
    assert rows["baseline tokens/s"] == f"{record['baseline_metrics']['decode_tokens_per_s']:.4g}"
    assert rows["prompts"].startswith("random token ids") and "no speed claim" in rows["note"]


# ------------------------------------------------------------------ the default model's name

@needs_smollm2
def test_default_model_is_named_smollm2(smol_dir):
    assert ModelArgs.from_checkpoint_dir(smol_dir).name == SMOLLM2_NAME == "SmolLM2-135M-Instruct"
