"""One benchmark run of any method — baseline, self-speculation (`selfspec`), standalone draft (`longspec`) — as
the seed's tests/*_benchmark.py scripts launch it. Everything that can be wrong with the input is checked before
weights or caches are allocated."""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

from magicdec import benchmark as bench
from magicdec import cost_model
from magicdec import draft_cache, fused
from magicdec import tp
from magicdec.attention import resolve_backend
from magicdec.config import ModelArgs
from magicdec.errors import MagicDecError
from magicdec.generate import Decoder, Draft, Sampling, decode, prefill
from magicdec.hierarchy import Hierarchy
from magicdec.kv_cache import KVCache, StreamingCache
from magicdec.lookup import PromptLookup
from magicdec.offload import OffloadedCache
from magicdec.planner import AutoGamma
from magicdec.sampling import next_token
from magicdec.verify import SYNTHETIC_DRAWS


DESCRIPTIONS = {
    "baseline": "Autoregressive baseline: prefill, then one target step per token.",
    "selfspec": "Self-speculation: the target drafts with a small KV cache (--draft_policy) and verifies with its full "
                "cache.",
    "longspec": "Standalone draft: a small model (--model) with a small KV cache (--draft_policy) drafts for --target.",
    "lookup": "Prompt lookup: no draft model; the tokens that followed the latest earlier occurrence of the last n "
              "tokens (n = --ngram_max..1) in the prompt and output are proposed (magicdec/lookup.py).",
}


def parser(method: str) -> argparse.ArgumentParser:
    p = bench.common_parser(DESCRIPTIONS[method])
    p.add_argument("--offload", action="store_true",
                   help="the target's KV cache beyond the first --on_chip layers in pinned host memory, streamed to the "
                        "GPU layer by layer while the layer before computes (TriForce's offloading)")
    p.add_argument("--on_chip", type=int, default=0, help="--offload: layers whose KV stays on the GPU")
    if method == "baseline":
        return p
    p.add_argument("--gamma", type=gamma_arg, nargs="+", default=[3],
                   help="tokens drafted per verification; several values time each on the same loaded model, caches "
                        "and baseline, and report the best; or 'auto': chosen per verification from step times measured "
                        "on the batch and the acceptance measured so far, 0 (speculation off) included")
    p.add_argument("--max_gamma", type=int, default=5, help="--gamma auto: candidates 1..max_gamma")
    p.add_argument("--alpha_prior", type=float, default=0.8, help="--gamma auto: acceptance rate assumed at the start")
    if method == "lookup":
        p.add_argument("--ngram_max", "--ngram", dest="ngram_max", type=int, default=3,
                       help="longest suffix looked up; shorter ones are tried when it never occurred")
    else:
        draft_cache_flags(p, method)
    p.add_argument("--synthetic_acceptance", type=float, default=None,
                   help="random-weight runs: accept each drafted token with this probability instead of comparing")
    p.add_argument("--baseline", action="store_true",
                   help="also time the baseline on the same model, prompts and device, for the measured speedup")
    p.add_argument("--baseline_json", type=Path, default=None, help="a baseline record to compare against instead")
    if method == "longspec":
        p.add_argument("--target", type=Path, default=None,
                       help="target model.pth, or the dir holding it (--model is the draft)")
        p.add_argument("--draft_name", default=None, help="draft repo id, for --random_weights shapes")
        p.add_argument("--draft_ranks", type=int, nargs="+", default=None,
                       help="tensor parallelism: ranks that run the draft and broadcast its tokens to the others "
                            "(default: all of --rank_group)")
    return p


def draft_cache_flags(p: argparse.ArgumentParser, method: str) -> None:
    """A draft model's KV cache: its budget and how it is chosen."""
    p.add_argument("--streamingllm_budget", "--draft_budget", dest="streamingllm_budget", type=int, default=256,
                   help="the draft's KV budget in prompt tokens (streaming: sinks + recent window)"
                        + (" (0 = full cache)" if method == "longspec" else ""))
    p.add_argument("--sinks", type=int, default=16, help="StreamingLLM sink tokens kept at the start")
    p.add_argument("--reindex", action="store_true",
                   help="streaming: attention sees positions inside the draft's cache (sinks, then the window), not "
                        "in the prompt, so a draft trained on contexts shorter than the prompt stays in range")
    own = "the target's prefill KV" if method == "selfspec" else "the draft's own full prefill"
    p.add_argument("--draft_policy", choices=draft_cache.POLICIES, default="streaming",
                   help="how the draft picks its KV: streaming (sinks + recent window, its own prefill); snapkv or "
                        f"retrieval (selected per KV head from {own}, the prompt's last {draft_cache.WINDOW} tokens "
                        "kept, generated tokens appended): see magicdec/draft_cache.py")
    p.add_argument("--chunk_size", type=int, default=8, help="--draft_policy retrieval: tokens per scored chunk")
    if method == "selfspec":
        p.add_argument("--refresh", type=int, default=None, metavar="N",
                       help="snapkv / retrieval: every N verifications select the draft's kept prompt positions again, "
                            "from the attention that verification computed over the full cache (its side output)")
        hierarchy_flags(p)


def hierarchy_flags(p: argparse.ArgumentParser) -> None:
    """TriForce's hierarchy: the self-draft (the middle level) speculates with a bottom draft of its own."""
    p.add_argument("--hierarchy", action="store_true",
                   help="the self-draft (target weights over its --draft_policy cache: TriForce's middle level) "
                        "collects its gamma tokens by speculating itself, --gamma_bottom at a time, with --draft")
    p.add_argument("--draft", default=None, metavar="ngram|PATH",
                   help="--hierarchy's bottom draft: ngram (prompt lookup, no model) or a small model's model.pth "
                        "(or its dir) over a StreamingLLM cache of --bottom_budget tokens")
    p.add_argument("--draft_name", default=None, help="--hierarchy with --random_weights: the bottom model's repo id")
    p.add_argument("--gamma_bottom", type=int, default=1, help="--hierarchy: tokens the bottom drafts per middle "
                                                                "verification (TriForce: 1)")
    p.add_argument("--bottom_budget", type=int, default=256, help="--hierarchy: the bottom model's StreamingLLM budget")
    p.add_argument("--ngram_max", "--ngram", dest="ngram_max", type=int, default=3,
                   help="--draft ngram: the longest suffix looked up")
    p.add_argument("--synthetic_bottom", type=float, default=None,
                   help="random-weight runs with --hierarchy: the middle accepts each bottom token with this "
                        "probability (--synthetic_acceptance is the target's rate for the middle's tokens)")


def gamma_arg(text: str):
    return text if text == "auto" else int(text)


def resolve_gamma(args) -> None:
    """--gamma N stays a number, --gamma auto the string, several values a list of numbers."""
    if "auto" in args.gamma and len(args.gamma) > 1:
        raise MagicDecError(f"--gamma auto takes no other values, got {' '.join(map(str, args.gamma))}")
    args.gamma = args.gamma[0] if len(args.gamma) == 1 else sorted(set(args.gamma))


def gammas_to_time(args) -> list[int]:
    """The fixed gammas a run times one after another (--gamma auto: one run, its policy's largest candidate)."""
    if args.gamma == "auto":
        return [args.max_gamma]
    return args.gamma if isinstance(args.gamma, list) else [args.gamma]


def max_gamma(args) -> int:
    return max(gammas_to_time(args))


def sources(args, method):
    """(target config, target checkpoint, draft config, draft checkpoint) without loading weights."""
    if method != "longspec":
        config, ckpt = bench.model_source(args)
        return config, ckpt, (config if method == "selfspec" else None), ckpt
    if args.random_weights:
        if not (args.model_name and args.draft_name):
            raise MagicDecError("--random_weights with a standalone draft needs --model_name (target) and --draft_name (draft)")
        return ModelArgs.from_name(args.model_name), None, ModelArgs.from_name(args.draft_name), None
    if args.target is None or args.model is None:
        raise MagicDecError("a standalone draft run needs --target TARGET/model.pth and --model DRAFT/model.pth")
    target_args = argparse.Namespace(**{**vars(args), "model": args.target, "random_weights": False})
    draft_args = argparse.Namespace(**{**vars(args), "random_weights": False})
    (tc, tk), (dc, dk) = bench.model_source(target_args), bench.model_source(draft_args)
    return tc, tk, dc, dk


def shards(args, method, rank, world, target_cfg, draft_cfg):
    """Tensor-parallel shards of the target and draft for this rank (None when single-process), and the draft's ranks."""
    ranks, n = " ".join(map(str, args.rank_group)), len(args.rank_group)
    if world == 1:
        if args.rank_group == [0]:
            return None, None, [0]
        if sorted(args.rank_group) == list(range(n)):  # a valid group for n processes, launched as one
            raise MagicDecError(f"--rank_group {ranks} needs {n} processes: launch with torchrun --nproc_per_node={n} "
                                "(or pass --rank_group 0 for one process)")
        raise MagicDecError(f"--rank_group {ranks}: rank ids must be 0..N-1 for an N-process job, each once; "
                            "this is one process, so use --rank_group 0")
    if sorted(args.rank_group) != list(range(world)):
        raise MagicDecError(f"--rank_group {ranks} must list every rank of this {world}-process job once (0..{world - 1})")
    target_group = tp.group_for(args.rank_group, world)
    target_shard = tp.make_shard(target_cfg, args.rank_group, target_group)
    draft_ranks = (getattr(args, "draft_ranks", None) or args.rank_group) if method == "longspec" else args.rank_group
    draft_group = tp.group_for(draft_ranks, world) if method == "longspec" else target_group
    draft_shard = None
    if method == "selfspec":
        draft_shard = target_shard
    elif method == "longspec" and rank in draft_ranks:
        draft_shard = tp.make_shard(draft_cfg, draft_ranks, draft_group) if len(draft_ranks) > 1 else None
    return target_shard, draft_shard, sorted(draft_ranks)


def local_config(config, shard):
    """The config of this rank's slice (for memory estimates)."""
    if shard is None:
        return config
    from dataclasses import replace

    kv = shard.kv[1] - shard.kv[0]
    return replace(config, n_kv_heads=kv, n_heads=kv * (config.n_heads // config.n_kv_heads),
                   intermediate_size=shard.ffn[1] - shard.ffn[0], head_dim=config.head_dim)


def check_offload(args, config) -> None:
    if not args.offload:
        if args.on_chip:
            raise MagicDecError("--on_chip counts the layers --offload keeps on the GPU: add --offload")
        return
    if not 0 <= args.on_chip <= config.n_layers:
        raise MagicDecError(f"--on_chip {args.on_chip}: must be 0..{config.n_layers} (the target's layers)")
    if args.compile:
        raise MagicDecError("--offload streams the cache on a side stream, which torch.compile's graphs do not "
                            "capture: drop --compile (--cuda_graphs graphs the draft's steps, the target's stay eager)")
    if getattr(args, "refresh", None):
        raise MagicDecError("--refresh re-selects from the target's whole cache after each verification: not with "
                            "--offload (its prompt KV is on the host)")


def check_speculation(args, method, target, draft, draft_ckpt, target_ckpt):
    if min(gammas_to_time(args)) < 1:
        what = "--max_gamma" if args.gamma == "auto" else "--gamma"
        raise MagicDecError(f"{what} must be at least 1, got {min(gammas_to_time(args))}")
    if args.gamma == "auto" and not 0 < args.alpha_prior < 1:
        raise MagicDecError(f"--alpha_prior must be in (0, 1), got {args.alpha_prior}")
    if args.synthetic_acceptance is not None and not 0 <= args.synthetic_acceptance <= 1:
        raise MagicDecError(f"--synthetic_acceptance must be in [0, 1], got {args.synthetic_acceptance}")
    if args.synthetic_acceptance is not None and args.temperature > 0:
        raise MagicDecError("--synthetic_acceptance decides acceptance by coin flips and takes the target's argmax: "
                            "drop --temperature (it would not be applied)")
    if method == "lookup":
        if args.ngram_max < 1:
            raise MagicDecError(f"--ngram_max {args.ngram_max}: must be at least 1 (the longest suffix looked up)")
        if args.gamma == "auto":
            raise MagicDecError("--gamma auto weighs draft steps' measured time, and prompt lookup runs none: pass "
                                "--gamma N (several values time each)")
        return
    check_draft_cache(args, method)
    if method == "selfspec":
        check_hierarchy(args, target)
    if method == "longspec":
        check_standalone_draft(args, target, draft, draft_ckpt, target_ckpt)


def check_hierarchy(args, target) -> None:
    if not args.hierarchy:
        if args.draft or args.draft_name:
            raise MagicDecError("--draft / --draft_name name --hierarchy's bottom draft: add --hierarchy (a standalone "
                                "draft is tests/longspec_benchmark.py)")
        if args.synthetic_bottom is not None:
            raise MagicDecError("--synthetic_bottom is the bottom level's acceptance: it needs --hierarchy")
        return
    if args.draft != "ngram" and not (args.draft_name if args.random_weights else args.draft):
        raise MagicDecError("--hierarchy needs a bottom draft: --draft ngram (prompt lookup), --draft PATH/model.pth, "
                            "or with --random_weights --draft_name ID")
    if args.gamma == "auto":
        raise MagicDecError("--gamma auto times one draft's steps; --hierarchy has two levels: pass --gamma N")
    if args.gamma_bottom < 1:
        raise MagicDecError(f"--gamma_bottom {args.gamma_bottom}: must be at least 1")
    if (args.synthetic_bottom is None) != (args.synthetic_acceptance is None):
        raise MagicDecError("--hierarchy with synthetic acceptance needs a rate for each level: --synthetic_acceptance "
                            "(target keeps middle tokens) and --synthetic_bottom (middle keeps bottom tokens)")
    if args.synthetic_bottom is not None and not 0 <= args.synthetic_bottom <= 1:
        raise MagicDecError(f"--synthetic_bottom must be in [0, 1], got {args.synthetic_bottom}")
    if args.draft == "ngram":
        if args.ngram_max < 1:
            raise MagicDecError(f"--ngram_max {args.ngram_max}: must be at least 1 (the longest suffix looked up)")
        return
    bottom, _ = bottom_source(args)
    if not args.sinks < args.bottom_budget < args.prefix_len:
        raise MagicDecError(f"--bottom_budget {args.bottom_budget}: must exceed --sinks {args.sinks} and stay below "
                            f"--prefix_len {args.prefix_len}")
    if bottom.vocab_size != target.vocab_size:
        raise MagicDecError(f"bottom draft vocabulary ({bottom.vocab_size}) differs from the target's "
                            f"({target.vocab_size}): a draft must share the target's tokenizer")
    if not args.random_weights:  # its keys keep absolute positions, as a standalone draft's without --reindex
        bench.check_context(bottom, args.prefix_len, args.gen_len + max_gamma(args) + args.gamma_bottom + 2,
                            "gen_len + gamma (bottom draft; --draft ngram has no context limit)")


def bottom_source(args):
    """(config, checkpoint) of --hierarchy's bottom model, without loading it; (None, None) for ngram or none."""
    if not getattr(args, "hierarchy", False) or args.draft == "ngram":
        return None, None
    if args.random_weights:
        return ModelArgs.from_name(args.draft_name), None
    return bench.model_source(argparse.Namespace(**{**vars(args), "model": Path(args.draft), "random_weights": False}))


def check_draft_cache(args, method: str) -> None:
    budget, sinks = args.streamingllm_budget, args.sinks
    if sinks < 0:
        raise MagicDecError(f"--sinks must be >= 0, got {sinks}")
    if not (method == "longspec" and budget == 0):
        if budget <= sinks:
            raise MagicDecError(f"--streamingllm_budget {budget} must exceed --sinks {sinks} (the budget holds the sinks plus a recent window)")
        if budget >= args.prefix_len:
            raise MagicDecError(f"--streamingllm_budget {budget} >= --prefix_len {args.prefix_len}: the draft would read the whole prompt; use a budget below the prefix length")
    policy = args.draft_policy
    if policy != "streaming":
        if method == "longspec" and budget == 0:
            raise MagicDecError(f"--draft_policy {policy} selects within a budget: --streamingllm_budget 0 (the full "
                                "cache) has nothing to select")
        if budget <= draft_cache.WINDOW:
            raise MagicDecError(f"--draft_budget {budget} must exceed the {draft_cache.WINDOW}-token window that "
                                f"--draft_policy {policy} keeps at the prompt's end")
        if policy == "retrieval" and not 1 <= args.chunk_size <= budget - draft_cache.WINDOW:
            raise MagicDecError(f"--chunk_size {args.chunk_size}: must be 1..{budget - draft_cache.WINDOW} (the "
                                f"--draft_budget {budget} minus the {draft_cache.WINDOW}-token window)")
    elif args.chunk_size != 8:
        raise MagicDecError("--chunk_size applies to --draft_policy retrieval only")
    refresh = getattr(args, "refresh", None)
    if refresh is not None and policy == "streaming":
        raise MagicDecError("--refresh re-selects a selected cache: use it with --draft_policy snapkv or retrieval")
    if refresh is not None and refresh < 1:
        raise MagicDecError(f"--refresh {refresh}: must be at least 1 (verifications between re-selections)")
    if args.reindex and policy != "streaming":
        raise MagicDecError(f"--reindex applies to --draft_policy streaming only (--draft_policy {policy} keeps the "
                            "target's keys at their prompt positions)")
    if args.reindex and budget == 0:
        raise MagicDecError("--reindex needs a StreamingLLM budget: --streamingllm_budget 0 is the full cache, whose "
                            "positions are the prompt's")


def check_standalone_draft(args, target, draft, draft_ckpt, target_ckpt) -> None:
    budget, sinks = args.streamingllm_budget, args.sinks
    if draft.vocab_size != target.vocab_size:
        raise MagicDecError(f"draft vocabulary ({draft.vocab_size}) differs from the target's ({target.vocab_size}): a draft must share the target's tokenizer")
    if target_ckpt and draft_ckpt:
        from magicdec.tokenizer import load_tokenizer

        t, d = load_tokenizer(args.tokenizer or target_ckpt.parent), load_tokenizer(draft_ckpt.parent)
        # Every id must mean the same string: decode each one with both (a probe text can miss a permutation).
        if t.vocab_size != d.vocab_size or any(t.decode([i]) != d.decode([i]) for i in range(t.vocab_size)):
            raise MagicDecError("draft and target tokenizers differ (same text, different ids): pick a draft trained with the target's tokenizer")
    # Without --reindex the draft's keys keep their absolute positions (see StreamingCache), so with real weights
    # a draft must have been trained on contexts this long; random-weight speed runs only need the shapes.
    if args.random_weights:
        pass
    elif args.reindex:  # the farthest a query sees: the budget, or a prefill chunk past its sinks
        farthest = max(budget, draft_prefill_chunk(args.prefill_chunk, budget) + sinks)
        if farthest > draft.max_seq_len:
            raise MagicDecError(f"--reindex: the draft would see {farthest} positions back (its budget, or a "
                                f"prefill chunk past the sinks), beyond its context of {draft.max_seq_len}; "
                                "lower --streamingllm_budget or --prefill_chunk")
    else:
        bench.check_context(draft, args.prefix_len, args.gen_len + max_gamma(args) + 1,
                            "gen_len + gamma + 1 (draft; --reindex keeps a draft within its context)")


DRAFT_PREFILL_CHUNK = 256  # the draft's ring must hold one prefill chunk: small chunks keep the ring (and its reads) small


def ring_extra_for(gen_len: int, gamma: int) -> int:
    """Ring slots beyond the window: a draft prefill chunk, or what generating gen_len tokens (and a warm-up of
    4*(gamma+1)) writes before rolling back to the prompt — never overwriting a prompt key the window still needs."""
    return max(DRAFT_PREFILL_CHUNK, max(gen_len, 4 * (gamma + 1)) + 2 * gamma + 4)


def appended_for(gen_len: int, gamma: int) -> int:
    """Positions generation reaches after the prompt (gen_len tokens, a verification's gamma + 1 past the last, and
    a slot of slack): what the target's cache holds beyond the prompt, and what a selected draft cache appends."""
    return gen_len + gamma + 2


def slots_beyond_budget(policy: str, gen_len: int, gamma: int) -> int:
    """Slots a draft cache holds beyond its budget, all read (masked or not) by each draft step: a StreamingLLM
    ring's spare slots, or a selected cache's appended positions."""
    return ring_extra_for(gen_len, gamma) if policy == "streaming" else appended_for(gen_len, gamma)


def new_draft_cache(config, B, n_kv_heads, budget, sinks, ring_extra, full_len, dtype, device, backend, rope=None):
    """The draft's cache: a full KVCache of `full_len` slots for budget 0, else a StreamingLLM ring of `budget`
    (sinks + recent window) with `ring_extra` slots for what a prefill chunk or a generation writes; `rope` (the
    draft's inverse frequencies) for positions inside the cache (--reindex)."""
    if budget == 0:
        return KVCache(config.n_layers, B, n_kv_heads, full_len, config.head_dim, dtype, device, backend)
    return StreamingCache(config.n_layers, B, n_kv_heads, budget, sinks, ring_extra, config.head_dim, dtype, device,
                          backend, rope)


def draft_prefill_chunk(chunk: int, budget: int) -> int:
    """A ring cache must hold a whole prefill chunk, so it is prefilled in small ones; a full cache in `chunk`s."""
    return chunk if budget == 0 else min(chunk, DRAFT_PREFILL_CHUNK)


def profile_gammas(decoder, target_cache, first, prev, args, eos, tries: int = 3) -> float:
    """--gamma auto: seconds per verification for every candidate gamma and for the plain step (gamma 0), measured
    on this batch and context before it is timed, as a server profiles each batch shape once. Rank 0's numbers are
    everyone's, so all ranks choose alike. Returns the seconds profiling took.

    Each run length is timed `tries` times and the fastest kept, with Python's garbage collector off: a host pause
    only ever adds time, and one single timing per length let the sweep's auto point at SmolLM2 8000 x 128 profile
    gamma 1 at 17.2 ms per verification where its timed runs took 15.4 (the same decoders outside the sweep
    profiled within 1% of their runs; H100)."""
    import gc
    import time

    policy, prompt_lengths, start = decoder.policy, target_cache.lengths.clone(), time.perf_counter()
    collecting = gc.isenabled()
    gc.disable()
    try:
        for g in [0] + policy.gammas:  # the plain step, then every candidate
            policy.forced = g
            decode(decoder, target_cache, first, min(args.gen_len, 4 * (g + 1)), eos, prev=prev)  # warm-up, capture
            target_cache.rollback(prompt_lengths)
            timings = []
            for n in (min(args.gen_len, 4 * (g + 1)), min(args.gen_len, 12 * (g + 1))):
                tried = []
                for _ in range(tries):
                    _, seconds = bench.timed(lambda: decode(decoder, target_cache, first, n, eos, prev=prev), args.device)
                    target_cache.rollback(prompt_lengths)
                    tried.append((seconds, decoder.stats.iterations))  # sampled tries may take different counts
                timings.append(min(tried))
            # the difference of a short and a longer run: a generation's fixed costs (setup, final sync) cancel out
            # (where the difference drowns in the noise of a tiny model's runs, the longer run's average)
            (s0, i0), (s1, i1) = timings
            policy.costs[g] = (s1 - s0) / (i1 - i0) if i1 > i0 and s1 > s0 else s1 / i1
    finally:
        if collecting:
            gc.enable()
    policy.forced = None
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        costs = [policy.costs]
        torch.distributed.broadcast_object_list(costs, src=0)
        policy.costs = costs[0]
    return time.perf_counter() - start


def timed_generation(decoder, target_cache, first, prev, args, eos, progress):
    """Warm up (compilation, CUDA-graph capture) then roll both caches back to the prompt and time a full run."""
    return timed_generations([decoder], target_cache, first, prev, args, eos, progress)[0]


MAX_ROUNDS = 50  # timed rounds at most, whatever min_seconds asks


def timed_generations(decoders, target_cache, first, prev, args, eos, progress=False):
    """(tokens, counts, seconds) of each decoder: warmed up, then rounds that time every decoder once, each from the
    prompt, until `args.repeats` rounds are done and every decoder has been timed for `args.min_seconds` in all (at
    most MAX_ROUNDS); each keeps its median run, and `decoder.round_seconds` lists all of its runs in round order.
    Interleaved, a speculative decoder and the baseline see the same state of the machine (clocks, host load,
    neighbours): timed minutes apart, the same graph on an H100 has measured up to 9% apart, more than the
    differences the planner must resolve. The order alternates from round to round, so neither decoder is always
    the one that runs right after the host's pause between rounds. A 0.13 s run (SmolLM2 at B = 1) varies by 3% from
    round to round: a median of three could not tell a 3% loss from noise, a median of ten can."""
    prompt_lengths = target_cache.lengths.clone()
    for decoder in decoders:
        target_cache.rollback(prompt_lengths)
        torch.manual_seed(args.seed + 1)
        # A draft whose verification length varies (prompt lookup) has a graph per length: only the whole run
        # meets every length, and a capture inside a timed run (SmolLM2 at B = 1: ~0.1 s a run) costs more than
        # the run's steps
        varying = getattr(getattr(decoder, "draft", None), "varying_lengths", False)
        warm = (args.gen_len if varying else 4 * (decoder.gamma + 1)) if (args.compile or args.cuda_graphs) else 2
        decode(decoder, target_cache, first, min(args.gen_len, warm), eos, prev=prev)
    timings = [[] for _ in decoders]
    repeats, min_seconds = getattr(args, "repeats", 1), getattr(args, "min_seconds", 0.0)
    while len(timings[0]) < repeats or (min(sum(r[0] for r in t) for t in timings) < min_seconds
                                        and len(timings[0]) < MAX_ROUNDS):
        order = list(zip(decoders, timings))
        for decoder, runs_of in (order if len(timings[0]) % 2 == 0 else order[::-1]):
            target_cache.rollback(prompt_lengths)
            torch.manual_seed(args.seed + 1)
            (out, counts), seconds = bench.timed(
                lambda: decode(decoder, target_cache, first, args.gen_len, eos, progress, prev), args.device)
            runs_of.append((seconds, decoder.stats, out, counts))
    results = []
    for decoder, runs_of in zip(decoders, timings):
        decoder.round_seconds = [r[0] for r in runs_of]
        seconds, decoder.stats, out, counts = sorted(runs_of, key=lambda r: r[0])[len(runs_of) // 2]
        results.append((out, counts, seconds))
    return results


def run(method: str, argv=None) -> dict:
    args = parser(method).parse_args(argv)
    bench.resolve_common(args)
    if method != "baseline":
        resolve_gamma(args)
    spec = method != "baseline"
    rank, world = tp.init_distributed(args.device)
    target_cfg, target_ckpt, draft_cfg, draft_ckpt = sources(args, method)
    check_offload(args, target_cfg)
    target_shard, draft_shard, draft_ranks = shards(args, method, rank, world, target_cfg, draft_cfg)
    gamma = max_gamma(args) if spec else 0
    bench.check_context(target_cfg, args.prefix_len, args.gen_len + gamma + 1 if spec else args.gen_len,
                        "gen_len + gamma + 1" if spec else "gen_len")
    if spec:
        check_speculation(args, method, target_cfg, draft_cfg, draft_ckpt, target_ckpt)
    baseline_given = bench.read_baseline(args.baseline_json, args, target_cfg) if spec and args.baseline_json else None
    dtype = bench.DTYPES[args.dtype]
    cache_len = args.prefix_len + appended_for(args.gen_len, gamma)
    # The draft's ring holds a prefill chunk, and everything a warm-up run writes before rolling back to the prompt.
    ring_extra = ring_extra_for(args.gen_len, gamma)
    target_local = local_config(target_cfg, target_shard)
    if args.offload:  # on the GPU: the on-chip layers, two layer slots, every offloaded layer's generated tail
        off = target_cfg.n_layers - args.on_chip
        device_slots = cache_len * (args.on_chip + 2) + off * (cache_len - args.prefix_len)
        parts = [(target_local, True, 0), (replace(target_local, n_layers=1), False, device_slots)]
        bench.check_host_fits(OffloadedCache.host_nbytes(target_cfg.n_layers, args.on_chip, args.B,
                                                         target_local.n_kv_heads, args.prefix_len,
                                                         target_cfg.head_dim, bench.DTYPES[args.dtype]),
                              f"--offload of {off} layers at B={args.B} x {args.prefix_len}")
    else:
        parts = [(target_local, True, cache_len)]
    lookup = method == "lookup"  # no draft model, no draft cache
    selection = spec and not lookup and args.draft_policy != "streaming"
    hierarchy = spec and getattr(args, "hierarchy", False)
    bottom_cfg, bottom_ckpt = bottom_source(args) if hierarchy else (None, None)
    # what a selection policy's draft appends after the prompt (a hierarchy's middle runs ahead of the target)
    append = appended_for(args.gen_len, gamma) + (args.gamma_bottom + 2 if hierarchy else 0)
    if spec and not lookup and rank in draft_ranks:
        budget = args.streamingllm_budget
        # A selected cache's ring holds every position generation reaches (`append`), so it needs no slots beyond.
        draft_slots = cache_len if budget == 0 else budget + slots_beyond_budget(args.draft_policy, args.gen_len, gamma)
        if selection and method == "longspec":  # the draft's own full prefill, selected from, then freed
            draft_slots += args.prefix_len
        if getattr(args, "refresh", None):  # each layer's first-query logits, fp32 per query head, as KV slots
            c = local_config(target_cfg, target_shard)
            item = torch.empty((), dtype=dtype).element_size()
            draft_slots += -(-2 * (c.n_heads // c.n_kv_heads) * cache_len // (c.head_dim * item))
        parts.append((local_config(draft_cfg, draft_shard), method == "longspec", draft_slots))
    if bottom_cfg is not None and rank == 0:  # the bottom model runs unsharded, on rank 0 (it broadcasts its tokens)
        parts.append((bottom_cfg, True, args.bottom_budget + ring_extra))
    bench.check_fits(bench.memory_needed(args.B, args.prefill_chunk, dtype, parts), args.device, args.B, args.prefix_len)
    prompts, tokenizer = bench.load_prompts_for(args, target_cfg, target_ckpt)
    copy_bw = bench.copy_bandwidth(args.device)
    torch.manual_seed(args.seed)
    target = bench.load_weights(args, target_cfg, target_ckpt, target_shard)
    if args.device.type == "cuda" and not args.compile and not args.no_fuse:
        fused.fuse()
    backend = resolve_backend(args.attn_backend, args.device)
    all_reduce = tp.enable_fast_all_reduce(target_shard, args.device, dtype)
    if method == "longspec" and draft_shard is not None and draft_shard.group is not target_shard.group:
        all_reduce += "; draft group: " + tp.enable_fast_all_reduce(draft_shard, args.device, dtype)
    if args.offload:
        cache = OffloadedCache(target_cfg.n_layers, args.B, target.n_kv_heads, cache_len, target_cfg.head_dim, dtype,
                               args.device, backend, args.on_chip, args.prefix_len)
    else:
        cache = KVCache(target_cfg.n_layers, args.B, target.n_kv_heads, cache_len, target_cfg.head_dim, dtype,
                        args.device, backend)
    draft = None
    if spec and not lookup:
        draft_model, draft_kv = None, None
        if rank in draft_ranks:
            draft_model = target if method == "selfspec" else bench.load_weights(args, draft_cfg, draft_ckpt, draft_shard)
            if not selection:  # a selection policy's cache is built from the target's prefill, below
                draft_kv = new_draft_cache(draft_cfg, args.B, draft_model.n_kv_heads, args.streamingllm_budget,
                                           args.sinks, ring_extra, cache_len, dtype, args.device, backend,
                                           draft_model.inv_freq if args.reindex else None)
        draft = Draft(draft_model, draft_kv, None if len(draft_ranks) == world else draft_ranks)
        draft_chunk = draft_prefill_chunk(args.prefill_chunk, args.streamingllm_budget)
    elif method == "lookup":
        draft = PromptLookup(prompts.to(args.device), args.ngram_max,
                             None if args.temperature == 0 else target_cfg.vocab_size, args.cuda_graphs or args.compile)
    sampling = Sampling(args.temperature, args.top_p, args.top_k)
    progress = not args.no_progress
    prompts = prompts.to(args.device)
    eos = [] if args.ignore_eos else target_cfg.eos_ids

    with torch.inference_mode():
        random_kv = args.seed if args.skip_prefill else None  # random weights and ids: random KV, same bytes read
        policy = draft_cache.policy_for(args.draft_policy, args.streamingllm_budget, args.chunk_size) if selection else None
        draft_prefill_s = None
        if selection and method == "selfspec":  # the target's prefill keeps its last queries; the draft selects from it
            (logits, queries), prefill_s = bench.timed(lambda: draft_cache.prefill_recording(
                target, cache, prompts, policy.queries, args.prefill_chunk, progress, random_kv), args.device)
            draft.cache, draft_prefill_s = bench.timed(  # the selection's time
                lambda: draft_cache.build(policy, cache, queries, append), args.device)
            del queries
            if args.refresh:
                draft.refresh = draft_cache.Refresh(policy, args.refresh, cache, draft.cache,
                                                    target.layers[0].attention.n_heads, graphed=args.cuda_graphs)
        else:
            if args.skip_prefill:
                cache.fill_random(args.prefix_len, args.seed)
                logits, prefill_s = target(prompts[:, -1:], cache, logits="last")[:, -1], None
            else:
                logits, prefill_s = bench.timed(lambda: prefill(target, cache, prompts, args.prefill_chunk, progress),
                                                args.device)
            if draft is None or draft.model is None:
                pass
            elif selection:  # a standalone draft's own full prefill, selected from, then freed
                draft.cache, draft_prefill_s = bench.timed(lambda: draft_cache.select_by_own_prefill(
                    policy, draft.model, prompts, args.prefill_chunk, append, dtype, backend, progress,
                    None if random_kv is None else random_kv + 1), args.device)
            elif args.skip_prefill:
                draft.fill_random(args.prefix_len, args.seed + 1)
            else:  # its KV is what its (StreamingLLM) attention produces
                _, draft_prefill_s = bench.timed(lambda: draft.prefill(prompts, draft_chunk, progress), args.device)
        if hierarchy:
            draft = Hierarchy(draft, new_bottom(args, bottom_cfg, bottom_ckpt, target_cfg.vocab_size, prompts, rank,
                                                world, ring_extra, dtype, backend, progress),
                              args.gamma_bottom, sampling, cache, args.cuda_graphs, args.compile, args.synthetic_bottom)
        torch.manual_seed(args.seed)
        first = next_token(logits, args.temperature, args.top_p, args.top_k)
        prev = prompts[:, -1]
        baseline = base_decoder = None
        if method == "baseline" or args.baseline:
            base_decoder = Decoder(target, sampling, compile=args.compile, cuda_graphs=args.cuda_graphs,
                                   graph_target=not args.offload)
        if method == "baseline":  # with --baseline, a speculative run times it in turns with each gamma instead
            out, counts, b_s = timed_generation(base_decoder, cache, first, prev, args, eos, progress)
            baseline = generation_metrics(counts, b_s, args, base_decoder.stats, base_decoder.round_seconds)
            baseline.update(bandwidth_metrics(target, target_cfg, args, dtype, b_s, copy_bw))
        sweep = {}  # gamma -> metrics of its timed run
        for g in gammas_to_time(args) if spec else []:
            cache.rollback(torch.full_like(cache.lengths, args.prefix_len))
            policy = AutoGamma(range(1, g + 1), args.alpha_prior) if args.gamma == "auto" else None
            decoder = Decoder(target, sampling, compile=args.compile, draft=draft, gamma=g, graph_target=not args.offload,
                              synthetic_acceptance=args.synthetic_acceptance, cuda_graphs=args.cuda_graphs,
                              policy=policy)
            profile_s = profile_gammas(decoder, cache, first, prev, args, eos) if policy else None
            paired = None
            if base_decoder is not None:  # timed in turns with the baseline: its speedup is against that baseline
                (out, counts, s), (_, bc, bs) = timed_generations([decoder, base_decoder], cache, first, prev, args, eos, progress)
                paired = generation_metrics(bc, bs, args, base_decoder.stats, base_decoder.round_seconds)
                paired.update(bandwidth_metrics(target, target_cfg, args, dtype, bs, copy_bw))
            else:
                out, counts, s = timed_generation(decoder, cache, first, prev, args, eos, progress)
            sweep[g] = generation_metrics(counts, s, args, decoder.stats, decoder.round_seconds)
            sweep[g].update(speculation_metrics(sweep[g], decoder.stats, baseline_given or paired, g))
            sweep[g].update(auto_gamma_profile_s=profile_s, paired_baseline=paired)
            del decoder  # its CUDA graphs' memory goes back before the next gamma captures its own
            bench.release_memory(args.device)
    if not spec:
        metrics = baseline
    else:
        best = max(sweep, key=lambda g: sweep[g].get("measured_speedup") or sweep[g]["decode_tokens_per_s"] or 0)
        metrics = dict(sweep[best], gamma=best)
        paired = metrics.pop("paired_baseline")
        baseline = baseline_given or paired  # what the reported speedup was measured against (as speculation_metrics)
    metrics.update(prefill_s=prefill_s, draft_prefill_s=draft_prefill_s,
                   copy_bandwidth_GBps=copy_bw / 1e9 if copy_bw else None,
                   peak_memory_GiB=(bench.peak_memory(args.device) or 0) / 2**30 or None)
    record = {
        "method": method,
        "args": {k: str(v) if isinstance(v, (Path, torch.device)) else v for k, v in vars(args).items()},
        "model_config": target_cfg.to_dict(),
        "draft_config": draft_cfg.to_dict() if method == "longspec" else None,
        "random_weights": bool(args.random_weights),
        "prefill": "skipped: KV caches filled with random values" if args.skip_prefill else "computed",
        "draft_cache": describe_draft_cache(args, method) if spec else None,
        "hierarchy": describe_hierarchy(args, bottom_cfg) if hierarchy else None,
        "offload": describe_offload(args, target_cfg, cache) if args.offload else None,
        "synthetic_acceptance": getattr(args, "synthetic_acceptance", None),
        "synthetic_draws": SYNTHETIC_DRAWS if getattr(args, "synthetic_acceptance", None) is not None else None,
        "decoding": "greedy" if sampling.greedy else f"sampled (temperature {args.temperature}, top_p {args.top_p}, top_k {args.top_k})",
        "prompt_source": args.prompt_source,
        "attn_backend": backend,
        "environment": bench.environment(args.device),
        "metrics": metrics,
        "baseline_metrics": baseline if spec else None,
    }
    if spec and len(sweep) > 1:
        record["gamma_sweep"] = {str(g): m for g, m in sweep.items()}
    if args.save_tokens:
        record.update(prompt_ids=prompts.tolist(), generated_ids=out.tolist(), generated_counts=counts.tolist())
    if world > 1:  # per-rank memory, and one writer
        peaks = [None] * world
        torch.distributed.all_gather_object(peaks, metrics["peak_memory_GiB"])
        record["tensor_parallel"] = {"world": world, "rank_group": args.rank_group, "draft_ranks": draft_ranks, "all_reduce": all_reduce,
                                     "peak_memory_GiB_per_rank": peaks}
        if rank != 0:
            return record
    print_summary(method, record, target_cfg, args)
    if args.printoutput and tokenizer is not None:
        for b in range(args.B):
            print(f"--- sequence {b}:", tokenizer.decode(out[b, :counts[b]].tolist()))
    bench.write_record(args.output, record)
    return record


def new_bottom(args, config, checkpoint, vocab_size, prompts, rank, world, ring_extra, dtype, backend, progress):
    """--hierarchy's bottom draft: prompt lookup, or a small model over a StreamingLLM cache filled by its own
    prefill (random KV for --skip_prefill), run on rank 0 alone under tensor parallelism (it broadcasts its tokens:
    sampled proposals must be the same on every rank)."""
    if args.draft == "ngram":
        return PromptLookup(prompts, args.ngram_max, None if args.temperature == 0 else vocab_size,
                            args.cuda_graphs or args.compile)
    ranks = None if world == 1 else [0]
    if rank != 0:
        return Draft(None, None, ranks)
    model = bench.load_weights(args, config, checkpoint)
    cache = new_draft_cache(config, args.B, model.n_kv_heads, args.bottom_budget, args.sinks, ring_extra, 0, dtype,
                            args.device, backend)
    bottom = Draft(model, cache, ranks)
    if args.skip_prefill:
        bottom.fill_random(args.prefix_len, args.seed + 2)
    else:
        bottom.prefill(prompts, draft_prefill_chunk(args.prefill_chunk, args.bottom_budget), progress)
    return bottom


def describe_draft_cache(args, method: str) -> str:
    """Where the draft's KV came from, for the record."""
    if method == "lookup":
        return f"none: prompt lookup (suffixes of {args.ngram_max} tokens down to 1)"
    if args.draft_policy == "streaming":
        return "its own prefill through its cache" + (", positions inside the cache (--reindex)" if args.reindex else "")
    source = ("the target's prefill KV, no draft prefill (draft_prefill_s: the selection)" if method == "selfspec" else
              "the draft's own full prefill (draft_prefill_s: that prefill and the selection)")
    again = (f", selected again every {args.refresh} verifications from their attention (--refresh)"
             if getattr(args, "refresh", None) else "")
    return f"{args.draft_policy}: selected per KV head from {source}{again}"


def describe_offload(args, config, cache) -> dict:
    """Where the target's KV was, and what streaming it costs: the prompt KV of every offloaded layer crosses the
    host link once per forward (a verification or a plain step)."""
    host = sum(t.nbytes for t in (*cache.host_k, *cache.host_v))
    h2d = bench.host_to_device_bandwidth(args.device)
    return {"on_chip_layers": args.on_chip, "offloaded_layers": config.n_layers - args.on_chip,
            "host_GiB": host / 2**30, "host_to_device_GBps": h2d / 1e9 if h2d else None,
            "copy_s_per_forward": host / h2d if h2d else None}


def describe_hierarchy(args, bottom_cfg) -> str:
    bottom = (f"prompt lookup (n-grams {args.ngram_max}..1)" if args.draft == "ngram" else
              f"{bottom_cfg.name} over a {args.bottom_budget}-token StreamingLLM cache")
    rate = f", synthetic acceptance {args.synthetic_bottom}" if args.synthetic_bottom is not None else ""
    return (f"bottom: {bottom}, {args.gamma_bottom} token(s) per middle verification{rate}; middle: the target's "
            f"weights over the draft cache; per-level acceptance and time: metrics.speculation.hierarchy")


def generation_metrics(counts, seconds, args, stats, round_seconds) -> dict:
    """Throughput of a timed generation (`seconds`: its median run; `round_seconds`: every run's, in round order).
    Token 1 comes from the prefill logits, so decode produced counts - 1. Over several batches of args.B sequences
    (a sweep's skip_tokens list): counts side by side, seconds, stats and iterations summed over the batches."""
    decoded = int((counts - 1).sum())
    batches = len(counts) // args.B
    per_seq = decoded / args.B
    return {"decode_s": seconds, "decode_tokens_per_s": decoded / seconds if decoded else None,
            "ms_per_token": 1e3 * seconds / per_seq if per_seq else None,
            "generated_tokens": int(counts.sum()), "batch_size": args.B, "batches": batches,
            "iterations": stats.iterations, "decode_steps": stats.iterations,
            "ms_per_step": 1e3 * seconds / stats.iterations if stats.iterations else None,
            "time_split_s": stats.time, "round_s": round_seconds}


def bandwidth_metrics(model, config, args, dtype, seconds, copy_bw) -> dict:
    """Bytes one decode step must read (weights + the KV of every sequence) over its measured time."""
    steps = args.gen_len - 1
    if not steps:
        return {}
    # Per rank under tensor parallelism: its weight slice and its KV heads, against its own GPU's copy bandwidth.
    kv_token = KVCache.nbytes_for(config.n_layers, 1, model.n_kv_heads, 1, config.head_dim, dtype)
    kv_read = kv_token * args.B * sum(args.prefix_len + i + 1 for i in range(steps)) / steps
    step_bytes = model.weight_bytes() + kv_read
    achieved = step_bytes / (seconds / steps)
    out = {"bytes_per_step": step_bytes, "achieved_bandwidth_GBps": achieved / 1e9}
    if copy_bw:
        out["bandwidth_fraction_of_copy"] = achieved / copy_bw
    return out


def speculation_metrics(metrics, stats, baseline, gamma) -> dict:
    """Acceptance, the measured cost ratios and the cost model's prediction Omega / (gamma*T_D/T_T + T_V/T_T)."""
    out = {"speculation": stats.to_dict()}
    alpha, omega = stats.alpha, stats.omega
    if baseline and baseline.get("ms_per_step") and stats.iterations:
        t_t = baseline["ms_per_step"] / 1e3
        t_d = stats.time.get("draft", 0.0) / stats.drafted / t_t if stats.drafted else 0.0
        t_v = stats.time.get("verify", 0.0) / stats.iterations / t_t
        out.update(T_D_over_T_T=t_d, T_V_over_T_T=t_v)
        fixed = stats.drafted == gamma * stats.iterations  # --gamma auto, prompt lookup: it varied, no one formula
        if alpha is not None and fixed:
            out["predicted_speedup"] = cost_model.omega(alpha, gamma) / (gamma * t_d + t_v)
        if metrics.get("decode_tokens_per_s") and baseline.get("decode_tokens_per_s"):
            out["measured_speedup"] = metrics["decode_tokens_per_s"] / baseline["decode_tokens_per_s"]
            # MagicDec's own convention (its benchmark stops at the first sequence to finish): no straggler cost
            first = stats.first_done
            if first and first["seconds"] > 0:
                first_tokens = metrics["batch_size"] * metrics["batches"]  # each batch's prefill token
                out["decode_tokens_per_s_first_done"] = (first["tokens"] - first_tokens) / first["seconds"]
                out["measured_speedup_first_done"] = out["decode_tokens_per_s_first_done"] / baseline["decode_tokens_per_s"]
    out.update(alpha=alpha, omega=omega)
    if metrics.get("iterations"):
        # Tokens per sequence per verification of the whole batch: the loop runs until its slowest sequence is done,
        # so stragglers make this lower than omega, and the speedup follows this one.
        decoded = metrics["generated_tokens"] / metrics["batch_size"] - metrics["batches"]
        out["omega_effective"] = decoded / metrics["iterations"]
        if "T_D_over_T_T" in out and stats.policy is None:  # draft steps per verification: gamma, or fewer (lookup)
            steps = stats.drafted / stats.iterations
            out["predicted_speedup_effective"] = out["omega_effective"] / (steps * out["T_D_over_T_T"] + out["T_V_over_T_T"])
    return out


def print_summary(method, record, config, args) -> None:
    m, base = record["metrics"], record.get("baseline_metrics")
    rows = [("method", method), ("model", config.name + (" (random weights)" if args.random_weights else "")),
            ("device", record["environment"].get("gpu", str(args.device))), ("decoding", record["decoding"]),
            ("B x prefix", f"{args.B} x {args.prefix_len}"), ("prompts", record.get("prompt_source") or "n/a"),
            ("prefill s", m["prefill_s"] or "skipped"),
            ("decode tokens/s", m.get("decode_tokens_per_s") or 0.0), ("ms / token", m.get("ms_per_token") or 0.0)]
    if base:  # what the speedup divides by, beside the speculative numbers
        rows += [("baseline tokens/s", base.get("decode_tokens_per_s") or 0.0),
                 ("baseline ms / token", base.get("ms_per_token") or 0.0)]
    if method == "baseline":
        rows.append(("ms / step", m.get("ms_per_step") or 0.0))
        if m.get("copy_bandwidth_GBps"):
            rows += [("achieved GB/s", m.get("achieved_bandwidth_GBps", 0.0)), ("copy GB/s", m["copy_bandwidth_GBps"]),
                     ("fraction of copy", m.get("bandwidth_fraction_of_copy", 0.0))]
    else:
        levels = (m.get("speculation") or {}).get("hierarchy")
        if levels:
            rows += [("hierarchy", record["hierarchy"]),
                     ("alpha bottom -> middle", levels["alpha_bottom_to_middle"] or "n/a"),
                     ("middle verifications", levels["middle_verifications"]),
                     ("bottom / middle s", f"{levels['bottom_seconds']:.3f} / {levels['middle_seconds']:.3f}")]
        rows += [("gamma", args.gamma if "gamma_sweep" not in record else f"{m['gamma']} (best of {args.gamma})"),
                 ("budget", f"{args.streamingllm_budget} ({getattr(args, 'draft_policy', 'streaming')}"
                            + (", reindexed)" if getattr(args, "reindex", False) else ")")
                  if method != "lookup" else f"none (prompt lookup, n-grams {args.ngram_max}..1)"),
                 ("alpha", m["alpha"] if m["alpha"] is not None else "n/a"), ("Omega", m["omega"] or 0.0)]
        policy = (m.get("speculation") or {}).get("auto_gamma") or {}
        used = {int(g): n for g, n in (policy.get("iterations_per_gamma") or {}).items()}  # str keys once in JSON
        if used.get(0):  # else alpha "n/a" and Omega 1 would stand there with no word why
            off = "switched off" if policy.get("switched_off") else "off at times"
            steps = ", ".join(f"gamma {g}: {n}" for g, n in sorted(used.items()))
            rows.append(("speculation", f"{off} by the --gamma auto policy: measured step times and acceptance said "
                                        f"drafting would not pay; steps per gamma: {steps}"))
        for key in ("omega_effective", "T_D_over_T_T", "T_V_over_T_T", "predicted_speedup", "predicted_speedup_effective",
                    "measured_speedup", "measured_speedup_first_done"):
            if key in m:
                rows.append((key, m[key]))
        if args.synthetic_acceptance is not None:
            rows.append(("synthetic acceptance", args.synthetic_acceptance))
        for g, gm in record.get("gamma_sweep", {}).items():
            rows.append((f"gamma {g}: speedup (first done)", "{:.3f} ({:.3f})".format(
                gm.get("measured_speedup") or 0.0, gm.get("measured_speedup_first_done") or 0.0)))
    if torch.device(args.device).type != "cuda":  # decode is bound by memory reads only on a GPU
        why = "verification is compute-bound on a CPU, so " if method != "baseline" else ""
        rows.append(("note", f"CPU run: {why}timings here are no speed claim; run on a GPU"))
    bench.print_table(rows)


def main(method: str) -> None:
    from magicdec.errors import one_line_errors

    with one_line_errors():
        run(method)
        gloo = torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo"
        if gloo:
            torch.distributed.barrier()  # every rank done with its collectives
    if gloo:
        # Done, and every rank past the barrier: leave without the interpreter's teardown, where a gloo group's
        # threads die (SIGABRT on some ranks), and without destroy_process_group, which still aborted a rank about
        # once in 35 runs on 2 CPU cores ("terminate called without an active exception"). An NCCL group is left to
        # the exit: tearing it down while CUDA graphs that captured its collectives still exist hung every rank on
        # 4 x H200.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
