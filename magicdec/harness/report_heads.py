"""The trained heads' acceptance against the context length, from sweep records (experiments/sweeps/heads_smollm2.toml
run once per decoding): per drafter at one gamma, the acceptance rate α and the tokens per verification Ω at each
prefix, greedy and sampled side by side, and the speedup beside them; one markdown table and one figure.

    magicdec report heads-acceptance results/heads/sweep_smollm2_greedy results/heads/sweep_smollm2_sampled \
        --gamma 2 --output results/heads/acceptance_by_context
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from magicdec import drafters, files
def records(dirs: list[Path], gamma: int) -> dict:
    """{(decoding, label): {prefix: record metrics}} for the drafters at `gamma` (lookup and the self-draft at
    whatever gamma their sweep ran)."""
    out = defaultdict(dict)
    for d in dirs:
        for f in sorted(d.glob("*.json")):
            r = json.loads(f.read_text())
            if "metrics" not in r or r.get("method") in (None, "baseline"):
                continue
            if r["method"] in drafters.owners("head") and r["gamma"] != gamma:  # the trained heads
                continue
            out[r["decoding"], r["label"]][r["prefix_len"]] = r["metrics"] | {"gamma": r["gamma"]}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="magicdec report heads-acceptance", description=__doc__.split("\n\n")[0])
    p.add_argument("sweeps", type=Path, nargs="+")
    p.add_argument("--gamma", type=int, default=2, help="the heads' gamma shown")
    p.add_argument("--output", type=Path, required=True, help="writes OUTPUT.md and OUTPUT.png")
    a = p.parse_args(argv)
    rows = records(a.sweeps, a.gamma)
    prefixes = sorted({q for v in rows.values() for q in v})
    lines = ["| decoding | drafter | γ | " + " | ".join(f"{q} α / Ω / speedup" for q in prefixes) + " |",
             "|---|---|---|" + "---|" * len(prefixes)]
    for (dec, label), by in sorted(rows.items()):
        g = next(iter(by.values()))["gamma"]
        cells = [f"{by[q]['alpha']:.3f} / {by[q]['acceptance_length']:.2f} / {by[q]['measured_speedup']:.3f}×"
                 if q in by else "—" for q in prefixes]
        lines.append(f"| {dec} | {label} | {g} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    a.output.parent.mkdir(parents=True, exist_ok=True)
    files.write_text(a.output.with_suffix(".md"), text)
    print(text)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decodings = sorted({dec for dec, _ in rows})
    fig, axes = plt.subplots(2, len(decodings), figsize=(6 * len(decodings), 8), squeeze=False)
    for col, dec in enumerate(decodings):
        for (d, label), by in sorted(rows.items()):
            if d != dec:
                continue
            xs = sorted(by)
            style = "--" if "window" in label else "-"
            axes[0][col].plot(xs, [by[x]["alpha"] for x in xs], style, marker="o", label=label)
            axes[1][col].plot(xs, [by[x]["measured_speedup"] for x in xs], style, marker="o", label=label)
        axes[0][col].set_title(f"{dec}: acceptance rate α")
        axes[1][col].set_title(f"{dec}: speedup over plain decoding")
        axes[1][col].axhline(1.0, color="grey", lw=0.8)
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prefix (tokens)")
            ax.grid(alpha=0.3)
        axes[0][col].legend(fontsize=7)
    fig.suptitle(f"SmolLM2-135M-Instruct, B = 8, trained heads at γ {a.gamma} (dashed: EAGLE's KV a window of 256)")
    fig.tight_layout()
    files.save_figure(a.output.with_suffix(".png"), fig, dpi=110)
    return 0


