"""Spec-Bench's table from a sweep's records: one row per drafter (its label), one column per (prefix, B), each cell
the measured speedup and the mean accepted tokens per verification (Ω), greedy / sampled; a bar plot beside it.

    python benchmarks/specbench_table.py results/specbench --output results/specbench/table
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def cells(records: list[dict]) -> dict:
    """label -> (prefix, B, decoding) -> (speedup, Omega, alpha, T_V/T_T, T_D/T_T)."""
    out = defaultdict(dict)
    for r in records:
        if r["method"] == "baseline":
            continue
        m = r["metrics"]
        out[r["label"]][(r["prefix_len"], r["B"], r["decoding"].split()[0])] = (
            m["measured_speedup"], m["acceptance_length"], m["alpha"], m["T_V_over_T_T"], m["T_D_over_T_T"])
    return out


def prefix_name(p: int) -> str:
    return f"{p // 1024}K" if p % 1024 == 0 else f"{p / 1000:g}K"


def table(found: dict) -> str:
    cols = sorted({k[:2] for v in found.values() for k in v}, key=lambda c: (c[1], c[0]))
    head = "| drafter | " + " | ".join(f"{prefix_name(p)} × {b}" for p, b in cols) + " |"
    lines = [head, "|---" * (len(cols) + 1) + "|"]
    for label in sorted(found):
        row = []
        for p, b in cols:
            both = [found[label].get((p, b, d)) for d in ("greedy", "sampled")]
            row.append(" / ".join(f"{c[0]:.2f}× ({c[1]:.2f})" if c else "—" for c in both))
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(found: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = sorted({k[:2] for v in found.values() for k in v}, key=lambda c: (c[1], c[0]))
    labels = sorted(found)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    width = 0.8 / len(labels)
    for ax, decoding in zip(axes, ("greedy", "sampled")):
        for i, label in enumerate(labels):
            ys = [found[label].get((p, b, decoding), (0,))[0] for p, b in cols]
            ax.bar([j + i * width for j in range(len(cols))], ys, width, label=label)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cols))], [f"{prefix_name(p)} × {b}" for p, b in cols])
        ax.set_title(decoding)
    axes[0].set_ylabel("speedup over plain decoding")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("records", type=Path, help="a sweep's output folder")
    p.add_argument("--output", type=Path, required=True, help="writes OUTPUT.md and OUTPUT.png")
    a = p.parse_args(argv)
    found = cells([json.loads(f.read_text()) for f in sorted(a.records.glob("*.json"))])
    a.output.with_suffix(".md").write_text(table(found) + "\n")
    plot(found, a.output.with_suffix(".png"))
    print(table(found))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
