"""Tokenizers: HF `tokenizer.json`, Llama-2 SentencePiece and Llama-3 tiktoken `tokenizer.model`, and llama2.c's
`tokenizer.bin` (magicdec.model.checkpoint.Llama2cTokenizer).

Every loader returns an object with encode(text, bos=True) -> list[int], decode(ids) -> str, bos_id, eos_id and
vocab_size. The format of a file is read from its content, since Llama-2 and Llama-3 both name theirs tokenizer.model.
"""
from __future__ import annotations

import base64
import json
import re
import struct
from pathlib import Path

from magicdec.errors import MagicDecError

# Llama 3's pre-tokenizer split: contractions, words with an optional leading non-letter, 1-3 digit numbers,
# punctuation runs, newlines, other whitespace
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIALS = (["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                    "<|reserved_special_token_1|>", "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
                    "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
                   + [f"<|reserved_special_token_{i}|>" for i in range(5, 251)])


class SentencePieceTokenizer:
    def __init__(self, path: Path):
        import sentencepiece
        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.bos_id, self.eos_id, self.vocab_size = self.sp.bos_id(), self.sp.eos_id(), self.sp.vocab_size()

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return [self.bos_id] * bos + self.sp.encode(text)

    def decode(self, ids) -> str:
        return self.sp.decode(list(ids))


class TiktokenTokenizer:
    def __init__(self, path: Path):
        import tiktoken
        ranks = {}
        for line in path.read_bytes().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        specials = {s: len(ranks) + i for i, s in enumerate(LLAMA3_SPECIALS)}
        self.enc = tiktoken.Encoding(path.parent.name or "llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                     special_tokens=specials)
        self.bos_id, self.eos_id = specials["<|begin_of_text|>"], specials["<|end_of_text|>"]
        self.vocab_size = self.enc.n_vocab

    def encode(self, text: str, bos: bool = True) -> list[int]:
        # special-token strings in the text become special tokens, as with HF's tokenizer.json
        ids = [self.bos_id] * bos
        for piece in _cut_long_runs(text):
            ids += self.enc.encode(piece, allowed_special="all")
        return ids

    def decode(self, ids) -> str:
        return self.enc.decode(list(ids))


def _cut_long_runs(text: str, n: int = 25_000):
    """Slices of text with no run of more than n whitespace or n non-whitespace chars: tiktoken's split regex
    backtracks and overflows its stack on such runs (a million spaces), and normal text has none, so its
    tokens do not change."""
    start = 0
    for m in re.finditer(r"\s{%d,}|\S{%d,}" % (n + 1, n + 1), text):
        for cut in range(m.start() + n, m.end(), n):
            yield text[start:cut]
            start = cut
    yield text[start:]


class HFTokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(str(path))
        self.vocab_size = self.tok.get_vocab_size()
        self.bos_id, self.eos_id = self._special_id(path.parent, "bos"), self._special_id(path.parent, "eos")

    def _special_id(self, d: Path, which: str) -> int | None:
        # the token string from tokenizer_config.json, else the id from the model's config.json
        for name, read in (("tokenizer_config.json", lambda c: c.get(f"{which}_token")),
                           ("config.json", lambda c: c.get(f"{which}_token_id"))):
            if (d / name).is_file() and (value := read(json.loads((d / name).read_text()))) is not None:
                if isinstance(value, dict):  # older files store AddedToken dicts
                    value = value.get("content")
                if isinstance(value, list):  # several eos ids: the first is the tokenizer's own
                    value = value[0]
                return value if isinstance(value, int) else self.tok.token_to_id(value)
        return None

    def encode(self, text: str, bos: bool = True) -> list[int]:
        # no post-processor specials: bos is ours to add, so every format behaves the same
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id] * (bos and self.bos_id is not None) + ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)


def _looks_like_llama2c(head: bytes, size: int) -> bool:
    """llama2.c's tokenizer.bin: int32 max_token_length, then (float32 score, int32 length, bytes) per token.
    A SentencePiece protobuf starts with a field tag (0x0a), which as a little-endian int32 is far too large to be
    a max_token_length; so check the header and that the first tokens' lengths are consistent with it."""
    if len(head) < 4:
        return False
    (max_len,) = struct.unpack_from("<i", head, 0)
    if not 0 < max_len <= 1024:
        return False
    at, tokens = 4, 0
    while at + 8 <= len(head) and tokens < 16:
        score, n = struct.unpack_from("<fi", head, at)
        if not 0 <= n <= max_len or score != score:  # NaN score
            return False
        at, tokens = at + 8 + n, tokens + 1
    return tokens > 0 and (tokens == 16 or at <= size)


def _file_format(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(512)
    if head.lstrip().startswith(b"{"):
        return "json"
    if re.match(rb"[A-Za-z0-9+/]+=* \d+\r?\n", head):  # tiktoken: "<base64 token> <rank>" lines
        return "tiktoken"
    if _looks_like_llama2c(head, path.stat().st_size):
        return "llama2c"
    return "sentencepiece"  # a protobuf; sentencepiece itself judges whether it is valid


def _llama2c_tokenizer(path: Path):
    from magicdec.model.checkpoint import Llama2cTokenizer  # lazily: only llama2.c files need checkpoint.py (and torch)

    return Llama2cTokenizer(path)


def load_tokenizer(path):
    """Tokenizer from a file, or a dir holding tokenizer.json, tokenizer.model or (llama2.c) tokenizer.bin."""
    path = Path(path)
    if path.is_dir():
        found = [path / n for n in ("tokenizer.json", "tokenizer.model", "tokenizer.bin") if (path / n).is_file()]
        if not found:
            raise MagicDecError(f"no tokenizer.json or tokenizer.model in {path} (nor a llama2.c tokenizer.bin): "
                                "download the model's tokenizer into it")
        path = found[0]
    if not path.is_file():
        raise MagicDecError(f"no tokenizer at {path}: pass a tokenizer.json, a tokenizer.model, a llama2.c "
                            "tokenizer.bin, or the dir holding one")
    fmt = _file_format(path)
    cls = {"json": HFTokenizer, "tiktoken": TiktokenTokenizer, "sentencepiece": SentencePieceTokenizer,
           "llama2c": _llama2c_tokenizer}[fmt]
    try:
        return cls(path)
    except MagicDecError:  # Llama2cTokenizer's own one-line message names the file and the fix
        raise
    except Exception as e:  # each library raises its own type for a bad file
        msg = str(e).splitlines()[0] if str(e) else ""
        raise MagicDecError(f"cannot load {path} as a tokenizer ({type(e).__name__}: {msg}): "
                            "re-download it, or pass an HF tokenizer.json or a Llama tokenizer.model") from None


# Models pad their embedding past the tokenizer's last id (Qwen2.5: 151665 tokens, 151936 or 152064 rows; Phi-3:
# 32011 of 32064), by well under 10%; a tokenizer that fills less of it is another model's (Llama-2's 32000 pieces
# against SmolLM2's 49152 rows runs and prints garbage).
MIN_VOCAB_FILL = 0.9


def check_tokenizer(tokenizer, config, where: str) -> None:
    """Refuse a tokenizer that cannot be the model's (config: a magicdec.config.ModelArgs): a vocabulary larger than
    the model's, much smaller than it, or special ids of which none agrees with the model config's. `where` names
    the tokenizer (its path) in the message."""
    model = config.name or "the model"
    fix = "it is another model's tokenizer; pass the model's own --tokenizer"
    n, rows = tokenizer.vocab_size, config.vocab_size
    if n > rows:
        raise MagicDecError(f"tokenizer {where} has {n} tokens but {model} only {rows}: {fix}")
    if n < MIN_VOCAB_FILL * rows:
        raise MagicDecError(f"tokenizer {where} has {n} tokens but {model} has {rows} "
                            f"(models pad their vocabulary by under {1 - MIN_VOCAB_FILL:.0%}): {fix}")
    # Compared where both sides know the id. One disagreement alone is not enough: JackFram/llama-68m's config says
    # bos_token_id 0 while its (Llama-2) tokenizer's BOS is 1, and an instruct tokenizer's EOS may be a chat-turn
    # end the base model's config does not list; a tokenizer of another vocabulary agrees on neither.
    pairs = [(name, ours, theirs) for name, ours, theirs in
             (("BOS", tokenizer.bos_id, [config.bos_id] if config.bos_id is not None else []),
              ("EOS", tokenizer.eos_id, config.eos_ids)) if ours is not None and theirs]
    if pairs and all(ours not in theirs for _, ours, theirs in pairs):
        said = " and ".join(f"{name} {ours}" for name, ours, _ in pairs)
        want = " and ".join(f"{name} {'/'.join(map(str, theirs))}" for name, _, theirs in pairs)
        raise MagicDecError(f"tokenizer {where} has {said} but {model}'s config says {want}: {fix}")
