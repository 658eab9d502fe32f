"""How well each draft-cache policy agrees with the target, per budget and prefix, on real text: for every batch of
prompts (B book chunks, each followed by the book's own next tokens), the target is prefilled once and every
(policy, budget) draft is built from that prefill (StreamingLLM by its own prefill), then measured three ways:

- teacher-forced: both read the book's next `teacher` tokens; at each position the draft's top-1 against the
  target's (greedy agreement) and sum_x min(p, q) at temperature 0.6, top-p 0.9 (the chance a sampled draft token is
  kept). No generation, so repetition loops cannot flatter the numbers.
- alpha of greedy and of sampled (0.6 / 0.9) self-speculation, gamma `--gamma`, `--gen_len` new tokens; with
  `--refresh N ...` also the same generations with snapkv / retrieval selecting again every N verifications from the
  verification's attention (row key `refresh_N`).

    python benchmarks/draft_policies.py --model /tmp/smol/model.pth --dataset /tmp/books --output results/draft_policies/smollm2.json
    python benchmarks/draft_policies.py --report results/draft_policies/smollm2.json   # table and plot from the JSON

The books: Project Gutenberg's plain-text books (../shared/data/gutenberg here, 21 of them); any folder of .txt works.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from magicdec import benchmark as bench  # noqa: E402
from magicdec import draft_cache, runs  # noqa: E402
from magicdec.errors import MagicDecError, one_line_errors  # noqa: E402
from magicdec.generate import Decoder, Draft, Sampling, decode  # noqa: E402
from magicdec.kv_cache import KVCache  # noqa: E402
from magicdec.sampling import probabilities  # noqa: E402

SAMPLED = Sampling(0.6, 0.9)
METRICS = {"teacher_top1": "teacher-forced top-1 agreement", "teacher_min_pq": "teacher-forced Σ min(p, q) (T 0.6, top-p 0.9)",
           "alpha_greedy": "α, greedy generation", "alpha_sampled": "α, sampled generation (T 0.6, top-p 0.9)"}


def drafter(row: dict) -> str:
    """A row's draft: its cache policy, and the weights' format where an older JSON's row ran a one-byte copy of
    the target's linears (results/quant: --draft_weights int8 / fp8, since removed)."""
    weights = row.get("draft_weights", "bf16")
    return row["policy"] if weights == "bf16" else f"{row['policy']} {weights}"


def new_draft(policy: str, budget: int, target, cache: KVCache, prompts, queries, a) -> Draft:
    """The draft of one (policy, budget) over this batch: StreamingLLM by its own prefill, a selection from the
    target's prefill KV and its last prompt tokens' queries."""
    cfg, B = target.args, prompts.shape[0]
    extra = runs.ring_extra_for(max(a.gen_len, a.teacher), a.gamma)
    if policy == "streaming":
        dc = runs.new_draft_cache(cfg, B, cfg.n_kv_heads, budget, a.sinks, extra, 0, cache.k[0].dtype,
                                  cache.k[0].device, "sdpa")
        draft = Draft(target, dc)
        draft.prefill(prompts, runs.draft_prefill_chunk(a.prefill_chunk, budget))
        dc.backend = cache.backend
        return draft
    sel = draft_cache.policy_for(policy, budget, a.chunk_size)
    return Draft(target, draft_cache.build(sel, cache, queries, runs.appended_for(max(a.gen_len, a.teacher), a.gamma),
                                           extra))


def teacher_forced(target, cache: KVCache, draft: Draft, prompts, book, logits) -> dict:
    """Top-1 agreement and sum min(p, q) at each of the book's next tokens, summed over the batch's positions."""
    P = prompts.shape[1]
    fed = torch.cat([prompts[:, -1:], book[:, :-1]], 1)  # position P-1 onwards: predicts book[:, 0..T-1]
    backends = cache.backend, draft.cache.backend
    cache.backend = draft.cache.backend = "sdpa"  # a long chunk: the decode kernel's fallback (flex) crashed the H100
    t_logits = torch.cat([logits[:, None], target(book[:, :-1], cache, logits="all")], 1)
    draft.cache.rollback(torch.full_like(draft.cache.lengths, P - 1))
    d_logits = draft.model(fed, draft.cache, logits="all")
    cache.rollback(torch.full_like(cache.lengths, P))
    cache.backend, draft.cache.backend = backends
    p, q = (probabilities(x.float(), SAMPLED.temperature, SAMPLED.top_p) for x in (t_logits, d_logits))
    return {"positions": fed.numel(), "teacher_top1": int((t_logits.argmax(-1) == d_logits.argmax(-1)).sum()),
            "teacher_min_pq": float(torch.minimum(p, q).sum(-1).sum())}


def generated_alpha(target, cache: KVCache, draft: Draft, prompts, logits, sampling: Sampling, a) -> dict:
    """Kept / examined drafted tokens of one speculative generation from the prompts."""
    P = prompts.shape[1]
    torch.manual_seed(a.seed)
    first = logits.argmax(-1) if sampling.greedy else probabilities(logits.float(), sampling.temperature,
                                                                      sampling.top_p).multinomial(1)[:, 0]
    decoder = Decoder(target, sampling, draft=draft, gamma=a.gamma)  # eager: alpha does not depend on speed
    decode(decoder, cache, first, a.gen_len, prev=prompts[:, -1])
    cache.rollback(torch.full_like(cache.lengths, P))
    return {"kept": sum(decoder.stats.kept), "examined": sum(decoder.stats.reached)}


def measure(a) -> dict:
    args = SimpleNamespace(model=a.model, model_name=a.model_name, random_weights=a.random_weights,
                           tokenizer=a.tokenizer, dataset=a.dataset, seed=a.seed, device=torch.device(a.device),
                           dtype="bfloat16" if a.device.startswith("cuda") else "float32", B=a.B)
    config, ckpt = bench.model_source(args)
    for P in a.prefix_lens:
        bench.check_context(config, P, max(a.gen_len, a.teacher) + a.gamma + 2, "generated tokens")
        if max(a.budgets) >= P:
            raise MagicDecError(f"--budgets {max(a.budgets)} >= --prefix_lens {P}: every budget must be below every prefix")
    if min(a.budgets) <= draft_cache.WINDOW and set(a.policies) - {"streaming"}:
        raise MagicDecError(f"--budgets must exceed the {draft_cache.WINDOW}-token window of snapkv and retrieval")
    target = bench.load_weights(args, config, ckpt)
    rows, start = [], time.time()
    meta = {"model": config.name, "random_weights": a.random_weights, "B": a.B, "gamma": a.gamma, "gen_len": a.gen_len,
            "teacher": a.teacher, "sinks": a.sinks, "chunk_size": a.chunk_size, "window": draft_cache.WINDOW,
            "environment": bench.environment(args.device)}
    work = [(P, skip) for P in a.prefix_lens for skip in a.skip_tokens]
    a.prefill_chunk = max(16, 16384 // a.B)
    bar = tqdm(total=len(work) * len(a.policies) * len(a.budgets), desc="drafts", disable=a.no_progress)
    with torch.inference_mode():
        for P, skip in work:
            args.prefix_len, args.skip_tokens = P + a.teacher, skip
            text, _ = bench.load_prompts_for(args, config, ckpt)
            prompts, book = text[:, :P].to(args.device), text[:, P:].to(args.device)
            c, dtype = config, bench.DTYPES[args.dtype]
            cache = KVCache(c.n_layers, a.B, c.n_kv_heads, P + max(a.gen_len, a.teacher) + a.gamma + 4, c.head_dim,
                            dtype, args.device, "sdpa")
            logits, queries = draft_cache.prefill_recording(target, cache, prompts, draft_cache.WINDOW, a.prefill_chunk)
            cache.backend = "triton" if cache.k[0].is_cuda else "sdpa"  # decode's kernel; prefill ran on sdpa
            for policy in a.policies:
                for budget in a.budgets:
                    draft = new_draft(policy, budget, target, cache, prompts, queries, a)
                    row = {"prefix_len": P, "skip_tokens": skip, "policy": policy, "budget": budget}
                    row |= teacher_forced(target, cache, draft, prompts, book, logits)
                    for mode, sampling in (("greedy", Sampling()), ("sampled", SAMPLED)):
                        row[mode] = generated_alpha(target, cache, draft, prompts, logits, sampling, a)
                    for n in a.refresh if policy != "streaming" else []:
                        sel = draft_cache.policy_for(policy, budget, a.chunk_size)
                        draft.refresh = draft_cache.Refresh(sel, n, cache, draft.cache, config.n_heads)
                        row[f"refresh_{n}"] = {mode: generated_alpha(target, cache, draft, prompts, logits, sampling, a)
                                               for mode, sampling in (("greedy", Sampling()), ("sampled", SAMPLED))}
                        draft.refresh = None
                    rows.append(row | {"seconds": time.time() - start})
                    del draft
                    bar.update(1)
                    if a.output:  # after every row: a device call's time limit loses only the row in progress
                        a.output.parent.mkdir(parents=True, exist_ok=True)
                        a.output.write_text(json.dumps(meta | {"rows": rows, "partial": True,
                                                               "prompt_source": args.prompt_source}, indent=1))
            del cache, queries
            bench.release_memory(args.device)
    bar.close()
    return meta | {"rows": rows, "prompt_source": args.prompt_source, "seconds": time.time() - start}


def summarize(result: dict) -> dict:
    """{(prefix, policy, budget): {metric: value}} over every batch: token-weighted rates."""
    out = {}
    for r in result["rows"]:
        s = out.setdefault((r["prefix_len"], drafter(r), r["budget"]), {"positions": 0, "teacher_top1": 0,
                           "teacher_min_pq": 0.0, "greedy": [0, 0], "sampled": [0, 0], "batches": 0})
        s["batches"] += 1
        for k in ("positions", "teacher_top1", "teacher_min_pq"):
            s[k] += r[k]
        for mode in ("greedy", "sampled"):
            s[mode][0] += r[mode]["kept"]
            s[mode][1] += r[mode]["examined"]
    return {key: {"teacher_top1": s["teacher_top1"] / s["positions"], "teacher_min_pq": s["teacher_min_pq"] / s["positions"],
                  "alpha_greedy": s["greedy"][0] / max(s["greedy"][1], 1),
                  "alpha_sampled": s["sampled"][0] / max(s["sampled"][1], 1), "batches": s["batches"]}
            for key, s in out.items()}


def refresh_table(result: dict) -> str | None:
    """α with and without --refresh N, per (prefix, policy, budget), over the rows that measured it."""
    cells = {}
    for r in result["rows"]:
        for key in [k for k in r if k.startswith("refresh_")]:
            c = cells.setdefault((r["prefix_len"], drafter(r), r["budget"], int(key.split("_")[1])),
                                 {m: [0, 0, 0, 0] for m in ("greedy", "sampled")})
            for m in ("greedy", "sampled"):
                c[m] = [c[m][0] + r[m]["kept"], c[m][1] + r[m]["examined"], c[m][2] + r[key][m]["kept"],
                        c[m][3] + r[key][m]["examined"]]
    if not cells:
        return None
    lines = ["| prefix | policy | budget | refresh every | α greedy: once → refreshed | α sampled: once → refreshed |",
             "|---|---|---|---|---|---|"]
    for (P, policy, budget, n), c in sorted(cells.items()):
        g, s_ = c["greedy"], c["sampled"]
        lines.append(f"| {P} | {policy} | {budget} | {n} | {g[0] / g[1]:.3f} → {g[2] / g[3]:.3f} | "
                     f"{s_[0] / s_[1]:.3f} → {s_[2] / s_[3]:.3f} |")
    return "\n".join(lines)


def table(result: dict) -> str:
    summary = summarize(result)
    lines = ["| prefix | policy | budget | " + " | ".join(METRICS.values()) + " | batches |", "|---" * 8 + "|"]
    for (P, policy, budget), m in sorted(summary.items()):
        lines.append(f"| {P} | {policy} | {budget} | " + " | ".join(f"{m[k]:.3f}" for k in METRICS) + f" | {m['batches']} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(result)
    prefixes = sorted({k[0] for k in summary})
    policies = sorted({k[1] for k in summary}, key=lambda d: (draft_cache.POLICIES.index(d.split()[0]), d))
    fig, axes = plt.subplots(len(METRICS), len(prefixes), figsize=(4 * len(prefixes), 3 * len(METRICS)), squeeze=False)
    for i, metric in enumerate(METRICS):
        for j, P in enumerate(prefixes):
            ax = axes[i][j]
            for policy in policies:
                pts = sorted((b, m[metric]) for (p, pol, b), m in summary.items() if p == P and pol == policy)
                ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o", label=policy)
            ax.set_xscale("log", base=2)
            ax.set_title(f"prefix {P}", fontsize=9)
            ax.set_xlabel("draft budget (tokens)")
            ax.set_ylabel(METRICS[metric], fontsize=8)
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.suptitle(f"{result['model']}: draft agreement with the target by cache policy (B={result['B']}, "
                 f"γ={result['gamma']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="model.pth (default: SmolLM2-135M-Instruct)")
    p.add_argument("--model_name", default=None, help="with --random_weights: the shapes")
    p.add_argument("--random_weights", action="store_true")
    p.add_argument("--tokenizer", type=Path, default=None, help="default: beside --model")
    p.add_argument("--dataset", default="auto",
                   help="a folder of .txt books, e.g. Project Gutenberg's plain-text books (../shared/data/gutenberg "
                        "here; any folder of .txt files works), or any other of the benchmarks' --dataset values")
    p.add_argument("--prefix_lens", type=int, nargs="+", default=[2048, 4096, 8000])
    p.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512, 1024])
    p.add_argument("--policies", nargs="+", choices=draft_cache.POLICIES, default=list(draft_cache.POLICIES))
    p.add_argument("--B", type=int, default=8, help="sequences per batch")
    p.add_argument("--skip_tokens", type=int, nargs="+", default=[8000, 15000, 22000], help="one batch per value")
    p.add_argument("--gamma", type=int, default=3)
    p.add_argument("--gen_len", type=int, default=64)
    p.add_argument("--teacher", type=int, default=64, help="teacher-forced tokens per sequence")
    p.add_argument("--sinks", type=int, default=16)
    p.add_argument("--chunk_size", type=int, default=8)
    p.add_argument("--refresh", type=int, nargs="*", default=[],
                   help="also generate with snapkv / retrieval re-selected every N verifications (--refresh N)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no_progress", action="store_true")
    p.add_argument("--output", type=Path, help="write the JSON here (and its table .md and plot .png beside it)")
    p.add_argument("--report", type=Path, nargs="+",
                   help="only make the table and plot of these JSONs (their rows together), written beside --output")
    a = p.parse_args(argv)
    with one_line_errors():
        if a.report:
            parts = [json.loads(f.read_text()) for f in a.report]
            point = lambda r: (r["prefix_len"], r["skip_tokens"], drafter(r), r["budget"])  # noqa: E731
            rows = {point(r): r for part in parts for r in part["rows"]}  # a later file's row replaces an earlier's
            result = parts[0] | {"rows": list(rows.values()), "sources": [str(f) for f in a.report], "partial": False}
            out = a.output or a.report[0]
        else:
            result, out = measure(a), a.output
            result["command"] = "python benchmarks/draft_policies.py " + " ".join(argv if argv is not None else sys.argv[1:])
        print(table(result))
        if refresh_table(result):
            print(refresh_table(result))
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            if not a.report or len(a.report) > 1:
                out.write_text(json.dumps(result, indent=1))
            out.with_suffix(".md").write_text(table(result) + "\n" + (f"\n{refresh_table(result)}\n"
                                                                       if refresh_table(result) else ""))
            plot(result, out.with_suffix(".png"))
            print(f"wrote {out} (.md, .png)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
