"""REST (magicdec/drafters/datastore.py, magicdec/drafters/rest.py): the suffix array and the continuation lookup against
brute force over the token sequence, the datastore file and its tokenizer check, the build command, and REST
speculation (chain and branches) equal to plain greedy decoding."""
from __future__ import annotations

import errno
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import one_line_error
from magicdec.drafters.datastore import SEPARATOR, Datastore, fingerprint, suffix_array
from magicdec.errors import MagicDecError
from magicdec.model.forward_plan import LAST_LOGITS


class Chars:
    """A tokenizer of the 96 printable characters (what Datastore.build and fingerprint need of one)."""
    vocab_size = 96

    def __init__(self, shift: int = 0):
        self.shift = shift

    def decode(self, ids):
        return "".join(chr(32 + (i + self.shift) % 96) for i in ids)

    def encode(self, text, bos=False):
        return [(ord(c) - 32 - self.shift) % 96 for c in text if 32 <= ord(c) < 128]


def test_suffix_array_sorts_by_the_first_16_tokens():
    t = np.random.default_rng(0).integers(0, 4, 3000).astype(np.int32)
    t[[500, 1700]] = SEPARATOR
    sa = suffix_array(t)
    key = lambda i: tuple(t[i:i + 16].tolist()) + (-2,) * (16 - len(t[i:i + 16])) + (i,)  # noqa: E731
    assert sa.tolist() == sorted(range(len(t)), key=key)


def brute_continuations(t, context, length, k):
    """The longest suffix of context occurring in t with a full continuation (no separator), its continuations
    counted, most frequent first, ties by where the suffix array puts their first occurrence."""
    sa = suffix_array(t)
    place = {int(s): j for j, s in enumerate(sa)}
    for n in range(min(16, len(context)), 0, -1):
        pat = context[-n:]
        occ = sorted((i for i in range(len(t) - n + 1) if t[i:i + n].tolist() == pat), key=place.get)
        seen, count = {}, Counter()
        for i in occ:
            c = t[i + n:i + n + length].tolist()
            if len(c) == length and SEPARATOR not in c:
                count[tuple(c)] += 1
                seen.setdefault(tuple(c), place[i])
        if count:
            return [list(c) for c in sorted(count, key=lambda c: (-count[c], seen[c]))][:k]
    return []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_continuations_equal_brute_force(seed):
    g = np.random.default_rng(seed)
    t = g.integers(0, 6, 4000).astype(np.int32)
    t[g.integers(0, 4000, 5)] = SEPARATOR
    store = Datastore(t, suffix_array(t), {"depth": 16})
    for _ in range(20):
        context = g.integers(0, 6, int(g.integers(1, 30))).tolist()
        assert store.continuations(context, 3, 4) == brute_continuations(t, context, 3, 4)
    assert store.continuations([7, 7], 3, 4) == []  # a token the corpus never holds


def test_datastore_file_and_its_tokenizer_check(tmp_path):
    store = Datastore.build([Chars().encode("the cat sat on the mat. the cat ran."), Chars().encode("a cat.")],
                            Chars(), ["a", "b"])
    store.save(tmp_path / "s.npz")
    back = Datastore.load(tmp_path / "s.npz", Chars())
    assert back.meta == store.meta and (back.tokens == store.tokens).all() and (back.sa == store.sa).all()
    assert back.meta["fingerprint"] == fingerprint(Chars()) and back.meta["sources"] == ["a", "b"]
    assert [Chars().decode(c) for c in back.continuations(Chars().encode("the c"), 3, 2)] == ["at "]
    with pytest.raises(MagicDecError, match="another tokenizer") as e:
        Datastore.load(tmp_path / "s.npz", Chars(shift=1))
    assert "\n" not in str(e.value)
    (tmp_path / "junk.npz").write_bytes(b"not a datastore")
    with pytest.raises(MagicDecError, match="not a datastore"):
        Datastore.load(tmp_path / "junk.npz")


def magicdec(*argv):
    import os
    import subprocess
    import sys

    from conftest import REPO

    return subprocess.run([sys.executable, "-m", "magicdec", *argv], cwd=REPO, capture_output=True, text=True,
                          env=os.environ | {"HF_HUB_OFFLINE": "1"})


def test_datastore_command_leaves_the_prompt_books_out(tmp_path):
    from magicdec.model.tokenizer import load_tokenizer
    from test_runs import PIECES, write_tokenizer

    write_tokenizer(tmp_path, PIECES)
    books = tmp_path / "books"
    books.mkdir()
    (books / "pg1.txt").write_text("It was the best of times, it was the worst of times.")
    (books / "pg2.txt").write_text("Call me Ishmael.")
    p = magicdec("datastore", "--books", str(books), "--tokenizer", str(tmp_path), "--exclude", "pg2",
                 "--output", str(tmp_path / "s.npz"))
    assert p.returncode == 0, p.stderr
    tokenizer = load_tokenizer(tmp_path)
    store = Datastore.load(tmp_path / "s.npz", tokenizer)
    assert store.meta["sources"] == ["pg1.txt"]
    found = store.continuations(tokenizer.encode("it was the ", bos=False), 4, 2)
    assert [tokenizer.decode(c) for c in found] == ["wors"]
    one_line_error(magicdec("datastore", "--books", str(books), "--tokenizer", str(tmp_path), "--exclude", "pg1",
                            "pg2", "--output", str(tmp_path / "t.npz")), "no .txt book left")


@pytest.mark.parametrize("width", [1, 3])
def test_rest_speculation_equals_plain_greedy(tiny, width):
    """A datastore holding the target's own greedy continuation of the first prompt (and noise): that sequence is
    proposed right, the others mostly wrong; the output is plain greedy decoding's either way."""
    from magicdec.drafters.rest import RestDraft
    from magicdec.decoding.generate import Decoder, decode
    from magicdec.model.kv_cache import KVCache
    from test_generate_speculative import plain_greedy

    prompts = torch.randint(0, 256, (3, 48), generator=torch.Generator().manual_seed(2))
    want = plain_greedy(tiny, prompts, 24)
    noise = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    docs = [prompts[0, -8:].tolist() + want[0].tolist(), noise]
    store = Datastore(np.concatenate([np.array(d + [SEPARATOR], dtype=np.int32) for d in docs]), None, {"depth": 16})
    store.sa = suffix_array(store.tokens)
    a = tiny.args
    cache = KVCache(a.n_layers, 3, a.n_kv_heads, 48 + 24 + 3 * width + 2, a.head_dim, torch.float32, "cpu")
    logits = tiny(prompts, cache, LAST_LOGITS)[:, -1]
    cache.advance(48)
    draft = RestDraft(store, prompts, 16, None).shaped(width)
    decoder = Decoder(tiny, drafter=draft, gamma=3)
    out, _ = decode(decoder, cache, logits.argmax(-1), 24, prev=prompts[:, -1])
    assert out.tolist() == want.tolist()
    per_seq = decoder.stats.sequence_kept
    assert per_seq[0] > 10 and decoder.stats.drafter["found"] > 0  # the first sequence found its continuation


# --- the datastore command's faults: its printed path, bad books, a file in the way, a read-only or full disk,
# a cut-short datastore, SIGTERM mid-write

@pytest.fixture
def books(tmp_path) -> Path:
    from test_runs import PIECES, write_tokenizer

    write_tokenizer(tmp_path, PIECES)
    d = tmp_path / "books"
    d.mkdir()
    (d / "pg1.txt").write_text("It was the best of times, it was the worst of times.")
    (d / "pg2.txt").write_text("Call me Ishmael.")
    return d


def datastore_line(capsys, *argv) -> str:
    """`magicdec datastore ARGV` in this process: its one error line (exit 2)."""
    from magicdec.cli import main

    with pytest.raises(SystemExit) as e:
        main(["datastore", *map(str, argv)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture
def no_tokenizer(monkeypatch):
    import magicdec.model.tokenizer

    monkeypatch.setattr(magicdec.model.tokenizer, "load_tokenizer", lambda *a: pytest.fail("the tokenizer was loaded"))


def test_the_datastore_is_at_exactly_the_path_printed(books, capsys):
    from magicdec.cli import main

    out = books.parent / "rest.ds"  # no .npz: np.savez given this name wrote rest.ds.npz, and `rest.ds` was printed
    assert main(["datastore", "--books", str(books), "--tokenizer", str(books.parent), "--output", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["output"] == str(out)
    assert not out.with_name("rest.ds.npz").exists() and Datastore.load(out).meta["sources"] == ["pg1.txt", "pg2.txt"]


@pytest.mark.parametrize("case, said", [
    ("missing", "--books {books}/nothing.txt: no such file or folder"),
    ("latin-1", "--books: {books}/pg1.txt is not UTF-8 (byte 0xe9 at byte 3): convert it, e.g. iconv -f latin1"),
    ("binary", "--books: {books}/pg1.txt holds NUL characters"),
    ("exclude", "--exclude pg9: no book of --books {books} is named so"),
])
def test_bad_books_are_one_line_before_the_tokenizer_loads(case, said, books, capsys, no_tokenizer):
    given = books
    if case == "missing":
        given = books / "nothing.txt"
    elif case == "latin-1":
        (books / "pg1.txt").write_bytes("Caf\xe9 society, na\xefve".encode("latin-1"))
    elif case == "binary":
        (books / "pg1.txt").write_bytes(bytes(4096))
    line = datastore_line(capsys, "--books", given, "--tokenizer", books.parent, "--output", books.parent / "s.npz",
                          *(["--exclude", "pg9"] if case == "exclude" else []))
    assert line.startswith("error: " + said.format(books=books)), line
    if case in ("latin-1", "binary"):
        assert "leave it out with --exclude pg1" in line, line
    assert not (books.parent / "s.npz").exists()


def test_an_output_that_is_not_a_datastore_is_never_replaced(books, capsys, no_tokenizer):
    notes = books.parent / "notes.txt"
    notes.write_text("my notes")
    line = datastore_line(capsys, "--books", books, "--tokenizer", books.parent, "--output", notes)
    assert line == (f"error: --output {notes} exists and is not a datastore: it will not be replaced; choose another "
                    "name, or move that file away")
    assert notes.read_text() == "my notes"


def test_a_read_only_output_folder_is_one_line_before_the_tokenizer_loads(books, capsys, no_tokenizer, monkeypatch):
    from test_files import faulty_disk

    faulty_disk(monkeypatch, books.parent / "ro", errno.EROFS)
    line = datastore_line(capsys, "--books", books, "--tokenizer", books.parent, "--output", books.parent / "ro" / "s")
    assert line == (f"error: --output: cannot write to {books.parent / 'ro'} (the file system is read-only); choose a "
                    "folder on a writable disk")


def test_a_full_disk_leaves_the_old_datastore_whole(books, capsys, monkeypatch):
    from magicdec.cli import main
    from test_files import faulty_disk, temporaries

    out = books.parent / "store" / "s.npz"
    main(["datastore", "--books", str(books), "--tokenizer", str(books.parent), "--output", str(out), "--exclude",
          "pg2"])
    whole = out.read_bytes()
    faulty_disk(monkeypatch, out.parent, errno.ENOSPC, room=300)
    line = datastore_line(capsys, "--books", books, "--tokenizer", books.parent, "--output", out)
    assert line == f"error: --output cannot write {out}: the disk is full; free space there or choose a folder on " \
                   "another disk"
    assert out.read_bytes() == whole and temporaries(out.parent) == []


def test_a_cut_short_datastore_is_one_line(books, tmp_path):
    from magicdec.cli import main

    main(["datastore", "--books", str(books), "--tokenizer", str(books.parent), "--output", str(tmp_path / "s.npz")])
    whole = (tmp_path / "s.npz").read_bytes()
    for cut in (len(whole) - 10, len(whole) // 2, 300, 0):
        (tmp_path / "cut.npz").write_bytes(whole[:cut])
        with pytest.raises(MagicDecError, match=r"^--datastore .*cut.npz: not a datastore, or one cut short \(\w+\); "
                                                r"rebuild it with `magicdec datastore`$"):
            Datastore.load(tmp_path / "cut.npz")


PAUSE_WRITING = """
import numpy
def half_then_pause(file, **arrays):  # a file object (a path for np.savez to add .npz to, before)
    f = file if hasattr(file, "write") else open(file if str(file).endswith(".npz") else f"{file}.npz", "wb")
    f.write(b"PK\\x03\\x04 half a datastore")
    f.flush()
    reached()
numpy.savez = half_then_pause
"""


def test_sigterm_mid_write_keeps_the_old_datastore(books, tmp_path):
    from magicdec.cli import main
    from test_errors import CLI, ended_with, terminated_at
    from test_files import temporaries

    out = tmp_path / "s.npz"
    main(["datastore", "--books", str(books), "--tokenizer", str(books.parent), "--output", str(out)])
    whole = out.read_bytes()
    p = terminated_at(PAUSE_WRITING + CLI, ["datastore", "--books", books, "--tokenizer", books.parent, "--output", out,
                                            "--exclude", "pg2"])
    ended_with(p, 143, f"interrupted: --output {out} was not written (it is as it was)")
    assert out.read_bytes() == whole and temporaries(tmp_path) == []
