"""Spec-Bench's table from a sweep's records: one row per drafter (its label), one column per (prefix, B), each cell
the measured speedup and the mean accepted tokens per verification (Ω), greedy / sampled; a bar plot beside it. Where
a drafter ran at several γ, its cell is the best of them (each timed in turns with the same baseline) and names its γ;
a † marks a cell whose γ ran at different code versions (so in different calls: the best is not of the same rounds).

    magicdec report specbench-table results/specbench --output results/specbench/table

The trained heads' rows (EAGLE, Hydra, Medusa) come from the sweep's records of those drafters run with `head` set
(experiments/sweeps/specbench_smollm2_heads.toml) and show only for the heads named here, `--eagle_head DIR`
`--hydra_head DIR` `--medusa_head DIR`: records of a fresh head (no --head: untrained, initialised as training
starts, for speed runs) or of another head are left out, and the output says which families have no rows and why.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from magicdec import files
from magicdec.harness.report import code_of
HEADS = {"eagle": "EAGLE", "hydra": "Hydra", "medusa": "Medusa"}  # drafter -> its name in the notes


def same_dir(ran: str | None, given: Path) -> bool:
    """Whether a record's --head is the directory given: the same path from here, or, for a record written on
    another machine, one ending in the given path (a relative one's parts, an absolute one's last)."""
    if not ran:
        return False
    ran_path = Path(ran)
    if ran_path.resolve() == given.resolve():
        return True
    parts = given.parts if not given.is_absolute() else (given.name,)
    return ran_path.parts[-len(parts):] == parts


def head_records(records: list[dict], given: dict[str, Path | None]) -> tuple[list[dict], list[str]]:
    """The records to tabulate (a head drafter's only where it ran the head given for its family) and a note per
    head family saying why it has no rows, or which records were left out."""
    keep, left_out = [], defaultdict(int)
    for r in records:
        family = r["method"]
        if family in HEADS and not (given.get(family) and same_dir((r.get("config") or {}).get("head"), given[family])):
            left_out[family] += 1
            continue
        keep.append(r)
    notes = []
    for family, name in HEADS.items():
        dropped = left_out[family]
        others = f"; {dropped} record{'s' * (dropped != 1)} of a fresh or another head left out" if dropped else ""
        if given.get(family) is None:
            notes.append(f"{name}: no rows (no --{family}_head DIR given: a fresh head's rows would be an untrained "
                         f"head's){others}")
        elif not any(r["method"] == family for r in keep):
            notes.append(f"{name}: no rows (no record ran --head {given[family]}){others}")
        elif dropped:
            notes.append(f"{name}: the rows of --head {given[family]}{others}")
    return keep, notes


def cells(records: list[dict]) -> dict:
    """label -> (prefix, B, decoding) -> (speedup, Omega, alpha, T_V/T_T, T_D/T_T, γ, how many γ ran, whether they
    ran at different code versions): the best γ's."""
    out, ran, versions = defaultdict(dict), defaultdict(int), defaultdict(set)
    for r in records:
        if r["method"] == "baseline":
            continue
        m = r["metrics"]
        key = (r["prefix_len"], r["B"], r["decoding"].split()[0])
        ran[r["label"], key] += 1
        versions[r["label"], key].add(code_of(r.get("environment") or {}))
        cell = (m["measured_speedup"], m["acceptance_length"], m["alpha"], m["T_V_over_T_T"], m["T_D_over_T_T"],
                r["gamma"])
        if key not in out[r["label"]] or cell[0] > out[r["label"]][key][0]:
            out[r["label"]][key] = cell
    return {label: {key: c + (ran[label, key], len(versions[label, key]) > 1) for key, c in v.items()}
            for label, v in out.items()}


def cell_text(c: tuple | None) -> str:
    if c is None:
        return "—"
    return f"{c[0]:.2f}× ({c[1]:.2f})" + (f" γ{c[5]}" if c[6] > 1 else "") + ("†" if c[7] else "")


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
            row.append(" / ".join(cell_text(c) for c in both))
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
    files.save_figure(path, fig, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="magicdec report specbench-table", description=__doc__.splitlines()[0])
    p.add_argument("records", type=Path, help="a sweep's output folder")
    p.add_argument("--output", type=Path, required=True, help="writes OUTPUT.md and OUTPUT.png")
    for family, name in HEADS.items():
        p.add_argument(f"--{family}_head", type=Path, metavar="DIR",
                       help=f"the trained {name} head whose rows to show (the directory its records ran --head with); "
                            f"without it no {name} rows")
    a = p.parse_args(argv)
    records = [json.loads(f.read_text()) for f in sorted(a.records.glob("*.json"))]
    records, notes = head_records(records, {family: getattr(a, f"{family}_head") for family in HEADS})
    found = cells(records)
    if any(c[7] for v in found.values() for c in v.values()):
        notes.append("†: this cell's γ ran at different code versions (different calls), so its best is not of the "
                     "same rounds")
    text = table(found) + ("\n\n" + "\n".join(f"- {n}" for n in notes) if notes else "")
    files.write_text(a.output.with_suffix(".md"), text + "\n")
    if found:
        plot(found, a.output.with_suffix(".png"))
    print(text)
    return 0


