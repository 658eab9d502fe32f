"""`magicdec generate-data`: self-distilled training data for draft heads, the target's own sampled continuations of
contexts cut at many depths of the books `magicdec train-head` trains on.

    magicdec generate-data --out data/smollm2_sd --tokens 10000000           # SmolLM2-135M, the Gutenberg books
    magicdec train-head --family eagle --data generated data/smollm2_sd --out heads/smollm2_eagle_sd

Why: a head drafts after text the target wrote itself, at the depth of a long context; a head trained on book text
alone learns to follow the books' author. Here each sequence is a context of --context_lens tokens (BOS and the
tokens of one training book from a uniformly drawn start: any depth of any book) and --gen_len tokens the target
sampled after it (its baseline decode, decoding.generate.Decoder with no drafter, the sampling of a sampled run).

Contexts come only from the books train-head trains on: its split (train_head.split_corpus, with the same
--holdout_B / --holdout_prefix_len / --skip_tokens / --exclude) holds out the benchmarks' prompt books, so the held-out
evaluation and the benchmarks stay clean; train-head checks it again when it reads the data.

The default sampling, temperature 0.6 and top-p 0.9, is the project's sampled workload (experiments/*.toml, the
heads' sampled sweeps): the continuations follow the trajectories a head meets when it drafts for a sampled run, and
at 0.6 they stay close to the greedy path a greedy run follows; a temperature near 1 would spend the data on the
tail of the distribution, which neither kind of run decodes. (What a head learns from at each position is the
target's whole distribution, whatever temperature picked the text.)

Written into --out:
  shard_NNNNN.pt  shard i: --batch sequences of one context length (--context_lens[i % their count]: one KV cache
                  shape), per sequence the book's name, the context's start in the book's tokens, the generated ids
                  (int32, padded with -1), their count and whether EOS ended them (the EOS itself is not kept); not
                  the context's tokens, which are rebuilt from the book; the target's and the corpus' fingerprints
  manifest.json   the settings, the target's fingerprint, each training book's token hash (train-head rebuilds the
                  contexts from the books and checks them against it), the split, and the totals generated

Deterministic: shard i's contexts come from a generator seeded by (--seed, i) and its sampling from torch's seeded
by (--seed, i) too, so the same command gives the same shards on the same device, whichever shards already exist.
Resumable: a re-run writes only the shards missing (each written whole: a temporary file renamed into place, so a
Ctrl-C leaves none half written), until the shards' generated tokens reach --tokens (which a re-run may raise);
settings or a target or books that differ from the manifest's are refused.

Several GPUs of one host: `--shard I/N` (CUDA_VISIBLE_DEVICES=I-1) writes into the same --out only the shards i with
i mod N = I - 1 among those a run with no EOS would need (ceil(--tokens / (--batch x --gen_len))); then the same
command without --shard, once, reads them all, writes whatever is still missing (a gap, or what EOS left short) and
the manifest's totals. The shards are the ones a single process writes: each is seeded by its own index.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from magicdec import files
from magicdec.errors import MagicDecError, interrupted_as
from magicdec.harness import train_head
from magicdec.harness.run_config import device_value
from magicdec.harness.sweep_grid import parse_shard

FORMAT = "magicdec generated data 1"
MANIFEST = "manifest.json"
DEFAULT_CONTEXTS = (512, 1024, 2048, 4096, 7936)  # the longest + --gen_len 256 = SmolLM2's 8192 positions
PREFILL_CHUNK = 2048  # tokens per sequence per prefill forward (part of what fixes the shards' bits)
EMPTY_SHARDS_MAX = 100  # consecutive shards with no generated token (every continuation EOS at once): give up


def shard_name(i: int) -> str:
    return f"shard_{i:05d}.pt"


@dataclass(frozen=True)
class Options:
    """What the data is: two runs of the same Options on the same target, books and device give the same shards."""
    gen_len: int = 256
    context_lens: tuple = DEFAULT_CONTEXTS
    temperature: float = 0.6
    top_p: float = 0.9
    batch: int = 32
    seed: int = 0
    holdout_B: int = train_head.Options.holdout_B
    holdout_prefix_len: int = train_head.Options.holdout_prefix_len
    skip_tokens: int = train_head.Options.skip_tokens
    exclude: tuple = ()

    def split(self) -> train_head.Options:
        """train-head's options that decide which books are held out; the shortest context stands for its window."""
        return train_head.Options(holdout_B=self.holdout_B, holdout_prefix_len=self.holdout_prefix_len,
                                  skip_tokens=self.skip_tokens, exclude=list(self.exclude),
                                  seq_len=min(self.context_lens))

    def settings(self) -> dict:
        """As the manifest stores them (JSON: tuples are lists)."""
        return json.loads(json.dumps(asdict(self)))


LEAST = {"tokens": (1, ""), "gen_len": (1, ""), "batch": (1, ""), "holdout_B": train_head.LEAST["holdout_B"],
         "holdout_prefix_len": (2, ""), "skip_tokens": (0, "")}


def check_options(o: Options, tokens: int) -> None:
    """Each number within its range: one line, before anything is read."""
    train_head.check_numbers(asdict(o) | {"tokens": tokens}, LEAST)
    short = [n for n in o.context_lens if n < 2]
    if short:
        raise MagicDecError(f"--context_lens {short[0]}: each must be an integer >= 2 (BOS and one token of a book)")
    if not (math.isfinite(o.temperature) and o.temperature > 0):
        raise MagicDecError(f"--temperature {o.temperature}: must be a finite number > 0 (the data is sampled; "
                            "greedy data would be one continuation per context)")
    if not 0 < o.top_p <= 1:
        raise MagicDecError(f"--top_p {o.top_p}: must be in (0, 1] (1: no nucleus cut)")


def check_context(o: Options, args) -> None:
    longest = max(o.context_lens)
    if longest + o.gen_len > args.max_seq_len:
        raise MagicDecError(f"--context_lens {longest} + --gen_len {o.gen_len} = {longest + o.gen_len} exceeds the "
                            f"target's context of {args.max_seq_len} tokens; lower the longest --context_lens or "
                            "--gen_len")


def parser() -> argparse.ArgumentParser:
    d = Options()
    p = argparse.ArgumentParser(prog="magicdec generate-data", formatter_class=argparse.RawDescriptionHelpFormatter,
                                description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("--target", default=None, help="as train-head's --target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--corpus", default=None, help="as train-head's --corpus (default: the Gutenberg books)")
    p.add_argument("--out", required=True, type=Path, help="the data folder (shards and manifest.json)")
    p.add_argument("--tokens", required=True, type=int,
                   help="generated tokens to reach in all (a re-run may raise it: it adds shards)")
    p.add_argument("--gen_len", type=int, default=d.gen_len, help="tokens generated per context (fewer at EOS)")
    p.add_argument("--context_lens", type=int, nargs="+", default=list(d.context_lens),
                   help="context lengths in tokens (BOS included), shard i taking the (i mod count)-th")
    p.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature (> 0)")
    p.add_argument("--top_p", type=float, default=d.top_p, help="nucleus cut (1: none)")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per shard (one generation call)")
    p.add_argument("--seed", type=int, default=d.seed, help="the contexts and the sampling")
    p.add_argument("--holdout_B", type=int, default=d.holdout_B, help="as train-head's: which books are held out")
    p.add_argument("--holdout_prefix_len", type=int, default=d.holdout_prefix_len)
    p.add_argument("--skip_tokens", type=int, default=d.skip_tokens)
    p.add_argument("--exclude", nargs="*", default=[], help="more books never used as contexts (names or stems)")
    p.add_argument("--device", type=device_value, default=None, help="cuda (or cuda:N) or cpu")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="the target's dtype (default bfloat16 on a GPU, float32 on a CPU)")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.add_argument("--shard", default="1/1", metavar="I/N",
                   help="write only every N-th shard, from the I-th (one process per GPU into the same --out); then "
                        "the same command without --shard writes the rest and the totals")
    return p


# ---------------------------------------------------------------------------------------------------- inputs

def token_hash(ids: torch.Tensor) -> str:
    """A book's token ids, hashed: the contexts are rebuilt from them."""
    return hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest()[:16]


def corpus_hash(book_hashes: dict) -> str:
    return hashlib.sha256(json.dumps(book_hashes, sort_keys=True).encode()).hexdigest()[:16]


def read_manifest(folder: Path, what: str = "--out") -> dict | None:
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise MagicDecError(f"{what} {folder}: {MANIFEST} is damaged or not generate-data's; restore it or generate "
                            "into another folder")
    return manifest


def check_same(manifest: dict, key: str, now, folder: Path, fix: str) -> None:
    """Refuse a resumed run whose `key` differs from the one that wrote the data."""
    was = manifest[key]
    if key == "options":
        for name in now:
            if now[name] != was.get(name):
                raise MagicDecError(f"--out {folder} holds data generated with --{name} {was.get(name)}, not "
                                    f"{now[name]}: give --{name} {was.get(name)} to continue it, or choose another "
                                    "--out")
    elif now != was:
        raise MagicDecError(f"--out {folder} holds data generated {fix}")


def context_pools(o: Options, trainable: dict, bos: int) -> dict:
    """context length -> train_head.Windows over the training books that hold a context of that length (the
    sampler the training windows use: uniform over every start)."""
    pools = {}
    for n in sorted(set(o.context_lens)):
        books = {name: ids for name, ids in trainable.items() if len(ids) >= n - 1}
        if not books:
            name, ids = max(trainable.items(), key=lambda kv: len(kv[1]))
            raise MagicDecError(f"--context_lens {n}: no training book holds {n - 1} tokens (the longest, {name}, "
                                f"has {len(ids)}); lower --context_lens or give longer books")
        pools[n] = train_head.Windows(books, n, bos)
    return pools


# ---------------------------------------------------------------------------------------------------- generation

class Sampler:
    """The target's baseline decode (Decoder.generate, no drafter) at the run's sampling: one cache and decoder per
    context length, reused by every shard of that length, so that a CUDA graph is captured once per shape."""

    def __init__(self, model, o: Options, device: torch.device, dtype: torch.dtype, eos_ids: list[int]):
        from magicdec.model.attention import resolve_backend

        self.model, self.o, self.device, self.dtype, self.eos_ids = model, o, device, dtype, eos_ids
        self.backend = resolve_backend("auto", device)
        self.step_mode = "cuda_graphs" if device.type == "cuda" else "eager"
        self.made = {}

    def cache_and_decoder(self, n: int):
        from magicdec.config import cache_slots
        from magicdec.decoding.acceptance import Acceptor
        from magicdec.decoding.generate import Decoder
        from magicdec.decoding.sampling import Sampling
        from magicdec.model.kv_cache import KVCache

        if n not in self.made:
            a, o = self.model.args, self.o
            cache = KVCache(a.n_layers, o.batch, self.model.n_kv_heads, cache_slots(n, o.gen_len, 0), a.head_dim,
                            self.dtype, self.device, self.backend)
            decoder = Decoder(self.model, Acceptor(Sampling(o.temperature, o.top_p)), step_mode=self.step_mode)
            self.made[n] = cache, decoder
        return self.made[n]

    @torch.inference_mode()
    def __call__(self, prompts: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(generated ids [B, gen_len] int32 padded with -1, their counts [B] (EOS not counted), whether EOS ended
        each [B]) for prompts [B, n]."""
        from magicdec.decoding.generate import prefill
        from magicdec.decoding.sampling import next_token

        o = self.o
        cache, decoder = self.cache_and_decoder(prompts.shape[1])
        cache.rollback(torch.zeros_like(cache.lengths))
        logits = prefill(self.model, cache, prompts.to(self.device), PREFILL_CHUNK)
        torch.manual_seed(seed)  # the first token's draw and the decode's: torch's generators, seeded per shard
        first = next_token(logits, o.temperature, o.top_p)
        ids, counts = decoder.generate(cache, first, o.gen_len, self.eos_ids)
        ids, counts = ids.cpu(), counts.cpu()
        last = ids.gather(1, (counts - 1).clamp(min=0)[:, None])[:, 0]
        eos = (counts > 0) & torch.isin(last, torch.tensor(self.eos_ids, dtype=torch.long))
        lengths = counts - eos.long()
        kept = torch.arange(o.gen_len)[None] < lengths[:, None]
        return torch.where(kept, ids, -1).to(torch.int32), lengths.to(torch.int32), eos


@dataclass
class Run:
    """What every shard of one run shares: its options, the contexts' pools and the fingerprints shards carry."""
    o: Options
    out: Path
    pools: dict
    target: str  # the target's fingerprint
    corpus: str  # the training books' fingerprint (corpus_hash)
    bos: int

    def stamp(self) -> dict:
        return {"format": FORMAT, "options": self.o.settings(), "target": self.target, "corpus": self.corpus}

    def contexts(self, i: int) -> tuple[int, list[str], list[int], torch.Tensor]:
        """Shard i's (context length, books, starts, prompts [batch, length]): from (--seed, i) alone."""
        n = self.o.context_lens[i % len(self.o.context_lens)]
        pool = self.pools[n]
        picks = pool.pick(self.o.seed, i, self.o.batch)
        prompts = torch.stack([torch.cat([torch.tensor([self.bos]), pool.books[b][s:s + n - 1]]) for b, s in picks])
        return n, [pool.names[b] for b, _ in picks], [s for _, s in picks], prompts

    def make(self, i: int, sample: Sampler) -> dict:
        n, books, starts, prompts = self.contexts(i)
        ids, lengths, eos = sample(prompts, train_head.step_seed(self.o.seed, i, 1))
        return self.stamp() | {"shard": i, "context_len": n, "books": books,
                               "starts": torch.tensor(starts, dtype=torch.int64), "ids": ids, "lengths": lengths,
                               "eos": eos}

    def read(self, i: int) -> dict:
        return read_shard(self.out / shard_name(i), self.stamp())


def read_shard(path: Path, stamp: dict | None = None) -> dict:
    """A shard, checked to be whole and (given `stamp`) to be this run's; one line otherwise."""
    try:
        shard = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated zip, a bad pickle, ... each raise their own type
        raise MagicDecError(f"{path} is damaged ({type(e).__name__}): delete it and run generate-data again (it is "
                            "written anew, the same)") from None
    if not isinstance(shard, dict) or shard.get("format") != FORMAT:
        raise MagicDecError(f"{path} is not a generate-data shard: move it out of the folder")
    if stamp is not None and any(shard.get(k) != v for k, v in stamp.items()):
        raise MagicDecError(f"{path} was written by another run (other settings, target or books) than the one "
                            f"{MANIFEST} describes: delete it, or generate into another folder")
    return shard


def planned_shards(o: Options, goal: int) -> int:
    """Shards a run needs when no sequence ends at EOS."""
    return -(-goal // (o.batch * o.gen_len))


def run_shard_slice(run: Run, goal: int, sample: Sampler, bar, index: int, count: int) -> dict:
    """--shard I/N: of the planned shards, those with i mod count = index, generated and written where missing."""
    written = 0
    for i in range(index, planned_shards(run.o, goal), count):
        path = run.out / shard_name(i)
        if path.exists():
            shard = run.read(i)
        else:
            shard = run.make(i, sample)
            files.save_torch(path, shard, "--out")
            written += 1
        bar.update(int(shard["lengths"].sum()))
    return {"shard": f"{index + 1}/{count}", "written_now": written}


def run_shards(run: Run, goal: int, sample: Sampler, bar) -> dict:
    """Shards 0, 1, ... read where written, generated and written whole where not, until their generated tokens
    reach `goal`; returns the totals."""
    total = sequences = written = empty = i = 0
    eos = 0
    while total < goal:
        path = run.out / shard_name(i)
        if path.exists():
            shard = run.read(i)
        else:
            shard = run.make(i, sample)
            files.save_torch(path, shard, "--out")
            written += 1
        n = int(shard["lengths"].sum())
        empty = 0 if n else empty + 1
        if empty >= EMPTY_SHARDS_MAX:
            raise MagicDecError(f"{EMPTY_SHARDS_MAX} shards in a row generated nothing (EOS first every time): "
                                "this target and sampling do not continue the books")
        total, sequences, eos, i = total + n, sequences + len(shard["books"]), eos + int(shard["eos"].sum()), i + 1
        bar.update(n)
    return {"shards": i, "sequences": sequences, "tokens": total, "ended_at_eos": eos, "written_now": written}


# ---------------------------------------------------------------------------------------------------- the command

def generate(argv: list[str]) -> dict:
    """The whole run; returns its manifest."""
    from magicdec.config import ModelArgs

    ns = vars(parser().parse_args(argv))
    out, goal = ns.pop("out"), ns.pop("tokens")
    target_arg, corpus_arg = ns.pop("target"), ns.pop("corpus")
    runtime = {k: ns.pop(k) for k in ("device", "dtype", "no_progress", "shard")}
    o = Options(**ns | {"context_lens": tuple(ns["context_lens"]), "exclude": tuple(ns["exclude"])})
    check_options(o, goal)
    shard = parse_shard(runtime["shard"], "each a process of its own writing into the same --out")
    if out.exists() and not out.is_dir():
        raise MagicDecError(f"--out {out} is a file: give the folder the shards and their manifest go to")
    device = train_head.resolve_device(runtime["device"])
    dtype = train_head.resolve_dtype(runtime["dtype"], device)
    ckpt = train_head.target_checkpoint(target_arg)
    args = ModelArgs.from_checkpoint_dir(ckpt.parent)
    check_context(o, args)
    corpus_path = Path(corpus_arg).expanduser() if corpus_arg is not None else train_head.default_corpus()
    files.writable_folder(out, "--out")
    manifest = read_manifest(out)
    if manifest is not None:  # the settings first: they are compared before anything is read
        check_same(manifest, "options", o.settings(), out, "")
        check_same(manifest, "run", {"dtype": str(dtype).removeprefix("torch."), "device": device.type}, out,
                   f"with --device {manifest['run']['device']} --dtype {manifest['run']['dtype']} (its samples' bits "
                   "depend on them): give those to continue it, or choose another --out")
    fingerprint = train_head.target_fingerprint(ckpt, args)
    if manifest is not None:
        check_same(manifest, "target_fingerprint", fingerprint, out,
                   f"by the target {manifest['target']['path']}, not {ckpt}: give that --target to continue it, or "
                   "choose another --out")
    defaults = (o.holdout_B, o.holdout_prefix_len) == (Options.holdout_B, Options.holdout_prefix_len)
    books = train_head.read_books(train_head.corpus_files(corpus_path))
    corpus, bos = train_head.tokenized_split(o.split(), corpus_path, books, ckpt, args, defaults,
                                             not runtime["no_progress"], "--context_lens")
    del books
    pools = context_pools(o, corpus.trainable, bos)
    book_hashes = {name: token_hash(corpus.trainable[name]) for name in sorted(corpus.trainable)}
    corpus_fingerprint = corpus_hash(book_hashes)
    if manifest is not None:
        check_same(manifest, "corpus_fingerprint", corpus_fingerprint, out,
                   f"from other books or another tokenization (--corpus {manifest['corpus']['path']}, split "
                   f"{manifest['corpus']['held_out_rule']}): give that --corpus to continue it, or choose another --out")
    run = Run(o, out, pools, fingerprint, corpus_fingerprint, bos)
    manifest = new_manifest(run, argv, ckpt, args, dtype, device, corpus, corpus_path, book_hashes, goal)
    files.write_json(out / MANIFEST, manifest, "--out", default=None)

    from magicdec.model.transformer import load_model
    from tqdm import tqdm

    model = load_model(ckpt, device, dtype)
    sample = Sampler(model, o, device, dtype, args.eos_ids)
    bar = tqdm(total=goal, desc="generate", unit="tok", unit_scale=True, disable=runtime["no_progress"],
               dynamic_ncols=True)
    t0 = time.perf_counter()

    def stopped() -> str:
        bar.close()
        done = sorted(p.name for p in out.glob("shard_*.pt"))
        return (f"interrupted: the {len(done)} shards in {out} are whole; the same command writes the rest and "
                "keeps them")

    with interrupted_as(stopped):
        if shard != (1, 1):  # a slice: the totals are the pass's without --shard
            part = run_shard_slice(run, goal, sample, bar, shard[0] - 1, shard[1])
        else:
            totals = run_shards(run, goal, sample, bar)
    bar.close()
    if shard != (1, 1):
        return manifest | {"generated": part | {"seconds_now": round(time.perf_counter() - t0, 3)}}
    manifest["generated"] = totals | {"seconds_now": round(time.perf_counter() - t0, 3)}
    files.write_json(out / MANIFEST, manifest, "--out", default=None)
    return manifest


def new_manifest(run: Run, argv, ckpt: Path, args, dtype, device, corpus, corpus_path: Path, book_hashes: dict,
                 goal: int) -> dict:
    from magicdec.device import code_version, environment

    return {"format": FORMAT, "command": "magicdec generate-data " + " ".join(shlex.quote(a) for a in argv),
            "options": run.o.settings(), "tokens": goal,
            "run": {"dtype": str(dtype).removeprefix("torch."), "device": device.type},
            "target_fingerprint": run.target, "corpus_fingerprint": run.corpus,
            "target": {"path": str(ckpt.resolve()), "name": args.name or ckpt.parent.name},
            "corpus": {"path": str(corpus_path), "resolved": str(corpus_path.resolve()), "books": book_hashes,
                       "held_out_books": corpus.describe["held_out_books"],
                       "held_out_rule": corpus.describe["held_out_rule"], "excluded": corpus.describe["excluded"]},
            "prefill_chunk": PREFILL_CHUNK, "eos_ids": args.eos_ids, "environment": environment(device),
            "code": code_version(), "generated": None}


# ---------------------------------------------------------------------------------------------------- reading it back

def load(folder: Path) -> tuple[dict, list[dict]]:
    """train-head's view: the manifest and every shard in `folder` (by name), each checked to be whole and of the
    manifest's run; one line on what is missing or damaged."""
    if not folder.is_dir():
        raise MagicDecError(f"--data generated {folder}: no such folder; make it with magicdec generate-data --out "
                            f"{folder}")
    manifest = read_manifest(folder, "--data generated")
    if manifest is None:
        raise MagicDecError(f"--data generated {folder}: no {MANIFEST} there; make the data with magicdec "
                            f"generate-data --out {folder}")
    stamp = {"format": FORMAT, "options": manifest["options"], "target": manifest["target_fingerprint"],
             "corpus": manifest["corpus_fingerprint"]}
    shards = [read_shard(p, stamp) for p in sorted(folder.glob("shard_*.pt"))]
    if not shards:
        raise MagicDecError(f"--data generated {folder}: no shard there yet; run its generate-data command "
                            f"({manifest['command']})")
    return manifest, shards


def training_sequences(folder: Path, manifest: dict, shards: list[dict], trainable: dict) -> list[tuple]:
    """(book ids, start, context length, generated ids) of every sequence, the contexts' books checked to be ones
    this training run trains on, with the tokens the data was generated from."""
    checked, seqs = set(), []
    for shard in shards:
        n = shard["context_len"]
        for book, start, ids, length in zip(shard["books"], shard["starts"].tolist(), shard["ids"],
                                            shard["lengths"].tolist()):
            if book not in checked:
                check_book(folder, manifest, book, trainable)
                checked.add(book)
            seqs.append((trainable[book], start, n, ids[:length].long()))
    return seqs


def check_book(folder: Path, manifest: dict, book: str, trainable: dict) -> None:
    if book not in trainable:
        raise MagicDecError(f"--data generated {folder}: its contexts come from {book}, which this run holds out or "
                            f"its --corpus lacks; train with the data's --corpus {manifest['corpus']['path']} and "
                            f"split (--holdout_B {manifest['options']['holdout_B']} --holdout_prefix_len "
                            f"{manifest['options']['holdout_prefix_len']} --skip_tokens "
                            f"{manifest['options']['skip_tokens']}, --exclude only what it excluded)")
    if token_hash(trainable[book]) != manifest["corpus"]["books"].get(book):
        raise MagicDecError(f"--data generated {folder}: {book} tokenizes to other tokens than the data's contexts "
                            f"came from; give the --corpus ({manifest['corpus']['path']}) and --target it was "
                            "generated with")


def describe(folder: Path, manifest: dict, shards: list[dict], windows) -> dict:
    """What train_log.json says of the data."""
    return {"kind": "generated", "folder": str(folder), "manifest": manifest, "shards": len(shards),
            "sequences": sum(len(s["books"]) for s in shards),
            "generated_tokens": int(sum(int(s["lengths"].sum()) for s in shards)),
            "windows": windows.windows(),
            "loss_positions": "those whose next token is a generated one (train_head.GeneratedWindows)"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    manifest = generate(argv)
    print(json.dumps({"out": str(vars(parser().parse_args(argv))["out"])} | manifest["generated"]))
    return 0


if __name__ == "__main__":
    from magicdec.errors import one_line_errors

    with one_line_errors():
        raise SystemExit(main())
