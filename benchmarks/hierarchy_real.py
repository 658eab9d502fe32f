"""TriForce's hierarchy on real weights (issue #24): SmolLM2-135M at 8K, prompt lookup at the bottom, the target's
weights over TriForce's retrieval cache in the middle, against the same self-draft alone and against StreamingLLM's,
greedy and sampled (T 0.6, top-p 0.9), all on the same batch of book prompts. Each run times its baseline in turns
(tests/selfspec_benchmark.py --baseline) and reports the best of its gammas; the record keeps every gamma.

Per row: α of the target keeping the middle's tokens, α of the middle keeping the bottom's (the hierarchy), tokens
per verification, decode tokens/s and the speedup over the baseline timed beside it.

    python benchmarks/hierarchy_real.py --model /tmp/smol/model.pth --dataset /tmp/books \
        --output results/triforce/hierarchy_smollm2.json

The books: Project Gutenberg's plain-text books (../shared/data/gutenberg here); any folder of .txt works.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from magicdec import benchmark as bench  # noqa: E402
from magicdec import runs  # noqa: E402

MODES = {"greedy": ["--temperature", "0"], "sampled": ["--temperature", "0.6", "--top_p", "0.9"]}


def drafters(a) -> dict[str, list[str]]:
    """Each drafter's flags: the self-drafts alone, then the hierarchy at each bottom gamma."""
    own = ["--draft_budget", str(a.budget), "--gamma", *map(str, a.gammas)]
    out = {"streaming": own + ["--draft_policy", "streaming"],
           "retrieval": own + ["--draft_policy", "retrieval", "--chunk_size", str(a.chunk_size)]}
    for gb in a.gamma_bottom:
        out[f"hierarchy (lookup {gb})"] = out["retrieval"] + ["--hierarchy", "--draft", "ngram", "--gamma_bottom",
                                                              str(gb), "--ngram_max", str(a.ngram_max)]
    return out


def summary(record: dict) -> dict:
    m = record["metrics"]
    keys = ("gamma", "alpha", "omega", "omega_effective", "T_D_over_T_T", "T_V_over_T_T", "measured_speedup",
            "decode_tokens_per_s")
    out = {k: m.get(k) for k in keys} | {"baseline_tokens_per_s": record["baseline_metrics"]["decode_tokens_per_s"]}
    out["hierarchy"] = (m.get("speculation") or {}).get("hierarchy")
    out["per_gamma"] = {g: {k: gm.get(k) for k in ("alpha", "measured_speedup", "decode_tokens_per_s")}
                        for g, gm in (record.get("gamma_sweep") or {}).items()}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model.pth (SmolLM2-135M converted from its GGUF)")
    p.add_argument("--dataset", required=True,
                   help="a folder of .txt books, e.g. Project Gutenberg's plain-text books (../shared/data/gutenberg "
                        "here); any folder of .txt files works")
    p.add_argument("--prefix_len", type=int, default=7936, help="SmolLM2's context is 8192")
    p.add_argument("--B", type=int, nargs="+", default=[8])
    p.add_argument("--gen_len", type=int, default=128)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--chunk_size", type=int, default=8)
    p.add_argument("--gammas", type=int, nargs="+", default=[2, 4, 6])
    p.add_argument("--gamma_bottom", type=int, nargs="+", default=[2, 4])
    p.add_argument("--ngram_max", type=int, default=3)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--output", type=Path, required=True)
    a = p.parse_args(argv)
    graphs = ["--cuda_graphs"] if a.device == "cuda" else []
    out = {"model": a.model, "random_weights": False, "prefix_len": a.prefix_len, "rows": []}
    a.output.parent.mkdir(parents=True, exist_ok=True)
    print("| B | decoding | drafter | gamma | alpha (target) | alpha (middle) | tokens/verif. | tokens/s | baseline | "
          "speedup |\n|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for B in a.B:
        for mode, flags in MODES.items():
            if mode not in a.modes:
                continue
            for name, extra in drafters(a).items():
                argv = ["--model", a.model, "--dataset", a.dataset, "--prefix_len", str(a.prefix_len), "--B", str(B),
                        "--gen_len", str(a.gen_len), "--repeats", str(a.repeats), "--device", a.device, "--baseline",
                        "--no_progress", "--seed", "0", *graphs, *flags, *extra]
                rec = runs.run("selfspec", argv)
                bench.release_memory(torch.device(a.device))
                row = {"B": B, "mode": mode, "drafter": name, "command": argv} | summary(rec)
                out["rows"].append(row)
                out["environment"] = rec["environment"]
                a.output.write_text(json.dumps(out, indent=1))
                h = row["hierarchy"] or {}
                mid = h.get("alpha_bottom_to_middle")
                print(f"| {B} | {mode} | {name} | {row['gamma']} | {row['alpha']:.3f} | "
                      f"{'-' if mid is None else f'{mid:.3f}'} | {row['omega_effective']:.2f} | "
                      f"{row['decode_tokens_per_s']:.0f} | {row['baseline_tokens_per_s']:.0f} | "
                      f"{row['measured_speedup']:.3f} |", flush=True)
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
