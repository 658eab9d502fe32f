"""`magicdec recycle-matrix`: Token Recycling's hot start (magicdec/drafters/recycling.py), the adjacency matrix a
target's verifications of other books leave: each token's row the target's k likeliest next ids at its latest
position, over windows taken from the books in turn (the prompts' own books left out with --exclude).

    magicdec recycle-matrix --books ../shared/data/gutenberg --exclude pg11 pg1184 --tokens 2000000 --output warm.pt
    magicdec run --drafter recycling --recycle_matrix warm.pt ...
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from magicdec import files
from magicdec.drafters.recycling import FORMAT, recycle
from magicdec.errors import MagicDecError
from magicdec.harness import train_head
from magicdec.harness.train_head import target_pass

LEAST = {"tokens": (1, ""), "k": (1, ""), "seq_len": (2, ""), "batch": (1, "")}  # train_head.check_numbers' form

def build_matrix(model, windows: torch.Tensor, k: int, batch: int, progress: bool = False) -> torch.Tensor:
    """What verifying `windows` [n, T] in order leaves: each token's row the target's k likeliest next ids at its
    latest position (the last window's, the last position's within one). [V + 1, k] on the CPU."""
    from tqdm import tqdm

    V = model.args.vocab_size
    matrix = torch.zeros(V + 1, k, dtype=torch.long)
    with torch.inference_mode():
        for i in tqdm(range(0, len(windows), batch), desc="recycle-matrix", unit="batch", disable=not progress):
            tokens = windows[i:i + batch].to(model.tok_embeddings.weight.device)
            top = target_pass(model, tokens).logits[..., :V].topk(k, -1).indices
            recycle(matrix, tokens.cpu(), top.cpu())
    return matrix


def windows_of(ids: list[torch.Tensor], seq_len: int, tokens: int, bos: int) -> torch.Tensor:
    """BOS + consecutive chunks of seq_len - 1 tokens, taken from the documents in turn (the first chunk of each,
    then the second of each, ...), until `tokens` tokens: a short matrix still sees every book."""
    n = seq_len - 1
    per_doc = [[doc[i:i + n] for i in range(0, len(doc) - n + 1, n)] for doc in ids]
    chunks = [c[j] for j in range(max(map(len, per_doc), default=0)) for c in per_doc if j < len(c)]
    chunks = chunks[:-(-tokens // seq_len)]
    if not chunks:
        raise MagicDecError(f"--seq_len {seq_len}: no book holds {n} tokens; lower --seq_len")
    return torch.stack([torch.cat([torch.tensor([bos]), c]) for c in chunks])


def main(argv=None) -> int:
    from magicdec.drafters.datastore import books_of, read_book

    p = argparse.ArgumentParser(prog="magicdec recycle-matrix", description="Token Recycling's hot start: the "
                                "adjacency matrix a target's verifications of other text leave")
    p.add_argument("--books", type=Path, required=True, help="a folder of .txt books (or one .txt file)")
    p.add_argument("--exclude", nargs="*", default=[], help="books left out (file names or stems): the prompts' own")
    p.add_argument("--tokens", type=int, default=1_000_000, help="tokens of the books the target reads")
    p.add_argument("--target", default=None, help="as train-head's --target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--k", type=int, default=8, help="candidates kept per token (>= the runs' --recycle_k)")
    p.add_argument("--seq_len", type=int, default=1024, help="tokens per window the target reads")
    p.add_argument("--batch", type=int, default=8, help="windows per forward")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when a GPU is visible)")
    p.add_argument("--output", type=Path, required=True, help="the matrix's file, written at exactly this path")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    argv = sys.argv[1:] if argv is None else list(argv)
    a = p.parse_args(argv)
    train_head.check_numbers(vars(a), LEAST)
    if a.output.is_dir():
        raise MagicDecError(f"--output {a.output} is a folder: name the matrix's file, e.g. {a.output / 'warm.pt'}")
    files.writable_folder(a.output.parent, "--output")
    books = books_of(a.books, a.exclude)
    ckpt = train_head.target_checkpoint(a.target)
    device = train_head.resolve_device(a.device)
    from magicdec.config import ModelArgs
    from magicdec.model.tokenizer import load_tokenizer
    from magicdec.model.transformer import load_model

    args = ModelArgs.from_checkpoint_dir(ckpt.parent)
    tokenizer = load_tokenizer(ckpt.parent)
    ids = [torch.tensor(tokenizer.encode(read_book(f), bos=False), dtype=torch.long) for f in books]
    windows = windows_of(ids, a.seq_len, a.tokens, tokenizer.bos_id)
    model = load_model(ckpt, device, train_head.resolve_dtype(None, device))
    matrix = build_matrix(model, windows, a.k, a.batch, not a.no_progress)
    record = {"format": FORMAT, "matrix": matrix.to(torch.int32), "k": a.k, "vocab_size": args.vocab_size,
              "target": {"path": str(ckpt), "fingerprint": train_head.target_fingerprint(ckpt, args)},
              "books": [f.name for f in books], "tokens": int(windows.numel()), "seq_len": a.seq_len,
              "command": "magicdec recycle-matrix " + " ".join(argv)}
    files.save_torch(a.output, record, "--output")
    print(json.dumps({k: v for k, v in record.items() if k != "matrix"} | {"output": str(a.output)}))
    return 0
