"""Sweep records (magicdec/harness/sweep.py) to markdown tables and PNG figures like the paper's, one markdown file per sweep,
and, when asked, its section of a results page (results/RESULTS.md). Every number comes from a record.

Per sweep: every drafter at each (prefix, B, decoding) at its best γ (speedups, acceptance, step-time ratios, draft
preparation, the cost model's prediction or why it has none); the best fixed setting against the planner (`auto`),
checked at every point: auto >= 0.97 x the baseline and >= 0.95 x the best fixed setting (the baseline counted as one,
speedup 1), both with every sequence reaching gen_len; the figures; the commands that made the records.

    magicdec report SWEEP_DIR --out OUT                                 # OUT/NAME.md and OUT/NAME_*.png only
    magicdec report SWEEP_DIR --out OUT --results_md results/RESULTS.md # and NAME's section of the results page
    magicdec report specbench-table | tp-tables | heads-acceptance | heads-data | atlas ...  # magicdec/harness/report_*.py

NAME is the sweep folder's name. The results page is updated in place: each sweep's section sits between
`<!-- sweep NAME -->` and `<!-- /sweep NAME -->` (an --include file between `<!-- include PATH -->` markers); a run
replaces or adds the sections of the sweeps it is given and keeps every other, and the table at the top lists every
section on the page. A page made before these markers is refused rather than cut down to the sweeps given: rebuild it
once with --rebuild and every sweep it should show; so is a page with a marker lost or doubled. Two reports into one
page take turns (it is locked while it is read, updated and written). OUT/NAME.md begins with a line saying this
command made it; a file there without that line (a page written by hand, the results page) is never replaced. A
record that cannot be read (not JSON, not UTF-8, not a JSON object) is skipped with a warning naming its file; a folder
that is missing or holds no records is an error.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shlex
import sys
import textwrap
from collections import Counter
from pathlib import Path

import matplotlib

from magicdec import files
from magicdec.errors import MagicDecError, one_line_errors

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BASE_TOL, BEST_TOL, MODEL_TOL = 0.97, 0.95, 0.10
NOT_FIXED = ("baseline", "auto")  # every other method is a drafter at a fixed setting
NEEDED = ("method", "prefix_len", "B", "decoding")  # what a timed point's record must name to be placed in a table
PNG = {"speedup": "speedup vs batch size", "drafters": "speedup vs batch size, every drafter",
       "predicted": "measured vs predicted speedup", "ratios": "T_D/T_T and T_V/T_T vs context",
       "alpha": "acceptance rate vs draft budget"}
MARKERS = "os^vD<>phX*"
CONVENTIONS = """\
How to read these tables:

- **speedup, all reach**: decode tokens/s over the baseline's (same model, batch, prefix, decoding mode, device),
  every sequence generating gen_len tokens, so a batch waits for its slowest sequence.
- **speedup, first done**: MagicDec's convention, the run stops when the first sequence of the batch has gen_len tokens.
- **cost model**: `magicdec/analysis/cost_model.py`, T_T, T_D, T_V from the bytes and FLOPs of each step over this device's
  measured copy bandwidth and matmul rate (plus a measured fixed cost per layer, and, in records made after
  2026-11-23, a measured fixed cost T_O per verification), with the measured α. Its Ω form
  Ω/(γ·T_D/T_T + T_V/T_T + T_O/T_T) is compared with *first done* (no stragglers); its Ω_eff form (measured tokens per
  verification of the whole batch, stragglers included) with *all reach*. error = predicted / measured − 1.
  *no model*: the record says why the cost model has no prediction for that drafter or setting.
- **every drafter**: at each point, one row per drafter configuration (its label: the drafter and what distinguishes
  its config, such as its draft budget) at its best γ by *all reach* speedup; *draft preparation*: seconds spent
  readying the draft before decoding (its prefill, or the selection of its cache).
- **best fixed**: the (drafter configuration, γ) with the highest *all reach* speedup at that point, over every drafter
  (the *first done* column names another setting where that one is best under its convention).
- **auto**: the planner picks the budget from the cost model and the acceptance measured so far, then γ per
  verification from step times measured on the batch (γ 0 = speculation off); `γ:n` = n verifications with that γ.
  Checks: auto ≥ 0.97 × baseline, auto ≥ 0.95 × best fixed (the baseline counted as a fixed setting, speedup 1).
- **random weights**: real shapes, random weights and prompt ids; acceptance is synthetic (each drafted token kept
  with probability α), so those sweeps measure the systems side, not a draft's quality.
"""


def warn(f: Path, why: str) -> None:
    """One line on stderr: a bad file costs its point, not the report."""
    print(f"warning: {f}: skipped, {why}", file=sys.stderr)


def one_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def read_record(f: Path) -> dict | None:
    """One sweep record, or None: a file that is not a readable JSON object, or a point record the tables cannot place,
    with a warning; another tool's JSON object (no `point`) quietly, as sweep.py itself treats it."""
    try:
        r = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return warn(f, f"not a readable JSON record ({one_line(e)})")
    if not isinstance(r, dict):
        return warn(f, f"a JSON {type(r).__name__}, not a record (a JSON object)")
    if "point" not in r:
        return None
    if "skipped" in r:
        return r
    missing = [k for k in NEEDED if k not in r] + ([] if isinstance(r.get("metrics"), dict) else ["metrics"])
    if missing:
        return warn(f, f"a point record without {', '.join(missing)}")
    return r


def load(d: Path):
    """(timed points, skipped points) of one sweep folder; a folder that is not there is the user's error."""
    d = Path(d)
    if not d.is_dir():
        raise MagicDecError(f"{d}: {'not a folder' if d.exists() else 'no such folder'}; give a sweep's --output_dir "
                            "(the folder of its JSON records)")
    recs = [r for r in map(read_record, sorted(d.glob("*.json"))) if r]
    return [r for r in recs if "skipped" not in r], [r for r in recs if "skipped" in r]


def rel(pred, meas):
    return pred / meas - 1 if pred is not None and meas else None


def is_fixed(r) -> bool:
    return r["method"] not in NOT_FIXED


def label(r) -> str:
    """The drafter and what distinguishes its config: the record's own label; for records made before labels, the
    method, its draft policy where the draft selects its cache, and its budget, as the tables named them then."""
    if r.get("label"):
        return r["label"]
    return r["method"] if not is_fixed(r) else f"{drafter(r)} b{r.get('budget')}"


def drafter(r) -> str:
    """The label less its draft budget: what the α-vs-budget figure draws one line of (records before labels: the
    method, with its draft policy when the draft selects its cache)."""
    b = r.get("budget")
    if r.get("label"):
        return r["label"] if b is None else re.sub(rf" b{b}(?= |$)", "", r["label"], count=1)
    policy = r.get("draft_policy") or "streaming"
    return r["method"] if policy == "streaming" else f"{r['method']} {policy}"


def setting(r) -> str:
    return f"{label(r)} γ{r.get('gamma')}"


def speedup(r) -> float:
    s = r["metrics"].get("measured_speedup")
    return float("-inf") if s is None else s


def gammas_used(auto) -> str:
    planner = auto.get("planner") or {}
    width, nodes = planner.get("tree_width"), planner.get("tree_nodes")
    if width or nodes:  # a planned tree runs at the planned gamma
        return f"b{auto.get('budget')}, tree {f'w{width}' if width else f'n{nodes}'} γ{auto.get('gamma')}"
    ag = ((auto["metrics"].get("speculation") or {}).get("auto_gamma")) or {}
    used = ag.get("iterations_per_gamma", {})
    off = " (off)" if ag.get("switched_off") else ""
    return f"b{auto.get('budget')}, γ " + " ".join(f"{g}:{n}" for g, n in used.items()) + off


def point_key(r) -> tuple:
    return r["prefix_len"], r["B"], r["decoding"]


def rows(recs) -> list[dict]:
    """One row per (prefix, B, decoding): baseline, best fixed settings, cost-model errors, auto and its checks."""
    out = []
    for key in sorted({point_key(r) for r in recs}):
        at = [r for r in recs if point_key(r) == key]
        base = next((r for r in at if r["method"] == "baseline"), None)
        fixed = [r for r in at if is_fixed(r) and r["metrics"].get("measured_speedup") is not None]
        best = max(fixed, key=lambda r: r["metrics"]["measured_speedup"], default=None)
        first = max(fixed, key=lambda r: r["metrics"].get("measured_speedup_first_done") or 0, default=None)
        auto = next((r for r in at if r["method"] == "auto"), None)
        row = dict(P=key[0], B=key[1], mode=key[2], base=base and base["metrics"].get("decode_tokens_per_s"),
                   best=best, first=first, auto=auto)
        if best:
            m, cm = best["metrics"], best["metrics"].get("cost_model") or {}
            row |= dict(s_all=m["measured_speedup"], s_first=m.get("measured_speedup_first_done"), alpha=m.get("alpha"),
                        pred_eff=cm.get("speedup_effective"), err_eff=rel(cm.get("speedup_effective"), m["measured_speedup"]),
                        pred=cm.get("speedup"), err=rel(cm.get("speedup"), m.get("measured_speedup_first_done")))
        if auto and auto["metrics"].get("measured_speedup") is not None:
            s = row["s_auto"] = auto["metrics"]["measured_speedup"]
            row["ok_base"] = s >= BASE_TOL
            # a sweep without fixed settings at this point (auto and baseline only) has nothing to compare with
            row["ok_best"] = s >= BEST_TOL * max(1.0, row["s_all"]) if best else None
        out.append(row)
    return out


def f2(x, fmt="{:.2f}"):
    return "—" if x is None else fmt.format(x)


def pct(x):
    return f2(x, "{:+.1%}")


def table(rs) -> str:
    ok = lambda x: "—" if x is None else ("PASS" if x else "**FAIL**")  # noqa: E731
    lines = ["| prefix | B | decoding | baseline tok/s | best fixed | speedup, all reach | speedup, first done | α "
             "| cost model Ω_eff (error vs all reach) | cost model Ω (error vs first done) | auto speedup | auto: budget, γ use "
             f"| auto ≥ {BASE_TOL} × baseline | auto ≥ {BEST_TOL} × best fixed |", "|" + "---|" * 14]
    for r in rs:
        b, f, a = r["best"], r["first"], r["auto"]
        first = f2(r.get("s_first"))
        if f and b and f is not b:
            first += f" (best {f['metrics']['measured_speedup_first_done']:.2f}: {setting(f)})"
        lines.append(f"| {r['P']} | {r['B']} | {r['mode']} | {f2(r['base'], '{:.1f}')} | {setting(b) if b else '—'} "
                     f"| {f2(r.get('s_all'))} | {first} | {f2(r.get('alpha'), '{:.3f}')} "
                     f"| {f2(r.get('pred_eff'))} ({pct(r.get('err_eff'))}) | {f2(r.get('pred'))} ({pct(r.get('err'))}) "
                     f"| {f2(r.get('s_auto'))} | {gammas_used(a) if a else '—'} | {ok(r.get('ok_base'))} | {ok(r.get('ok_best'))} |")
    return "\n".join(lines)


def best_per_drafter(recs) -> list[dict]:
    """Per (prefix, B, decoding), each drafter label's record at its best γ by all-reach speedup (auto: its own
    record), fastest first: which drafter wins where, each at its own best, not only the overall best."""
    out = []
    for key in sorted({point_key(r) for r in recs}):
        best = {}
        for r in recs:
            if point_key(r) == key and r["method"] != "baseline" and (
                    label(r) not in best or speedup(r) > speedup(best[label(r)])):
                best[label(r)] = r
        out += sorted(best.values(), key=lambda r: (-speedup(r), label(r)))
    return out


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def model_cells(m) -> tuple[str, str]:
    """The cost model's Ω_eff and Ω predictions with their errors vs all reach and first done, or why it has none."""
    cm = m.get("cost_model") or {}
    if "none" in cm:
        return cell(f"no model: {cm['none']}"), "—"
    return tuple("—" if p is None else f"{f2(p)} ({pct(rel(p, meas))})" for p, meas in
                 ((cm.get("speedup_effective"), m.get("measured_speedup")),
                  (cm.get("speedup"), m.get("measured_speedup_first_done"))))


def drafters_table(recs) -> str | None:
    """Every drafter (and auto) at each point, at its best γ: speedups, acceptance, step-time ratios, draft
    preparation and the cost model's view, so a drafter that never wins overall still shows how close it came."""
    best = best_per_drafter(recs)
    if not best:
        return None
    header = ("| prefix | B | decoding | drafter | γ (best, all reach) | speedup, all reach | speedup, first done | α "
              "| acceptance length | T_D/T_T | T_V/T_T | draft preparation (s) | cost model Ω_eff (error vs all reach) "
              "| cost model Ω (error vs first done) |")
    lines = [header, "|" + "---|" * 14]
    for r in best:
        m = r["metrics"]
        gamma = gammas_used(r) if r["method"] == "auto" else f2(r.get("gamma"), "{}")
        length = m.get("acceptance_length", m.get("omega"))  # records before acceptance_length: Ω, the same count
        lines.append(f"| {r['prefix_len']} | {r['B']} | {r['decoding']} | {cell(label(r))} | {gamma} "
                     f"| {f2(m.get('measured_speedup'))} | {f2(m.get('measured_speedup_first_done'))} "
                     f"| {f2(m.get('alpha'), '{:.3f}')} | {f2(length)} | {f2(m.get('T_D_over_T_T'), '{:.3f}')} "
                     f"| {f2(m.get('T_V_over_T_T'), '{:.3f}')} | {f2(m.get('draft_prefill_s'), '{:.3g}')} "
                     f"| {' | '.join(model_cells(m))} |")
    return "\n".join(lines)


def batch_table(recs) -> str | None:
    """Where points were timed on several batches of prompts (a sweep's skip_tokens list): per batch, its best fixed
    setting and auto, each batch's speedup against the baseline runs paired with it. The main table compares totals
    over all batches; this shows how much of one batch's ranking is that batch's luck."""
    lines = []
    for key in sorted({point_key(r) for r in recs if len(r.get("batches") or []) > 1}):
        at = [r for r in recs if point_key(r) == key and r.get("batches")]
        fixed = [r for r in at if is_fixed(r)]
        auto = next((r for r in at if r["method"] == "auto"), None)
        if not fixed:  # auto and baseline only: no setting to rank the batches by
            continue
        if not lines:
            lines = ["| prefix | B | decoding | prompts from | best fixed on this batch | its speedup | auto speedup "
                     "| auto γ use | auto / best |", "|" + "---|" * 9]
        for i, skip in enumerate(b["skip_tokens"] for b in at[0]["batches"]):
            best = max(fixed, key=lambda r: r["batches"][i]["measured_speedup"])
            s_best = best["batches"][i]["measured_speedup"]
            a = auto and auto["batches"][i]
            use = a and " ".join(f"{g}:{n}" for g, n in (a.get("gamma_use") or {}).items())
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {skip} | {setting(best)} | {f2(s_best)} "
                         f"| {f2(a and a['measured_speedup'])} | {use or '—'} "
                         f"| {f2(a and a['measured_speedup'] / max(1.0, s_best), '{:.3f}')} |")
    return "\n".join(lines) or None


def comparisons(m) -> list[tuple[str, str, float | None, float | None]]:
    """(label, marker, predicted, measured) of one fixed speculative point."""
    cm = m.get("cost_model") or {}
    return [("cost model Ω_eff vs all reach", "o", cm.get("speedup_effective"), m.get("measured_speedup")),
            ("cost model Ω vs first done", "s", cm.get("speedup"), m.get("measured_speedup_first_done")),
            ("measured T_D/T_T, T_V/T_T, Ω_eff vs all reach", "x", m.get("predicted_speedup_effective"), m.get("measured_speedup"))]


def fixed_metrics(recs):
    return [r["metrics"] for r in recs if is_fixed(r) and r["metrics"].get("measured_speedup")]


def model_counts(recs) -> list[tuple[str, int, int]]:
    """(comparison, fixed speculative points within MODEL_TOL, points with both numbers) per comparison."""
    out = []
    for i, name in enumerate(c[0] for c in comparisons({})):
        errs = [e for e in (rel(*comparisons(m)[i][2:]) for m in fixed_metrics(recs)) if e is not None]
        out.append((name, sum(abs(e) <= MODEL_TOL for e in errs), len(errs)))
    return out


def planner_counts(rs) -> dict[str, tuple[int, int]]:
    """(passed, checked) for each planner check; `best` and `both` only where the point has fixed settings."""
    checked = [r for r in rs if "ok_base" in r]
    both = [r for r in checked if r["ok_best"] is not None]
    return {"base": (sum(r["ok_base"] for r in checked), len(checked)),
            "best": (sum(r["ok_best"] for r in both), len(both)),
            "both": (sum(r["ok_base"] and r["ok_best"] for r in both), len(both))}


def summary(recs, rs) -> str:
    parts = [f"{name}: {n}/{total}" for name, n, total in model_counts(recs)]
    c = {k: f"{n}/{total}" for k, (n, total) in planner_counts(rs).items()}
    return (f"Speculative points within {MODEL_TOL:.0%} of measurement: " + "; ".join(parts) + ". Planner: "
            f"{c['both']} points pass both checks (≥ {BASE_TOL} × baseline: {c['base']}, "
            f"≥ {BEST_TOL} × best fixed: {c['best']}).")


def point(r) -> str:
    return f"{r['prefix_len']} × {r['B']} {r['decoding']}, {setting(r)}"


def overview_row(link: str, recs, skipped) -> str:
    """One sweep in one line: model, weights, device, points, its best fixed speedups (each with its point), how many
    fixed points the cost model predicts within MODEL_TOL and the planner's checks, rounded as the sweep's own table."""
    if not recs:
        return f"| {link} | no timed points | | | 0 | — | — | — | — | — |"
    model, devs, note, _ = about(recs, skipped)
    rs, fixed = rows(recs), [r for r in recs if is_fixed(r) and r["metrics"].get("measured_speedup") is not None]
    best = max(fixed, key=lambda r: r["metrics"]["measured_speedup"], default=None)
    first = max(fixed, key=lambda r: r["metrics"].get("measured_speedup_first_done") or 0, default=None)
    s_all = best and best["metrics"]["measured_speedup"]
    s_first = first and first["metrics"].get("measured_speedup_first_done")
    # the cost model's own predictions (Ω_eff vs all reach, Ω vs first done), not the measured-ratio check
    model_fit = "; ".join(f"{name.replace('cost model ', '')}: {n}/{total}" for name, n, total in model_counts(recs)[:2])
    pc = planner_counts(rs)
    checks = [f"{pc[k][0]}/{pc[k][1]}" if pc[k][1] else "—" for k in ("base", "best")]  # "—": nothing to check
    batches = max(len(r.get("batches") or []) for r in recs)
    cells = [link, model, note, ", ".join(devs), f"{len(rs)}" + (f", each timed on {batches} batches" if batches > 1 else ""),
             f"{f2(s_all)} ({point(best)})" if s_all else "— (no fixed settings)",
             f"{f2(s_first)} ({point(first)})" if s_first else "—",
             model_fit if fixed else "—", *checks]
    return "| " + " | ".join(cells) + " |"


OVERVIEW_HEAD = ("| sweep | model | weights | device | points (prefix × B × decoding) "
                 "| best fixed speedup, all reach (point) | best fixed speedup, first done (point) "
                 f"| cost model within {MODEL_TOL:.0%} (fixed points) | auto ≥ {BASE_TOL} × baseline "
                 f"| auto ≥ {BEST_TOL} × best fixed |\n" + "|" + "---|" * 10)


def panels(nrows, ncols, title, w=4.2, h=3.4):
    fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows + 0.6), squeeze=False)
    fig.suptitle(textwrap.fill(title, int(11 * w * ncols)), fontsize=9)
    return fig, axes


def line(ax, pts, *style, **kw):
    pts = sorted((x, y) for x, y in pts if y is not None)
    if pts:
        ax.plot(*zip(*pts), *style, **kw)


def legend(axes, order: list[str]) -> None:
    """One legend on the top-right panel naming every line of every panel (a panel may lack some), in `order`."""
    seen = {}
    for ax in axes.flat:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(name, handle)
    names = [n for n in order if n in seen]
    if names:
        axes[0][-1].legend([seen[n] for n in names], names, fontsize=7)


def natural(name: str) -> list:
    """A sort key that puts b256 before b1024."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    try:
        files.save_figure(path, fig, "--out", dpi=110)
    finally:
        plt.close(fig)
    return path


def fig_speedup(rs, path, title):
    """(a) speedup vs batch size, a panel per prefix (columns) and decoding mode (rows)."""
    prefixes, modes = sorted({r["P"] for r in rs}), sorted({r["mode"] for r in rs})
    if len({r["B"] for r in rs if r["best"]}) < 2:
        return None
    fig, axes = panels(len(modes), len(prefixes), title)
    for i, mode in enumerate(modes):
        for j, P in enumerate(prefixes):
            ax, at = axes[i][j], [r for r in rs if r["P"] == P and r["mode"] == mode and r["best"]]
            cm = lambda r, f: (r[f]["metrics"].get("cost_model") or {})  # noqa: E731
            line(ax, [(r["B"], r["s_all"]) for r in at], "o-", color="C0", label="best fixed, all reach")
            line(ax, [(r["B"], cm(r, "best").get("speedup_effective")) for r in at], "o--", color="C0", mfc="none",
                 label="cost model (Ω_eff)")
            line(ax, [(r["B"], r["first"]["metrics"].get("measured_speedup_first_done")) for r in at], "s-", color="C1",
                 label="best fixed, first done")
            line(ax, [(r["B"], cm(r, "first").get("speedup")) for r in at], "s--", color="C1", mfc="none",
                 label="cost model (Ω)")
            line(ax, [(r["B"], r.get("s_auto")) for r in at], "^-", color="C2", label="auto, all reach")
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set(title=f"prefix {P}, {mode}", xlabel="batch size", ylabel="speedup over baseline")
    axes[0][-1].legend(fontsize=7)
    return save(fig, path)


def fig_drafters(recs, path, title):
    """Speedup (all reach) vs batch size, a line per drafter label at its best γ and one for auto, a panel per prefix
    (columns) and decoding mode (rows): where each drafter wins, not only the best setting's envelope."""
    best = best_per_drafter(recs)
    if len({r["B"] for r in best}) < 2:
        return None
    prefixes, modes = sorted({r["prefix_len"] for r in best}), sorted({r["decoding"] for r in best})
    names = sorted({label(r) for r in best}, key=lambda n: (n == "auto", natural(n)))
    fig, axes = panels(len(modes), len(prefixes), title)
    for i, mode in enumerate(modes):
        for j, P in enumerate(prefixes):
            ax = axes[i][j]
            for k, name in enumerate(names):
                line(ax, [(r["B"], r["metrics"].get("measured_speedup")) for r in best
                          if (r["prefix_len"], r["decoding"], label(r)) == (P, mode, name)],
                     MARKERS[k % len(MARKERS)] + ("--" if name == "auto" else "-"), color=f"C{k % 10}", label=name)
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set(title=f"prefix {P}, {mode}", xlabel="batch size", ylabel="speedup over baseline, all reach")
    legend(axes, names)
    return save(fig, path)


def fig_predicted(recs, path, title):
    """(b) predicted vs measured speedup of every fixed speculative point, with y = x and a ±10% band."""
    ms = fixed_metrics(recs)
    series = [(lab, mk, [c[i][2:][::-1] for c in map(comparisons, ms) if None not in c[i][2:]])
              for i, (lab, mk, _, _) in enumerate(comparisons({}))]
    vals = [v for _, _, pts in series for p in pts for v in p]
    if not vals:
        return None
    fig, axes = panels(1, 1, title, 5, 4.6)
    ax, lo, hi = axes[0][0], min(vals) * 0.9, max(vals) * 1.1
    ax.plot([lo, hi], [lo, hi], color="gray", lw=0.8)
    ax.fill_between([lo, hi], [lo * (1 - MODEL_TOL), hi * (1 - MODEL_TOL)], [lo * (1 + MODEL_TOL), hi * (1 + MODEL_TOL)],
                    color="gray", alpha=0.15, label=f"±{MODEL_TOL:.0%}")
    for lab, mk, pts in series:
        if pts:
            ax.scatter(*zip(*pts), marker=mk, s=18, label=lab)
    ax.set(xlim=(lo, hi), ylim=(lo, hi), xlabel="measured speedup", ylabel="predicted speedup")
    ax.legend(fontsize=7)
    return save(fig, path)


def reference_setting(recs, rs, B):
    """The fixed (drafter label, γ) measured at the most prefixes for this B, ties to the most often best, then to the
    smallest budget."""
    cover, budget = {}, {}
    for r in recs:
        if is_fixed(r) and r["B"] == B:
            s = (label(r), r.get("gamma"))
            cover.setdefault(s, set()).add(r["prefix_len"])
            budget[s] = r.get("budget") or 0
    wins = Counter((label(r["best"]), r["best"].get("gamma")) for r in rs if r["best"] and r["B"] == B)
    return max(cover, key=lambda s: (len(cover[s]), wins[s], -budget[s]), default=None)


def fig_ratios(recs, rs, path, title):
    """(c) T_D/T_T and T_V/T_T, measured and from the cost model, vs prefix: a panel per batch size (up to 4)."""
    if len({r["prefix_len"] for r in recs if is_fixed(r)}) < 2:
        return None
    Bs = sorted({r["B"] for r in recs if is_fixed(r)})[-4:]  # the largest four
    fig, axes = panels(1, len(Bs), title)
    for ax, B in zip(axes[0], Bs):
        s = reference_setting(recs, rs, B)
        mode = min({r["decoding"] for r in recs}, key=lambda m: m != "greedy")
        at = [r for r in recs if r["B"] == B and r["decoding"] == mode and (label(r), r.get("gamma")) == s]
        for i, k in enumerate(("T_D_over_T_T", "T_V_over_T_T")):
            name = k.replace("_over_", "/")
            line(ax, [(r["prefix_len"], r["metrics"].get(k)) for r in at], "o-", color=f"C{i}", label=f"{name} measured")
            line(ax, [(r["prefix_len"], (r["metrics"].get("cost_model") or {}).get(k)) for r in at], "o--", color=f"C{i}",
                 mfc="none", label=f"{name} cost model")
        ax.set_xscale("log", base=2)
        ax.set(title=f"B={B}, {s[0]} γ{s[1]}, {mode}", xlabel="prefix length", ylabel="ratio to a baseline step")
    axes[0][-1].legend(fontsize=7)
    return save(fig, path)


def fig_alpha(recs, path, title):
    """(d) acceptance rate vs draft budget (mean over γ and B), a line per prefix and drafter (its label less the
    budget), a panel per mode; drafters without a budget (prompt lookup) have no place on this axis."""
    spec = [r for r in recs if is_fixed(r) and r.get("budget") is not None and r["metrics"].get("alpha") is not None]
    budgets, modes = sorted({r["budget"] for r in spec}), sorted({r["decoding"] for r in spec})
    if len(budgets) < 2:
        return None
    fig, axes = panels(1, len(modes), title)
    for ax, mode in zip(axes[0], modes):
        for P, method in sorted({(r["prefix_len"], drafter(r)) for r in spec}):
            by = {}
            for r in spec:
                if (r["prefix_len"], drafter(r), r["decoding"]) == (P, method, mode):
                    by.setdefault(budgets.index(r["budget"]), []).append(r["metrics"]["alpha"])
            line(ax, [(i, sum(a) / len(a)) for i, a in by.items()], "o-", label=f"prefix {P}, {method}")
        ax.set_xticks(range(len(budgets)), [str(b) if b else "full" for b in budgets])
        ax.set(title=mode, xlabel="draft budget (tokens)", ylabel="α (accepted / examined)")
        ax.legend(fontsize=7)
    return save(fig, path)


def code_of(env: dict) -> str | None:
    code = env.get("code") or {}
    if not code.get("commit"):
        return None
    return f"code {code['commit'][:12]}" + (" with uncommitted changes" if code.get("dirty") else "")


def about(recs, skipped) -> tuple[str, list[str], str, list[str]]:
    """(model, devices, weights note, the records' environments as JSON) of one sweep."""
    r0 = (recs or skipped)[0]
    envs = sorted({json.dumps(r.get("environment") or {}, sort_keys=True) for r in recs + skipped})
    devs = sorted({e.get("gpu") or f"{e.get('device')} {e.get('cpu', '')}".strip() for e in map(json.loads, envs)})
    model = str(r0.get("model")) + (f" + {r0['draft_model']} draft" if r0.get("draft_model") else "")
    synth = sorted({(r.get("prefix_len"), r["synthetic_acceptance"]) for r in recs + skipped
                    if r.get("synthetic_acceptance") is not None})
    synth = [f"{synth[0][1]:.2f}"] if len({a for _, a in synth}) == 1 else [f"{a:.2f} at prefix {P}" for P, a in synth]
    note = ("random weights" + (", synthetic α " + ", ".join(synth) if synth else "")
            if r0.get("random_weights") else "real weights, " + str(r0.get("prompt_source")))
    return model, devs, note, envs


def describe(d: Path, name: str, recs, skipped) -> tuple[str, str]:
    """The sweep's title and a paragraph on its device, model, weights and code."""
    r0 = (recs or skipped)[0]
    model, devs, note, envs = about(recs, skipped)
    versions = "; ".join(f"{k} {v}" for k, v in json.loads(envs[0]).items() if k in ("torch", "python"))
    codes = sorted({c for c in map(code_of, map(json.loads, envs)) if c})
    text = [f"- device: {', '.join(devs)}; {versions}" + "".join(f"; {c}" for c in codes)]
    dm = next((r["device_model"] for r in recs if r.get("device_model")), None)
    if dm:
        text.append(f"- measured by the sweep: copy bandwidth {dm['bandwidth'] / 1e9:.0f} GB/s, matmul "
                    f"{dm['matmul_flops'] / 1e12:.3g} TFLOP/s, fixed cost {dm.get('layer_overhead_s', 0) * 1e6:.1f} µs per layer"
                    + (f", sampling {dm['sampling_s_per_logit'] * 1e12:.0f} ps per logit" if dm.get("sampling_s_per_logit") else ""))
    sinks = next((r["sinks"] for r in recs + skipped if r.get("sinks") is not None), None)  # None: no drafter has sinks
    text.append(f"- {model}, {note}; gen_len {r0.get('gen_len')}" + (f", {sinks} sink tokens" if sinks is not None else "")
                + f"; CUDA graphs {'on' if r0.get('cuda_graphs') else 'off'}; records: `{d}`")
    return f"{name}: {model} on {', '.join(devs)} ({note})", "\n".join(text)


def section(d: Path, out: Path, name: str, recs, skipped) -> tuple[str, list[Path]]:
    """One sweep's markdown (without its figures) and its PNGs, written to `out` as NAME_*.png."""
    title, about_text = describe(d, name, recs, skipped)
    rs = rows(recs)
    pngs = [fig_speedup(rs, out / f"{name}_speedup.png", title), fig_drafters(recs, out / f"{name}_drafters.png", title),
            fig_predicted(recs, out / f"{name}_predicted.png", title),
            fig_ratios(recs, rs, out / f"{name}_ratios.png", title), fig_alpha(recs, out / f"{name}_alpha.png", title)]
    cmds = text_of(d / "commands.txt").strip() if (d / "commands.txt").exists() else "(no commands.txt)"
    text = [f"## {title}", about_text, "Commands (device and date after #):", f"```bash\n{cmds}\n```"]
    text += [f"Config `{t.name}`:\n```toml\n{text_of(t).strip()}\n```" for t in sorted(d.glob("*.toml"))]
    text += [table(rs), summary(recs, rs)] if recs else []
    every = drafters_table(recs)
    if every:
        text.append("Every drafter at each point, at its best γ (auto: the γ it used):\n\n" + every)
    per_batch = batch_table(recs)
    if per_batch:
        text.append("Each batch on its own (the table above: all batches together):\n\n" + per_batch)
    if skipped:
        text.append("Skipped:\n" + "\n".join(f"- `{r['point']}`: {r['skipped']}" for r in skipped))
    return "\n\n".join(text), [p for p in pngs if p]


def text_of(f: Path) -> str:
    """A text file beside the records (commands, config, an included page), undecodable bytes shown as U+FFFD
    rather than stopping the report."""
    return Path(f).read_text(encoding="utf-8", errors="replace")


def images(pngs, rel_to: Path) -> str:
    return "\n\n".join(f"![{PNG[p.stem.rsplit('_', 1)[1]]}]({os.path.relpath(p, rel_to)})" for p in pngs)


def relinked(md: Path, to: Path) -> str:
    """md's text with its relative links made relative to the directory `to` (where it is included), so that a
    README's links to files beside it still lead there from RESULTS.md."""
    def fix(m: re.Match) -> str:
        target = m.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:|#|/", target):  # a URL, an anchor or an absolute path: as written
            return m.group(0)
        return f"{m.group(1)}({os.path.relpath(md.parent / target, to)})"
    return re.sub(r"(\])\(([^)\s]+)\)", fix, text_of(md))


# The results page: generated blocks between markers, so that a run replaces only what it made
def tags(kind: str, name: str = "") -> tuple[str, str]:
    tag = f"{kind} {name}".strip()
    return f"<!-- {tag} -->", f"<!-- /{tag} -->"


def block_re(kind: str, name: str = "") -> re.Pattern:
    start, end = tags(kind, name)
    return re.compile(rf"^{re.escape(start)}\n(.*?)\n?{re.escape(end)}$", re.DOTALL | re.MULTILINE)


def names_of(page: str, kind: str) -> list[str]:
    return re.findall(rf"^<!-- {kind} (.+?) -->$", page, re.MULTILINE)


def put(page: str, kind: str, name: str, body: str) -> str:
    """page with the block (kind, name) holding body: in place where it is, else after the last block of its kind
    (a new sweep before the included files), else at the end. Text outside the blocks stays as it was."""
    start, end = tags(kind, name)
    new = f"{start}\n\n{body.strip()}\n\n{end}"
    found = block_re(kind, name).search(page)
    if found:
        return page[:found.start()] + new + page[found.end():]
    ours = [block_re(kind, n).search(page) for n in names_of(page, kind)]
    later = [block_re("include", n).search(page) for n in names_of(page, "include")] if kind == "sweep" else []
    at = (max(m.end() for m in ours if m) if any(ours) else min(m.start() for m in later if m) if any(later)
          else len(page))
    return page[:at].rstrip("\n") + "\n\n" + new + "\n\n" + page[at:].lstrip("\n")


def check_markers(page: str, path: Path) -> None:
    """Every block of the page between exactly one start and one end marker, in that order: a marker lost or doubled
    (a hand edit, a page cut short) would otherwise put a second copy of a section on it."""
    for kind in ("head", "sweep", "include"):
        starts = re.findall(rf"^<!-- {kind}(?: (.+?))? -->$", page, re.MULTILINE)
        ends = re.findall(rf"^<!-- /{kind}(?: (.+?))? -->$", page, re.MULTILINE)
        for name in dict.fromkeys(starts + ends):
            start, end = tags(kind, name)
            if (starts.count(name), ends.count(name)) != (1, 1) or page.index(start) > page.index(end):
                raise MagicDecError(
                    f"--results_md {path}: `{start}` appears {starts.count(name)} time(s) and `{end}` "
                    f"{ends.count(name)} time(s), where each block has one start and one end marker after it (a hand "
                    "edit or a page cut short?): restore the markers, or rewrite the page whole with --rebuild and "
                    "every sweep it should show")


def old_page(path: Path, rebuild: bool) -> str:
    """The page's text to update: empty when it is new or rebuilt. A page without markers (written whole by report
    runs before sections had them) is refused: updating it would drop the sweeps this run was not given; so is one
    with a marker lost or doubled."""
    if rebuild or not path.exists():
        return ""
    try:
        page = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MagicDecError(f"--results_md {path}: cannot read it ({one_line(e)}); fix or move it, or pass --rebuild "
                            "to write it whole") from None
    check_markers(page, path)
    if page.strip() and not (block_re("head").search(page) or names_of(page, "sweep")):
        made = re.search(r"^Made by `([^`]+)`", page, re.MULTILINE)
        raise MagicDecError(f"--results_md {path} has no `<!-- sweep NAME -->` markers (written before sections were "
                            "kept apart), so updating it would lose the sweeps not given here: rewrite it whole with "
                            "--rebuild and every sweep it should show"
                            + (f" (it was made by: {made.group(1)})" if made else ""))
    return page


def head(page: str, fresh_rows: dict[str, str], command: str) -> str:
    """The page's opening: the last command, one overview row per sweep section on the page (a new row for the
    sweeps of this run, the earlier row for the others) and how to read the tables."""
    old = block_re("head").search(page)
    kept = {m.group(1): m.group(0) for m in re.finditer(r"^\| \[(.+?)\]\(.*$", old.group(1) if old else "", re.MULTILINE)}
    listed = [fresh_rows.get(n) or kept.get(n) or f"| {n} | no row: run the report on this sweep again | | | | | | | | |"
              for n in names_of(page, "sweep")]
    made = (f"Last updated by `{command}`; a run replaces the sections of the sweeps it names and keeps every other "
            "section (between `<!-- sweep NAME -->` markers).")
    overview = "\n".join(["Each sweep in one row (its section below has the commands, the config and every point):\n",
                          OVERVIEW_HEAD, *listed])
    return f"{made}\n\n{overview}\n\n{CONVENTIONS}"


def write_page(path: Path, page: str, sections: dict[str, str], overview_rows: dict[str, str], includes: list[Path],
               command: str) -> None:
    """The page with this run's sweep sections and included files put in place, then its opening remade."""
    page = page or "# Results\n"
    for name, text in sections.items():
        page = put(page, "sweep", name, text)
    for f in includes:
        page = put(page, "include", os.path.relpath(f.resolve(), path.parent.resolve()), relinked(f, path.parent))
    if not block_re("head").search(page):  # a new page: the opening after its title
        title, _, rest = page.partition("\n")
        page = f"{title}\n\n{tags('head')[0]}\n\n{tags('head')[1]}\n\n{rest.lstrip()}"
    page = put(page, "head", "", head(page, overview_rows, command))
    files.write_text(path, page.rstrip() + "\n", "--results_md")


MADE_BY = "<!-- made by magicdec report from {}: the next report of that folder replaces this page -->"


def ours(page: Path, sweep: Path, results_md: Path | None) -> None:
    """A sweep's page may replace only a page an earlier report made (its first line MADE_BY): never the results
    page or another file that happens to have its name (a sweep folder named RESULTS, --out results)."""
    if results_md is not None and page.resolve() == results_md.resolve():
        raise MagicDecError(f"--out {page.parent}: the page of sweep {sweep} would be {page}, the --results_md page "
                            "itself: give another --out (or rename the sweep folder)")
    if not page.exists():
        return
    try:
        with page.open(encoding="utf-8", errors="replace") as f:
            first = f.readline()
    except OSError as e:
        raise MagicDecError(f"--out: cannot read {page} ({one_line(e)}); move it or choose another --out") from None
    if not first.startswith(MADE_BY.split("{}")[0]):
        raise MagicDecError(f"--out: {page} exists and was not made by magicdec report (its first line is not "
                            f"`{MADE_BY.split('{}')[0].strip()} ...`), so the page of sweep {sweep} will not replace "
                            "it: choose another --out, or move that file away (an earlier report's page made before "
                            "this line existed: delete it)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="magicdec report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweeps", type=Path, nargs="+", metavar="SWEEP_DIR",
                   help="sweep output folders (a `magicdec sweep ... --output_dir`), one section each, named after "
                        "the folder")
    p.add_argument("--out", type=Path, required=True,
                   help="folder for each sweep's markdown (NAME.md) and figures (NAME_*.png); made if missing")
    p.add_argument("--results_md", type=Path, default=None,
                   help="a results page to update in place, e.g. results/RESULTS.md: the sections of the sweeps given "
                        "here are replaced or added, every other section is kept (default: none, only --out is "
                        "written)")
    p.add_argument("--rebuild", action="store_true",
                   help="write --results_md whole from the sweeps and --include files given here, dropping every other "
                        "section (needed once for a page made before sections had markers)")
    p.add_argument("--include", type=Path, action="append", default=[], metavar="MD",
                   help="a markdown file to put on --results_md after the sweeps, its relative links made relative to "
                        "the page (repeatable; replaces that file's earlier copy there)")
    return p


# Reports of their own records, each a module beside this one: `magicdec report NAME ...` (NAME before any sweep
# folder; `magicdec report NAME --help` for its flags).
REPORTS = {"specbench-table": "report_specbench", "tp-tables": "report_tp", "heads-acceptance": "report_heads",
           "heads-data": "report_training", "atlas": "report_atlas"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in REPORTS:
        return importlib.import_module(f"magicdec.harness.{REPORTS[argv[0]]}").main(argv[1:]) or 0
    a = parser().parse_args(argv)
    for flag, given in (("--include", a.include), ("--rebuild", a.rebuild)):
        if given and a.results_md is None:
            raise MagicDecError(f"{flag} applies to the results page: give --results_md too")
    if a.out.exists() and not a.out.is_dir():
        raise MagicDecError(f"--out {a.out} is a file: give a folder for the markdown and figures")
    missing = [f for f in a.include if not f.is_file()]
    if missing:
        raise MagicDecError(f"--include {missing[0]}: no such file")
    loaded = [load(d) for d in a.sweeps]
    for d, (recs, skipped) in zip(a.sweeps, loaded):
        if not recs and not skipped:
            raise MagicDecError(f"{d}: no sweep records in it ({len(list(d.glob('*.json')))} JSON file(s), none a sweep "
                                "point's record); give a sweep's --output_dir")
    names = [d.resolve().name for d in a.sweeps]
    if len(set(names)) < len(names):  # two sweeps called out/: prefix their parents' names
        names = ["_".join(d.resolve().parts[-2:]) for d in a.sweeps]
    # refused before anything is drawn or written: a page this command did not make, a folder it cannot write
    for d, name in zip(a.sweeps, names):
        ours(a.out / f"{name}.md", d, a.results_md)
    if a.results_md:
        old_page(a.results_md, a.rebuild)  # read again, under its lock, when it is written
        files.writable_folder(a.results_md.parent, "--results_md")
    files.writable_folder(a.out, "--out")
    command = "magicdec report " + shlex.join(argv)
    sections, overview = {}, {}
    for d, name, (recs, skipped) in zip(a.sweeps, names, loaded):
        text, pngs = section(d, a.out, name, recs, skipped)
        files.write_text(a.out / f"{name}.md", f"{MADE_BY.format(d)}\n\n{text}\n\n{images(pngs, a.out)}\n", "--out")
        print(text)
        if a.results_md:
            sections[name] = f"{text}\n\n{images(pngs, a.results_md.parent)}"
            overview[name] = overview_row(f"[{name}]({os.path.relpath(a.out / f'{name}.md', a.results_md.parent)})",
                                          recs, skipped)
    if a.results_md:  # read, updated and written by one report at a time: a second waits, then adds to this one's
        with files.locked(a.results_md.with_name(f".{a.results_md.name}.lock")):
            write_page(a.results_md, old_page(a.results_md, a.rebuild), sections, overview, a.include, command)
    print(f"wrote {a.out}/" + (f" and {a.results_md}" if a.results_md else ""))
    return 0


if __name__ == "__main__":
    with one_line_errors():
        raise SystemExit(main())
