"""Prompts for long-context benchmarks: fixed-length token chunks cut from long documents.

MagicDec benchmarks on PG-19 test books: skip the first 8000 tokens of each book (front matter),
then cut prefix_len-token prompts. Here the cutting is fully deterministic, so two runs (or two
machines) given the same source and sizes see the same prompts:
  documents in a fixed order -> tokens [skip_tokens:] -> non-overlapping chunks of prefix_len - 1
  -> BOS + chunk, all chunks of document 0, then document 1, ... until batch_size prompts exist.

Sources: a folder of .txt books (sorted by file name), a .jsonl file ("text" field per line), one
.txt file, "pg19" (PG-19 test split through `datasets`), "stdlib" (the documentation text that
ships with every Python: pydoc_data.topics) and "auto" (PG-19 when the hub is reachable, else
stdlib, with a note on stderr). `resolve_source` returns a PromptSource whose `describe()` and
`used` say which text the prompts came from, for the run's record.
"""
from __future__ import annotations

import json
import os
import re
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

import torch
from tqdm import tqdm

from magicdec.errors import MagicDecError

PG19_DATASET = "emozilla/pg19"
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_CUT_GAP = 1024  # chars between the two cuts that check a partial tokenization (see _encode_head)
_CUT_MARGIN = 64  # tokens kept beyond the ones needed, so the cut's own damage stays out of them


@dataclass
class PromptSource:
    kind: str  # "folder" | "jsonl" | "txt" | "pg19" | "stdlib"
    location: str  # path, dataset id or module name
    note: str = ""  # why this source was picked, when "auto" picked it
    used: list = field(default_factory=list)  # (document name, prompts taken), filled by load_prompts

    def describe(self) -> str:
        if self.kind == "folder":
            return f"folder {self.location} ({len(_folder_books(Path(self.location)))} .txt books, sorted by name)"
        if self.kind == "jsonl":
            return f"jsonl file {self.location} ('text' field per line)"
        if self.kind == "txt":
            return f"text file {self.location}"
        if self.kind == "pg19":
            return f"PG-19 test split ({self.location} via datasets)"
        return f"Python stdlib {self.location} documentation text (not PG-19)"

    __str__ = describe  # so `str(source)` is what goes in a run's record

    def documents(self) -> Iterator[tuple[str, str]]:
        """(name, text) of each document, in the source's fixed order, read one at a time."""
        if self.kind == "folder":
            for path in _folder_books(Path(self.location)):
                yield path.name, _read_text(path)
        elif self.kind == "txt":
            yield Path(self.location).name, _read_text(Path(self.location))
        elif self.kind == "jsonl":
            yield from _jsonl_documents(Path(self.location))
        elif self.kind == "pg19":
            yield from _pg19_documents()
        else:
            yield self.location, _stdlib_text()


def resolve_source(source: str | Path | PromptSource = "auto") -> PromptSource:
    """Turn --dataset into a PromptSource. "auto" probes the hub (a quick socket connect) and falls
    back to the stdlib text with a one-line note on stderr, so offline runs still work but say so."""
    if isinstance(source, PromptSource):
        return source
    name = str(source)
    if name == "auto":
        reason = _hub_unreachable_reason()
        if reason is None:
            return PromptSource("pg19", PG19_DATASET)
        note = (f"note: PG-19 is not reachable ({reason}); prompts come from the Python stdlib pydoc_data.topics "
                f"documentation text, which is NOT PG-19 (pass --dataset DIR for a folder of .txt books)")
        print(note, file=sys.stderr)
        return PromptSource("stdlib", "pydoc_data.topics", note=note)
    if name == "pg19":
        reason = _hub_unreachable_reason()
        if reason is not None:
            raise MagicDecError(f"--dataset pg19: the Hugging Face hub is not reachable ({reason}); "
                                f"pass --dataset with a local folder of .txt books instead (e.g. ../shared/data/gutenberg)")
        return PromptSource("pg19", PG19_DATASET)
    if name == "stdlib":
        return PromptSource("stdlib", "pydoc_data.topics")
    path = Path(name).expanduser()
    if path.is_dir():
        if not _folder_books(path):
            raise MagicDecError(f"--dataset {name}: the folder has no .txt files; give a folder of .txt books, a .jsonl or .txt file, 'pg19' or 'stdlib'")
        return PromptSource("folder", str(path))
    if path.is_file() and path.suffix == ".jsonl":
        return PromptSource("jsonl", str(path))
    if path.is_file() and path.suffix == ".txt":
        return PromptSource("txt", str(path))
    what = "is not a .txt or .jsonl file" if path.is_file() else "does not exist"
    raise MagicDecError(f"--dataset {name} {what}; give a folder of .txt books, a .jsonl file with a 'text' field per line, "
                        f"a .txt file, 'pg19', 'stdlib' or 'auto'")


def load_prompts(tokenizer, batch_size: int, prefix_len: int, source: str | Path | PromptSource = "auto",
                 skip_tokens: int = 8000, bos_id: int | None = None, progress: bool = True) -> torch.Tensor:
    """[batch_size, prefix_len] LongTensor of distinct prompts: BOS + prefix_len - 1 consecutive text tokens.

    Never repeats or pads: if the source has fewer than batch_size such chunks, MagicDecError says how many it has.
    """
    _check_sizes(batch_size, prefix_len)
    if not isinstance(skip_tokens, int) or skip_tokens < 0:
        raise MagicDecError(f"skip_tokens must be a non-negative integer, got {skip_tokens!r}")
    bos = tokenizer.bos_id if bos_id is None else bos_id
    if bos is None or bos < 0:
        raise MagicDecError("the tokenizer has no BOS token; pass bos_id explicitly to load_prompts")
    src = resolve_source(source)
    src.used = []
    chunk = prefix_len - 1
    rows: list[list[int]] = []
    lengths = []  # tokens after the skip, per document: to say what would fit when the source runs out
    # The bar appears only if loading takes more than 3 s (many or huge documents, PG-19 download).
    with tqdm(total=batch_size, desc="prompts", unit="prompt", delay=3, leave=False, disable=not progress) as bar:
        for name, text in src.documents():
            want = batch_size - len(rows)
            ids = _encode_head(tokenizer, text, skip_tokens + want * chunk)
            body = ids[skip_tokens:]
            lengths.append(len(body))
            take = min(want, len(body) // chunk)
            rows += [[bos] + body[i * chunk:(i + 1) * chunk] for i in range(take)]
            if take:
                src.used.append((name, take))
                bar.update(take)
            if len(rows) == batch_size:
                return torch.tensor(rows, dtype=torch.long)
    # Every document was tokenized in full to get here, so len(rows) is all the source has.
    fit = _longest_chunk(lengths, batch_size)
    hint = f"; prefix_len <= {fit + 1} would give {batch_size}" if fit else ""
    raise MagicDecError(f"{src.describe()} has only {len(rows)} prompts of prefix_len {prefix_len} after skipping "
                        f"{skip_tokens} tokens per document, but batch_size {batch_size} were asked for{hint}: "
                        f"lower --B, --prefix_len or --skip_tokens, or give a bigger --dataset")


def random_prompts(vocab_size: int, batch_size: int, prefix_len: int, seed: int, bos_id: int | None) -> torch.Tensor:
    """[batch_size, prefix_len] LongTensor of uniformly random token ids with distinct rows, for
    random-weight runs that have no tokenizer: same seed, same prompts. Column 0 is bos_id unless it is None."""
    _check_sizes(batch_size, prefix_len)
    if vocab_size < 1:
        raise MagicDecError(f"vocab_size must be positive, got {vocab_size}")
    n_rand = prefix_len - 1 if bos_id is not None else prefix_len
    if vocab_size ** min(n_rand, 64) < batch_size:  # fewer distinct rows exist than asked for (capped: 2**64 > any batch)
        raise MagicDecError(f"only {vocab_size ** n_rand} distinct random prompts of prefix_len {prefix_len} exist "
                            f"with vocab_size {vocab_size}; lower --B or raise --prefix_len")
    gen = torch.Generator().manual_seed(seed)
    rand = torch.randint(0, vocab_size, (batch_size, n_rand), generator=gen)
    while True:  # redraw duplicate rows (only plausible for tiny vocab/prefix) until all differ
        first = _first_occurrences(rand)
        dup = torch.ones(batch_size, dtype=torch.bool)
        dup[first] = False
        if not dup.any():
            break
        rand[dup] = torch.randint(0, vocab_size, (int(dup.sum()), n_rand), generator=gen)
    if bos_id is None:
        return rand
    return torch.cat([torch.full((batch_size, 1), bos_id, dtype=torch.long), rand], dim=1)


# ---------------------------------------------------------------------------------------------

def _check_sizes(batch_size, prefix_len):
    if not isinstance(batch_size, int) or batch_size < 1:
        raise MagicDecError(f"batch size must be a positive integer, got {batch_size!r}; pass --B >= 1")
    if not isinstance(prefix_len, int) or prefix_len < 2:
        raise MagicDecError(f"prefix_len must be an integer >= 2 (BOS plus at least one text token), got {prefix_len!r}")


def _encode_head(tokenizer, text: str, n_tokens: int) -> list[int]:
    """tokenizer.encode(text, bos=False)[:n_tokens], tokenizing only as much of text as needed.

    Books run to 700K+ tokens and tokenizing them whole takes seconds each. Cutting the text only
    changes the tokens right at the cut (BPE merges do not reach across more than a word or so), so
    tokenize a prefix holding a margin beyond n_tokens and keep it only if a second cut _CUT_GAP
    chars later gives the same first n_tokens (i.e. neither cut reached back into them);
    otherwise grow the prefix. Past the end of the text it is just the whole-text tokenization.
    """
    n = 4 * n_tokens + _CUT_GAP  # English runs ~4 chars per token
    while n < len(text):
        head = tokenizer.encode(text[:n], bos=False)
        if len(head) >= n_tokens + _CUT_MARGIN:
            if tokenizer.encode(text[:n + _CUT_GAP], bos=False)[:n_tokens] == head[:n_tokens]:
                return head[:n_tokens]
            n *= 2  # a long unbroken run of text around the cut: move the cut well past it
        else:  # too few tokens: grow by the chars per token seen so far
            n = int(n * 1.2 * (n_tokens + _CUT_MARGIN) / max(len(head), 1)) + _CUT_GAP
    return tokenizer.encode(text, bos=False)[:n_tokens]


def _longest_chunk(lengths: list[int], batch_size: int) -> int:
    """Largest chunk length c with sum(L // c) >= batch_size (0 if none): the prefix_len hint when data runs out."""
    lo, hi = 0, max(lengths, default=0)
    while lo < hi:  # sum(L // c) only falls as c grows, so bisect
        mid = (lo + hi + 1) // 2
        if sum(n // mid for n in lengths) >= batch_size:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _first_occurrences(rows: torch.Tensor):
    """Indices of the first occurrence of each distinct row."""
    uniq, inverse = torch.unique(rows, dim=0, return_inverse=True)
    first = torch.full((len(uniq),), len(rows), dtype=torch.long)
    return first.scatter_reduce_(0, inverse, torch.arange(len(rows)), reduce="amin")


def _folder_books(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.suffix == ".txt" and p.is_file())


def _read_text(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e.object[e.start], e.start, "byte") from None
    _check_text(text, str(path))
    return text


def _not_utf8(path: Path, byte: int, at: int, where: str) -> MagicDecError:
    # Latin-1 (or Windows-1252) is the usual culprit: every byte is valid there, so iconv from it always succeeds
    out = path.with_suffix(".utf8" + path.suffix)
    return MagicDecError(f"{path} is not UTF-8 (byte 0x{byte:02x} at {where} {at}): convert it, e.g. iconv -f latin1 "
                         f"-t utf-8 {path} > {out}, and use {out.name} in its place (or leave it out of --dataset)")


# Control characters other than tab, newline, carriage return, vertical tab and form feed, which real text has
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f]")
_MAX_CONTROL = 0.1  # of the characters: books have a few form feeds or escapes at most; binary data is full of them


def _check_text(text: str, where: str) -> None:
    """Refuse a document that is not text: NUL bytes (which no text file holds; a file of zeros, or UTF-16) or a
    large share of control characters (binary data that happens to decode as UTF-8)."""
    if "\0" in text:
        raise MagicDecError(f"{where} holds NUL characters (the first at character {text.index(chr(0))}): it is not a "
                            "text document (binary, or UTF-16: iconv -f utf-16 -t utf-8 converts that); leave it out "
                            "of --dataset")
    n = sum(1 for _ in _CONTROL.finditer(text))
    if n > _MAX_CONTROL * len(text):
        raise MagicDecError(f"{where} is {n / len(text):.0%} control characters: it is not a text document; "
                            "leave it out of --dataset")


def _jsonl_documents(path: Path) -> Iterator[tuple[str, str]]:
    try:
        yield from _jsonl_lines(path)
    except UnicodeDecodeError:  # raised mid-file by the text reader, which knows no line numbers: find the line
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise _not_utf8(path, raw[e.start], e.start, f"line {lineno} column") from None
        raise  # not reached: the same bytes failed to decode as a whole


def _jsonl_lines(path: Path) -> Iterator[tuple[str, str]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise MagicDecError(f"{path} line {lineno} is not a JSON object with a 'text' field; "
                                    f"fix that line (one {{\"text\": ...}} object per line)") from None
            if not isinstance(text, str):
                raise MagicDecError(f"{path} line {lineno}: 'text' is {type(text).__name__}, not a string; fix that line")
            _check_text(text, f"{path} line {lineno}")
            yield f"{path.name}:{lineno}", text


def _pg19_documents() -> Iterator[tuple[str, str]]:
    try:
        import datasets
        ds = datasets.load_dataset(PG19_DATASET, split="test", streaming=True)
        for i, row in enumerate(ds):  # streaming keeps the dataset's order and reads only the books needed
            yield row.get("short_book_title") or f"pg19-test-{i}", row["text"]
    except Exception as e:  # network, auth, missing package: all mean "not readable from here"
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        raise MagicDecError(f"PG-19 ({PG19_DATASET}) could not be read through `datasets` ({why}); pass --dataset "
                            f"with a local folder of .txt books instead (e.g. ../shared/data/gutenberg)") from None


def _stdlib_text() -> str:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise MagicDecError("this Python has no pydoc_data module (the stdlib text); pass --dataset with a folder of .txt books") from None
    return "\n\n".join(topics[k] for k in sorted(topics))


def _hub_unreachable_reason() -> str | None:
    """None if a TCP connection to the hub opens within 3 s, else why not. Offline env vars skip the probe."""
    for var in _OFFLINE_VARS:
        if os.environ.get(var, "").strip().lower() not in ("", "0", "false", "no", "off"):
            return f"{var} is set"
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")  # HF_ENDPOINT: a mirror
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=3).close()
        return None
    except OSError as e:
        return f"cannot connect to {host}:{port}: {e.strerror or type(e).__name__}"
