"""magicdec beside transformers in one run: the same weights, prompts and device through both libraries, greedy.

Batch 1 (for each prefix): our baseline, self-speculation (StreamingLLM draft cache) and a standalone draft (the
target's first --draft_layers layers + final norm + head, full KV cache) against transformers' greedy `generate`
with a dynamic cache, a static cache, a static cache + torch.compile (where it works), assisted generation with the
same truncated draft, and prompt-lookup decoding beside ours (tests/lookup_benchmark.py's drafter). Batch B > 1: our baseline against transformers' batched greedy
`generate` (static cache, compiled where it works; equal-length prompts, no padding). Decode tokens/s only (prefill
excluded on both sides) and each method's token agreement with our baseline. Both libraries run the very same
tensors: transformers' state dict, renamed by checkpoint._hf_name, is our model's. Our side is built as every run
is, by the engine (magicdec/harness/engine.py): its target cache and prefill, each drafter (selfspec, standalone, lookup, by
their run configs) and the decoders; the engine is handed our model on transformers' tensors (and the truncated
draft) and the prompts both libraries read. Writes summary.json under --output_dir (rewritten after every
measurement) and prints a markdown table. The books (--dataset): Project Gutenberg text (PG-19 is Project Gutenberg
books before 1919), in this workspace the 21 books of ../shared/data/gutenberg, or any folder of .txt books.

    python benchmarks/transformers_side_by_side.py --prefix_lens 1024 4096 8000 --batch_sizes 1 8 16 32 64 \
        --output_dir results/side_by_side/smollm2
    python benchmarks/transformers_side_by_side.py --random_weights --model_name meta-llama/Meta-Llama-3.1-8B \
        --prefix_lens 8192 16384 --batch_sizes 8 16 --hf_prefill_chunk 2048 --output_dir results/side_by_side/llama8b
"""
import argparse
import copy
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from magicdec import data
from magicdec import device as dev
from magicdec import files
from magicdec.model.checkpoint import _hf_name, load_state_dict
from magicdec.config import ModelArgs
from magicdec.harness.engine import Engine, first_tokens
from magicdec.decoding.generate import decode
from magicdec.model.transformer import from_state_dict
from magicdec.harness.run_config import RunConfig
from magicdec.harness.trial import Trial

TIMING = {"magicdec": "decode only: timing.timed_generations after a warm-up run, prefill done before and not timed",
          "transformers": "decode only: t(generate max_new_tokens=n) - t(generate max_new_tokens=1), both timed after "
                          "one warm-up generate(n); tokens/s = B*(n-1) / difference; static caches: one "
                          "StaticCache(prefix + n) passed to every call and reset before it"}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="model.pth with its config.json (default: SmolLM2-135M, real weights)")
    p.add_argument("--model_name", help="with --random_weights: the shapes (magicdec/config.py KNOWN_MODELS)")
    p.add_argument("--random_weights", action="store_true")
    p.add_argument("--random_prompts", action="store_true", help="random prompt ids even with a tokenizer")
    p.add_argument("--tokenizer", type=Path)
    p.add_argument("--dataset", default="auto",
                   help="where the prompts come from: a folder of .txt books, e.g. ../shared/data/gutenberg (Project "
                        "Gutenberg books, the kind of text PG-19 holds), or pg19, stdlib, auto, one .txt file, a .jsonl "
                        "file with a 'text' field per line")
    p.add_argument("--skip_tokens", type=int, default=8000)
    p.add_argument("--prefix_lens", type=int, nargs="+", default=[1024])
    p.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8], help="1: every method; >1: baselines")
    p.add_argument("--gen_len", type=int, default=64)
    p.add_argument("--draft_layers", type=int, default=None, help="standalone draft: the first K layers (n_layers/4)")
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    p.add_argument("--gammas", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--sinks", type=int, default=16)
    p.add_argument("--prompt_lookup", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
    p.add_argument("--ngram_max", type=int, default=3, help="our prompt lookup's longest n-gram (and transformers' "
                                                           "max_matching_ngram_size in the run at our best gamma)")
    p.add_argument("--hf_attn", default="sdpa", help="transformers' attn_implementation (sdpa or eager)")
    p.add_argument("--hf_compile", choices=["auto", "dynamic", "off"], default="auto",
                   help="static caches on GPU: auto = transformers' default CompileConfig (dynamic=None: static first, "
                        "dynamic after a change of shape); dynamic = CompileConfig(dynamic=True)")
    p.add_argument("--hf_prefill_chunk", type=int, default=None,
                   help="transformers' prefill_chunk_size for the uncompiled static cache, e.g. when the compiled run "
                        "is out of memory at large B x prefix (prefill is not timed)")
    p.add_argument("--rounds", type=int, default=3,
                   help="B = 1: after the one-at-a-time pass, each library's fastest method of each kind timed again "
                        "in this many interleaved rounds (0: none)")
    p.add_argument("--no_fuse", action="store_true", help="plain PyTorch elementwise ops on our side")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save_tokens", action="store_true", help="prompt and generated ids in the records")
    p.add_argument("--no_progress", action="store_true")
    p.add_argument("--output_dir", type=Path, required=True)
    return p.parse_args(argv)


# ---------------------------------------------------------------- one set of tensors, two libraries

def hf_config_for(a: ModelArgs, attn: str):
    """transformers' config for a known model's shapes (random weights: there is no config.json to read)."""
    return transformers.LlamaConfig(
        vocab_size=a.vocab_size, hidden_size=a.dim, num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_kv_heads, head_dim=a.head_dim, intermediate_size=a.intermediate_size,
        rms_norm_eps=a.norm_eps, rope_theta=a.rope_base, rope_scaling=copy.deepcopy(a.rope_scaling),
        max_position_embeddings=a.max_seq_len, tie_word_embeddings=a.tie_embeddings, attention_bias=a.attention_bias,
        bos_token_id=a.bos_id, eos_token_id=a.eos_id, attn_implementation=attn)


def build_hf(config, device, dtype, state=None):
    """transformers' model made directly on the device (random init: normal(0, initializer_range), norms 1), or
    with `state` (HF names) assigned in place of its weights: the tensors are shared, not copied."""
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if unexpected or set(missing) - ({"lm_head.weight"} if config.tie_word_embeddings else set()):
            raise SystemExit(f"weights do not fit transformers' model: missing {missing}, unexpected {unexpected}")
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
    # Every method makes exactly n tokens: ours ignores EOS, so transformers must not stop (or bias) at one.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
    return model.eval().requires_grad_(False)


def ours_from_hf(hf, args: ModelArgs, device, dtype):
    """Our Transformer on transformers' own tensors, renamed by checkpoint._hf_name (only the fused wqkv is new)."""
    state = {ours: t for name, t in hf.state_dict().items() if (ours := _hf_name(name)) is not None}
    return from_state_dict(args, state, device, dtype, None, "transformers' model")


def load_models(cli, args: ModelArgs, ckpt: Path | None, device, dtype):
    """(transformers' target, ours) holding identical weights: transformers' own random init at `args`' shapes
    (--random_weights), or the checkpoint's tensors cast once to the target dtype."""
    if ckpt is None:
        torch.manual_seed(cli.seed)
        hf = build_hf(hf_config_for(args, cli.hf_attn), device, dtype)
        return hf, ours_from_hf(hf, args, device, dtype)
    config = transformers.AutoConfig.from_pretrained(ckpt.parent, attn_implementation=cli.hf_attn)
    with torch.device("meta"):  # only to learn transformers' names: their inverse is _hf_name
        names = transformers.AutoModelForCausalLM.from_config(config).state_dict()
    to_hf = {_hf_name(k): k for k in names}
    # Cast by the target dtype once, here; ours then takes these very tensors.
    state = {to_hf[k]: v.to(device=device, dtype=dtype) for k, v in load_state_dict(ckpt).items()}
    hf = build_hf(config, device, dtype, state)
    return hf, ours_from_hf(hf, args, device, dtype)


def first_layers(hf, args: ModelArgs, k: int, device, dtype):
    """The standalone draft for both libraries: the target's first k layers, final norm and LM head (same tensors)."""
    config = copy.deepcopy(hf.config)
    config.num_hidden_layers = k
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:k]
    keep = {n: t for n, t in hf.state_dict().items() if not n.startswith("model.layers.") or int(n.split(".")[2]) < k}
    draft = build_hf(config, device, dtype, keep)
    return draft, ours_from_hf(draft, replace(args, n_layers=k), device, dtype)


# ---------------------------------------------------------------- what is timed

def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


class Shared:
    """What this script made for both libraries, handed to the engine (caches, prefills, drafters, decoders): as its
    model loader, our Transformers on transformers' tensors (by layer count: the target, the truncated draft); as its
    prompt source, the prompt ids transformers reads too (each B the first B rows of its prefix's)."""

    def __init__(self):
        self.models, self.given = {}, {}  # n_layers -> Transformer; prefix_len -> (prompts [max B, P], source)

    def load(self, config, checkpoint, shard=None, flag="--draft"):
        return self.models[config.n_layers]

    def prompts(self, cfg: RunConfig):
        prompts, source = self.given[cfg.workload.prefix_len]
        return prompts[:cfg.workload.B], None, source


class Ours:
    """Our side at one (B, prefix): the trial's target cache prefilled once by the engine, with room for the longest
    verification of `gammas`; every method starts from its prompt. `cfg` is the baseline's run config there; a
    method's is it with the drafter's options (`config`)."""

    def __init__(self, engine: Engine, cfg: RunConfig, gammas):
        self.engine, self.cfg, self.gammas = engine, cfg, list(gammas)
        self.B, self.P, self.gen_len = cfg.workload.B, cfg.workload.prefix_len, cfg.workload.gen_len
        self.trial = Trial(engine, cfg, ahead=max(self.gammas))
        self.batch = self.trial.batch
        self.prompts, self.target = self.batch.prompts, engine.target
        self.first, self.prev = first_tokens(cfg, self.batch)

    def config(self, **options) -> RunConfig:
        return RunConfig.from_options(self.cfg.options() | {"gamma": self.gammas} | options)

    def drafter(self, cfg: RunConfig, models: dict | None = None):
        """The drafter `cfg` configures, prepared over this batch (its own prefill, or the prompts to look up)."""
        return self.trial.prepare(cfg, models or {})[0]

    def decode_rate(self, cfg: RunConfig | None = None, drafter=None, gamma=0, baseline=None):
        """Tokens and metrics of one timed greedy generation (the trial's: warm-up, roll back, time)."""
        cfg = cfg or self.cfg
        timed, = self.trial.time([self.engine.decoder(cfg, drafter, gamma)], cfg)
        return timed.out, timed.metrics(self.B, baseline, gamma)


def ours_timer(ours: Ours, cfg: RunConfig | None = None, drafter=None, gamma=0):
    """A function timing one of our generations (the loop's own clock), made after a warm-up run."""
    cfg = cfg or ours.cfg
    cache = ours.batch.cache
    dec = ours.engine.decoder(cfg, drafter, gamma)
    ours.trial.time([dec], cfg)

    def once():
        cache.rollback(torch.full_like(cache.lengths, ours.P))
        torch.manual_seed(cfg.workload.seed + 1)
        out, counts = decode(dec, cache, ours.first, ours.gen_len, [], prev=ours.prev)
        return out, {"decode_s": dec.seconds, "decode_tokens_per_s": int((counts - 1).sum()) / dec.seconds}
    return once


def common_prefix(tokens: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per row, how many leading tokens equal our baseline's."""
    t = min(tokens.shape[1], reference.shape[1])
    return (tokens[:, :t].cpu() == reference[:, :t].cpu()).long().cumprod(1).sum(1)


def agreement(tokens: torch.Tensor, reference: torch.Tensor) -> float:
    """The mean common prefix of each row with our baseline's, over its length (a method that stopped early agrees on
    fewer tokens)."""
    return float(common_prefix(tokens, reference).float().mean()) / reference.shape[1]


def clock(name: str) -> str:
    """The clock a method's seconds were read on: each library's own (TIMING says how)."""
    return TIMING["transformers" if name.startswith("transformers") else "magicdec"]


def interleaved(timers: dict, rounds: int, ref, progress: bool) -> dict:
    """Each timer run once per round, the order reversed every other round (timing.timed_generations' rule), so
    every library meets the same state of the machine; per method its rates in round order, median, min and max,
    and its agreement with our baseline's tokens."""
    names, rates, agree, agreed = list(timers), {n: [] for n in timers}, {}, {}
    for r in tqdm(range(rounds), desc="interleaved rounds", disable=not progress):
        for name in names if r % 2 == 0 else names[::-1]:
            tokens, m = timers[name]()
            rates[name].append(m["decode_tokens_per_s"])
            agree[name] = agreement(tokens, ref)
            agreed[name] = [int(common_prefix(tokens, ref).min()), int(ref.shape[1])]
    return {n: {"tokens_per_s": v, "median": statistics.median(v), "min": min(v), "max": max(v),
                "agreement_with_our_baseline": agree[n], "tokens_equal_to_our_baseline": agreed[n],
                "clock": clock(n)} for n, v in rates.items()}


def ratios(result: dict, pairs: list[tuple[str, str]]) -> dict:
    """a / b per round (the same round's runs), median, min and max, for each (a, b) both timed."""
    out = {}
    for a, b in pairs:
        if a in result and b in result:
            per = [x / y for x, y in zip(result[a]["tokens_per_s"], result[b]["tokens_per_s"])]
            out[f"{a} / {b}"] = {"per_round": per, "median": statistics.median(per), "min": min(per), "max": max(per)}
    return out


def hf_decode_rate(model, ids, n, device, **kw):
    """transformers' greedy generate, decode only: t(n new tokens) - t(1 new token), after one warm-up of n."""
    return hf_timer(model, ids, n, device, **kw)()


def hf_timer(model, ids, n, device, static=False, compiled=None, prefill_chunk_size=None, **kw):
    """A function timing transformers' greedy generate once, decode only (t(n new tokens) - t(1 new token)), made
    after one warm-up of n. A static cache is made once for prefix + n and reset before each call, as its docs do for
    repeated calls: fixed shapes and addresses, so no recompilation or CUDA-graph re-capture inside the timed calls."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=ids.shape[1] + n) if static else None

    def generate(k):
        if cache is not None:
            cache.reset()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, do_sample=False,
                             past_key_values=cache, disable_compile=compiled is None,
                             compile_config=compiled,
                             prefill_chunk_size=prefill_chunk_size, **kw)
        return out[:, ids.shape[1]:]

    def once():
        tokens, t_n = dev.timed(lambda: generate(n), device)
        _, t_1 = dev.timed(lambda: generate(1), device)
        decoded = ids.shape[0] * (n - 1)
        return tokens, {"decode_s": t_n - t_1, "decode_tokens_per_s": decoded / (t_n - t_1), "generate_n_s": t_n,
                        "generate_1_s": t_1, "generated_tokens": tokens.numel(), "batch_size": ids.shape[0]}

    generate(n)
    return once


# ---------------------------------------------------------------- the run

def main(argv=None):
    start = time.perf_counter()
    cli = parse(argv)
    transformers.logging.set_verbosity_error()  # its per-call advice would bury the progress and the table
    device = torch.device(cli.device)
    gpu = device.type == "cuda"
    if hasattr(torch._dynamo.config, "recompile_limit"):  # transformers' compiled forward recompiles as shapes change
        torch._dynamo.config.recompile_limit = 64
    # Our side's run options: greedy, EOS ignored (every method makes exactly gen_len tokens), CUDA graphs on a GPU.
    options = {"model": cli.model, "model_name": cli.model_name, "random_weights": cli.random_weights,
               "tokenizer": cli.tokenizer, "dataset": cli.dataset, "skip_tokens": cli.skip_tokens,
               "gen_len": cli.gen_len, "seed": cli.seed, "device": cli.device, "ignore_eos": True,
               "step_mode": "cuda_graphs" if gpu else "eager", "fuse": not cli.no_fuse, "progress": False}
    largest = RunConfig.from_options(options | {"B": max(cli.batch_sizes), "prefix_len": max(cli.prefix_lens)})
    shared = Shared()
    # the target's config and checkpoint, checked before anything loads
    engine = Engine(largest, prompts=shared.prompts, load=shared.load)
    engine.check(largest)
    args, ckpt, dtype = engine.target_config, engine.checkpoint, engine.dtype
    cli.output_dir.mkdir(parents=True, exist_ok=True)
    hf, target = load_models(cli, args, ckpt, device, dtype)
    k = cli.draft_layers or max(1, args.n_layers // 4)
    want_b1 = 1 in cli.batch_sizes
    hf_draft, draft = first_layers(hf, args, k, device, dtype) if want_b1 else (None, None)
    shared.models = {k: draft, args.n_layers: target}
    engine.load_target()  # ours, with the fused kernels on a GPU unless --no_fuse
    summary = {"model": args.name, "model_config": args.to_dict(), "random_weights": cli.random_weights,
               "checkpoint": str(ckpt) if ckpt else None, "draft_layers": k, "dtype": str(dtype),
               "hf_attn_implementation": cli.hf_attn, "environment": dev.environment(device), "timing": TIMING,
               "args": {key: str(v) if isinstance(v, Path) else v for key, v in vars(cli).items()}, "records": []}
    records = summary["records"]

    def emit(B, P, library, method, tokens, metrics, reference, **extra):
        rec = {"B": B, "prefix_len": P, "gen_len": cli.gen_len, "library": library, "method": method, **extra,
               "run_elapsed_s": time.perf_counter() - start}  # compile and prefill included: for planning runs
        if tokens is not None:
            rec["agreement_with_our_baseline"] = agreement(tokens, reference)
            if cli.save_tokens:
                rec["tokens"] = tokens.tolist()
        rec["metrics"] = metrics
        records.append(rec)
        files.write_json(cli.output_dir / "summary.json", summary)
        return rec

    def attempt(B, P, library, method, reference, fn, **extra):
        """Run fn() -> (tokens, metrics); a failure (compile error, out of memory) is one line, not fatal."""
        try:
            tokens, metrics = fn()
        except Exception as e:  # noqa: BLE001 - "where it works": say why not and go on
            if gpu:
                torch._dynamo.reset()
            dev.release_memory(device)
            return emit(B, P, library, method, None, None, reference, error=one_line(e), **extra)
        return emit(B, P, library, method, tokens, metrics, reference, **extra)

    # transformers compiles generate on CUDA only; its default CompileConfig (dynamic=None) lets torch recompile with
    # dynamic shapes after the first change of shape; dynamic=True compiles for every shape at once.
    compiled = {"auto": transformers.CompileConfig(), "dynamic": transformers.CompileConfig(dynamic=True)}.get(
        cli.hf_compile) if gpu else None
    summary["hf_compile_config"] = repr(compiled)
    # No prefill chunking when compiled: transformers then runs the chunks through the compiled forward, and with
    # transformers 5.17 / torch 2.11 that crashed (segfault in cudagraph_trees), which no except clause can catch.
    hf_static = {"static": True, "compiled": compiled}
    hf_eager = {"static": True, "compiled": None, "prefill_chunk_size": cli.hf_prefill_chunk}
    plan = [(P, B) for P in sorted(cli.prefix_lens) for B in sorted(cli.batch_sizes)]
    # Every prefix's prompts first (too little text fails now, not after minutes); each B takes the first B rows.
    shared.given = {P: prompts_for(cli, engine, RunConfig.from_options(options | {"B": max(cli.batch_sizes),
                                                                                 "prefix_len": P}))
                    for P in cli.prefix_lens}
    summary["prompt_source"] = shared.given[plan[0][0]][1]
    with torch.inference_mode():
        for P, B in tqdm(plan, desc="side by side", disable=cli.no_progress):
            ours = Ours(engine, RunConfig.from_options(options | {"B": B, "prefix_len": P}), cli.gammas)
            prompts = ours.prompts
            if cli.save_tokens:
                summary.setdefault("prompts", {})[f"P{P}_B{B}"] = prompts.tolist()
            ref, base = ours.decode_rate()
            emit(B, P, "magicdec", "baseline", ref, base, ref, cuda_graphs=gpu)
            if B == 1:
                batch1(cli, ours, ckpt, hf, hf_draft, prompts, ref, base, emit, attempt, device, gpu, hf_static,
                       hf_eager)
            del ours
            dev.release_memory(device)  # free our caches before transformers allocates its own
            if B > 1:
                rec = None
                if compiled is not None:
                    rec = attempt(B, P, "transformers", "static+compiled", ref,
                                  lambda: hf_decode_rate(hf, prompts, cli.gen_len, device, **hf_static))
                if rec is None or "error" in rec:  # uncompiled (CPU, --hf_compile off, or the compiled run failed)
                    attempt(B, P, "transformers", "static", ref,
                            lambda: hf_decode_rate(hf, prompts, cli.gen_len, device, **hf_eager),
                            prefill_chunk_size=cli.hf_prefill_chunk)
            dev.release_memory(device)
    print_table(records, summary)
    print(f"wrote {cli.output_dir / 'summary.json'}")
    return summary


def prompts_for(cli, engine: Engine, cfg: RunConfig):
    """(the same prompt ids for both libraries, where they came from): text through the checkpoint's tokenizer, or
    seeded random ids (--random_prompts, or random weights without a tokenizer), as any run's are."""
    if cli.random_prompts:
        c, w = engine.target_config, cfg.workload
        return (data.random_prompts(c.vocab_size, w.B, w.prefix_len, w.seed, c.bos_id or 0),
                "random token ids" + (" (random weights)" if cli.random_weights else ""))
    prompts, _, source = engine.dataset_prompts(cfg)  # the engine's own choice, not the shared ones it hands out
    return prompts, source


def batch1(cli, ours, ckpt, hf, hf_draft, prompts, ref, base, emit, attempt, device, gpu, hf_static, hf_eager):
    """Every method at batch 1: our speculation beside transformers' generate, assisted and prompt-lookup decoding."""
    P, n = prompts.shape[1], cli.gen_len
    best = {}  # our method -> (tokens/s, gamma)
    for budget in cli.budgets:
        if not cli.sinks < budget < P:
            emit(1, P, "magicdec", "selfspec", None, None, ref, budget=budget,
                 error=f"budget must be in ({cli.sinks}, {P})")
            continue
        cfg = ours.config(drafter="selfspec", draft_budget=budget, sinks=cli.sinks)  # StreamingLLM, own prefill
        drafter = ours.drafter(cfg)
        for gamma in cli.gammas:
            out, m = ours.decode_rate(cfg, drafter, gamma, base)
            emit(1, P, "magicdec", "selfspec", out, m, ref, budget=budget, gamma=gamma)
            best["selfspec"] = max(best.get("selfspec", (0, None, None)), (m["decode_tokens_per_s"], gamma, budget))
        del drafter
    # the standalone draft: the target's first --draft_layers layers (the engine is handed them), its full cache
    k = hf_draft.config.num_hidden_layers
    cfg = ours.config(drafter="standalone", draft_budget=0, sinks=cli.sinks, draft=str(ckpt) if ckpt else None,
                      draft_name=None if ckpt else cli.model_name)
    drafter = ours.drafter(cfg, {"draft": (replace(ours.engine.target_config, n_layers=k), None)})
    for gamma in cli.gammas:
        out, m = ours.decode_rate(cfg, drafter, gamma, base)
        emit(1, P, "magicdec", "standalone_draft", out, m, ref, gamma=gamma, draft_layers=k)
        best["standalone_draft"] = max(best.get("standalone_draft", (0, None, None)),
                                       (m["decode_tokens_per_s"], gamma, None))
    del drafter
    cfg = ours.config(drafter="lookup", ngram_max=cli.ngram_max)  # prompt lookup: no draft model, n-grams
    drafter = ours.drafter(cfg)
    for gamma in cli.gammas:
        out, m = ours.decode_rate(cfg, drafter, gamma, base)
        emit(1, P, "magicdec", "prompt_lookup", out, m, ref, gamma=gamma, ngram_max=cli.ngram_max)
        best["prompt_lookup"] = max(best.get("prompt_lookup", (0, None, None)), (m["decode_tokens_per_s"], gamma, None))
    del drafter
    for method, (rate, gamma, budget) in best.items():
        emit(1, P, "magicdec", f"{method} (best)", None, {"decode_tokens_per_s": rate}, ref, gamma=gamma, budget=budget)
    dev.release_memory(device)

    def hf_rate(model=hf, **kw):
        return lambda: hf_decode_rate(model, prompts, n, device, **kw)

    hf_runs = {}  # transformers' method -> (its record, its generate options): the fastest of each kind goes on
    hf_runs["dynamic"] = attempt(1, P, "transformers", "dynamic", ref, hf_rate()), {}
    hf_runs["static"] = attempt(1, P, "transformers", "static", ref, hf_rate(**hf_eager),
                                prefill_chunk_size=cli.hf_prefill_chunk), hf_eager
    if hf_static["compiled"]:
        hf_runs["static+compiled"] = attempt(1, P, "transformers", "static+compiled", ref, hf_rate(**hf_static)), \
            hf_static
    else:
        emit(1, P, "transformers", "static+compiled", None, None, ref,
             error="skipped: transformers compiles generate on CUDA only" if not gpu else "skipped: --hf_compile off")
    # Assisted generation with the same truncated draft: with transformers' own defaults, then constant at our best
    # gamma with its confidence-based early stop off, i.e. the schedule our standalone draft runs.
    defaults = hf_draft.generation_config._get_default_generation_params()
    own = {key: getattr(hf_draft.generation_config, key, None) or defaults.get(key) for key in
           ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}
    hf_runs["assisted (its defaults)"] = attempt(1, P, "transformers", "assisted (its defaults)", ref,
                                                 hf_rate(assistant_model=hf_draft), assistant_settings=own,
                                                 draft_layers=k), {"assistant_model": hf_draft}
    gamma = best["standalone_draft"][1]
    mine = {"num_assistant_tokens": gamma, "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0}
    saved = {key: getattr(hf_draft.generation_config, key, None) for key in mine}
    for key, value in mine.items():
        setattr(hf_draft.generation_config, key, value)
    mine_rec = attempt(1, P, "transformers", f"assisted (gamma {gamma})", ref, hf_rate(assistant_model=hf_draft),
                       assistant_settings=mine, draft_layers=k)
    for key, value in saved.items():
        setattr(hf_draft.generation_config, key, value)
    hf_runs["prompt_lookup"] = attempt(1, P, "transformers", "prompt_lookup", ref,
                                       hf_rate(prompt_lookup_num_tokens=cli.prompt_lookup),
                                       prompt_lookup_num_tokens=cli.prompt_lookup), \
        {"prompt_lookup_num_tokens": cli.prompt_lookup}
    gamma = best["prompt_lookup"][1]  # ours' best gamma and n-gram length, the same lookup on transformers' side
    same = {"prompt_lookup_num_tokens": gamma, "max_matching_ngram_size": cli.ngram_max}
    hf_runs[f"prompt_lookup (gamma {gamma})"] = attempt(1, P, "transformers", f"prompt_lookup (gamma {gamma})", ref,
                                                        hf_rate(**same), **same), same
    dev.release_memory(device)
    if cli.rounds:
        mine_rec["assisted_settings"] = mine
        rounds_b1(cli, ours, ckpt, hf, hf_draft, prompts, ref, best, hf_runs, mine_rec, emit, device)


def fastest(hf_runs: dict, kind: str):
    """transformers' fastest method of a kind (plain, assisted, prompt_lookup) in the one-at-a-time pass: (name,
    generate options), or None where none ran."""
    plain = ("dynamic", "static", "static+compiled")
    ok = {n: (rec, kw) for n, (rec, kw) in hf_runs.items() if rec.get("metrics")
          and ((n in plain) if kind == "plain" else n.startswith(kind))}
    if not ok:
        return None
    name = max(ok, key=lambda n: ok[n][0]["metrics"]["decode_tokens_per_s"])
    return name, ok[name][1]


def rounds_b1(cli, ours, ckpt, hf, hf_draft, prompts, ref, best, hf_runs, assisted_mine, emit, device):
    """Each library at its fastest configuration of each kind (our best gamma per method; transformers' fastest plain
    decode, assisted and prompt-lookup generation of the one-at-a-time pass), timed in interleaved rounds: the
    ratios a reader may cite, each round's runs side by side."""
    P, n = prompts.shape[1], cli.gen_len
    timers, what = {"ours: baseline": ours_timer(ours)}, {"ours: baseline": {}}
    keep = []  # drafters stay alive while their timers are
    for method, drafter_name, extra in (("prompt_lookup", "lookup", {"ngram_max": cli.ngram_max}),
                                        ("standalone_draft", "standalone", None)):
        gamma = best[method][1]
        if drafter_name == "standalone":
            k = hf_draft.config.num_hidden_layers
            cfg = ours.config(drafter="standalone", draft_budget=0, sinks=cli.sinks, draft=str(ckpt) if ckpt else None,
                              draft_name=None if ckpt else cli.model_name)
            drafter = ours.drafter(cfg, {"draft": (replace(ours.engine.target_config, n_layers=k), None)})
        else:
            cfg = ours.config(drafter=drafter_name, **extra)
            drafter = ours.drafter(cfg)
        keep.append(drafter)
        timers[f"ours: {method}"] = ours_timer(ours, cfg, drafter, gamma)
        what[f"ours: {method}"] = {"gamma": gamma}
    for kind in ("plain", "prompt_lookup", "assisted"):
        found = fastest(hf_runs, kind)
        if found is None:
            continue
        name, kw = found
        if name.startswith("assisted (gamma"):
            for key, value in assisted_mine["assisted_settings"].items():
                setattr(hf_draft.generation_config, key, value)
        timers[f"transformers: {name}"] = hf_timer(hf, prompts, n, device, **kw)
        what[f"transformers: {name}"] = {key: f"the target's first {hf_draft.config.num_hidden_layers} layers"
                                         if key == "assistant_model" else str(v) if key == "compiled" else v
                                         for key, v in kw.items()}
    result = interleaved(timers, cli.rounds, ref, not cli.no_progress)
    plain = next((t for t in timers if t.startswith("transformers: ") and fastest(hf_runs, "plain")
                  and t.endswith(fastest(hf_runs, "plain")[0])), None)
    look = next((t for t in timers if t.startswith("transformers: prompt_lookup")), None)
    assisted = next((t for t in timers if t.startswith("transformers: assisted")), None)
    pairs = [("ours: prompt_lookup", "ours: baseline"), ("ours: standalone_draft", "ours: baseline"),
             ("ours: baseline", plain), ("ours: prompt_lookup", plain), ("ours: prompt_lookup", look),
             ("ours: standalone_draft", assisted), (look, plain), (assisted, plain)]
    emit(1, P, "both", "interleaved rounds", None, {"methods": {k: result[k] | {"settings": what[k]} for k in result},
                                                    "ratios": ratios(result, [p for p in pairs if None not in p]),
                                                    "rounds": cli.rounds}, ref)


def print_table(records, summary):
    """Every record, with its speed relative to our baseline at the same (B, prefix): above 1 is faster than it."""
    base = {(r["B"], r["prefix_len"]): r["metrics"]["decode_tokens_per_s"] for r in records
            if r["library"] == "magicdec" and r["method"] == "baseline"}
    env = summary["environment"]
    print(f"\n{summary['model']}{' (random weights)' if summary['random_weights'] else ''}, "
          f"{env.get('gpu', env['device'])}, {summary['dtype']}, torch {env['torch']}, transformers "
          f"{env['transformers']}, gen_len {records[0]['gen_len'] if records else '-'}; "
          "decode tokens/s, prefill excluded\n")
    print("| B | prefix | library | method | tokens/s | / our baseline | agreement | note |")
    print("|---|---|---|---|---|---|---|---|")
    for r in records:
        m, note = r.get("metrics") or {}, r.get("error", "")
        if m and r.get("prefill_chunk_size"):
            note = f"transformers prefill_chunk_size {r['prefill_chunk_size']}"
        if m and r.get("budget") is not None:
            note = f"budget {r['budget']}, gamma {r['gamma']}"
        elif m and r.get("gamma") is not None:
            note = f"gamma {r['gamma']}"
        if m.get("alpha") is not None:
            note += f", alpha {m['alpha']:.2f}"
        rate, agree = m.get("decode_tokens_per_s"), r.get("agreement_with_our_baseline")
        relative = rate / base[(r["B"], r["prefix_len"])] if rate else None
        print(f"| {r['B']} | {r['prefix_len']} | {r['library']} | {r['method']} | {f'{rate:.1f}' if rate else '-'} | "
              f"{f'{relative:.2f}' if relative else '-'} | {f'{agree:.3f}' if agree is not None else '-'} | {note} |")
    for r in records:
        if r["method"] == "interleaved rounds":
            print(f"\nB = 1, prefix {r['prefix_len']}: {r['metrics']['rounds']} interleaved rounds, decode tokens/s "
                  "median [min-max] and ratios of the same rounds\n")
            for name, m in r["metrics"]["methods"].items():
                same, total = m["tokens_equal_to_our_baseline"]
                print(f"- {name} {m['settings']}: {m['median']:.1f} [{m['min']:.1f}-{m['max']:.1f}]; its output equals "
                      f"our baseline's for the first {same} of {total} tokens; clock: {m['clock']}")
            for name, m in r["metrics"]["ratios"].items():
                print(f"- {name}: {m['median']:.2f}x [{m['min']:.2f}-{m['max']:.2f}]")
    # The issue's goal: our baseline >= 2x transformers' batched generate at B >= 8 and prefix >= 8K.
    theirs = [r for r in records if r["library"] == "transformers" and r["B"] > 1 and r.get("metrics")]
    if theirs:
        print("\n| B | prefix | transformers method | our baseline / transformers |\n|---|---|---|---|")
        for r in theirs:
            print(f"| {r['B']} | {r['prefix_len']} | {r['method']} | "
                  f"{base[(r['B'], r['prefix_len'])] / r['metrics']['decode_tokens_per_s']:.2f} |")


if __name__ == "__main__":
    from magicdec.errors import one_line_errors

    with one_line_errors():  # bad input (too little text, unknown model, ...): one line, exit status 2
        main()
