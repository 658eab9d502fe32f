"""Held-out acceptance against training tokens, from train-head logs (train_log.json): how far more data moves a
head, one curve per log, the heads trained on the books' text beside those trained on the target's own generations
(magicdec generate-data). One markdown table and one figure.

    magicdec report heads-data results/heads/smollm2_eagle_log.json results/heads/self_distilled/smollm2_eagle_sd_log.json \
        --output results/heads/self_distilled/acceptance_by_training_tokens

x: the tokens the steps have read (step x batch x window, counted alike for both kinds of data); y: the held-out
evaluation's teacher-forced top-1 agreement at the first drafted position: on the held-out books' text (the same
windows for every log of one split) and, where the log has it (train-head --eval_own_tokens), on the target's own
continuation of them, the text a head drafts after. A head that has not yet flattened is limited by its steps, not
its data.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from magicdec import files
from magicdec.errors import MagicDecError


def curve(log: dict) -> dict:
    """What one log says: its family, data (kind and distinct tokens), and (tokens read, first-position
    agreement) at each held-out evaluation."""
    o = log["options"]
    per_step = o["batch_size"] * o["seq_len"]
    data = log.get("data") or {"kind": "corpus"}  # logs from before --data were all trained on the books' text
    distinct = data["generated_tokens"] if data["kind"] == "generated" else log["corpus"]["train_tokens"]
    points = [(e["step"] * per_step, e["acceptance"][0]) for e in log["evals"]]
    own = [(e["step"] * per_step, e["own_text_acceptance"][0]) for e in log["evals"] if "own_text_acceptance" in e]
    return {"family": o["family"], "data": data["kind"], "distinct_tokens": distinct, "points": points, "own": own}


def read(path: Path) -> dict:
    try:
        log = json.loads(path.read_text())
        return curve(log)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, IndexError) as e:
        raise MagicDecError(f"{path}: not a train-head log (train_log.json) with held-out evaluations ({e!r}); give "
                            "the train_log.json a magicdec train-head run wrote") from None


def label(c: dict) -> str:
    return f"{c['family']}, {c['data']} ({c['distinct_tokens'] / 1e6:.1f}M distinct tokens)"


def table(curves: list[dict]) -> str:
    lines = ["| head | data | distinct tokens | steps' tokens read | held-out agreement (first position) at the last "
             "evaluation | at half of it | on the target's own text, last |", "|---|---|---|---|---|---|---|"]
    for c in curves:
        (x, y), half = c["points"][-1], c["points"][len(c["points"]) // 2]
        own = f"{c['own'][-1][1]:.3f}" if c["own"] else "not evaluated"
        lines.append(f"| {c['family']} | {c['data']} | {c['distinct_tokens'] / 1e6:.2f}M | {x / 1e6:.1f}M | {y:.3f} "
                     f"| {half[1]:.3f} at {half[0] / 1e6:.1f}M | {own} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="magicdec report heads-data", description=__doc__.split("\n\n")[0])
    p.add_argument("logs", type=Path, nargs="+", help="train-head's train_log.json files")
    p.add_argument("--output", type=Path, required=True, help="writes OUTPUT.md and OUTPUT.png")
    a = p.parse_args(argv)
    curves = [read(path) for path in a.logs]
    text = table(curves)
    a.output.parent.mkdir(parents=True, exist_ok=True)
    files.write_text(a.output.with_suffix(".md"), text)
    print(text)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("points", "held-out books' text")] + ([("own", "the target's own text after held-out contexts")]
                                                    if any(c["own"] for c in curves) else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels), 5), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        for c in curves:
            if c[key]:
                xs, ys = zip(*c[key])
                ax.plot([x / 1e6 for x in xs], ys, marker="o", markersize=3, label=label(c),
                        linestyle="-" if c["data"] == "generated" else "--")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("tokens read in training (millions: steps x batch x window)")
        ax.set_ylabel("held-out top-1 agreement, first drafted position")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    files.save_figure(a.output.with_suffix(".png"), fig, dpi=120)
    return 0
