"""Sweep records (magicdec/sweep.py) to markdown tables, PNG figures like the paper's and results/RESULTS.md, with the
commands that made them and the planner's check: at every point, auto >= 0.97 x the baseline and >= 0.95 x the best
fixed setting (the baseline counted as one, speedup 1), both with every sequence reaching gen_len.

    python -m magicdec.report results/issue5/smollm2 results/issue5/llama31_8b --out results/issue5 \
        --results_md results/RESULTS.md --include results/issue5/side_by_side/README.md

Every number comes from a record; writes OUT/<dir>.md (one sweep) and OUT/<dir>_*.png, and RESULTS.md (all of them,
after a summary table with one row per sweep).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import textwrap
from collections import Counter
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BASE_TOL, BEST_TOL, MODEL_TOL = 0.97, 0.95, 0.10
FIXED = ("selfspec", "longspec")
PNG = {"speedup": "speedup vs batch size", "predicted": "measured vs predicted speedup",
       "ratios": "T_D/T_T and T_V/T_T vs context", "alpha": "acceptance rate vs draft budget"}
CONVENTIONS = """\
How to read these tables:

- **speedup, all reach**: decode tokens/s over the baseline's (same model, batch, prefix, decoding mode, device),
  every sequence generating gen_len tokens, so a batch waits for its slowest sequence.
- **speedup, first done**: MagicDec's convention, the run stops when the first sequence of the batch has gen_len tokens.
- **cost model**: `magicdec/cost_model.py`, T_T, T_D, T_V from the bytes and FLOPs of each step over this device's
  measured copy bandwidth and matmul rate (plus a measured fixed cost per layer, and, in records made after
  2026-11-23, a measured fixed cost T_O per verification), with the measured α. Its Ω form
  Ω/(γ·T_D/T_T + T_V/T_T + T_O/T_T) is compared with *first done* (no stragglers); its Ω_eff form (measured tokens per
  verification of the whole batch, stragglers included) with *all reach*. error = predicted / measured − 1.
- **best fixed**: the (method, draft budget, γ) with the highest *all reach* speedup at that point (the *first done*
  column names another setting where that one is best under its convention).
- **auto**: the planner picks the budget from the cost model and the acceptance measured so far, then γ per
  verification from step times measured on the batch (γ 0 = speculation off); `γ:n` = n verifications with that γ.
  Checks: auto ≥ 0.97 × baseline, auto ≥ 0.95 × best fixed (the baseline counted as a fixed setting, speedup 1).
- **random weights**: real shapes, random weights and prompt ids; acceptance is synthetic (each drafted token kept
  with probability α), so those sweeps measure the systems side, not a draft's quality.
"""


def load(d: Path):
    recs = [json.loads(f.read_text()) for f in sorted(Path(d).glob("*.json"))]
    recs = [r for r in recs if isinstance(r, dict) and "point" in r]
    return [r for r in recs if "metrics" in r], [r for r in recs if "skipped" in r]


def rel(pred, meas):
    return pred / meas - 1 if pred is not None and meas else None


def drafter(r) -> str:
    """The method, with its draft policy when the draft selects its cache (StreamingLLM is the default)."""
    policy = r.get("draft_policy") or "streaming"
    return r["method"] if policy == "streaming" else f"{r['method']} {policy}"


def setting(r) -> str:
    return f"{drafter(r)} b{r['budget']} γ{r['gamma']}"


def gammas_used(auto) -> str:
    ag = ((auto["metrics"].get("speculation") or {}).get("auto_gamma")) or {}
    used = ag.get("iterations_per_gamma", {})
    off = " (off)" if ag.get("switched_off") else ""
    return f"b{auto.get('budget')}, γ " + " ".join(f"{g}:{n}" for g, n in used.items()) + off


def rows(recs) -> list[dict]:
    """One row per (prefix, B, decoding): baseline, best fixed settings, cost-model errors, auto and its checks."""
    out = []
    for key in sorted({(r["prefix_len"], r["B"], r["decoding"]) for r in recs}):
        at = [r for r in recs if (r["prefix_len"], r["B"], r["decoding"]) == key]
        base = next((r for r in at if r["method"] == "baseline"), None)
        fixed = [r for r in at if r["method"] in FIXED and r["metrics"].get("measured_speedup") is not None]
        best = max(fixed, key=lambda r: r["metrics"]["measured_speedup"], default=None)
        first = max(fixed, key=lambda r: r["metrics"].get("measured_speedup_first_done") or 0, default=None)
        auto = next((r for r in at if r["method"] == "auto"), None)
        row = dict(P=key[0], B=key[1], mode=key[2], base=base and base["metrics"]["decode_tokens_per_s"],
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


def table(rs) -> str:
    pct, ok = (lambda x: f2(x, "{:+.1%}")), (lambda x: "—" if x is None else ("PASS" if x else "**FAIL**"))
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


def batch_table(recs) -> str | None:
    """Where points were timed on several batches of prompts (a sweep's skip_tokens list): per batch, its best fixed
    setting and auto, each batch's speedup against the baseline runs paired with it. The main table compares totals
    over all batches; this shows how much of one batch's ranking is that batch's luck."""
    lines = []
    for key in sorted({(r["prefix_len"], r["B"], r["decoding"]) for r in recs if len(r.get("batches") or []) > 1}):
        at = [r for r in recs if (r["prefix_len"], r["B"], r["decoding"]) == key and r.get("batches")]
        fixed = [r for r in at if r["method"] in FIXED]
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
    return [r["metrics"] for r in recs if r["method"] in FIXED and r["metrics"].get("measured_speedup")]


def model_counts(recs) -> list[tuple[str, int, int]]:
    """(comparison, fixed speculative points within MODEL_TOL, points with both numbers) per comparison."""
    out = []
    for i, label in enumerate(c[0] for c in comparisons({})):
        errs = [e for e in (rel(*comparisons(m)[i][2:]) for m in fixed_metrics(recs)) if e is not None]
        out.append((label, sum(abs(e) <= MODEL_TOL for e in errs), len(errs)))
    return out


def planner_counts(rs) -> dict[str, tuple[int, int]]:
    """(passed, checked) for each planner check; `best` and `both` only where the point has fixed settings."""
    checked = [r for r in rs if "ok_base" in r]
    both = [r for r in checked if r["ok_best"] is not None]
    return {"base": (sum(r["ok_base"] for r in checked), len(checked)),
            "best": (sum(r["ok_best"] for r in both), len(both)),
            "both": (sum(r["ok_base"] and r["ok_best"] for r in both), len(both))}


def summary(recs, rs) -> str:
    parts = [f"{label}: {n}/{total}" for label, n, total in model_counts(recs)]
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
        return f"| {link} | no records | | | 0 | — | — | — | — | — |"
    model, devs, note, _ = about(recs, skipped)
    rs, fixed = rows(recs), [r for r in recs if r["method"] in FIXED and r["metrics"].get("measured_speedup") is not None]
    best = max(fixed, key=lambda r: r["metrics"]["measured_speedup"], default=None)
    first = max(fixed, key=lambda r: r["metrics"].get("measured_speedup_first_done") or 0, default=None)
    s_all = best and best["metrics"]["measured_speedup"]
    s_first = first and first["metrics"].get("measured_speedup_first_done")
    # the cost model's own predictions (Ω_eff vs all reach, Ω vs first done), not the measured-ratio check
    model_fit = "; ".join(f"{label.replace('cost model ', '')}: {n}/{total}" for label, n, total in model_counts(recs)[:2])
    pc = planner_counts(rs)
    checks = [f"{pc[k][0]}/{pc[k][1]}" if pc[k][1] else "—" for k in ("base", "best")]  # "—": nothing to check
    batches = max(len(r.get("batches") or []) for r in recs)
    cells = [link, model, note, ", ".join(devs), f"{len(rs)}" + (f", each timed on {batches} batches" if batches > 1 else ""),
             f"{f2(s_all)} ({point(best)})" if s_all else "— (no fixed settings)",
             f"{f2(s_first)} ({point(first)})" if s_first else "—",
             model_fit if fixed else "—", *checks]
    return "| " + " | ".join(cells) + " |"


def overview(sweeps: list[tuple[str, Path, Path]], rel_to: Path) -> str:
    """The table RESULTS.md opens with: one row per (name, sweep directory, its markdown file), linked to that file."""
    lines = ["| sweep | model | weights | device | points (prefix × B × decoding) | best fixed speedup, all reach (point) "
             f"| best fixed speedup, first done (point) | cost model within {MODEL_TOL:.0%} (fixed points) "
             f"| auto ≥ {BASE_TOL} × baseline | auto ≥ {BEST_TOL} × best fixed |", "|" + "---|" * 10]
    lines += [overview_row(f"[{name}]({os.path.relpath(md, rel_to)})", *load(d)) for name, d, md in sweeps]
    return "\n".join(lines)


def panels(nrows, ncols, title, w=4.2, h=3.4):
    fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows + 0.6), squeeze=False)
    fig.suptitle(textwrap.fill(title, int(11 * w * ncols)), fontsize=9)
    return fig, axes


def line(ax, pts, *style, **kw):
    pts = sorted((x, y) for x, y in pts if y is not None)
    if pts:
        ax.plot(*zip(*pts), *style, **kw)


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
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
    """The fixed (method, budget, γ) measured at the most prefixes for this B, ties to the most often best."""
    cover = {}
    for r in recs:
        if r["method"] in FIXED and r["B"] == B:
            cover.setdefault((drafter(r), r["budget"], r["gamma"]), set()).add(r["prefix_len"])
    wins = Counter((drafter(r["best"]), r["best"]["budget"], r["best"]["gamma"]) for r in rs if r["best"] and r["B"] == B)
    return max(cover, key=lambda s: (len(cover[s]), wins[s], -(s[1] or 0)), default=None)


def fig_ratios(recs, rs, path, title):
    """(c) T_D/T_T and T_V/T_T, measured and from the cost model, vs prefix: a panel per batch size (up to 4)."""
    if len({r["prefix_len"] for r in recs if r["method"] in FIXED}) < 2:
        return None
    Bs = sorted({r["B"] for r in recs if r["method"] in FIXED})[-4:]  # the largest four
    fig, axes = panels(1, len(Bs), title)
    for ax, B in zip(axes[0], Bs):
        s = reference_setting(recs, rs, B)
        mode = min({r["decoding"] for r in recs}, key=lambda m: m != "greedy")
        at = [r for r in recs if r["B"] == B and r["decoding"] == mode and (drafter(r), r["budget"], r["gamma"]) == s]
        for i, k in enumerate(("T_D_over_T_T", "T_V_over_T_T")):
            name = k.replace("_over_", "/")
            line(ax, [(r["prefix_len"], r["metrics"].get(k)) for r in at], "o-", color=f"C{i}", label=f"{name} measured")
            line(ax, [(r["prefix_len"], (r["metrics"].get("cost_model") or {}).get(k)) for r in at], "o--", color=f"C{i}",
                 mfc="none", label=f"{name} cost model")
        ax.set_xscale("log", base=2)
        ax.set(title=f"B={B}, {s[0]} b{s[1]} γ{s[2]}, {mode}", xlabel="prefix length", ylabel="ratio to a baseline step")
    axes[0][-1].legend(fontsize=7)
    return save(fig, path)


def fig_alpha(recs, path, title):
    """(d) acceptance rate vs draft budget (mean over γ and B), a line per prefix and method (with its draft policy),
    a panel per mode."""
    spec = [r for r in recs if r["method"] in FIXED and r["metrics"].get("alpha") is not None]
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


def about(recs, skipped) -> tuple[str, list[str], str, list[str]]:
    """(model, devices, weights note, the records' environments as JSON) of one sweep."""
    r0 = (recs or skipped)[0]
    envs = sorted({json.dumps(r.get("environment") or {}, sort_keys=True) for r in recs + skipped})
    devs = sorted({e.get("gpu") or f"{e.get('device')} {e.get('cpu', '')}".strip() for e in map(json.loads, envs)})
    model = str(r0.get("model")) + (f" + {r0['draft_model']} draft" if r0.get("draft_model") else "")
    synth = sorted({(r["prefix_len"], r["synthetic_acceptance"]) for r in recs + skipped
                    if r.get("synthetic_acceptance") is not None})
    synth = [f"{synth[0][1]:.2f}"] if len({a for _, a in synth}) == 1 else [f"{a:.2f} at prefix {P}" for P, a in synth]
    note = ("random weights" + (", synthetic α " + ", ".join(synth) if synth else "")
            if r0.get("random_weights") else "real weights, " + str(r0.get("prompt_source")))
    return model, devs, note, envs


def describe(d: Path, name: str, recs, skipped) -> tuple[str, str]:
    """The sweep's title and a paragraph on its device, model and weights."""
    r0 = (recs or skipped)[0]
    model, devs, note, envs = about(recs, skipped)
    versions = "; ".join(f"{k} {v}" for k, v in json.loads(envs[0]).items() if k in ("torch", "python"))
    text = [f"- device: {', '.join(devs)}; {versions}"]
    dm = next((r["device_model"] for r in recs if r.get("device_model")), None)
    if dm:
        text.append(f"- measured by the sweep: copy bandwidth {dm['bandwidth'] / 1e9:.0f} GB/s, matmul "
                    f"{dm['matmul_flops'] / 1e12:.3g} TFLOP/s, fixed cost {dm.get('layer_overhead_s', 0) * 1e6:.1f} µs per layer"
                    + (f", sampling {dm['sampling_s_per_logit'] * 1e12:.0f} ps per logit" if dm.get("sampling_s_per_logit") else ""))
    text.append(f"- {model}, {note}; gen_len {r0.get('gen_len')}, {r0.get('sinks')} sink tokens; CUDA graphs "
                f"{'on' if r0.get('cuda_graphs') else 'off'}; records: `{d}`")
    return f"{name}: {model} on {', '.join(devs)} ({note})", "\n".join(text)


def section(d: Path, out: Path, name: str) -> tuple[str, list[Path]]:
    """One sweep's markdown (without its figures) and its PNGs, written to `out` as NAME_*.png."""
    recs, skipped = load(d)
    if not recs and not skipped:
        return f"## {name}\n\nNo records in `{d}`.", []
    title, about = describe(d, name, recs, skipped)
    rs = rows(recs)
    pngs = [fig_speedup(rs, out / f"{name}_speedup.png", title), fig_predicted(recs, out / f"{name}_predicted.png", title),
            fig_ratios(recs, rs, out / f"{name}_ratios.png", title), fig_alpha(recs, out / f"{name}_alpha.png", title)]
    cmds = (d / "commands.txt").read_text().strip() if (d / "commands.txt").exists() else "(no commands.txt)"
    text = [f"## {title}", about, "Commands (device and date after #):", f"```bash\n{cmds}\n```"]
    text += [f"Config `{t.name}`:\n```toml\n{t.read_text().strip()}\n```" for t in sorted(d.glob("*.toml"))]
    text += [table(rs), summary(recs, rs)] if recs else []
    per_batch = batch_table(recs)
    if per_batch:
        text.append("Each batch on its own (the table above: all batches together):\n\n" + per_batch)
    if skipped:
        text.append("Skipped:\n" + "\n".join(f"- `{r['point']}`: {r['skipped']}" for r in skipped))
    return "\n\n".join(text), [p for p in pngs if p]


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
    return re.sub(r"(\])\(([^)\s]+)\)", fix, md.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sweeps", type=Path, nargs="+", help="sweep output directories")
    p.add_argument("--out", type=Path, required=True, help="where the PNGs and one markdown file per sweep go")
    p.add_argument("--results_md", type=Path, default=Path("results/RESULTS.md"))
    p.add_argument("--include", type=Path, action="append", default=[], help="markdown appended, its relative links made relative to --results_md (repeatable)")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    a.results_md.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m magicdec.report"] + (argv if argv is not None else sys.argv[1:]))
    names = [d.resolve().name for d in a.sweeps]
    if len(set(names)) < len(names):  # two sweeps called out/: prefix their parents' names
        names = ["_".join(d.resolve().parts[-2:]) for d in a.sweeps]
    parts = ["# Results", f"Made by `{command}` from the sweep records below.",
             "Each sweep in one row (its section below has the commands, the config and every point):\n\n"
             + overview([(n, d, a.out / f"{n}.md") for n, d in zip(names, a.sweeps)], a.results_md.parent),
             CONVENTIONS]
    for d, name in zip(a.sweeps, names):
        text, pngs = section(d, a.out, name)
        (a.out / f"{name}.md").write_text(f"{text}\n\n{images(pngs, a.out)}\n")
        parts.append(f"{text}\n\n{images(pngs, a.results_md.parent)}\n")
        print(text)
    parts += [relinked(f, a.results_md.parent).strip() + "\n" for f in a.include]
    a.results_md.write_text("\n\n".join(parts))
    print(f"wrote {a.results_md} and {a.out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
