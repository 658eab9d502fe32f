"""How well each draft-cache policy agrees with the target, per budget and prefix, on real text: for every batch of
prompts (B book chunks, each followed by the book's own next tokens), the target is prefilled once and every
(policy, budget) draft is built from that prefill (StreamingLLM by its own prefill), then measured three ways:

- teacher-forced: both read the book's next `teacher` tokens; at each position the draft's top-1 against the
  target's (greedy agreement) and sum_x min(p, q) at temperature 0.6, top-p 0.9 (the chance a sampled draft token is
  kept). No generation, so repetition loops cannot flatter the numbers.
- alpha of greedy and of sampled (0.6 / 0.9) self-speculation, gamma `--gamma`, `--gen_len` new tokens; with
  `--refresh N ...` also the same generations with snapkv / retrieval selecting again every N verifications from the
  verification's attention (row key `refresh_N`).

The target, its prefill and every draft are the engine's (magicdec/harness/engine.py): each (policy, budget) is a
self-speculation run config (--drafter selfspec --draft_policy P --draft_budget N) prepared over the shared prefill.
The books: Project Gutenberg text (PG-19 is Project Gutenberg books before 1919), in this workspace the 21 books of
../shared/data/gutenberg; --dataset takes any folder of .txt books (or pg19, stdlib, a .txt or .jsonl file).

    python benchmarks/draft_policies.py --dataset ../shared/data/gutenberg --output results/draft_policies/smollm2.json
    python benchmarks/draft_policies.py --report results/draft_policies/smollm2.json   # table and plot from the JSON
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from magicdec import device as dev
from magicdec.drafters import draft_cache
from magicdec.model import draft_weights, quant_kv
from magicdec import files
from magicdec.harness.engine import Engine
from magicdec.errors import one_line_errors
from magicdec.decoding.generate import decode
from magicdec.harness.run_config import RunConfig
from magicdec.harness.trial import Trial
from magicdec.decoding.sampling import probabilities

MODES = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.6, "top_p": 0.9}}
SAMPLED = MODES["sampled"]
METRICS = {"teacher_top1": "teacher-forced top-1 agreement", "teacher_min_pq": "teacher-forced Σ min(p, q) (T 0.6, top-p 0.9)",
           "alpha_greedy": "α, greedy generation", "alpha_sampled": "α, sampled generation (T 0.6, top-p 0.9)"}
# the engine's flags in its errors, as this script's user types them
RENAMED = {"--draft_budget": "--budgets", "--prefix_len": "--prefix_lens", "--draft_policy": "--policies"}
BOOKS = ("where the books come from: a folder of .txt books, e.g. ../shared/data/gutenberg (Project Gutenberg "
         "books, the kind of text PG-19 holds), or pg19, stdlib, auto, one .txt file, a .jsonl file with a 'text' "
         "field per line")


def drafter(row: dict) -> str:
    """A row's draft: its cache policy, and its weights' format where not bf16 (results/quant's rows ran an earlier,
    removed int8 / fp8 copy)."""
    weights = row.get("draft_weights", "bf16")
    return row["policy"] if weights == "bf16" else f"{row['policy']} {weights}"


class Books:
    """The engine's prompt source here: its own prompts (`text`: Engine.dataset_prompts), each followed by its book's
    own next `teacher` tokens: prompts of prefix_len + teacher tokens are cut at prefix_len, and what follows is kept
    (`book`) for the teacher-forced measure."""

    def __init__(self, teacher: int):
        self.teacher, self.book, self.text = teacher, None, None

    def prompts(self, cfg: RunConfig):
        P = cfg.workload.prefix_len
        text, tokenizer, source = self.text(replace(cfg, workload=replace(cfg.workload, prefix_len=P + self.teacher)))
        self.book = text[:, P:]
        return text[:, :P], tokenizer, source


def teacher_forced(target, cache, draft, prompts, book, logits) -> dict:
    """Top-1 agreement and sum min(p, q) at each of the book's next tokens, summed over the batch's positions.
    `draft`: a model draft (its model over its cache) prepared from the target's prefill of `prompts`."""
    P = prompts.shape[1]
    fed = torch.cat([prompts[:, -1:], book[:, :-1]], 1)  # position P-1 onwards: predicts book[:, 0..T-1]
    backends = cache.backend, draft.cache.backend
    cache.backend = draft.cache.backend = "sdpa"  # a long chunk: the decode kernel's fallback (flex) crashed the H100
    t_logits = torch.cat([logits[:, None], target(book[:, :-1], cache)], 1)
    draft.cache.rollback(torch.full_like(draft.cache.lengths, P - 1))
    d_logits = draft.model(fed, draft.cache)
    cache.rollback(torch.full_like(cache.lengths, P))
    cache.backend, draft.cache.backend = backends
    p, q = (probabilities(x.float(), SAMPLED["temperature"], SAMPLED["top_p"]) for x in (t_logits, d_logits))
    return {"positions": fed.numel(), "teacher_top1": int((t_logits.argmax(-1) == d_logits.argmax(-1)).sum()),
            "teacher_min_pq": float(torch.minimum(p, q).sum(-1).sum())}


def generated_alpha(decoder, cache, prompts, logits, gen_len: int, seed: int) -> dict:
    """Kept / examined drafted tokens of one speculative generation of `decoder` (its drafter, gamma and decoding)
    from the prompts, whose prefill left `cache` and the last position's `logits`."""
    P, s = prompts.shape[1], decoder.sampling
    torch.manual_seed(seed)
    first = logits.argmax(-1) if s.greedy else probabilities(logits.float(), s.temperature, s.top_p).multinomial(1)[:, 0]
    decode(decoder, cache, first, gen_len, prev=prompts[:, -1])
    cache.rollback(torch.full_like(cache.lengths, P))
    return {"kept": sum(decoder.stats.kept), "examined": sum(decoder.stats.reached)}


def base_options(a, P: int, skip: int) -> dict:
    """A self-speculation run at --gamma over prefix P, its prompts `skip` tokens into each book (its caches hold
    --gen_len generated or --teacher teacher-forced tokens, whichever is more), decoded greedy."""
    return {"model": a.model, "model_name": a.model_name, "random_weights": a.random_weights,
            "tokenizer": a.tokenizer, "dataset": a.dataset, "seed": a.seed, "device": a.device, "B": a.B,
            "prefix_len": P, "skip_tokens": skip, "gen_len": max(a.gen_len, a.teacher), "drafter": "selfspec",
            "gamma": [a.gamma], "sinks": a.sinks, "progress": False}


def equal_byte_budgets(P: int, head_dim: int, kvs) -> list[int]:
    """The bf16 draft budgets whose step reads as much KV as each quantized copy of a P-token prompt does."""
    return [P * quant_kv.row_bytes(head_dim, quant_kv.BITS[kv]) // (2 * head_dim) for kv in kvs if kv != "bf16"]


def configs(a, P: int, skip: int, head_dim: int) -> dict:
    """The run config of each (policy, budget, weight format) draft at prefix P (base_options): --budgets, and
    with --equal_bytes the budgets of equal_byte_budgets; each --draft_kv copy is a row (policy "kv int8", budget
    0). `refresh` N and `decoding` (MODES) change them."""
    base = base_options(a, P, skip)
    budgets = a.budgets + (equal_byte_budgets(P, head_dim, a.draft_kv) if a.equal_bytes else [])
    out = {}
    for kv in (kv for kv in a.draft_kv if kv != "bf16"):
        for fmt in a.draft_weights:
            opts = base | {"draft_kv": kv, "draft_weights": fmt} | ({"draft_group": a.draft_group}
                                                                    if fmt == "int4" else {})
            out[f"kv {kv}", 0, fmt] = RunConfig.from_options(opts)
    for policy in a.policies:
        for budget in budgets:
            for fmt in a.draft_weights:
                opts = base | {"draft_policy": policy, "draft_budget": budget, "draft_weights": fmt}
                if policy == "retrieval":
                    opts["chunk_size"] = a.chunk_size
                if fmt == "int4":
                    opts["draft_group"] = a.draft_group
                out[policy, budget, fmt] = RunConfig.from_options(opts)
    return out


def changed(cfg: RunConfig, **options) -> RunConfig:
    return RunConfig.from_options(cfg.options() | options)


def measure(a) -> dict:
    work = [(P, skip) for P in a.prefix_lens for skip in a.skip_tokens]
    # the engine's own config: the target, prompts and device (its drafts are the points')
    books = Books(a.teacher)
    engine = Engine(RunConfig.from_options(base_options(a, *work[0]) | {"drafter": "baseline"}, strict=False),
                    prompts=books.prompts)
    books.text = engine.dataset_prompts
    engine.check_dataset(engine.cfg)  # the books behind its prompts, before any weight loads
    points = {(P, skip): configs(a, P, skip, engine.target_config.head_dim) for P, skip in work}
    for cfg in (c for pts in points.values() for c in pts.values()):  # every draft's options, context and memory
        cfg.check()
        for n in a.refresh if cfg.draft.selected else [None]:
            engine.check(changed(cfg, refresh=n))
    engine.load_target()
    rows, start, source = [], time.time(), None
    meta = {"model": engine.target_config.name, "random_weights": a.random_weights, "B": a.B, "gamma": a.gamma,
            "gen_len": a.gen_len, "teacher": a.teacher, "sinks": a.sinks, "chunk_size": a.chunk_size,
            "window": draft_cache.WINDOW, "environment": dev.environment(engine.device)}
    bar = tqdm(total=sum(len(pts) for pts in points.values()), desc="drafts", disable=a.no_progress)

    def alphas(cfg: RunConfig, draft, batch) -> dict:
        """Greedy and sampled alpha of `draft` (prepared from `cfg`) over this batch: eager, as alpha does not
        depend on speed."""
        return {mode: generated_alpha(engine.decoder(changed(cfg, **decoding), draft, a.gamma), batch.cache,
                                      batch.prompts, batch.logits, a.gen_len, a.seed)
                for mode, decoding in MODES.items()}

    with torch.inference_mode():
        for P, skip in work:
            drafts = points[P, skip]
            queries = max(cfg.drafter.prefill_queries(cfg) for cfg in drafts.values())
            trial = Trial(engine, next(iter(drafts.values())), queries=queries)  # one target prefill for every draft
            batch = trial.batch
            book, source = books.book.to(engine.device), batch.prompt_source
            for (policy, budget, fmt), cfg in drafts.items():
                row = {"prefix_len": P, "skip_tokens": skip, "policy": policy, "budget": budget, "draft_weights": fmt}
                draft = trial.prepare(cfg, {})[0]
                row |= teacher_forced(engine.target, batch.cache, draft, batch.prompts, book, batch.logits)
                row |= alphas(cfg, draft, batch)
                del draft
                for n in a.refresh if cfg.draft.selected else []:
                    refreshed = changed(cfg, refresh=n)
                    draft = trial.prepare(refreshed, {})[0]
                    row[f"refresh_{n}"] = alphas(refreshed, draft, batch)
                    del draft
                rows.append(row | {"seconds": time.time() - start})
                dev.release_memory(engine.device)
                bar.update(1)
                if a.output:  # after every row: a device call's time limit loses only the row in progress
                    a.output.parent.mkdir(parents=True, exist_ok=True)
                    files.write_json(a.output, meta | {"rows": rows, "partial": True, "prompt_source": source})
            del trial, batch, book
            dev.release_memory(engine.device)
    bar.close()
    return meta | {"rows": rows, "prompt_source": source, "seconds": time.time() - start}


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
    rank = {p: i for i, p in enumerate(draft_cache.POLICIES)}  # then the quantized copies ("kv int8")
    policies = sorted({k[1] for k in summary}, key=lambda d: (rank.get(d.split()[0], len(rank)), d))
    fig, axes = plt.subplots(len(METRICS), len(prefixes), figsize=(4 * len(prefixes), 3 * len(METRICS)), squeeze=False)
    for i, metric in enumerate(METRICS):
        for j, P in enumerate(prefixes):
            ax = axes[i][j]
            for policy in policies:
                pts = sorted((b, m[metric]) for (p, pol, b), m in summary.items() if p == P and pol == policy)
                if policy.startswith("kv"):  # the whole context through a quantized copy: no budget
                    ax.axhline(pts[0][1], ls="--", color=f"C{policies.index(policy)}", label=policy + " (whole KV)")
                    continue
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
    files.save_figure(path, fig, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="model.pth made by convert_hf_checkpoint.py (default: SmolLM2-135M-Instruct)")
    p.add_argument("--model_name", default=None, help="with --random_weights: the shapes")
    p.add_argument("--random_weights", action="store_true")
    p.add_argument("--tokenizer", type=Path, default=None, help="default: beside --model")
    p.add_argument("--dataset", default="auto", help=BOOKS)
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
    p.add_argument("--draft_weights", nargs="+", choices=draft_weights.FORMATS, default=["bf16"],
                   help="the draft's weight formats (magicdec/model/draft_weights.py): each is a row of its own")
    p.add_argument("--draft_group", type=int, default=128, help="--draft_weights int4: columns per scale and zero")
    p.add_argument("--draft_kv", nargs="+", choices=quant_kv.FORMATS, default=["bf16"],
                   help="also draft over the target's whole KV through each quantized copy (QuantSpec: "
                        "magicdec/model/quant_kv.py): a row each, policy 'kv int8' / 'kv int4'")
    p.add_argument("--equal_bytes", action="store_true",
                   help="also the budgets whose bf16 draft cache reads as many bytes as each --draft_kv copy")
    p.add_argument("--refresh", type=int, nargs="*", default=[],
                   help="also generate with snapkv / retrieval re-selected every N verifications (--refresh N)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no_progress", action="store_true")
    p.add_argument("--output", type=Path, help="write the JSON here (and its table .md and plot .png beside it)")
    p.add_argument("--report", type=Path, nargs="+",
                   help="only make the table and plot of these JSONs (their rows together), written beside --output")
    a = p.parse_args(argv)
    with one_line_errors(rename=RENAMED):
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
                files.write_json(out, result)
            files.write_text(out.with_suffix(".md"), table(result) + "\n" + (f"\n{refresh_table(result)}\n"
                                                                             if refresh_table(result) else ""))
            plot(result, out.with_suffix(".png"))
            print(f"wrote {out} (.md, .png)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
