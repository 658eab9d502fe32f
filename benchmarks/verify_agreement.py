"""Does a verification's argmax equal decode's on the GPU? SmolLM2 (real weights) on a Gutenberg prompt, bf16: greedy
decode of --gen_len tokens one at a time, then the same tokens fed back --T at a time from the prompt's end (as a
verification feeds them), each position's logits compared: argmax mismatches and bitwise-equal rows. Run with every
fused op plain, all fused, each one plain, and each one alone fused (fused.py).

Greedy speculation is exact when a T-token forward gives each position the logits a 1-token step gives it. The plain
ops do, bitwise; a torch.compile'd reduction (RMSNorm's mean, the split merge's sum) is compiled per shape and may
sum in another order for T = 1 than for T > 1, so at a bf16 near-tie greedy outputs parted; fused.py now runs those
two as Triton kernels with one program per row (results/quant/README.md).

    python3 benchmarks/verify_agreement.py --model /tmp/smol/model.pth --dataset /tmp/books

The books: Project Gutenberg's plain-text books (../shared/data/gutenberg here); any folder of .txt works.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from magicdec import fused  # noqa: E402
from magicdec import triton_attention  # noqa: E402  (imported: it registers the merge as a fused op)
from magicdec.data import load_prompts  # noqa: E402
from magicdec.generate import prefill  # noqa: E402
from magicdec.kv_cache import KVCache  # noqa: E402
from magicdec.model import load_model  # noqa: E402
from magicdec.tokenizer import load_tokenizer  # noqa: E402


def compare(model, prompts, n: int, T: int, label: str) -> None:
    a, dev, P = model.args, prompts.device, prompts.shape[1]
    cache = KVCache(a.n_layers, 1, a.n_kv_heads, P + n + T, a.head_dim, torch.bfloat16, dev, "triton")
    with torch.inference_mode():
        tok = prefill(model, cache, prompts, 1024).argmax(-1)[:, None]
        toks, decoded = [tok], []
        for _ in range(n):
            logits = model(tok, cache, logits="last")[:, -1].float()
            cache.advance(1)
            decoded.append(logits)
            tok = logits.argmax(-1)[:, None]
            toks.append(tok)
        seq = torch.cat(toks, 1)  # seq[:, i] sits at position P + i
        cache.rollback(torch.full_like(cache.lengths, P))
        verified = []
        for i in range(0, n, T):
            verified.append(model(seq[:, i:i + T], cache).float())
            cache.advance(T)
    ver, dec = torch.cat(verified, 1)[0, :n], torch.stack(decoded, 1)[0]
    mismatches = (ver.argmax(-1) != dec.argmax(-1)).nonzero().flatten().tolist()
    print(f"{label:28s} argmax mismatches {len(mismatches):3d} first {mismatches[:3]}  max |dlogit| "
          f"{(ver - dec).abs().max().item():.4f}  bitwise-equal rows {(ver == dec).all(-1).sum().item()}/{n}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model.pth (its directory holds the tokenizer)")
    p.add_argument("--dataset", required=True,
                   help="a folder of .txt books, e.g. Project Gutenberg's plain-text books (../shared/data/gutenberg "
                        "here); any folder of .txt files works")
    p.add_argument("--prefix_len", type=int, default=4096)
    p.add_argument("--gen_len", type=int, default=128)
    p.add_argument("--T", type=int, default=4, help="tokens per verification forward")
    p.add_argument("--quick", action="store_true", help="only every op plain and every op fused")
    a = p.parse_args()
    dev = torch.device("cuda")
    model = load_model(a.model, dev, torch.bfloat16)
    prompts = load_prompts(load_tokenizer(Path(a.model).parent), 1, a.prefix_len, a.dataset).to(dev)
    ops = fused.names()
    print("fused ops:", ", ".join(f"{n} ({how})" for n, how in ops.items()),
          f"({triton_attention.__name__} imported first)")
    run = lambda label: compare(model, prompts, a.gen_len, a.T, label)  # noqa: E731
    fused.fuse(False)
    run("plain")
    fused.fuse(True)
    run("all fused")
    if a.quick:
        return
    for name in ops:
        fused.fuse(only=set(ops) - {name})
        run("plain " + name.split(".")[-1])
    for name in ops:
        fused.fuse(only={name})
        run("only fused " + name.split(".")[-1])

if __name__ == "__main__":
    main()
