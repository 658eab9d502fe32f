"""Every registered drafter side by side over one shared prefill: what the harness is for, on any machine.

    magicdec compare                      # SmolLM2-135M (real weights) on a book, greedy and sampled, on this machine

The target's cache is prefilled once; each drafter (each of its `variants`) is prepared over it and generates, timed
in turns with the plain baseline. For each: acceptance α, acceptance length (tokens per verification Ω), tokens per
verification of the whole batch, its cost terms measured here (T_D/T_T, T_V/T_T), whether its greedy output equals
plain decoding's, and the cost model's prediction of its speedup for a real serving shape (Llama-3.1-8B at 32K on an
H100, from the committed device profile in magicdec/profiles/) at the α measured here: a prediction, labelled so.
The speed measured on this machine is shown too, and says it is no claim where the machine is a CPU (decode is
memory-bound only on a GPU; on a CPU verification is compute-bound).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from magicdec import cost_model as cm
from magicdec import device as dev
from magicdec import drafters
from magicdec import metrics as met
from magicdec import timing
from magicdec.config import ModelArgs
from magicdec.engine import Engine, first_tokens
from magicdec.errors import MagicDecError
from magicdec.run import write_record
from magicdec.run_config import RunConfig, writable_folder

PROFILES = cm.PROFILES
SAMPLED = {"temperature": 0.6, "top_p": 0.9}


def variants(base: dict, engine: Engine) -> list[dict]:
    """Every variant of every registered drafter: its name, options, config (greedy), the models it loads, or why
    it cannot run here (a check of the config, or of the engine against the models' configs and memory)."""
    out = []
    for name, kind in drafters.registry().items():
        for extra in kind.variants:
            v = {"drafter": name, "options": base | {"drafter": name} | extra, "why": None}
            v["cfg"] = RunConfig.from_options(v["options"], strict=False)
            try:
                v["cfg"].check()
                v["models"] = engine.check(v["cfg"])
            except MagicDecError as e:
                v["why"] = str(e)
            out.append(v)
    return out


def load_profile(path: Path) -> tuple[cm.Device, dict, dict]:
    """(the profiled device, its fixed cost per verification by drafter, what the profile says of itself)."""
    try:
        p = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MagicDecError(f"--profile {path}: cannot read it as a device profile ({e})") from None
    device = cm.Device(p["bandwidth"], p["matmul_flops"], p.get("layer_overhead_s", 0.0),
                       sampling_s_per_logit=p.get("sampling_s_per_logit", 0.0), weight_kernels=cm.weight_kernels_of(p),
                       attention_flops=p.get("attention_flops", 0.0), **cm.head_costs_of(p))
    return device, p.get("verify_overhead_s", {}), p


def prediction(options: dict, summary: dict | None, alpha: float | None, gamma: int, a, profile) -> dict:
    """The cost model's speedup for this drafter config at the prediction shape (random weights: shapes only), on
    the profiled device (load_profile's)."""
    if alpha is None:
        return {"none": "no acceptance measured"}
    device, overheads, _ = profile
    shape = {"random_weights": True, "model_name": a.predict_model, "B": a.predict_B, "prefix_len": a.predict_prefix,
             "gen_len": a.gen_len, "device": "cpu", "dataset": "stdlib"}
    drop = {"model", "tokenizer", "dataset"} | ({"draft"} if options.get("draft") != "ngram" else set())
    cfg = RunConfig.from_options({k: v for k, v in options.items() if k not in drop} | shape, strict=False)
    kind = cfg.drafter
    if kind.models(cfg):
        return {"none": f"no draft model of {a.predict_model}'s shapes named for the prediction"}
    device = cm.Device(**(vars(device) | {"verify_overhead_s": overheads.get(kind.name, 0.0)}))
    p = kind.predict(cfg, ModelArgs.from_name(a.predict_model), {}, device, alpha, gamma, cfg.lookahead, summary)
    return p or {"none": f"the cost model has no model of {kind.name}"}


def compare(a) -> dict:
    base = {"B": a.B, "prefix_len": a.prefix_len, "gen_len": a.gen_len, "gamma": [a.gamma], "dataset": a.dataset,
            "skip_tokens": a.skip_tokens, "progress": False} | ({"model": a.model} if a.model else {}) | \
        ({"device": a.device} if a.device else {})
    target = RunConfig.from_options(base, strict=False)
    target.check()
    if a.output:
        writable_folder(a.output.parent, f"--output {a.output}")
    profile = load_profile(a.profile)
    engine = Engine(target)
    found = variants(base, engine)
    runnable = [v["cfg"] for v in found if v["why"] is None]
    engine.load_target()
    queries = max((cfg.drafter.prefill_queries(cfg) for cfg in runnable), default=0)
    ahead = max(cfg.lookahead for cfg in runnable)
    batch = engine.prefill(target, queries, target.workload.prefix_len + target.workload.gen_len + ahead + 2)
    modes = {"greedy": {}, "sampled": SAMPLED} if not a.greedy_only else {"greedy": {}}
    rows, env = [], dev.environment(engine.device)
    eos = engine.target_config.eos_ids
    for mode, sampling in modes.items():
        base_cfg = RunConfig.from_options(base | sampling, strict=False)
        made = []  # (row, cfg, decoder) of each variant that runs, all prepared over the one prefill
        with torch.inference_mode():
            for v in found:
                row = {"drafter": v["drafter"], "label": v["cfg"].describe(), "decoding": mode, "options": v["options"]}
                if v["why"] is not None:
                    rows.append(row | {"skipped": v["why"]})
                    continue
                cfg = RunConfig.from_options(v["options"] | sampling)
                drafter, draft_s, _ = engine.prepare(cfg, batch, v["models"])
                made.append((row | {"draft_preparation_s": draft_s}, cfg, engine.decoder(cfg, drafter, a.gamma)))
            # every drafter and the baseline in turns from the same prompt: one machine state for all of them
            batch.cache.rollback(torch.full_like(batch.cache.lengths, target.workload.prefix_len))
            first, prev = first_tokens(base_cfg, batch)
            base_decoder = engine.decoder(base_cfg)
            timed = timing.timed_generations([base_decoder] + [d for _, _, d in made], batch.cache, first, prev,
                                             target.workload.gen_len, eos, target.workload.seed,
                                             base_cfg.runtime.graphed, a.repeats)
        (b_out, b_counts, b_s), results = timed[0], timed[1:]
        b = met.generation_metrics(b_counts, b_s, a.B, base_decoder.stats, base_decoder.round_seconds,
                                     base_decoder.round_rates)
        for (row, cfg, decoder), (out, counts, s) in zip(made, results):
            m = met.generation_metrics(counts, s, a.B, decoder.stats, decoder.round_seconds,
                                           decoder.round_rates)
            m |= met.speculation_metrics(m, decoder.stats, b, a.gamma)
            summary = m["speculation"].get("drafter")
            rows.append(row | {"alpha": m["alpha"], "acceptance_length": m["omega"],
                               "tokens_per_verification": m["omega_effective"],
                               "T_D_over_T_T": m.get("T_D_over_T_T"), "T_V_over_T_T": m.get("T_V_over_T_T"),
                               "measured_speedup": m.get("measured_speedup"),
                               "equals_plain_decoding": bool(torch.equal(out, b_out)) if mode == "greedy" else None,
                               "drafter_summary": summary,
                               "predicted": prediction(row["options"] | sampling, summary, m["alpha"], a.gamma, a,
                                                       profile)})
        del made
        dev.release_memory(engine.device)
    record = {"command": "magicdec compare " + " ".join(a.argv), "model_config": engine.target_config.to_dict(),
              "prompt_source": batch.prompt_source, "prefill_s": batch.seconds, "environment": env,
              "prediction": {"model": a.predict_model, "B": a.predict_B, "prefix_len": a.predict_prefix,
                             "profile": profile[2]}, "rows": rows}
    print_table(record, a)
    write_record(a.output, record)
    return record


def f(x, fmt="{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def print_table(record: dict, a) -> None:
    env, prof = record["environment"], record["prediction"]["profile"]
    gpu = "gpu" in env
    here = env.get("gpu") or f"{env.get('cpu', '')} CPU"
    print(f"\n{record['model_config'].get('name')}, {a.B} x {a.prefix_len} tokens ({record['prompt_source']}), "
          f"{a.gen_len} generated, gamma {a.gamma}; prefill {f(record['prefill_s'])} s, shared by every drafter")
    print(f"predicted: the cost model for {a.predict_model} at {a.predict_B} x {a.predict_prefix} on "
          f"{prof.get('device')} (profile measured {prof.get('measured')}) at the alpha measured here: a prediction, "
          "not a measurement")
    speed = f"speedup here ({here}{', no claim' if not gpu else ''})"
    head = ["drafter", "decoding", "alpha", "acceptance length", "tokens / verification", "T_D/T_T here",
            "T_V/T_T here", "predicted speedup", speed, "output = plain greedy"]
    lines = [head]
    for r in record["rows"]:
        if "skipped" in r:
            lines.append([r["label"], r["decoding"], "not run: " + r["skipped"]] + [""] * 7)
            continue
        p = r["predicted"]
        lines.append([r["label"], r["decoding"], f(r["alpha"], "{:.3f}"), f(r["acceptance_length"]),
                      f(r["tokens_per_verification"]), f(r["T_D_over_T_T"]), f(r["T_V_over_T_T"]),
                      f(p.get("speedup")) + "x" if "speedup" in p else "no model",
                      f(r["measured_speedup"]) + "x", {True: "yes", False: "NO", None: "—"}[r["equals_plain_decoding"]]])
    widths = [max(len(str(line[i])) for line in lines if len(line) > i and not str(line[i]).startswith("not run"))
              for i in range(len(head))]
    for line in lines:
        if line[2].startswith("not run"):
            print(f"{line[0]:<{widths[0]}}  {line[1]:<{widths[1]}}  {line[2]}")
        else:
            print("  ".join(f"{str(c):<{w}}" for c, w in zip(line, widths)))
    print("alpha: drafted tokens kept / examined; acceptance length: tokens per verification (kept + the target's "
          "own); T_D/T_T, T_V/T_T: a draft step and a verification over a plain decode step, on this machine")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="magicdec compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="the target's model.pth (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dataset", default=None,
                   help="where the prompt comes from (as magicdec run --dataset; default: the public-domain Gutenberg "
                        "books that ship with the tests, in a clone; else auto: PG-19 when reachable, else Python's "
                        "docs)")
    p.add_argument("--skip_tokens", type=int, default=8000, help="tokens skipped at the start of the book")
    p.add_argument("--B", type=int, default=1, help="batch size")
    p.add_argument("--prefix_len", type=int, default=2048, help="prompt length in tokens")
    p.add_argument("--gen_len", type=int, default=64, help="tokens generated per sequence")
    p.add_argument("--gamma", type=int, default=3, help="tokens drafted per verification")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per drafter and baseline, in turns")
    p.add_argument("--greedy_only", action="store_true", help="skip the sampled (T 0.6, top-p 0.9) runs")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when a GPU is visible)")
    p.add_argument("--profile", type=Path, default=PROFILES / "h100.json",
                   help="the device profile the predictions use (measured bandwidth, matmul rate, fixed costs)")
    p.add_argument("--predict_model", default="meta-llama/Meta-Llama-3.1-8B", help="the shapes predicted for")
    p.add_argument("--predict_prefix", type=int, default=32768, help="the prompt length predicted for")
    p.add_argument("--predict_B", type=int, default=8, help="the batch size predicted for")
    p.add_argument("--output", type=Path, default=None, help="write the side by side as JSON here")
    a = p.parse_args(argv)
    a.argv = argv
    if a.dataset is None:  # a book, offline and the same everywhere: the excerpts a clone carries for its tests
        books = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "gutenberg"
        a.dataset = str(books) if books.is_dir() else "auto"
    compare(a)
    return 0


if __name__ == "__main__":
    from magicdec.errors import one_line_errors

    with one_line_errors():
        raise SystemExit(main())
