"""Whether a hand-written results page's speedups come from its records.

A page's figures, in its tables: each `1.234×` (a speedup), `1.26–1.45×` (two of them: the ends of a span of points)
and `[1.118–1.181]` (the min–max of one measurement's rounds, with the figure before it, if any, their median). Each
must equal, at its printed precision, what its records hold or derive by the project's one rule:
- a measurement's rounds: a list under a key naming a speedup (`measured_speedup_rounds`); each round's ratio of a
  run over its baseline of the same round (`metrics` over `baseline_metrics`: `round_tokens_per_s`, else the
  baseline's `round_s` over the run's, rounds that decoded the same tokens); the runs of one interleaved call
  (sibling entries each with a `tokens_per_s` list of its rounds), each one's rates and any two's ratios round by
  round; a ratio stored with its rounds (`{"per_round": [...]}` under a key naming a ratio, or a `rounds` list
  beside a key naming a ratio: `{"T_V_over_T_T": 1.2, "rounds": [...]}`). A range is such a
  list's min and max, and a figure written just before it is the same list's median;
- a single figure: a number under a key naming a speedup or another ratio (`T_V_over_T_T`, `vs_bf16`; not a
  prediction's), or any round, median, min or max above.
A page's records are the JSON files under its folder and those it links (`[text](path)` or `` `path` ``: a record,
a folder of them, or another page, whose folder then counts).

Exempt, by a narrow rule: a figure written after, in its clause (the text between `|`, `;` and sentence ends), the
name of another source or of a model: the word "paper", a paper's name followed by ":" or "≈" ("MagicDec: 1.84×",
"QuantSpec ≈ 2.5×"; MagicDec, TriForce, Spec-Bench, QuantSpec, Sequoia), "predict" (predicted, prediction) or "cost
model"; and a bound, a figure written right after "≥", "≤", "<" or ">" (a goal). A figure before such a name is
checked: "1.84× (the paper's)" is not exempt.

    python -m magicdec.harness.pages results/heads/README.md   # each figure no record backs, with its line
"""
from __future__ import annotations

import itertools
import json
import re
import statistics
import sys
from pathlib import Path

FIGURE = re.compile(r"(?<![\d.])(\d+\.\d+)(?:–(\d+\.\d+))?×")
RANGE = re.compile(r"(?:(?<![\d.])(\d+\.\d+)×?\**\s*)?\[(?:rounds )?(\d+\.\d+)–(\d+\.\d+)[\],]")
CLAUSE = re.compile(r"\||;|\.\s")
# a paper named as the source ("MagicDec: 1.84×"); not the drafters' names (EAGLE, Hydra, ...), which name our runs too
EXEMPT = re.compile(r"\bpaper|predict|cost model|\b(?:MagicDec|TriForce|Spec-Bench|QuantSpec|Sequoia)\s*[:≈]",
                    re.IGNORECASE)
BOUND = re.compile(r"[≥≤<>]\s*\**\s*$")
RATIO = re.compile(r"speedup|ratio|_over_|(?:^|_)vs_")  # a key holding a speedup or another ratio
LINK = re.compile(r"\]\(([^)\s#]+)\)|`([^`\s]+)`")


def numbers(value) -> list[float] | None:
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 for v in value):
        return [float(v) for v in value]
    return None


def paired(mine: list[float], base: list[float], seconds: bool = False) -> list[float] | None:
    if mine and base and len(mine) == len(base) and all(mine) and all(base):
        return [b / a if seconds else a / b for a, b in zip(mine, base)]
    return None


def rounds(record) -> list[list[float]]:
    """Every list of a measurement's rounds a record holds or derives (see the module's doc)."""
    out = []
    if isinstance(record, dict):
        mine, base = record.get("metrics"), record.get("baseline_metrics")
        if isinstance(mine, dict) and isinstance(base, dict):
            ratios = paired(numbers(mine.get("round_tokens_per_s")), numbers(base.get("round_tokens_per_s"))) or \
                paired(numbers(mine.get("round_s")), numbers(base.get("round_s")), seconds=True)
            out += [ratios] if ratios else []
        runs = [numbers(v.get("tokens_per_s")) for v in record.values() if isinstance(v, dict)]
        runs = [r for r in runs if r and len(r) > 1]
        out += runs + [r for a, b in itertools.permutations(runs, 2) if (r := paired(a, b))]
        if any(RATIO.search(str(k).lower()) for k in record) and len(numbers(record.get("rounds")) or []) > 1:
            out.append(numbers(record["rounds"]))  # a ratio beside its rounds ({"T_V_over_T_T": ..., "rounds": [...]})
        for key, value in record.items():
            if "speedup" in str(key).lower() and numbers(value) and len(value) > 1:
                out.append(numbers(value))
            if RATIO.search(str(key).lower()) and isinstance(value, dict) and len(numbers(value.get("per_round")) or
                                                                                   []) > 1:
                out.append(numbers(value["per_round"]))  # a ratio stored with its rounds: {"per_round": [...], ...}
            out += rounds(value)
    elif isinstance(record, list):
        for value in record:
            out += rounds(value)
    return out


def singles(record) -> list[float]:
    """Every speedup or other ratio a record stores (not a prediction's: a key or a parent naming one or the cost
    model)."""
    out = []
    if isinstance(record, dict):
        for key, value in record.items():
            key = str(key).lower()
            if "predict" in key or key == "cost_model":
                continue
            if RATIO.search(key) and isinstance(value, (int, float)) and not isinstance(value, bool):
                out.append(float(value))
            out += singles(value)
    elif isinstance(record, list):
        for value in record:
            out += singles(value)
    return out


def linked(page: Path, text: str, root: Path) -> set[Path]:
    """The records a page links: JSON files, folders of them, other pages' folders (not results/ or the root)."""
    found, wide = set(), {root.resolve(), (root / "results").resolve()}
    for m in LINK.finditer(text):
        target = (m.group(1) or m.group(2)).rstrip("/.,")
        for base in (page.parent, root):
            p = (base / target).resolve()
            if p.is_file() and p.suffix == ".md":
                p = p.parent
            if p.is_file() and p.suffix == ".json":
                found.add(p)
            elif p.is_dir() and p not in wide and p.is_relative_to(root.resolve()):
                found.update(p.rglob("*.json"))
    return found


def records(page: Path, text: str, root: Path) -> list[Path]:
    folder = page.parent.resolve()
    own = set() if folder in (root.resolve(), (root / "results").resolve()) else set(folder.rglob("*.json"))
    return sorted(own | linked(page, text, root))


def printed(value: float, like: str) -> str:
    return f"{value:.{len(like.split('.')[1])}f}"


def unbacked(page: Path, root: Path, lines: list[str] | None = None) -> list[tuple[str, str]]:
    """(figure, its line) for each figure in the page's tables (or the given lines) that no record of the page backs
    (a range: "[min–max]", with its median before it if the page writes one)."""
    text = page.read_text(encoding="utf-8")
    lists, held = [], []
    for f in records(page, text, root):
        try:
            record = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        lists += rounds(record)
        held += singles(record)
    held += [x for r in lists for x in (*r, statistics.median(r))]
    out = []
    for line in [ln for ln in text.splitlines() if ln.lstrip().startswith("|")] if lines is None else lines:
        for clause in CLAUSE.split(line):
            medians = set()
            for m in RANGE.finditer(clause):
                median, lo, hi = m.groups()
                medians.add(m.start(1))  # the figure before a range is checked with it, as its median
                if EXEMPT.search(clause[:m.start()]):
                    continue
                if not any(printed(min(r), lo) == lo and printed(max(r), hi) == hi and
                           (median is None or printed(statistics.median(r), median) == median) for r in lists):
                    out.append((f"{median + ' ' if median else ''}[{lo}–{hi}]", line))
            for m in FIGURE.finditer(clause):
                if m.start() in medians or EXEMPT.search(clause[:m.start()]) or BOUND.search(clause[:m.start()]):
                    continue
                out += [(x, line) for x in m.groups() if x and not any(printed(v, x) == x for v in held)]
    return out


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[2]
    for name in sys.argv[1:]:
        for figure, line in unbacked(Path(name), root):
            print(f"{name}: {figure} not in its records: {line[:140]}")
