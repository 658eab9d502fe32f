"""`magicdec train-head` (magicdec/train_head.py) on the CPU: a tiny head of each family trained for a few dozen steps
for stories260K (real weights, llama2.c) on stories it wrote itself; the training loss falls and the held-out
acceptance rises, the same command gives the same weights, a run interrupted and resumed gives the weights of an
uninterrupted one, the saved head loads through heads.load and drafts losslessly (greedy output == plain decoding),
the prompt books are held out exactly as data.load_prompts picks them, and bad input is one line before the target
is loaded.

Nothing here depends on the machine's speed: every check compares numbers a fixed seed determines."""
from __future__ import annotations

import errno
import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from conftest import STORIES
from magicdec import heads, train_head
from magicdec.cli import main as cli_main
from magicdec.config import ModelArgs
from magicdec.errors import MagicDecError

BIN, TOK = STORIES / "stories260K.bin", STORIES / "tok512.bin"
pytestmark = pytest.mark.skipif(not BIN.is_file() or not TOK.is_file(), reason=f"no stories260K in {STORIES}")

STEPS = 30
# Small and quick: windows of 40 tokens, 4 a step; the learning rate high enough for 30 steps to show.
SMALL = ["--batch_size", "4", "--seq_len", "40", "--lr", "3e-3", "--warmup", "3", "--eval_windows", "8",
         "--holdout_B", "0", "--exclude", "stories0", "--device", "cpu", "--no_progress"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models here are tiny: each op is microseconds of work, and with two threads on a shared two-core machine
    most of the time went to waiting for the second core (a 30-step run 25 s, 3 s on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def stories(tmp_path_factory) -> Path:
    from magicdec.checkpoint import convert_llama2c

    return convert_llama2c(BIN, tmp_path_factory.mktemp("stories260K"), tokenizer_path=TOK).parent


@pytest.fixture(scope="module")
def corpus(stories, tmp_path_factory) -> Path:
    """Four 'books' of stories260K's own sampled stories (seed 0, temperature 1): text in its domain, where its
    distributions are what a head can learn in a few dozen steps. stories0 is held out (--exclude)."""
    from magicdec.kv_cache import KVCache
    from magicdec.model import load_model
    from magicdec.tokenizer import load_tokenizer

    model, tok = load_model(stories / "model.pth", "cpu", torch.float32), load_tokenizer(stories)
    a, B, N = model.args, 8, 160
    cache = KVCache(a.n_layers, B, a.n_kv_heads, N + 1, a.head_dim, torch.float32, "cpu")
    gen, x, out = torch.Generator().manual_seed(0), torch.full((B, 1), tok.bos_id), []
    with torch.inference_mode():
        for _ in range(N):
            probs = model(x, cache)[:, -1].softmax(-1)
            cache.advance(1)
            x = torch.multinomial(probs, 1, generator=gen)
            out.append(x)
    ids = torch.cat(out, 1)
    d = tmp_path_factory.mktemp("corpus")
    for i in range(4):
        (d / f"stories{i}.txt").write_text("\n\n".join(tok.decode(ids[b].tolist()) for b in (2 * i, 2 * i + 1)))
    return d


def command(stories, corpus, out, family, *extra) -> list[str]:
    return ["--family", family, "--target", str(stories), "--corpus", str(corpus), "--out", str(out), *SMALL,
            *extra]


@pytest.fixture(scope="module")
def trained(stories, corpus, tmp_path_factory):
    """family -> (out dir, log) of a 30-step run."""
    done = {}

    def get(family):
        if family not in done:
            out = tmp_path_factory.mktemp(f"head_{family}")
            log = train_head.train(command(stories, corpus, out, family, "--steps", str(STEPS), "--eval_every", "15",
                                           "--save_every", "10"))
            done[family] = out, log
        return done[family]

    return get


def head_state(out: Path) -> dict:
    return torch.load(out / train_head.STATE, weights_only=False)["head"]


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", train_head.FAMILIES)
def test_training_loss_falls_and_held_out_acceptance_rises(trained, stories, family):
    out, log = trained(family)
    losses = [r["loss"] for r in log["steps"]]
    assert [r["step"] for r in log["steps"]] == list(range(1, STEPS + 1))
    # The seed fixes the run, so this is a fixed comparison: the first steps' mean against the last steps'. Measured:
    # the last five are 0.55-0.75 of the first five (medusa, hydra, eagle3 near 0.6; eagle's smooth-L1 term falls
    # less); 0.9 fails a head that does not learn, which stays within a few percent.
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.9 * first, (family, losses)
    evals = log["evals"]
    assert [e["step"] for e in evals] == [0, 15, 30]
    assert evals[-1]["loss"] < evals[0]["loss"]
    assert evals[-1]["acceptance"][0] > evals[0]["acceptance"][0], evals  # head 1 / draft step 1
    n_acc = log["options"]["num_heads"]
    assert all(len(e["acceptance"]) == n_acc for e in evals)
    # what the log says about the run
    assert log["corpus"]["held_out_books"] == ["stories0.txt"]
    assert "stories0.txt" not in log["corpus"]["train_books"]
    assert log["command"].startswith("magicdec train-head --family " + family)
    for key in ("environment", "code", "target", "options", "head_parameters", "seconds"):
        assert key in log, key
    assert all({"loss", "tokens_per_s", "seconds", "lr"} <= set(r) for r in log["steps"])
    assert (out / train_head.PLOT).stat().st_size > 0
    assert json.loads((out / train_head.LOG).read_text())["steps"] == log["steps"]
    # the head in its family's published format, loaded as a drafter loads it: the trained weights
    args = ModelArgs.from_checkpoint_dir(stories)
    head = heads.load(out, args, family)
    assert heads.detect(out) == family
    assert same_weights(head.state_dict(), head_state(out))


def test_the_same_command_gives_the_same_weights_and_a_resumed_run_those_of_an_uninterrupted_one(
        stories, corpus, tmp_path, monkeypatch):
    """EAGLE: its noise, its unrolled attention and its optimizer state all have to come back for this to hold."""
    def run(out, *extra):
        return train_head.train(command(stories, corpus, out, "eagle", "--steps", "10", "--save_every", "4",
                                        "--eval_every", "5", *extra))

    straight = run(tmp_path / "a")
    again = run(tmp_path / "b")
    assert same_weights(head_state(tmp_path / "a"), head_state(tmp_path / "b"))
    assert [r["loss"] for r in straight["steps"]] == [r["loss"] for r in again["steps"]]
    run(tmp_path / "seed1", "--seed", "1")
    assert not same_weights(head_state(tmp_path / "a"), head_state(tmp_path / "seed1"))

    batch = train_head.Windows.batch

    def interrupted(self, seed, step, batch_size):
        if step == 7:
            raise KeyboardInterrupt
        return batch(self, seed, step, batch_size)

    monkeypatch.setattr(train_head.Windows, "batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "c")
    assert json.loads((tmp_path / "c" / train_head.STATE_META).read_text())["step"] == 4  # the last checkpoint
    monkeypatch.setattr(train_head.Windows, "batch", batch)
    resumed = train_head.train(["--out", str(tmp_path / "c"), "--resume", "--device", "cpu", "--no_progress",
                                "--save_every", "4", "--eval_every", "5"])
    assert same_weights(head_state(tmp_path / "a"), head_state(tmp_path / "c"))
    assert [r["loss"] for r in resumed["steps"]] == [r["loss"] for r in straight["steps"]]
    assert [e["acceptance"] for e in resumed["evals"]] == [e["acceptance"] for e in straight["evals"]]
    assert resumed["resumed_at"] == [4]


DRAFTER = {"medusa": "medusa", "hydra": "hydra", "eagle": "eagle", "eagle3": "eagle"}


@pytest.mark.parametrize("family", train_head.FAMILIES)
def test_a_trained_head_drafts_losslessly(trained, stories, corpus, family, tmp_path):
    """Greedy speculative output with the trained head == plain autoregressive decoding, token for token, with some
    drafted tokens accepted (the trained head agrees with the target at times). Medusa's heads draft two and more
    positions ahead from one feature: 30 steps keep none here, so its run is resumed to 120."""
    from magicdec.cli import run_record

    out, _ = trained(family)
    if family == "medusa":
        shutil.copytree(out, tmp_path / "medusa")
        out = tmp_path / "medusa"
        train_head.train(command(stories, corpus, out, family, "--steps", "120", "--resume"))
    base = ["--model", str(stories / "model.pth"), "--dataset", str(corpus / "stories0.txt"), "--B", "2",
            "--prefix_len", "32", "--gen_len", "48", "--skip_tokens", "0", "--device", "cpu", "--no_progress",
            "--save_tokens", "--ignore_eos"]
    plain = run_record(base)
    drafted = run_record(base + ["--drafter", DRAFTER[family], "--head", str(out), "--gamma", "3"])
    assert drafted["generated_ids"] == plain["generated_ids"]
    assert drafted["metrics"]["alpha"] > 0


# --- which books are held out -------------------------------------------------------------------------------------

class Chars:
    """A tokenizer of one token per character (fast, exact counts): what matters is which books load_prompts reads."""
    bos_id, eos_id, vocab_size = 0, 1, 256

    def encode(self, text, bos=True):
        return [0] * bos + [ord(c) % 254 + 2 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_the_prompt_books_are_exactly_those_load_prompts_reads(tmp_path):
    for name, n in (("a", 300), ("b", 500), ("c", 400), ("d", 350)):
        (tmp_path / f"{name}.txt").write_text("x" * n)
    books = train_head.read_books(train_head.corpus_files(tmp_path))
    o = train_head.Options(family="medusa", holdout_B=7, holdout_prefix_len=50, skip_tokens=10, seq_len=20).resolved()
    # a.txt gives (300 - 10) // 49 = 5 prompts, so the 7 reach into b.txt: a and b are the prompt books
    split = train_head.split_corpus(o, tmp_path, books, Chars(), 0)
    assert split.describe["held_out_books"] == ["a.txt", "b.txt"]
    assert split.describe["train_books"] == ["c.txt", "d.txt"]
    assert len(split.held_out["a.txt"]) == 290  # evaluated on the text after skip_tokens, as the prompts
    o.exclude = ["d"]
    split = train_head.split_corpus(o, tmp_path, books, Chars(), 0)
    assert split.describe["train_books"] == ["c.txt"] and split.describe["excluded"] == ["d.txt"]
    o.holdout_B = 30  # more prompts than the corpus has
    with pytest.raises(MagicDecError, match="smaller than the prompts it must hold out"):
        train_head.split_corpus(o, tmp_path, books, Chars(), 0)


# --- bad input: one line, before the target is loaded -------------------------------------------------------------

def one_line(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli_main(["train-head", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def forbid_target_load(monkeypatch):
    import magicdec.model

    monkeypatch.setattr(magicdec.model, "load_model", lambda *a, **k: pytest.fail("the target was loaded"))


@pytest.fixture
def no_target_load(monkeypatch):
    forbid_target_load(monkeypatch)


@pytest.mark.parametrize("case, expected", [
    ("empty folder", "it is empty"),
    ("no .txt", "holds no .txt file"),
    ("binary .txt", "is not UTF-8"),
    ("zeros .txt", "holds NUL characters"),
    ("empty books", "hold no text"),
    ("missing target", "no checkpoint there"),
])
def test_bad_corpus_or_target_is_one_line(case, expected, stories, tmp_path, capsys, no_target_load):
    c = tmp_path / "corpus"
    c.mkdir()
    target = stories
    if case == "no .txt":
        (c / "weights.bin").write_bytes(bytes(range(256)) * 4)
    elif case == "binary .txt":
        (c / "book.txt").write_bytes(bytes(range(256)) * 4)
    elif case == "zeros .txt":
        (c / "book.txt").write_bytes(bytes(4096))
    elif case == "empty books":
        (c / "a.txt").write_text("")
        (c / "b.txt").write_text("  \n\n ")
    elif case == "missing target":
        (c / "a.txt").write_text("Once upon a time.")
        target = tmp_path / "nowhere"
    line = one_line(capsys, ["--family", "medusa", "--target", str(target), "--corpus", str(c), "--out",
                             str(tmp_path / "out"), "--device", "cpu", "--no_progress"])
    assert expected in line, line


def test_resuming_another_family_or_target_or_nothing_is_one_line(trained, stories, corpus, tmp_path, capsys,
                                                                   monkeypatch):
    out, _ = trained("medusa")
    forbid_target_load(monkeypatch)
    run = ["--corpus", str(corpus), "--device", "cpu", "--no_progress"]
    line = one_line(capsys, ["--family", "eagle", "--resume", "--out", str(out), *run])
    assert "holds a medusa checkpoint, not eagle" in line
    other = tmp_path / "other_target"  # the same shapes, other weights
    shutil.copytree(stories, other)
    state = torch.load(other / "model.pth", weights_only=True)
    state["tok_embeddings.weight"] = state["tok_embeddings.weight"] + 1
    torch.save(state, other / "model.pth")
    line = one_line(capsys, ["--resume", "--target", str(other), "--out", str(out), *run])
    assert "was trained for the target" in line
    line = one_line(capsys, ["--resume", "--lr", "0.5", "--out", str(out), *run])
    assert "--lr 0.5 differs from the saved run's" in line
    assert "no checkpoint in" in one_line(capsys, ["--family", "medusa", "--resume", "--out", str(tmp_path / "x"),
                                                   *run])
    assert "pass --resume to continue it" in one_line(capsys, ["--family", "medusa", "--out", str(out), *run])


# --- faults: a read-only or full --out, a damaged checkpoint, SIGTERM ------------------------------------------------

def test_a_read_only_out_is_one_line_before_the_target_loads(stories, corpus, tmp_path, capsys, no_target_load,
                                                              monkeypatch):
    from test_files import faulty_disk

    faulty_disk(monkeypatch, tmp_path / "out", errno.EROFS)
    line = one_line(capsys, command(stories, corpus, tmp_path / "out", "medusa", "--steps", "2"))
    assert line == (f"error: --out: cannot write to {tmp_path / 'out'} (the file system is read-only); choose a folder "
                    "on a writable disk")


def test_a_full_out_is_one_line_and_the_last_checkpoint_stands(stories, corpus, tmp_path, capsys, monkeypatch):
    """The disk fills at the second checkpoint: one line naming the file; the first checkpoint stands whole (a
    --resume on more room continues from it); no temporary file is left."""
    from test_files import faulty_disk, temporaries

    out = tmp_path / "out"
    batch = train_head.Windows.batch

    def fill_after_first(self, seed, step, n):  # step 2 begins after step 1's checkpoint is written
        if step == 2:
            faulty_disk(monkeypatch, out, errno.ENOSPC, room=1000)
        return batch(self, seed, step, n)

    monkeypatch.setattr(train_head.Windows, "batch", fill_after_first)
    line = one_line(capsys, command(stories, corpus, out, "medusa", "--steps", "3", "--save_every", "1"))
    assert line == (f"error: --out cannot write {out / train_head.STATE}: the disk is full; free space there or choose "
                    "a folder on another disk")
    assert temporaries(out) == []
    assert torch.load(out / train_head.STATE, weights_only=False)["step"] == 1
    assert json.loads((out / train_head.STATE_META).read_text())["step"] == 1


def test_a_damaged_checkpoint_on_resume_is_one_line_before_the_target_loads(tmp_path, capsys, no_target_load):
    out = tmp_path / "out"
    out.mkdir()
    (out / train_head.STATE_META).write_text(json.dumps({
        "family": "medusa", "step": 4, "options": asdict(train_head.Options(family="medusa").resolved()),
        "target": {}, "corpus": "c", "corpus_resolved": "c"}))
    torch.save({"step": 4, "head": {"w": torch.ones(10000)}, "optimizer": {}, "rng": {}, "log": {}},
               out / train_head.STATE)
    whole = (out / train_head.STATE).read_bytes()
    for cut in (len(whole) // 2, 100, 0):
        (out / train_head.STATE).write_bytes(whole[:cut])
        line = one_line(capsys, ["--resume", "--out", str(out), "--device", "cpu", "--no_progress"])
        assert line == (f"error: --resume: {out / train_head.STATE} is truncated or corrupt ("
                        f"{line.split('(')[1].split(')')[0]}): it cannot continue; restore the file or train anew in "
                        "another --out"), line


PAUSE_AT_STEP_3 = """
from magicdec import train_head
batch = train_head.Windows.batch
train_head.Windows.batch = lambda self, seed, step, n: reached() if step == 3 else batch(self, seed, step, n)
"""
PAUSE_WRITING_THE_HEAD = """
import torch
from magicdec import heads
save = torch.save
def half_then_pause(obj, f, *a, **kw):
    if str(f).endswith("_lm_head.pt"):
        open(f, "wb").write(b"PK half a head")
        reached()
    save(obj, f, *a, **kw)
heads.torch.save = half_then_pause
"""


@pytest.mark.parametrize("where", [PAUSE_AT_STEP_3, PAUSE_WRITING_THE_HEAD], ids=["training", "writing the head"])
def test_sigterm_keeps_the_last_checkpoint_whole_and_says_so(where, stories, corpus, tmp_path):
    """SIGTERM while training, or while the final head is written (it cut 595 KB of a head to 18 KB): one line
    naming the checkpoint that stands, exit 143; every file in --out whole, none partial, no temporary left."""
    from test_errors import CLI, ended_with, terminated_at

    out = tmp_path / "out"
    p = terminated_at(where + CLI, ["train-head", *command(stories, corpus, out, "medusa", "--steps", "4",
                                                           "--save_every", "2", "--eval_every", "100")])
    ended_with(p, 143, f"interrupted: the checkpoint of step 2 in {out} stands; the same command with --resume "
                       "continues from it")
    assert sorted(f.name for f in out.iterdir()) == sorted([train_head.STATE, train_head.STATE_META, train_head.LOG,
                                                            train_head.PLOT])
    assert torch.load(out / train_head.STATE, weights_only=False)["step"] == 2
