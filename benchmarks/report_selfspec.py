"""Markdown table and plot of a selfspec_sweep.py summary: the best (budget, gamma) per (prefix, B, decoding), under
both throughput conventions (every sequence reaches gen_len / MagicDec's stop at the first finished sequence).

    python benchmarks/report_selfspec.py results/issue3/smollm2/summary.json --plot results/issue3/smollm2_speedup.png
"""
import argparse
import json
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("summary", type=Path)
p.add_argument("--plot", type=Path, default=None)
args = p.parse_args()
records = json.loads(args.summary.read_text())
base = {(r["prefix_len"], r["B"], r["decoding"]): r["metrics"] for r in records if r["method"] == "baseline"}
best = {}
for r in records:
    if r["method"] != "selfspec":
        continue
    key = (r["prefix_len"], r["B"], r["decoding"])
    for conv, field in (("all", "measured_speedup"), ("first", "measured_speedup_first_done")):
        if (key, conv) not in best or r["metrics"][field] > best[key, conv]["metrics"][field]:
            best[key, conv] = r

print("| prefix | B | decoding | baseline tok/s | best speedup, all reach gen_len (budget, γ) | α | Ω | Ω_eff | T_D/T_T | T_V/T_T "
      "| predicted (Ω) | predicted (Ω_eff) | best speedup, stop at first done (budget, γ) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for key in sorted(base):
    a, f = best.get((key, "all")), best.get((key, "first"))
    if a is None:
        continue
    m = a["metrics"]
    print(f"| {key[0]} | {key[1]} | {key[2]} | {base[key]['decode_tokens_per_s']:.0f} | {m['measured_speedup']:.2f} "
          f"({a['budget']}, {a['gamma']}) | {m['alpha']:.3f} | {m['omega']:.2f} | {m['omega_effective']:.2f} | "
          f"{m['T_D_over_T_T']:.3f} | {m['T_V_over_T_T']:.3f} | {m['predicted_speedup']:.2f} | "
          f"{m['predicted_speedup_effective']:.2f} | {f['metrics']['measured_speedup_first_done']:.2f} "
          f"({f['budget']}, {f['gamma']}) |")

if args.plot:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefixes = sorted({k[0] for k in base})
    fig, axes = plt.subplots(1, len(prefixes), figsize=(5 * len(prefixes), 4), sharey=True, squeeze=False)
    for ax, P in zip(axes[0], prefixes):
        for mode, style in (("greedy", "-"), ("sampled", "--")):
            for conv, marker, label in (("all", "o", "all reach gen_len"), ("first", "s", "stop at first done")):
                pts = sorted((k[1], best[(k, conv)]["metrics"]["measured_speedup" if conv == "all" else
                                                          "measured_speedup_first_done"])
                             for k in base if k[0] == P and k[2] == mode and (k, conv) in best)
                if pts:
                    ax.plot(*zip(*pts), style, marker=marker, label=f"{mode}, {label}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"prefix {P}")
        ax.set_xlabel("batch size")
    axes[0][0].set_ylabel("self-speculation speedup (best budget, γ)")
    axes[0][-1].legend(fontsize=7)
    r0 = records[0]
    fig.suptitle(f"{r0['model']} on {r0['environment'].get('gpu')}, bf16, CUDA graphs")
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=120)
    print(f"\nwrote {args.plot}")
