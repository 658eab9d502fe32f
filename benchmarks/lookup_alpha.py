"""Prompt lookup's teacher-forced acceptance: at each of a book's next `--teacher` tokens, with the true text so far
(prompt + book) as context, the token lookup would propose first (magicdec/drafters/lookup.py) against the target's
prediction there — its top-1, and p(proposed) at T 0.6 / top-p 0.9 (the chance speculative sampling keeps a one-hot
proposal). No generation, so a repetition loop cannot flatter it; positions where nothing matched count as
rejected, and the share of positions with a proposal is reported beside.

The books: Project Gutenberg text (PG-19 is Project Gutenberg books before 1919), in this workspace the 21 books of
../shared/data/gutenberg; --dataset takes any folder of .txt books (or pg19, stdlib, a .txt or .jsonl file: see
`magicdec run --help`). The engine (magicdec/harness/engine.py) loads the target and prefills each batch of prompts, each
prompt followed by its book's own next --teacher tokens.

    python benchmarks/lookup_alpha.py --dataset ../shared/data/gutenberg --prefix_len 4096 --output results/lookup/teacher_gutenberg.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from magicdec import device as dev
from magicdec import files
from magicdec.drafters.lookup import propose_ngram
from magicdec.harness.engine import Engine
from magicdec.errors import one_line_errors
from magicdec.harness.run_config import RunConfig
from magicdec.decoding.sampling import probabilities

BOOKS = ("where the books come from: a folder of .txt books, e.g. ../shared/data/gutenberg (Project Gutenberg "
         "books, the kind of text PG-19 holds), or pg19, stdlib, one .txt file, a .jsonl file with a 'text' field")


def teacher_forced(target, cache, text: torch.Tensor, P: int, ngram_max: int) -> dict:
    """Counts over the book text[:, P:] given the prompt text[:, :P]: positions, those where lookup proposed a token,
    those where it is the target's top-1, and the sum of p(proposed) at T 0.6 / top-p 0.9. `cache` holds the target's
    KV of at least text's first P - 1 tokens (here a prefill of the whole text); the target reads the book from
    position P - 1 on, predicting each of its tokens from the true text before it, and the cache is left at P."""
    B, L = text.shape
    T = L - P
    cache.rollback(torch.full_like(cache.lengths, P - 1))
    logits = target(text[:, P - 1:L - 1], cache)  # [B, T, V]: predicts text[:, P:]
    cache.rollback(torch.full_like(cache.lengths, P))
    p = probabilities(logits.float(), 0.6, 0.9)
    out = {"positions": B * T, "proposed": 0, "top1": 0, "min_pq": 0.0}
    for t in range(T):  # context: the prompt and the book's first t tokens
        token, n = propose_ngram(text, torch.full((B,), P + t, device=text.device), 1, ngram_max)
        found = n > 0
        out["proposed"] += int(found.sum())
        out["top1"] += int(((token[:, 0] == logits[:, t].argmax(-1)) & found).sum())
        out["min_pq"] += float((p[:, t].gather(1, token)[:, 0] * found).sum())
    return out


def main(argv=None) -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--model", type=Path, default=None,
                   help="model.pth made by convert_hf_checkpoint.py (default: SmolLM2-135M-Instruct)")
    a.add_argument("--dataset", default="auto", help=BOOKS)
    a.add_argument("--prefix_len", type=int, default=4096)
    a.add_argument("--B", type=int, default=8)
    a.add_argument("--skip_tokens", type=int, nargs="+", default=[8000, 15000, 22000], help="one batch per value")
    a.add_argument("--teacher", type=int, default=64)
    a.add_argument("--ngram_max", type=int, default=3)
    a.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a.add_argument("--output", type=Path, required=True)
    a = a.parse_args(argv)
    rows, source = [], None
    with one_line_errors():
        # Each prompt with its book's next --teacher tokens, prefilled whole (fp32); teacher_forced rolls the cache
        # back to the prompt's end. No generation.
        configs = [RunConfig.from_options({"model": a.model, "dataset": a.dataset, "B": a.B,
                                           "prefix_len": a.prefix_len + a.teacher, "gen_len": 1, "skip_tokens": skip,
                                           "device": a.device, "dtype": "float32", "prefill_chunk": 1024,
                                           "progress": False}) for skip in a.skip_tokens]
        engine = Engine(configs[0])
        engine.check(configs[0])  # the context and memory, before the weights load
        for skip, cfg in zip(a.skip_tokens, configs):
            with torch.inference_mode():
                batch = engine.prefill(cfg)
                rows.append({"skip_tokens": skip} | teacher_forced(engine.load_target(), batch.cache, batch.prompts,
                                                                    a.prefix_len, a.ngram_max))
            source = batch.prompt_source
            del batch
            dev.release_memory(engine.device)
    n = sum(r["positions"] for r in rows)
    total = {k: sum(r[k] for r in rows) / n for k in ("proposed", "top1", "min_pq")}
    name = engine.target_config.name
    result = {"command": "python benchmarks/lookup_alpha.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": name, "prompt_source": source, "prefix_len": a.prefix_len, "B": a.B,
              "teacher": a.teacher, "ngram_max": a.ngram_max, "environment": dev.environment(engine.device),
              "rows": rows, "rates": total}
    a.output.parent.mkdir(parents=True, exist_ok=True)
    files.write_json(a.output, result)
    print(f"{name}, {source}: proposed at {total['proposed']:.3f} of positions, top-1 agreement "
          f"{total['top1']:.3f}, p(proposed) at T 0.6 / top-p 0.9 {total['min_pq']:.3f}; per batch "
          + ", ".join(f"{r['min_pq'] / r['positions']:.3f}" for r in rows))


if __name__ == "__main__":
    main()
