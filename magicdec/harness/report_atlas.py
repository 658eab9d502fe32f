"""The speedup atlas from plan records (one JSON per (B, prefix_len, decoding) point, written by a sweep's `plan`
points or by `magicdec run --plan ... --output`): a results page that opens with its findings and the issue's goals
checked, a heat map per device and decoding, a row per point, and the planner's ranking beside what was measured at
three points; with --readme, the README's summary table between its atlas-summary markers. Every number on the page
comes from a record, and so does every label (device, tensor-parallel world, acceptance source, weights).

    magicdec report atlas results/atlas/h100 results/atlas/tp4 --out results/atlas --readme README.md
    magicdec report atlas results/atlas/h100 --out results/atlas --show_ranking 12,32K --show_ranking 1,100K

Each folder's `*.json` are read (not its .batches/, stale/ or broken/): a record with method "plan" is placed, another
sweep point's record or another tool's JSON is passed over, and a file that is not a readable plan record is skipped
with a warning naming it. Writes OUT/atlas.md (replacing only a page this command made) and OUT/atlas_*.png.

Per point: the winner is the fastest option measured there by all-reach median, the baseline (1 by definition)
counted as one, so "off" where no option measured ≥ 1; the plan's run (the heat map's colour) is the record's
`choice`; the planner's pick is its rank-1 option, within 5% where its measured speedup is ≥ 0.95 × the winner's.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from magicdec import files
from magicdec.harness.plan_command import family as plan_family
from magicdec.errors import MagicDecError
from magicdec.harness.report import cell, warn
from magicdec.harness.report_specbench import prefix_name
from magicdec.harness.sweep import read_object

PAGE, MADE_BY = "atlas.md", "<!-- made by magicdec report atlas"
START, END = "<!-- atlas-summary:start -->", "<!-- atlas-summary:end -->"
PICK_TOL, MODEL_TOL, PLAN_FLOOR, SHARE = 0.05, 0.10, 0.98, 0.90  # the goals
RANKING_ROWS = 10
BASELINE = {"label": "baseline", "drafter": "baseline", "config": {}, "metrics": {"measured_speedup": 1.0}}


@dataclass(frozen=True)
class Goal:
    """One of the issue's goals at one point: the plan's measured speedups there against its bounds."""
    text: str
    gpu: str  # a part of the record's environment.gpu
    world: int
    prefix: str  # the prefix as prefix_name prints it
    batches: tuple[int, ...]
    all_reach: float | None = None
    first_done: float | None = None


GOALS = (Goal("One H100, 32K × 12 (13 where it fits): ≥ 1.8× all reach and ≥ 2.1× first done", "H100", 1, "32K",
              (12, 13), 1.8, 2.1),
         Goal("One H100, 100K × 1: ≥ 2.5×", "H100", 1, "100K", (1,), 2.5),
         Goal("TP = 4 on 4 × H100, 100K × 16: ≥ 2.3× first done and ≥ 1.9× all reach", "H100", 4, "100K", (16,),
              1.9, 2.3),
         Goal("TP = 4 on 4 × H200, 100K × 32: ≥ 2.5× first done", "H200", 4, "100K", (32,), None, 2.5))


# --- reading --------------------------------------------------------------------------------------------------------
def number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def problem(r: dict) -> str | None:
    """What keeps a plan record off the atlas, or None."""
    need = {"B": int, "prefix_len": int, "decoding": str, "environment": dict}
    if r.get("skipped") is None:
        need |= {"gen_len": int, "plan": dict, "candidates": list, "choice": dict, "planner_pick": dict}
    missing = [k for k, t in need.items() if not isinstance(r.get(k), t)]
    if missing:
        return f"a plan record without {', '.join(missing)} (or of the wrong type)"
    if r.get("skipped") is not None:
        return None
    if not isinstance(r["plan"].get("ranking"), list):
        return "a plan record without plan.ranking"
    for i, c in enumerate(r["candidates"]):
        if not (isinstance(c, dict) and isinstance(c.get("label"), str) and isinstance(c.get("metrics"), dict)):
            return f"candidate {i} without a label and metrics"
    choice, pick = r["choice"], r["planner_pick"]
    if not (isinstance(choice.get("label"), str) and number(choice.get("measured_speedup"))
            and number(choice.get("measured_speedup_first_done"))):
        return "a choice without label, measured_speedup and measured_speedup_first_done"
    if not choice.get("off") and choice["label"] not in {c["label"] for c in r["candidates"]}:
        return f"its choice {choice['label']!r} is none of its timed candidates"
    if not (isinstance(pick.get("label"), str) and number(pick.get("predicted_speedup"))):
        return "a planner_pick without label and predicted_speedup"
    return None


def read_plan(f: Path) -> dict | None:
    """A plan record, or None: another tool's JSON or another method's point quietly, anything unreadable or
    incomplete with a warning naming the file."""
    r, why = read_object(f)
    if r is None:
        return warn(f, why)
    if r.get("method") != "plan":
        return None
    why = problem(r)
    return warn(f, why) if why else r | {"_file": f}


def load(dirs: list[Path]) -> list[dict]:
    """Every plan record of the folders; a folder without one, or two records of one point, is an error."""
    out = []
    for d in dirs:
        if not d.is_dir():
            raise MagicDecError(f"{d}: {'not a folder' if d.exists() else 'no such folder'}; give the folder of a "
                                "sweep's plan records (its --output_dir)")
        found = [r for r in map(read_plan, sorted(d.glob("*.json"))) if r]
        if not found:
            raise MagicDecError(f"{d}: no plan records in it (of {len(list(d.glob('*.json')))} JSON file(s), none a "
                                "readable record with method \"plan\"); give the --output_dir of a sweep with plan points")
        out += found
    seen = {}
    for r in out:
        k = group(r) + (r["B"], r["prefix_len"])
        if k in seen and (r.get("skipped") is None) == (seen[k].get("skipped") is None):
            raise MagicDecError(f"two plan records of one point ({where(r)}): {seen[k]['_file']} and {r['_file']}; "
                                "give each point's folder once (move the other record away)")
        if k not in seen or seen[k].get("skipped") is not None:  # a timed record of the point wins over a skipped one
            seen[k] = r
    return list(seen.values())


# --- one point --------------------------------------------------------------------------------------------------------
def group(r: dict) -> tuple[str, int, str]:
    """(device, tensor-parallel world, decoding), as the record names them."""
    env = r["environment"]
    tp = r.get("tensor_parallel") or {}
    world = tp.get("world") or len((r.get("config") or {}).get("rank_group") or [0])
    return env.get("gpu") or env.get("device") or "unknown device", int(world), r["decoding"]


def group_title(g: tuple[str, int, str]) -> str:
    device, world, decoding = g
    return f"{device}, {'one GPU' if world == 1 else f'TP = {world}'}, {decoding}"


def device_name(g: tuple[str, int, str]) -> str:
    """A table's device column: the GPU, with its tensor-parallel world above one."""
    return g[0] if g[1] == 1 else f"{g[0]}, TP = {g[1]}"


def where(r: dict) -> str:
    return f"{group_title(group(r))}, {prefix_name(r['prefix_len'])} × {r['B']}"


def family(c: dict) -> str:
    """A candidate's family (plan_command.family): its drafter, its draft weights where not bf16, "tree" for a tree."""
    return plan_family(c.get("drafter") or c["label"].split()[0], c.get("config") or {})


def measured(r: dict) -> list[dict]:
    """The timed candidates and the baseline, fastest first by all-reach median (the candidates' rank order on ties,
    the baseline after them)."""
    timed = [c for c in r["candidates"] if number(c["metrics"].get("measured_speedup"))]
    return sorted(timed + [BASELINE], key=lambda c: -c["metrics"]["measured_speedup"])


def point(r: dict) -> dict:
    """What the page shows of one record."""
    p = {"record": r, "group": group(r), "B": r["B"], "L": r["prefix_len"], "skipped": r.get("skipped")}
    if p["skipped"] is not None:
        return p
    order = measured(r)
    choice, pick = r["choice"], r["planner_pick"]
    chosen = next((c for c in r["candidates"] if c["label"] == choice["label"]), None)
    pick_m = pick.get("measured_speedup")
    if pick_m is None and pick["label"] == "baseline":
        pick_m = 1.0  # the baseline against itself
    best = order[0]["metrics"]["measured_speedup"]
    err = pick.get("prediction_error")
    return p | {"winner": order[0], "runner_up": order[1] if len(order) > 1 else None, "best": best,
                "ran": {"off": bool(choice.get("off")), "why": choice.get("why"), "all": choice["measured_speedup"],
                        "first": choice["measured_speedup_first_done"],
                        "family": "off" if choice.get("off") or chosen is None else family(chosen)},
                "pick": pick, "pick_measured": pick_m,
                "pick_ok": None if pick_m is None else pick_m >= (1 - PICK_TOL) * best,
                "model_ok": None if err is None else abs(err) <= MODEL_TOL}


def name(p: dict) -> str:
    return f"{prefix_name(p['L'])} × {p['B']}"


# --- the heat map -----------------------------------------------------------------------------------------------------
def grid(points: list[dict]) -> dict:
    """One group's heat map as data: the batch sizes (columns) and prefixes (rows) present, the plan's measured
    all-reach speedup per cell (NaN: no record, or it does not fit) and each cell's text."""
    Bs, Ls = sorted({p["B"] for p in points}), sorted({p["L"] for p in points})
    speedup = np.full((len(Ls), len(Bs)), np.nan)
    text = np.full((len(Ls), len(Bs)), "", dtype=object)
    for p in points:
        i, j = Ls.index(p["L"]), Bs.index(p["B"])
        text[i, j] = cell_text(p)
        if p["skipped"] is None:
            speedup[i, j] = p["ran"]["all"]
    return {"B": Bs, "L": Ls, "speedup": speedup, "text": text}


def cell_text(p: dict) -> str:
    """A cell of the heat map and of the README's summary: the plan's speedup and family, "off", "does not fit"."""
    if p["skipped"] is not None:
        return "does not fit"
    return "off" if p["ran"]["off"] else f"{p['ran']['all']:.2f}×\n{p['ran']['family']}"


def heat_map(g: dict, title: str, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    values = g["speedup"][np.isfinite(g["speedup"])]
    low, high = min([*values, 0.95]), max([*values, 1.05])  # centred at 1 whatever the range
    cmap, norm = plt.get_cmap("RdBu").with_extremes(bad="white"), TwoSlopeNorm(1.0, low, high)
    fig, ax = plt.subplots(figsize=(1.5 * len(g["B"]) + 2.5, 0.85 * len(g["L"]) + 1.8))
    im = ax.imshow(np.ma.masked_invalid(g["speedup"]), cmap=cmap, norm=norm, aspect="auto", origin="lower")
    for i in range(len(g["L"])):
        for j in range(len(g["B"])):
            v = g["speedup"][i, j]
            if g["text"][i, j] == "does not fit":
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="0.9", hatch="//", edgecolor="0.6"))
            dark = np.isfinite(v) and np.dot(cmap(norm(v))[:3], (0.299, 0.587, 0.114)) < 0.5  # white text there
            ax.text(j, i, g["text"][i, j], ha="center", va="center", fontsize=7, color="white" if dark else "black")
    ax.set_xticks(range(len(g["B"])), [str(b) for b in g["B"]])
    ax.set_yticks(range(len(g["L"])), [prefix_name(L) for L in g["L"]])
    ax.set_xlabel("batch size B")
    ax.set_ylabel("prefix length")
    ax.set_title(title, fontsize=9)
    bar = fig.colorbar(im, ax=ax, label="the plan's speedup, all reach (median)")
    bar.set_ticks(sorted(set(np.round(np.r_[np.linspace(low, 1, 3), np.linspace(1, high, 5)], 2))))  # both sides of 1
    fig.tight_layout()
    files.save_figure(path, fig, "--out", dpi=120)
    plt.close(fig)
    return path


# --- the page ---------------------------------------------------------------------------------------------------------
def x3(v) -> str:
    return f"{v:.3f}×"


def span(m: dict, key: str) -> str:
    """A measurement's median [min–max] of its rounds, as the record holds them."""
    rng = m.get(f"{key}_range")
    value = m.get(key)
    if not number(value):
        return "—"
    return x3(value) + (f" [{rng[0]:.3f}–{rng[1]:.3f}]" if isinstance(rng, list) and len(rng) == 2 else "")


def share(flags: list[bool]) -> str:
    return f"{sum(flags)}/{len(flags)} ({sum(flags) / len(flags):.0%})" if flags else "—"


def checks(points: list[dict]) -> dict[str, tuple[list[bool], list[str]]]:
    """The planner's checks over timed points: (each point's result, the misses' descriptions)."""
    timed = [p for p in points if p["skipped"] is None]
    out = {}
    pick = [p for p in timed if p["pick_ok"] is not None]
    out["pick"] = ([p["pick_ok"] for p in pick],
                   [f"{name(p)} (pick {x3(p['pick_measured'])} vs best {x3(p['best'])})" for p in pick if not p["pick_ok"]]
                   + [f"{name(p)} (pick not timed)" for p in timed if p["pick_ok"] is None])
    model = [p for p in timed if p["model_ok"] is not None]
    out["model"] = ([p["model_ok"] for p in model],
                    [f"{name(p)} ({p['pick']['prediction_error']:+.1%})" for p in model if not p["model_ok"]])
    out["floor"] = ([p["ran"]["all"] >= PLAN_FLOOR for p in timed],
                    [f"{name(p)} ({x3(p['ran']['all'])})" for p in timed if p["ran"]["all"] < PLAN_FLOOR])
    return out


def with_misses(result: tuple[list[bool], list[str]]) -> str:
    flags, misses = result
    return share(flags) + (f"; misses: {', '.join(misses)}" if misses else "")


def findings(groups: dict) -> list[str]:
    lines = ["| device | decoding | points timed, does not fit | best point (the plan's run) | speculation off "
             f"| planner's pick within {PICK_TOL:.0%} of the measured best | cost model within {MODEL_TOL:.0%} "
             "(prediction error) |", "|---|---|---|---|---|---|---|"]
    for g, points in groups.items():
        timed = [p for p in points if p["skipped"] is None]
        best = max(timed, key=lambda p: p["ran"]["all"], default=None)
        off = [name(p) for p in timed if p["ran"]["off"]]
        c = checks(points)
        device = device_name(g)
        top = (f"{name(best)}: {x3(best['ran']['all'])} all reach, {x3(best['ran']['first'])} first done "
               f"({best['ran']['family']})" if best else "—")
        lines.append(f"| {device} | {g[2]} | {len(timed)}, {len(points) - len(timed)} | {top} "
                     f"| {len(off)}{': ' + ', '.join(off) if off else ''} | {with_misses(c['pick'])} "
                     f"| {with_misses(c['model'])} |")
    return lines


def model_rows(groups: dict) -> list[str]:
    """The cost model against every timed candidate (not only the picks), per drafter: how often its prediction
    was within MODEL_TOL of the all-reach median, and the errors' range (predicted / measured - 1)."""
    lines = [f"| device | decoding | drafter | candidates within {MODEL_TOL:.0%} | prediction errors (min, median, "
             "max) |", "|---|---|---|---|---|"]
    for g, points in groups.items():
        errors: dict[str, list[float]] = {}
        for p in points:
            for c in p["record"].get("candidates", []) if p["skipped"] is None else []:
                m = c["metrics"].get("measured_speedup")
                if number(m) and number(c.get("predicted_speedup")):
                    errors.setdefault(c["drafter"], []).append(c["predicted_speedup"] / m - 1)
        device = device_name(g)
        for drafter, e in sorted(errors.items()):
            e = sorted(e)
            lines.append(f"| {device} | {g[2]} | {drafter} | {share([abs(x) <= MODEL_TOL for x in e])} "
                         f"| {e[0]:+.1%}, {e[len(e) // 2]:+.1%}, {e[-1]:+.1%} |")
    return lines


def goal_rows(groups: dict) -> list[str]:
    lines = ["| goal | where | measured (the plan's run) | verdict |", "|---|---|---|---|"]
    for goal in GOALS:
        at = [p for g, points in groups.items() for p in points if goal.gpu in g[0] and g[1] == goal.world
              and prefix_name(p["L"]) == goal.prefix and p["B"] in goal.batches]
        if not at:
            lines.append(f"| {goal.text} | not in these records | — | not measured |")
        for p in at:
            if p["skipped"] is not None:
                lines.append(f"| {goal.text} | {group_title(p['group'])}, {name(p)} | does not fit | not measured |")
                continue
            ok = [(goal.all_reach is None or p["ran"]["all"] >= goal.all_reach),
                  (goal.first_done is None or p["ran"]["first"] >= goal.first_done)]
            lines.append(f"| {goal.text} | {group_title(p['group'])}, {name(p)} | {x3(p['ran']['all'])} all reach, "
                         f"{x3(p['ran']['first'])} first done ({p['ran']['family']}) | "
                         f"{'PASS' if all(ok) else '**MISS**'} |")
    every = [p for points in groups.values() for p in points]
    c = checks(every)
    for key, text, need in (("floor", f"Every point, 4K × 256 included: the plan's measured speedup ≥ {PLAN_FLOOR}",
                             1.0),
                            ("pick", f"The planner's pick within {PICK_TOL:.0%} of the best measured option at "
                                     f"≥ {SHARE:.0%} of the points", SHARE),
                            ("model", f"The cost model within {MODEL_TOL:.0%} of measurement at ≥ {SHARE:.0%} of the "
                                      "points", SHARE)):
        flags = c[key][0]
        verdict = "not measured" if not flags else "PASS" if sum(flags) >= need * len(flags) else "**MISS**"
        lines.append(f"| {text} | every device | {with_misses(c[key])} | {verdict} |")
    return lines


def pick_cell(p: dict) -> str:
    pick = p["pick"]
    m = p["pick_measured"]
    err = pick.get("prediction_error")
    return cell(f"{pick['label']}: predicted {pick['predicted_speedup']:.2f}×, "
                + (f"measured {x3(m)}" if m is not None else "not timed")
                + (f", error {err:+.1%}" if err is not None else ""))


def point_rows(points: list[dict]) -> list[str]:
    lines = ["| B | L | winner (measured) | first done | all reach | runner-up | the plan ran (all reach) "
             "| planner's pick | acceptance | gen_len | decoding |", "|" + "---|" * 11]
    for p in sorted(points, key=lambda p: (p["L"], p["B"])):
        r = p["record"]
        head = f"| {p['B']} | {prefix_name(p['L'])} |"
        if p["skipped"] is not None:
            lines.append(f"{head} does not fit: {cell(str(p['skipped']))} |" + " |" * 6 + f" {r.get('gen_len', '')} "
                         f"| {r['decoding']} |")
            continue
        w, up = p["winner"], p["runner_up"]
        if w is BASELINE:
            win, first, alls = "off: no option measured ≥ 1", "—", "—"
        else:
            win = cell(f"{w['label']} (γ {w.get('gamma')})")
            first, alls = span(w["metrics"], "measured_speedup_first_done"), span(w["metrics"], "measured_speedup")
        runner = "—" if up is None else "baseline" if up is BASELINE else \
            cell(f"{up['label']} {x3(up['metrics']['measured_speedup'])}")
        ran = p["ran"]
        ran_cell = cell(f"off: {ran['why']}" if ran["off"] else f"{ran['family']} {x3(ran['all'])}")
        source = (w if w is not BASELINE else {}).get("acceptance_source") or r["plan"].get("acceptance") or "—"
        lines.append(f"{head} {win} | {first} | {alls} | {runner} | {ran_cell} | {pick_cell(p)} | {cell(str(source))} "
                     f"| {r['gen_len']} | {r['decoding']} |")
    return lines


def about(points: list[dict]) -> str:
    """A group's shared facts, as its records state them (each value that differs between records listed)."""
    recs = [p["record"] for p in points]
    timed = [r for r in recs if r.get("skipped") is None]

    def values(get) -> str:
        found = list(dict.fromkeys(str(get(r)) for r in timed))
        return cell(", ".join(found)) if found else "—"
    weights = values(lambda r: "random weights" if r.get("random_weights") else "real weights")
    return (f"{values(lambda r: r.get('model'))} ({weights}); plan mode {values(lambda r: r['plan'].get('mode'))}, "
            f"selection: {values(lambda r: r['plan'].get('selection'))}; device profile "
            f"{values(lambda r: profile_name(r['plan'].get('profile')))}; acceptance "
            f"{values(lambda r: r['plan'].get('acceptance'))}")


def profile_name(path: str | None) -> str | None:
    """A committed profile as the repository names it (a record made elsewhere holds that machine's absolute path)."""
    where = "magicdec/analysis/profiles/"
    return path[path.index(where):] if path and where in path else path


def parse_point(text: str) -> tuple[int, str]:
    """--show_ranking B,L: (B, the prefix as prefix_name prints it); L in tokens (32768) or as printed (32K)."""
    m = re.fullmatch(r"\s*(\d+)\s*,\s*(\d+)\s*([kK]?)\s*", text)
    if not m:
        raise MagicDecError(f"--show_ranking {text!r}: give B,L (e.g. 12,32K or 12,32768)")
    return int(m.group(1)), f"{m.group(2)}K" if m.group(3) else prefix_name(int(m.group(2)))


def ranking_points(points: list[dict], asked: list[str]) -> list[tuple[int, str]]:
    """The points whose ranking the page prints: those asked for (each must be timed in the records), else three
    spread over the grid (the smallest, the middle and the largest of B × L)."""
    timed = sorted({(p["B"], p["L"]) for p in points if p["skipped"] is None}, key=lambda k: (k[0] * k[1], k))
    have = {(b, prefix_name(L)) for b, L in timed}
    if not asked and not timed:
        return []
    if not asked:
        return list(dict.fromkeys((timed[i][0], prefix_name(timed[i][1])) for i in (0, len(timed) // 2, -1)))
    out = [parse_point(a) for a in asked]
    for a, k in zip(asked, out):
        if k not in have:
            shown = ", ".join(f"{b},{L}" for b, L in sorted(have, key=lambda k: (k[0], k[1]))[:12])
            raise MagicDecError(f"--show_ranking {a}: no timed plan record at B {k[0]}, prefix {k[1]} in these folders; "
                                f"give one of: {shown}{' ...' if len(have) > 12 else ''}")
    return list(dict.fromkeys(out))


def ranking_table(p: dict) -> list[str]:
    r = p["record"]
    timed = {c["label"]: c["metrics"] for c in r["candidates"]}
    lines = ["| rank | option | γ | T_D/T_T | T_V/T_T | Ω | predicted speedup | acceptance | measured, all reach "
             "| measured, first done |", "|" + "---|" * 10]
    for row in sorted(r["plan"]["ranking"], key=lambda row: row.get("rank", 0))[:RANKING_ROWS]:
        m = timed.get(row.get("label"))
        meas = [span(m, "measured_speedup"), span(m, "measured_speedup_first_done")] if m else ["not timed"] * 2
        if row.get("label") == "baseline":
            meas = ["the baseline"] * 2
        num = lambda k, f="{:.3f}": f.format(row[k]) if number(row.get(k)) else "—"  # noqa: E731
        lines.append(f"| {row.get('rank')} | {cell(str(row.get('label')))} | {row.get('gamma')} | {num('T_D_over_T_T')} "
                     f"| {num('T_V_over_T_T')} | {num('omega', '{:.2f}')} | {num('speedup')} "
                     f"| {cell(str(row.get('acceptance')))} | {meas[0]} | {meas[1]} |")
    return lines


def page(groups: dict, pngs: dict, shown: list[tuple[int, str]], dirs: list[Path], out: Path, command: str) -> str:
    links = ", ".join(f"[`{d}`]({os.path.relpath(d.resolve(), out.resolve())})" for d in dirs)
    parts = [f"{MADE_BY} from {' '.join(map(str, dirs))}: the next report into this folder replaces this page -->",
             "# The speedup atlas", "", "## Findings", "", *findings(groups), "", "## The goals", "", *goal_rows(groups),
             "", "## The cost model per drafter", "", *model_rows(groups),
             "", f"Made by `{command}` from the plan records in {links}. *all reach*: decode tokens/s over the "
             "baseline's, every sequence generating gen_len tokens; *first done*: stopped when the first sequence is "
             "done (MagicDec's convention); each the median [min–max] of the record's interleaved rounds. *the plan's "
             "run*: the option the planner ran (its `choice`: the rank-1 option in mode auto, the best of K measured "
             "in mode confirm; \"off\": the baseline); *winner*: the fastest option measured at the point; "
             "*prediction error*: the pick's predicted / measured − 1.", "", "## Heat maps", ""]
    for g in groups:
        parts += [f"![{group_title(g)}]({pngs[g].name})", ""]
    parts += ["## Every point", ""]
    for g, points in groups.items():
        parts += [f"### {group_title(g)}", "", about(points), "", *point_rows(points), ""]
    parts += ["## The planner's ranking beside measurement", "",
              f"The record's top {RANKING_ROWS} rows of the planner's ranking (its prediction, before timing), with "
              "what was measured for each option that was timed.", ""]
    for B, L in shown:
        for g, points in groups.items():
            for p in points:
                if p["skipped"] is None and p["B"] == B and prefix_name(p["L"]) == L:
                    parts += [f"### {group_title(g)}: {name(p)}", "", *ranking_table(p), ""]
    return "\n".join(parts)


# --- the README's summary -----------------------------------------------------------------------------------------------
def summary(groups: dict, link: str) -> str:
    parts = [f"The speedup atlas ([its page]({link})): per device, the plan's measured speedup (all reach, median) "
             "at each prefix L and batch B, with the family it ran; \"off\": the baseline ran.", ""]
    for g, points in groups.items():
        d = grid(points)
        parts += [f"**{group_title(g)}**", "", "| L \\ B | " + " | ".join(map(str, d["B"])) + " |",
                  "|---" * (len(d["B"]) + 1) + "|"]
        for L, row in zip(d["L"], d["text"]):
            parts.append(f"| {prefix_name(L)} | " + " | ".join(t.replace("\n", " ") for t in row) + " |")
        parts.append("")
    return "\n".join(parts).rstrip()


def readme_text(path: Path) -> str:
    """The README, checked to hold each atlas-summary marker once, start before end."""
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MagicDecError(f"--readme {path}: cannot read it ({(str(e).splitlines() or [''])[0]}); give the README "
                            "to update") from None
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise MagicDecError(f"--readme {path}: needs the lines `{START}` and `{END}` once each, in that order, where "
                            f"the atlas's summary goes (found {text.count(START)} and {text.count(END)}); add them")
    return text


def with_summary(text: str, body: str) -> str:
    """The README's text with only what lies between the markers replaced."""
    a, b = text.index(START) + len(START), text.index(END)
    return f"{text[:a]}\n{body}\n{text[b:]}"


# --- the command ------------------------------------------------------------------------------------------------------
def check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise MagicDecError(f"--out {out} is a file: give a folder for the page and its heat maps")
    files.writable_folder(out, "--out")
    mine = out / PAGE
    if mine.exists():
        with mine.open(encoding="utf-8", errors="replace") as f:
            if not f.readline().startswith(MADE_BY):
                raise MagicDecError(f"--out: {mine} exists and was not made by magicdec report atlas, so it will not be "
                                    "replaced: choose another --out or move that file away")


def slug(g: tuple[str, int, str]) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", f"{g[0]} tp{g[1]} {g[2]}").strip("-")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="magicdec report atlas", description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", type=Path, nargs="+", metavar="DIR", help="folders of plan records (a sweep's --output_dir)")
    p.add_argument("--out", type=Path, required=True, help=f"folder for {PAGE} and the heat maps (atlas_*.png)")
    p.add_argument("--readme", type=Path, default=None,
                   help=f"a README whose lines between `{START}` and `{END}` become the atlas's summary table")
    p.add_argument("--show_ranking", action="append", default=[], metavar="B,L",
                   help="a point whose ranking the page prints beside measurement (repeatable; default: three "
                        "points spread over the grid)")
    a = p.parse_args(argv)
    if a.readme is not None:
        readme_text(a.readme)  # checked now, read again when written
    points = [point(r) for r in load(a.dirs)]
    shown = ranking_points(points, a.show_ranking)
    check_out(a.out)
    if a.readme is not None:
        files.writable_folder(a.readme.resolve().parent, "--readme")
    groups: dict = {}
    for pt in sorted(points, key=lambda pt: pt["group"]):
        groups.setdefault(pt["group"], []).append(pt)
    pngs = {g: heat_map(grid(pts), group_title(g), a.out / f"atlas_{slug(g)}.png") for g, pts in groups.items()}
    text = page(groups, pngs, shown, a.dirs, a.out, "magicdec report atlas " + shlex.join(argv))
    files.write_text(a.out / PAGE, text + "\n", "--out")
    print(text)
    if a.readme is not None:
        link = os.path.relpath((a.out / PAGE).resolve(), a.readme.resolve().parent)
        files.write_text(a.readme, with_summary(readme_text(a.readme), summary(groups, link)), "--readme")
        print(f"wrote the atlas summary into {a.readme}")
    print(f"wrote {a.out / PAGE} and {len(pngs)} heat map(s)")
    return 0
