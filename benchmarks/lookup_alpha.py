"""Prompt lookup's teacher-forced acceptance: at each of a book's next `--teacher` tokens, with the true text so far
(prompt + book) as context, the token lookup would propose first (magicdec/lookup.py) against the target's
prediction there — its top-1, and p(proposed) at T 0.6 / top-p 0.9 (the chance speculative sampling keeps a one-hot
proposal). No generation, so a repetition loop cannot flatter it; positions where nothing matched count as
rejected, and the share of positions with a proposal is reported beside.

    python benchmarks/lookup_alpha.py --dataset ../shared/data/gutenberg --prefix_len 4096 --output results/lookup/teacher_gutenberg.json

The books: Project Gutenberg's plain-text books (../shared/data/gutenberg here); any folder of .txt works.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from magicdec import benchmark as bench  # noqa: E402
from magicdec.generate import prefill  # noqa: E402
from magicdec.kv_cache import KVCache  # noqa: E402
from magicdec.lookup import propose_ngram  # noqa: E402
from magicdec.sampling import probabilities  # noqa: E402


def teacher_forced(target, prompts: torch.Tensor, book: torch.Tensor, ngram_max: int) -> dict:
    B, P = prompts.shape
    T, c = book.shape[1], target.args
    cache = KVCache(c.n_layers, B, c.n_kv_heads, P + T, c.head_dim, torch.float32, prompts.device)
    first = prefill(target, cache, prompts, 1024)
    logits = torch.cat([first[:, None], target(book[:, :-1], cache, logits="all")], 1)  # [B, T, V]: predicts book
    p = probabilities(logits.float(), 0.6, 0.9)
    text = torch.cat([prompts, book], 1)
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
    a.add_argument("--model", type=Path, default=None)
    a.add_argument("--dataset", default="auto",
                   help="a folder of .txt books, e.g. Project Gutenberg's plain-text books (../shared/data/gutenberg "
                        "here; any folder of .txt files works), or any other of the benchmarks' --dataset values")
    a.add_argument("--prefix_len", type=int, default=4096)
    a.add_argument("--B", type=int, default=8)
    a.add_argument("--skip_tokens", type=int, nargs="+", default=[8000, 15000, 22000], help="one batch per value")
    a.add_argument("--teacher", type=int, default=64)
    a.add_argument("--ngram_max", type=int, default=3)
    a.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a.add_argument("--output", type=Path, required=True)
    a = a.parse_args(argv)
    args = SimpleNamespace(model=a.model, model_name=None, random_weights=False, tokenizer=None, dataset=a.dataset,
                           seed=0, device=torch.device(a.device), dtype="float32", B=a.B,
                           prefix_len=a.prefix_len + a.teacher)
    config, ckpt = bench.model_source(args)
    target = bench.load_weights(args, config, ckpt)
    rows = []
    with torch.inference_mode():
        for skip in a.skip_tokens:
            args.skip_tokens = skip
            text, _ = bench.load_prompts_for(args, config, ckpt)
            text = text.to(a.device)
            rows.append({"skip_tokens": skip} | teacher_forced(target, text[:, :a.prefix_len], text[:, a.prefix_len:],
                                                                a.ngram_max))
    n = sum(r["positions"] for r in rows)
    total = {k: sum(r[k] for r in rows) / n for k in ("proposed", "top1", "min_pq")}
    result = {"command": "python benchmarks/lookup_alpha.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": config.name, "prompt_source": args.prompt_source, "prefix_len": a.prefix_len, "B": a.B,
              "teacher": a.teacher, "ngram_max": a.ngram_max, "environment": bench.environment(args.device),
              "rows": rows, "rates": total}
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(result, indent=1))
    print(f"{config.name}, {args.prompt_source}: proposed at {total['proposed']:.3f} of positions, top-1 agreement "
          f"{total['top1']:.3f}, p(proposed) at T 0.6 / top-p 0.9 {total['min_pq']:.3f}; per batch "
          + ", ".join(f"{r['min_pq'] / r['positions']:.3f}" for r in rows))


if __name__ == "__main__":
    main()
