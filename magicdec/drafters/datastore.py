"""REST's datastore: a corpus tokenized with the target's tokenizer and a suffix array over it, so the continuations
of any recent context (its longest suffix that occurs) can be looked up without a model (He et al. 2024, "REST:
Retrieval-Based Speculative Decoding").

    magicdec datastore --books ../shared/data/gutenberg --tokenizer DIR --exclude pg11 pg1342 --output rest.npz

The books a run's prompts come from should be left out (--exclude), or the draft would read the answers. The file
keeps the tokens, the suffix array (suffixes sorted by their first DEPTH tokens: a lookup never matches more), and
the tokenizer's fingerprint, which a run checks against its own tokenizer.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from magicdec import files
from magicdec.errors import interrupted_as, MagicDecError

DEPTH = 16  # suffixes are sorted by their first DEPTH tokens: the longest context suffix a lookup matches
SEPARATOR = -1  # between documents: no continuation crosses it


def fingerprint(tokenizer) -> str:
    """What a datastore's tokens mean: the vocabulary size and the text of the first ids."""
    n = tokenizer.vocab_size
    text = "\x00".join(tokenizer.decode([i]) for i in range(min(n, 4096)))
    return hashlib.sha256(f"{n}\x00{text}".encode()).hexdigest()[:16]


def suffix_array(tokens: np.ndarray, depth: int = DEPTH) -> np.ndarray:
    """Start positions sorted by the suffixes' first `depth` tokens (prefix doubling: ranks of 1, 2, 4, ... tokens),
    ties in position order."""
    n = tokens.shape[0]
    rank = tokens.astype(np.int64) + 2  # a separator ranks below every token, the end below that
    k = 1
    while True:
        nxt = np.concatenate([rank[k:], np.zeros(min(k, n), dtype=np.int64)])  # past the end: rank 0
        order = np.lexsort((np.arange(n), nxt, rank))
        pair_r, pair_n = rank[order], nxt[order]
        change = np.concatenate([[True], (pair_r[1:] != pair_r[:-1]) | (pair_n[1:] != pair_n[:-1])])
        new = np.empty(n, dtype=np.int64)
        new[order] = np.cumsum(change)
        rank, k = new, 2 * k
        if k >= depth or change.all():
            return order.astype(np.int64)


@dataclass
class Datastore:
    tokens: np.ndarray  # int32, documents separated by SEPARATOR
    sa: np.ndarray  # suffix array (suffix_array)
    meta: dict  # fingerprint, vocab_size, sources, depth

    @classmethod
    def build(cls, documents: list[list[int]], tokenizer, sources: list[str]) -> "Datastore":
        parts = []
        for doc in documents:
            parts += [np.asarray(doc, dtype=np.int32), np.array([SEPARATOR], dtype=np.int32)]
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        meta = {"fingerprint": fingerprint(tokenizer), "vocab_size": tokenizer.vocab_size, "sources": sources,
                "depth": DEPTH, "tokens": int(tokens.shape[0])}
        return cls(tokens, suffix_array(tokens), meta)

    def save(self, path: Path) -> Path:
        """To exactly `path` (np.savez given a name would add .npz), whole or not at all."""
        return files.save_npz(path, "--output", tokens=self.tokens, sa=self.sa, meta=np.array(json.dumps(self.meta)))

    @classmethod
    def load(cls, path: Path, tokenizer=None) -> "Datastore":
        """The datastore at `path`, checked against the run's tokenizer where there is one."""
        path = Path(path)
        if not path.is_file():
            raise MagicDecError(f"--datastore {path}: no such file; build one with `magicdec datastore --books DIR "
                                f"--tokenizer DIR --output {path}`")
        try:
            with np.load(path) as f:
                out = cls(f["tokens"], f["sa"], json.loads(str(f["meta"])))
            if not isinstance(out.meta, dict) or not {"fingerprint", "vocab_size", "depth"} <= set(out.meta):
                raise KeyError("meta")
        except (OSError, ValueError, KeyError, AttributeError, EOFError, zipfile.BadZipFile,
                zlib.error) as e:  # cut short, another file, another archive: each fails its own way
            raise MagicDecError(f"--datastore {path}: not a datastore, or one cut short ({type(e).__name__}); rebuild "
                                "it with `magicdec datastore`") from None
        if tokenizer is not None and out.meta["fingerprint"] != fingerprint(tokenizer):
            raise MagicDecError(f"--datastore {path} was built with another tokenizer ({out.meta['vocab_size']} "
                                f"tokens, not this run's {tokenizer.vocab_size} or not the same ids): rebuild it "
                                "with the target's --tokenizer")
        return out

    def _range(self, pattern: np.ndarray) -> tuple[int, int]:
        """[lo, hi) of the suffix array whose suffixes start with `pattern` (at most DEPTH tokens)."""
        n, m, t, sa = self.sa.shape[0], pattern.shape[0], self.tokens, self.sa

        def order(i) -> int:
            """-1, 0 or 1: suffix i's first m tokens before, equal to or after the pattern (past the end: -2)."""
            s = t[sa[i]:sa[i] + m]
            if s.shape[0] < m:
                s = np.concatenate([s, np.full(m - s.shape[0], -2, dtype=t.dtype)])
            diff = np.nonzero(s != pattern)[0]
            return 0 if not diff.size else (-1 if s[diff[0]] < pattern[diff[0]] else 1)

        def first_where(before) -> int:  # the first index whose suffix is not `before` the pattern
            lo, hi = 0, n
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (mid + 1, hi) if before(order(mid)) else (lo, mid)
            return lo

        return first_where(lambda o: o < 0), first_where(lambda o: o <= 0)

    def continuations(self, context: list[int], length: int, k: int, max_suffix: int = DEPTH,
                      max_matches: int = 5000) -> list[list[int]]:
        """Up to k distinct continuations of `length` tokens after the longest suffix of `context` (at most
        max_suffix tokens) that occurs, most frequent first (ties: the earlier in the suffix array), from at most
        max_matches occurrences; none if no suffix occurs with a full continuation."""
        for n in range(min(max_suffix, self.meta["depth"], len(context)), 0, -1):
            lo, hi = self._range(np.asarray(context[-n:], dtype=np.int32))
            if lo == hi:
                continue
            starts = self.sa[lo:min(hi, lo + max_matches)] + n
            starts = starts[starts + length <= self.tokens.shape[0]]
            windows = self.tokens[starts[:, None] + np.arange(length)]
            windows = windows[~(windows == SEPARATOR).any(1)]
            if windows.shape[0]:
                found, first, counts = np.unique(windows, axis=0, return_index=True, return_counts=True)
                order = np.lexsort((first, -counts))[:k]  # most frequent, then the earliest in the suffix array
                return found[order].tolist()
        return []


def is_datastore(path: Path) -> bool:
    try:
        with np.load(path) as f:
            return {"tokens", "sa", "meta"} <= set(f.files)
    except Exception:  # not an archive, or not numpy's: whatever it is, not a datastore
        return False


def books_of(books: Path, exclude: list[str]) -> list[Path]:
    """The .txt books to build from, every --exclude naming one of them (a name that matches none is a typo that
    would put the prompts' own book in the datastore)."""
    from magicdec.data import _folder_books

    if not books.exists():
        raise MagicDecError(f"--books {books}: no such file or folder; give a folder of .txt books (or one .txt file)")
    found = _folder_books(books) if books.is_dir() else [books]
    unknown = [x for x in exclude if not any(x in (f.name, f.stem) for f in found)]
    if unknown:
        raise MagicDecError(f"--exclude {unknown[0]}: no book of --books {books} is named so (give file names or "
                            f"stems, e.g. {found[0].stem if found else 'pg1342'})")
    left = [f for f in found if f.name not in exclude and f.stem not in exclude]
    if not left:
        raise MagicDecError(f"--books {books}: no .txt book left to build from (after --exclude)")
    return left


def read_book(f: Path) -> str:
    """A book's text; one that is not UTF-8 text (Latin-1, binary) is a line naming it and the fix."""
    from magicdec.data import _read_text

    try:
        return _read_text(f)
    except OSError as e:
        raise MagicDecError(f"--books: cannot read {f} ({e.strerror or e})") from None
    except MagicDecError as e:  # data's wording, for --dataset: here a book is left out with --exclude
        raise MagicDecError(f"--books: {e}".replace("out of --dataset", f"out with --exclude {f.stem}")) from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="magicdec datastore", description=__doc__.splitlines()[0])
    p.add_argument("--books", type=Path, required=True, help="a folder of .txt books (or one .txt file)")
    p.add_argument("--tokenizer", type=Path, required=True, help="the target's tokenizer (file or dir)")
    p.add_argument("--exclude", nargs="*", default=[], help="books left out (file names or stems): the prompts' own")
    p.add_argument("--output", type=Path, required=True, help="the datastore's file, written at exactly this path")
    a = p.parse_args(argv)
    from magicdec.model.tokenizer import load_tokenizer

    books = books_of(a.books, a.exclude)
    if a.output.is_dir():
        raise MagicDecError(f"--output {a.output} is a folder: name the datastore's file, e.g. {a.output / 'rest.npz'}")
    if a.output.exists() and not is_datastore(a.output):
        raise MagicDecError(f"--output {a.output} exists and is not a datastore: it will not be replaced; choose "
                            "another name, or move that file away")
    files.writable_folder(a.output.parent, "--output")
    texts = [read_book(f) for f in books]
    tokenizer = load_tokenizer(a.tokenizer)
    with interrupted_as(lambda: f"interrupted: --output {a.output} was not written (it is as it was); run the same "
                                "command again"):
        docs = [tokenizer.encode(text, bos=False) for text in texts]
        store = Datastore.build(docs, tokenizer, [f.name for f in books])
        store.save(a.output)
    print(json.dumps(store.meta | {"output": str(a.output)}))
    return 0
