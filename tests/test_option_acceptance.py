"""magicdec option-acceptance on a real model (stories260K; SmolLM2 where installed): the file the planner reads, each
chain's alpha and per-position rates counted here from its saved trace, each tree's per-rank rates from its record's
counts, a written trace replayed at random weights keeping its counts, the sensitivity copy, options that cannot run
listed with the reason, a second run going on from the first, and bad input as one line before anything loads."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import BOOKS, STORIES, needs_smollm2
from magicdec import cli
from magicdec.analysis import acceptance_inputs
from magicdec.config import KNOWN_MODELS, ModelArgs
from magicdec.harness import option_acceptance as oa
from magicdec.harness import plan_command

pytestmark = pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file(), reason=f"no stories260K in {STORIES}")

GAMMA, B, PREFIX, GEN = 4, 2, 440, 32  # 256 of 440 prompt tokens: a streaming draft keeps most, not all
ONLY = ["drafter=selfspec,draft_kv=int4,draft_weights=bf16",  # whole-KV int4 copy: alpha well below 1
        "drafter=selfspec,draft_kv=bf16,draft_policy=streaming,draft_weights=bf16,tree_width=3",
        "drafter=selfspec,draft_kv=bf16,draft_policy=streaming,draft_weights=bf16,tree_nodes=16",
        "drafter=lookup,ngram_max=2", "drafter=lookahead,ngram_size=3"]


@pytest.fixture(scope="module")
def stories(tmp_path_factory) -> Path:
    from magicdec.model.checkpoint import convert_llama2c

    return convert_llama2c(STORIES / "stories260K.bin", tmp_path_factory.mktemp("stories"), STORIES / "tok512.bin")


@pytest.fixture(scope="module")
def books(tmp_path_factory) -> Path:
    """Three documents of a Gutenberg book (stories260K's tokenizer is slow over whole books)."""
    text = "".join(c for c in (BOOKS / "pg1342.txt").read_text(encoding="utf-8") if c.isascii())
    path = tmp_path_factory.mktemp("books") / "books.jsonl"
    path.write_text("".join(json.dumps({"text": text[s:s + 3000]}) + "\n" for s in (20_000, 40_000, 60_000)))
    return path


def point(stories: Path, books: Path) -> list[str]:
    return ["--model", str(stories), "--dataset", str(books), "--skip_tokens", "0", "--B", str(B), "--prefix_len",
            str(PREFIX), "--gen_len", str(GEN), "--gamma", str(GAMMA), "--temperature", "0.6", "--top_p", "0.9",
            "--device", "cpu", "--no_progress"]


def command(*argv) -> list[str]:
    return ["option-acceptance", *argv] + [x for o in ONLY for x in ("--only", o)]


@pytest.fixture(scope="module")
def measured(stories, books, tmp_path_factory) -> Path:
    """The acceptance file of a sampled run (T 0.6, top-p 0.9: a tiny model's greedy drafts are all kept) of a few
    options: chains, widths, a Sequoia tree, lookup, Lookahead."""
    out = tmp_path_factory.mktemp("acceptance") / "acc.json"
    assert cli.main(command(*point(stories, books), "--ignore_eos", "--output", str(out))) == 0
    return out


def entries(path: Path) -> dict:
    return {k: v for k, v in json.loads(path.read_text()).items() if k != "_meta"}


def test_the_file_is_what_the_planner_reads_at_this_point(measured, stories):
    """Every label is one `magicdec plan` lists at the same point, with this file's entry as its acceptance."""
    given = acceptance_inputs.load_acceptance(measured)
    assert len(given) == 8
    result = plan_command.plan(plan_command.parser().parse_args(
        ["--model", str(stories), "--B", str(B), "--prefix_len", str(PREFIX), "--gen_len", str(GEN), "--temperature",
         "0.6", "--gammas", str(GAMMA), "--acceptance", str(measured)]))
    rows = {r["label"]: r for r in result["ranking"] + result["not_ranked"]}
    for label, entry in entries(measured).items():
        assert label in rows, label
        assert rows[label].get("acceptance", entry["source"]) == entry["source"]  # ranked: this entry's source
        assert rows[label].get("reason") != "no acceptance input", label  # not ranked: for another reason
        assert entry["source"] == f"stories260K real weights, {PREFIX}-token prompt, sampled T 0.6 top-p 0.9, B {B}, " \
                                  f"{GEN} tokens, γ {GAMMA}"
    assert sum("acceptance" in rows[label] for label in given) >= 6
    meta = json.loads(measured.read_text())["_meta"]
    assert meta["carry_rule"] == oa.CARRY_RULE and meta["point"]["prefix_len"] == PREFIX
    assert "a quantized draft cache drafts chains only" in \
        meta["not_measured"]["selfspec --draft_kv int4 --draft_weights bf16 --tree_nodes 16"]


def trace_rates(trace: dict) -> tuple[float, list[float]]:
    """A chain's alpha and per-position conditional rates, counted from its trace: at a verification drafting g
    tokens, a sequence that kept a of them examined positions 0..min(a, g - 1) and kept 0..a - 1."""
    kept, reached = [0] * GAMMA, [0] * GAMMA
    for g, row in zip(trace["gammas"], trace["accepted"]):
        for a in row:
            if a < 0 or g == 0:  # stopped, or nothing drafted
                continue
            for i in range(min(a + 1, g)):
                reached[i] += 1
                kept[i] += i < a
    rates = [k / r for k, r in zip(kept, reached) if r]
    return sum(kept) / sum(reached), rates


def test_a_chains_rates_are_its_trace_counted(measured):
    chains = {k: v for k, v in entries(measured).items() if "trace" in v}
    assert {k.split()[0] for k in chains} == {"selfspec", "lookup"} and len(chains) == 2
    for label, entry in chains.items():
        trace = json.loads((measured.parent / entry["trace"]).read_text())["acceptance_trace"]
        alpha, positions = trace_rates(trace)
        assert 0 < alpha < 1, label
        assert entry["alpha"] == pytest.approx(alpha, abs=1e-12), label
        assert entry["positions"] == pytest.approx(positions, abs=1e-12), label
    lookahead = entries(measured)["lookahead --ngram_size 3 --guesses 2"]  # verified as a tree: no chain trace
    assert "trace" not in lookahead and "positions" in lookahead


def test_a_trees_rates_are_its_records_rank_counts(measured):
    """A tree's alpha is its first candidates' kept / tried, its siblings the later ranks'; the Sequoia tree is
    shaped for the widest tree's rates of the same draft."""
    runs = {json.loads(p.read_text())["label"]: json.loads(p.read_text())
            for p in (measured.parent / "acc_runs").glob("*.json")}
    trees = {k: v for k, v in entries(measured).items() if "siblings" in v}
    assert len(trees) == 5
    for label, entry in trees.items():
        counts = runs[label]["metrics"]["speculation"]["per_rank"]
        rates = [k / r for k, r in zip(counts["kept"], counts["reached"]) if r]
        assert [entry["alpha"], *entry["siblings"]] == pytest.approx(rates, abs=1e-12), label
        assert "trace" not in entry and "acceptance_trace" not in runs[label]
    wide = trees["selfspec --draft_policy streaming --draft_budget 256 --draft_weights bf16 --tree_width 3"]
    assert wide["siblings"], "the width-3 tree's later candidates were tried"
    shaped = runs["selfspec --draft_policy streaming --draft_budget 256 --draft_weights bf16 --tree_nodes 16"]
    assert shaped["config"]["tree_rates"] == pytest.approx([wide["alpha"], *wide["siblings"]])


def test_a_trees_sequence_factors_are_each_sequences_rate_over_the_batchs(measured, tmp_path):
    """Each sequence's kept / reached over the batch's (by hand: 2 of 4 and 6 of 4 in a batch of 8 of 8: 0.5 and
    1.5), read from every tree's run record; an earlier file without them gets them from its records on resume."""
    assert oa.sequence_factors({"kept": [2, 6], "reached": [4, 4]}) == pytest.approx([0.5, 1.5])
    assert oa.sequence_factors({"kept": [2, 6], "reached": [4, 0]}) == []  # a sequence that reached nothing
    runs = {json.loads(p.read_text())["label"]: json.loads(p.read_text())
            for p in (measured.parent / "acc_runs").glob("*.json")}
    trees = {k: v for k, v in entries(measured).items() if "siblings" in v}
    for label, entry in trees.items():
        per = runs[label]["metrics"]["speculation"]["per_sequence"]
        batch = sum(per["kept"]) / sum(per["reached"])
        assert entry["sequence_factors"] == pytest.approx([k / r / batch for k, r in zip(per["kept"], per["reached"])])
    older = {label: {k: v for k, v in e.items() if k != "sequence_factors"} for label, e in entries(measured).items()}
    assert oa.with_sequence_factors(older, measured.parent / "acc_runs") == entries(measured)
    assert oa.with_sequence_factors(older, tmp_path) == older  # no records there: left as they were


def test_a_written_trace_replays_its_counts_at_random_weights(measured, monkeypatch):
    """`magicdec run --acceptance_trace` over a chain's record, at random weights of other shapes and the recorded
    gamma: each sequence keeps exactly the recorded counts, verification by verification."""
    from magicdec.cli import run_record

    monkeypatch.setitem(KNOWN_MODELS, "test/small-random", ModelArgs(
        vocab_size=512, dim=96, n_layers=3, n_heads=6, n_kv_heads=2, intermediate_size=160, max_seq_len=1024,
        bos_id=1, eos_id=2))
    label = "selfspec --draft_kv int4 --draft_weights bf16"
    record = measured.parent / entries(measured)[label]["trace"]
    trace = json.loads(record.read_text())["acceptance_trace"]
    replay = run_record(["--random_weights", "--model_name", "test/small-random", "--prefix_len", "64", "--B",
                         str(B), "--gen_len", str(GEN), "--device", "cpu", "--no_progress", "--drafter", "selfspec",
                         "--draft_budget", "32", "--sinks", "4", "--gamma", str(GAMMA), "--synthetic_acceptance",
                         "0.5", "--acceptance_trace", str(record), "--save_trace", "--ignore_eos"])
    assert replay["acceptance_trace"] == trace
    assert replay["metrics"]["alpha"] == pytest.approx(entries(measured)[label]["alpha"])


def test_the_sensitivity_copy_moves_every_rate(measured, tmp_path):
    source = tmp_path / "acc.json"
    shutil.copy(measured, source)
    given = entries(source)
    for delta in (-0.3, 0.25):
        path = oa.shifted(source, delta)
        assert path == tmp_path / f"acc.shift{delta:+g}.json"
        acceptance_inputs.load_acceptance(path)  # the planner reads it
        moved = entries(path)
        assert set(moved) == set(given)
        for label, e in given.items():
            m = moved[label]
            for key in ("alpha", "bottom"):
                if key in e:
                    assert m[key] == pytest.approx(min(1.0, max(0.0, e[key] + delta)))
            for key in ("positions", "siblings"):
                assert m.get(key) == (None if key not in e else
                                      pytest.approx([min(1.0, max(0.0, r + delta)) for r in e[key]]))
            assert m["source"] == f"sensitivity: alpha shifted by {delta:+g} from {e['source']}"
            assert "trace" not in m  # the trace holds the unshifted counts
        assert json.loads(path.read_text())["_meta"]["sensitivity"]["alpha_shift"] == delta
    assert any(e["alpha"] + 0.25 > 1 for e in given.values())  # the clip was met
    assert cli.main(["option-acceptance", "--shift", str(source), "--alpha_shift", "0.1"]) == 0
    assert entries(tmp_path / "acc.shift+0.1.json") == entries(oa.shifted(source, 0.1))


def test_a_second_run_goes_on_from_the_first_and_another_point_is_refused(measured, stories, books, tmp_path,
                                                                           monkeypatch, capsys):
    out = tmp_path / "acc.json"
    shutil.copy(measured, out)
    shutil.copytree(measured.parent / "acc_runs", tmp_path / "acc_runs")
    monkeypatch.setattr("magicdec.harness.engine.Engine.load_target", lambda self: pytest.fail("loaded the target"))
    assert cli.main(command(*point(stories, books), "--ignore_eos", "--output", str(out))) == 0
    assert "nothing left to measure" in capsys.readouterr().out and entries(out) == entries(measured)
    with pytest.raises(SystemExit) as e:
        cli.main(command(*point(stories, books), "--output", str(out)))  # without --ignore_eos: another point
    assert e.value.code == 2 and "holds other acceptance than this point's" in capsys.readouterr().err


def test_a_file_added_to_by_another_command_keeps_every_command_and_reason(measured, stories, books, tmp_path):
    out = tmp_path / "acc.json"
    shutil.copy(measured, out)
    shutil.copytree(measured.parent / "acc_runs", tmp_path / "acc_runs")
    first = json.loads(measured.read_text())["_meta"]["command"]
    add = ["option-acceptance", *point(stories, books), "--ignore_eos", "--output", str(out), "--only",
           "drafter=lookup,ngram_max=3", "--only", "drafter=medusa,num_heads=3,tree_width=1,tree_nodes=0"]
    assert cli.main(add) == 0
    assert cli.main(add[:-4] + ["--only", "drafter=lookahead,ngram_size=3"]) == 0  # measured before: nothing runs
    written = json.loads(out.read_text())
    meta = written["_meta"]
    assert meta["command"] == first and len(meta["commands"]) == 3 and meta["commands"][0] == first
    assert meta["commands"][1].endswith("tree_width=1,tree_nodes=0") and "ngram_size=3" in meta["commands"][2]
    assert meta["not_measured"]["medusa --num_heads 3"].startswith("untrained")  # the second command's reason kept
    now, then = entries(out), entries(measured)
    assert all(now[k] == v for k, v in then.items())
    assert sorted(set(now) - set(then)) == ["lookup --ngram_max 3 --tree_width 1", "lookup --ngram_max 3 --tree_width 2"]


def test_options_that_cannot_run_here_are_listed_with_the_reason(stories, books, tmp_path):
    out = tmp_path / "acc.json"
    assert cli.main(["option-acceptance", *point(stories, books), "--output", str(out), "--only_drafters",
                     "rest,standalone,medusa", "--only", "drafter=rest",
                     "--only", "drafter=standalone,draft_budget=0,draft_weights=bf16,tree_width=1,tree_nodes=0",
                     "--only", "drafter=medusa,num_heads=3,tree_width=1,tree_nodes=0"]) == 0
    written = json.loads(out.read_text())
    assert list(written) == ["_meta"]
    why = written["_meta"]["not_measured"]
    assert "--datastore" in why["rest"]
    assert "--draft" in why["standalone --draft_budget 0 --draft_weights bf16"]
    assert why["medusa --num_heads 3"].startswith("untrained")


@needs_smollm2
def test_the_default_model_runs_end_to_end(smol_dir, tmp_path, monkeypatch):
    """No --model: SmolLM2-135M-Instruct as the README's main job finds it, prompts from the Gutenberg books."""
    monkeypatch.setenv("MAGICDEC_CACHE", str(smol_dir.parent))
    out = tmp_path / "acc.json"
    assert cli.main(["option-acceptance", "--only_drafters", "lookup", "--only",
                     "drafter=lookup,ngram_max=3,tree_width=1", "--B", "1", "--prefix_len", "128", "--gen_len", "8",
                     "--device", "cpu", "--no_progress", "--output", str(out)]) == 0
    (entry,) = entries(out).values()
    assert entry["source"] == "SmolLM2-135M-Instruct real weights, 128-token prompt, greedy, B 1, 8 tokens, γ 6"
    assert json.loads(out.read_text())["_meta"]["prompt_source"].startswith(f"folder {BOOKS}")


@pytest.mark.parametrize("argv, message", [
    (["--only_drafters", "selfspec,nope"], "--only_drafters: unknown drafter 'nope'"),
    (["--gamma", "0"], "--gamma 0: give a draft length of at least 1"),
    (["--prefix_len", "500"], "prefix_len + gen_len + gamma + 1 = 539 exceeds stories260K's context of 512"),
    (["--output", "FILE/acc.json"], "--output FILE/acc.json: cannot write to FILE"),
    (["--draft", "ngram"], "--draft ngram: the hierarchy's prompt-lookup bottom is measured without it"),
    (["--draft", "nowhere/model.pth"], "--draft nowhere/model.pth: no such checkpoint"),
    (["--model", None, "--prefix_len", "8190"], "prefix_len + gen_len + gamma + 1 = 8229 exceeds HuggingFaceTB/SmolLM2-135M's context of 8192"),
])
def test_bad_input_is_one_line_before_anything_loads(argv, message, stories, tmp_path, monkeypatch, capsys):
    in_the_way = tmp_path / "FILE"
    in_the_way.write_text("a file where the output's folder would be")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("magicdec.harness.engine.Engine.__init__", lambda *a: pytest.fail("made an engine"))
    monkeypatch.setattr("magicdec.model.checkpoint.smollm2_checkpoint", lambda *a: pytest.fail("converted SmolLM2"))
    given = ["--model", str(stories), "--prefix_len", "400", "--gen_len", "32", "--device", "cpu", "--no_progress"]
    if argv[:2] == ["--model", None]:
        given, argv = given[2:], argv[2:]
    with pytest.raises(SystemExit) as e:
        cli.main(["option-acceptance", *given, *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: " + message) and err.count("\n") == 1, err
