"""magicdec.data: deterministic prompt chunks, checked against a plain whole-document tokenization."""
import json
import re
import shutil
import subprocess

import pytest
import sentencepiece as spm
import torch

from conftest import BOOKS, LLAMA2_TOKENIZER, needs_llama_tokenizers
from magicdec.data import PromptSource, _encode_head, load_prompts, random_prompts, resolve_source
from magicdec.errors import MagicDecError

class SPTokenizer:
    """Stand-in with the magicdec tokenizer interface, so these tests do not depend on magicdec.model.tokenizer."""

    def __init__(self, path=LLAMA2_TOKENIZER):
        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        self.bos_id, self.eos_id, self.vocab_size = self.sp.bos_id(), self.sp.eos_id(), self.sp.vocab_size()
        self.encoded = []  # (first 100 characters, length) of every text encoded, to check that loading is lazy

    def encode(self, text, bos=True):
        self.encoded.append((text[:100], len(text)))
        return ([self.bos_id] if bos else []) + self.sp.encode(text)

    def decode(self, ids):
        return self.sp.decode(ids)


@pytest.fixture(scope="module")
def tok():
    return SPTokenizer()


@pytest.fixture(scope="module")
def whole():
    """Whole-document tokenizations (cached: pg1184 alone takes ~2.5 s)."""
    sp = spm.SentencePieceProcessor(model_file=str(LLAMA2_TOKENIZER))
    cache = {}

    def get(text):
        if text not in cache:
            cache[text] = sp.encode(text)
        return cache[text]
    return get


def reference(whole, texts, batch_size, prefix_len, skip):
    """The rule written out the obvious way: tokenize every document whole, skip, cut, BOS in front."""
    chunk, rows = prefix_len - 1, []
    for text in texts:
        ids = whole(text)[skip:]
        rows += [[1] + ids[i * chunk:(i + 1) * chunk] for i in range(len(ids) // chunk)]
    return rows[:batch_size], len(rows)


def book(name):
    return (BOOKS / name).read_text(encoding="utf-8")


@needs_llama_tokenizers
def test_gutenberg_folder_matches_whole_book_tokenization(tok, whole):
    # Sorted order is pg11, pg1184, ...: pg11 (~42K tokens) gives 33 chunks, the rest come from the start of pg1184.
    tok.encoded.clear()
    src = resolve_source(BOOKS)
    got = load_prompts(tok, 40, 1025, src)
    want, _ = reference(whole, [book("pg11.txt"), book("pg1184.txt")], 40, 1025, 8000)
    assert got.dtype == torch.long and got.shape == (40, 1025)
    assert got.tolist() == want
    assert [name for name, _ in src.used] == ["pg11.txt", "pg1184.txt"] and sum(n for _, n in src.used) == 40
    # pg1184 was not tokenized whole: no more than twice the text that holds the tokens taken from it
    second = book("pg1184.txt")
    taken = len(tok.decode(whole(second)[:8000 + 7 * 1024]))
    assert max(n for head, n in tok.encoded if second.startswith(head)) < 2 * taken < len(second)
    assert (got[:, 0] == tok.bos_id).all()
    assert len({tuple(r) for r in got.tolist()}) == 40


@needs_llama_tokenizers
def test_short_document_contributes_nothing(tok, whole):
    # skip 40000 leaves pg11 ~2K tokens, less than one 4096-token chunk: every prompt comes from pg1184.
    src = resolve_source(BOOKS)
    got = load_prompts(tok, 3, 4097, src, skip_tokens=40000)
    want, _ = reference(whole, [book("pg11.txt"), book("pg1184.txt")], 3, 4097, 40000)
    assert got.tolist() == want and src.used == [("pg1184.txt", 3)]
    assert want[0][1:] == whole(book("pg1184.txt"))[40000:44096]


@needs_llama_tokenizers
@pytest.mark.parametrize("n_tokens", [1, 500, 8000, 33000, 42149, 60000])
def test_partial_tokenization_equals_whole(tok, whole, n_tokens):
    for name in ("pg11.txt", "pg1184.txt", "pg1342.txt"):
        text = book(name)
        assert _encode_head(tok, text, n_tokens) == whole(text)[:n_tokens], name


@needs_llama_tokenizers
def test_partial_tokenization_with_unbroken_runs(tok, whole):
    # Long whitespace-free runs and digit/newline soup at every plausible cut point.
    text = book("pg11.txt")[:20000]
    text = text + "=" * 9000 + "0123456789" * 700 + "\n\n\r\n" + "x" * 5000 + " " + text
    for n_tokens in (3000, 5000, 6500, 8000, 12000):
        assert _encode_head(tok, text, n_tokens) == whole(text)[:n_tokens]


@needs_llama_tokenizers
def test_partial_tokenization_sweep(tok, whole):
    text = book("pg11.txt")
    for n_tokens in torch.randint(1, 45000, (25,), generator=torch.Generator().manual_seed(0)).tolist():
        assert _encode_head(tok, text, n_tokens) == whole(text)[:n_tokens], n_tokens


class WordLengthTokenizer:
    """A toy with far-reaching cut damage: a token per 4 characters, valued by the length of its word.
    Cutting inside a long word changes every token of that word, not just the last one."""
    bos_id = 0

    def encode(self, text, bos=True):
        return ([0] if bos else []) + [len(w) % 997 + 1 for w in text.split(" ") for _ in range(0, len(w), 4)]


def test_partial_tokenization_moves_past_far_reaching_cuts():
    toy = WordLengthTokenizer()
    text = " ".join(["abcd"] * 3000 + ["z" * 400_000] + ["abc"] * 3000)
    for n_tokens in (100, 3500, 5000, 60000, 102000, 104000):
        assert _encode_head(toy, text, n_tokens) == toy.encode(text, bos=False)[:n_tokens]


@needs_llama_tokenizers
def test_deterministic_contiguous_non_overlapping(tok, whole):
    a = load_prompts(tok, 5, 300, "stdlib", skip_tokens=1000)
    b = load_prompts(tok, 5, 300, "stdlib", skip_tokens=1000)
    assert torch.equal(a, b)
    assert (a[:, 0] == tok.bos_id).all()
    # One document: the chunks are exactly the tokens after the skip, back to back, each used once.
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics))
    assert a[:, 1:].flatten().tolist() == whole(text)[1000:1000 + 5 * 299]
    assert len({tuple(r) for r in a.tolist()}) == 5


def test_bos_override():
    got = load_prompts(WordLengthTokenizer(), 2, 16, "stdlib", bos_id=7)
    assert (got[:, 0] == 7).all()


def write_jsonl(path, texts, extra_lines=()):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t, "id": len(t)}) + "\n\n")  # blank lines are skipped
        f.writelines(extra_lines)
    return path


@needs_llama_tokenizers
def test_jsonl_source(tok, whole, tmp_path):
    texts = [book("pg11.txt")[:25000], book("pg844.txt")[:50000]]
    path = write_jsonl(tmp_path / "docs.jsonl", texts)
    src = resolve_source(str(path))
    assert src.kind == "jsonl"
    want, n_avail = reference(whole, texts, 12, 513, 2000)
    assert n_avail > 12 > len(reference(whole, texts[:1], 99, 513, 2000)[0])  # both documents are used
    assert load_prompts(tok, 12, 513, src, skip_tokens=2000).tolist() == want
    assert [n for n, _ in src.used] == ["docs.jsonl:1", "docs.jsonl:3"]


def test_jsonl_bad_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", ["short text"], ['{"txt": "no text field"}\n'])
    with pytest.raises(MagicDecError, match="line 3 .*'text' field"):
        load_prompts(WordLengthTokenizer(), 5, 8, path, skip_tokens=0)


@needs_llama_tokenizers
def test_running_out_says_how_many(tok, whole, tmp_path):
    texts = [book("pg11.txt")[:9000], book("pg844.txt")[:7000]]
    path = write_jsonl(tmp_path / "small.jsonl", texts)
    _, n_avail = reference(whole, texts, 10**9, 257, 100)
    assert n_avail > 0
    with pytest.raises(MagicDecError, match=rf"has only {n_avail} prompts of prefix_len 257 .*lower --B") as e:
        load_prompts(tok, n_avail + 1, 257, path, skip_tokens=100)
    assert "\n" not in str(e.value)
    assert load_prompts(tok, n_avail, 257, path, skip_tokens=100).shape == (n_avail, 257)  # exactly all of it works
    with pytest.raises(MagicDecError, match=r"has only 0 prompts of prefix_len 100000"):
        load_prompts(tok, 1, 100000, path)


@needs_llama_tokenizers
def test_single_txt_file(tok, whole):
    src = resolve_source(BOOKS / "pg11.txt")
    assert src.kind == "txt"
    want, _ = reference(whole, [book("pg11.txt")], 6, 2049, 8000)
    assert load_prompts(tok, 6, 2049, src).tolist() == want


def test_auto_offline_falls_back_to_stdlib_with_note(monkeypatch, capsys):
    tok = WordLengthTokenizer()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    got = load_prompts(tok, 3, 128, "auto")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pydoc_data.topics" in err and "NOT PG-19" in err
    assert torch.equal(got, load_prompts(tok, 3, 128, "stdlib"))
    src = resolve_source("auto")
    assert src.kind == "stdlib" and "not PG-19" in src.describe() and src.note


def test_pg19_offline_is_an_error(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(MagicDecError, match="not reachable.*local folder"):
        resolve_source("pg19")


def test_bad_inputs(tmp_path):
    tok = WordLengthTokenizer()
    for bs, pl in [(0, 16), (-1, 16), (2, 1), (2, 0), (2, -5), (1.5, 16), (2, 16.0)]:
        with pytest.raises(MagicDecError):
            load_prompts(tok, bs, pl, "stdlib")
    with pytest.raises(MagicDecError, match="skip_tokens"):
        load_prompts(tok, 2, 16, "stdlib", skip_tokens=-1)
    with pytest.raises(MagicDecError, match="does not exist"):
        load_prompts(tok, 2, 16, str(tmp_path / "nope"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(MagicDecError, match="not a .txt or .jsonl"):
        resolve_source(tmp_path / "x.csv")
    with pytest.raises(MagicDecError, match="no .txt files"):
        resolve_source(tmp_path)


def test_prompt_source_describe():
    assert f"{len(list(BOOKS.glob('*.txt')))} .txt books" in resolve_source(BOOKS).describe()  # 21 in ../shared/data
    assert PromptSource("pg19", "emozilla/pg19").describe().startswith("PG-19 test split")
    assert str(PromptSource("stdlib", "pydoc_data.topics")) == "Python stdlib pydoc_data.topics documentation text (not PG-19)"


def test_random_prompts():
    a = random_prompts(32000, 8, 64, seed=0, bos_id=1)
    assert a.shape == (8, 64) and a.dtype == torch.long and (a[:, 0] == 1).all()
    assert ((a >= 0) & (a < 32000)).all()
    assert torch.equal(a, random_prompts(32000, 8, 64, seed=0, bos_id=1))
    assert not torch.equal(a, random_prompts(32000, 8, 64, seed=1, bos_id=1))
    assert len({tuple(r) for r in a.tolist()}) == 8
    # Tiny space: 2 ** 3 = 8 distinct rows exist; all 8 come out distinct, a 9th is impossible.
    tiny = random_prompts(2, 8, 4, seed=0, bos_id=1)
    assert len({tuple(r) for r in tiny.tolist()}) == 8
    with pytest.raises(MagicDecError, match="only 8 distinct"):
        random_prompts(2, 9, 4, seed=0, bos_id=1)
    assert random_prompts(100, 4, 5, seed=0, bos_id=None).shape == (4, 5)
    with pytest.raises(MagicDecError):
        random_prompts(100, 0, 5, seed=0, bos_id=1)


# ------------------------------------------------------------------ documents that are not (UTF-8) text

def load_toy(source, n=2):
    """A few prompts through the toy tokenizer: these checks are about reading documents, not tokens."""
    return load_prompts(WordLengthTokenizer(), n, 16, source, skip_tokens=0)


def refused(match, source) -> str:
    with pytest.raises(MagicDecError, match=match) as e:
        load_toy(source)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_binary_documents_are_refused(tmp_path):
    zeros = tmp_path / "zeros.txt"
    zeros.write_bytes(bytes(2 << 20))  # 2 MB of NUL bytes: valid UTF-8, so only a text check catches it
    refused(rf"^{re.escape(str(zeros))} holds NUL characters .*not a text document", zeros)
    utf16 = tmp_path / "utf16.txt"  # ASCII text as UTF-16 without a BOM: every other byte is NUL
    utf16.write_bytes(("plain English words " * 500).encode("utf-16-le"))
    refused(r"utf16.txt holds NUL .*iconv -f utf-16 -t utf-8", utf16)
    controls = tmp_path / "controls.txt"  # decodes as UTF-8, a third of it control characters
    controls.write_bytes(bytes(range(1, 9)) * 1000 + b"words and more words " * 800)
    refused(r"controls.txt is 3\d% control characters: it is not a text document", controls)
    folder = tmp_path / "books"
    folder.mkdir()
    (folder / "a.txt").write_bytes(bytes(1000))  # sorted first: refused before any prompt is cut
    (folder / "b.txt").write_text("ordinary words " * 2000)
    refused(rf"^{re.escape(str(folder / 'a.txt'))} holds NUL", folder)
    jsonl = write_jsonl(tmp_path / "docs.jsonl", ["ordinary words", "nul\u0000inside " * 500])
    refused(r"docs.jsonl line 3 holds NUL characters \(the first at character 3\)", jsonl)


def test_text_with_a_few_control_characters_is_text(tmp_path):
    # form feeds between pages and terminal escapes: a few per thousand characters, as real files have them
    text = "".join(f"\x0cpage {i}\x1b[1m bold\x1b[0m " + "some ordinary words " * 50 for i in range(40))
    path = tmp_path / "pages.txt"
    path.write_text(text, encoding="utf-8")
    toy = WordLengthTokenizer()
    want = toy.encode(text, bos=False)
    assert load_prompts(toy, 3, 16, path, skip_tokens=0)[:, 1:].flatten().tolist() == want[:45]


def test_latin1_documents_name_the_file_and_the_fix(tmp_path):
    text = "Café society. " * 400
    for name, data in (("latin1.txt", text.encode("latin-1")),
                       ("latin1.jsonl", "\n".join(json.dumps({"text": t}, ensure_ascii=False)
                                                  for t in ("first line", text)).encode("latin-1"))):
        path = tmp_path / name
        path.write_bytes(data)
        column = data.splitlines()[-1].index("é".encode("latin-1"))  # the offending byte within its line
        where = "byte 3" if name.endswith(".txt") else f"line 2 column {column}"
        msg = refused(rf"^{re.escape(str(path))} is not UTF-8 \(byte 0xe9 at {where}\): convert it, e.g. iconv -f latin1 -t utf-8",
                      path)
        if shutil.which("iconv"):  # the command in the message fixes the file
            command = re.search(r"e\.g\. (iconv .*?), and use (\S+) in its place", msg)
            subprocess.run(command[1], shell=True, check=True)
            fixed = tmp_path / command[2]
            assert fixed.suffix == path.suffix and fixed.read_text(encoding="utf-8") == data.decode("latin-1")
            assert load_toy(fixed).shape == (2, 16)
