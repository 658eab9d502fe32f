"""What the planner predicts each option at: its acceptance inputs, as `magicdec plan --acceptance FILE.json`,
`magicdec run --plan_acceptance` and a sweep's [plan] table give them. The file maps an option's label (its drafter
and flags) or a drafter's name to a rate, or to {"alpha": a, "siblings": [...], "positions": [...], "bottom": b,
"trace": "record.json", "source": "...", "sequence_factors": [...]}: a tree's later candidates' rates, a chain's
per-position conditional rates, the hierarchy's middle's rate of its bottom's tokens, a run record whose acceptance
trace a random-weight chain replays (relative to the file's folder), where the rates came from, a tree's
per-sequence acceptance over its batch's; a top-level "_meta" object (the producer's notes) is not read. Bad input:
one line naming the entry and what to give."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from magicdec.analysis import cost_model as cm
from magicdec.errors import MagicDecError

IID_LABEL = "iid α, sensitivity"


@dataclass(frozen=True)
class Acceptance:
    """What an option is predicted at: its first candidate's rate, a tree's later candidates' rates, a chain's
    per-position conditional rates, the hierarchy's bottom rate; and where they came from."""
    alpha: float
    siblings: tuple[float, ...] = ()
    positions: tuple[float, ...] = ()
    bottom: float | None = None
    source: str = IID_LABEL
    trace: Path | None = None  # a record whose acceptance trace a random-weight chain replays
    sequence_factors: tuple[float, ...] = ()  # a tree's per-sequence acceptance over its batch's, in its real run

    def chain_alpha(self, gamma: int) -> float:
        """The iid rate that yields what the per-position rates yield over gamma drafted tokens (positions past the
        list at alpha)."""
        return cm.positions_alpha(self.positions, self.alpha, gamma) if self.positions else self.alpha

    def run_options(self, tree: bool, shaped: bool = True, levels: bool = False) -> dict:
        """This acceptance as a random-weight run draws it (synthetic acceptance): a tree's first and later
        candidates' rates (`levels`, a drafter measured per level of its guesses: the first's rate per level, its
        per-position rates); a chain's trace replayed, else its per-position rates, else its rate (`shaped`: with the
        trace, positions or sequence factors; without, the rates alone, which decide whether the option runs here)."""
        out = {"synthetic_acceptance": self.alpha}
        if tree:
            return out | ({"synthetic_siblings": list(self.siblings)} if self.siblings else {}) | (
                {"synthetic_sequence_factors": list(self.sequence_factors)} if shaped and self.sequence_factors else {}) | (
                {"synthetic_positions": list(self.positions)} if shaped and levels and self.positions else {})
        if shaped and self.trace is not None:
            return out | {"acceptance_trace": str(self.trace)}
        if shaped and self.positions:
            return out | {"synthetic_positions": list(self.positions)}
        return out


def rate(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise MagicDecError(f"{what} {value!r}: an acceptance rate must be a number in [0, 1]")
    return float(value)


def rates(values, what: str) -> tuple[float, ...]:
    if not isinstance(values, (list, tuple)):
        raise MagicDecError(f"{what} {values!r}: give a list of rates in [0, 1]")
    return tuple(rate(v, what) for v in values)


ENTRY_KEYS = ("alpha", "siblings", "positions", "bottom", "trace", "source", "sequence_factors")
META = "_meta"  # the producer's notes (its command, model, date): not read


def acceptance_entry(value, key: str, path: Path, flag: str = "--acceptance") -> Acceptance:
    where = f"{flag} {path}: {key!r}"
    if not isinstance(value, dict):
        return Acceptance(rate(value, where), source=f"{path.name}: {key}")
    unknown = set(value) - set(ENTRY_KEYS)
    if unknown or "alpha" not in value:
        raise MagicDecError(f"{where}: give a rate or {{\"alpha\": a[, \"siblings\": [...], \"positions\": [...], "
                            f"\"bottom\": b, \"trace\": \"record.json\", \"source\": \"...\"]}}"
                            + (f", not {sorted(unknown)[0]!r}" if unknown else ""))
    for text in ("trace", "source"):
        if text in value and not (isinstance(value[text], str) and value[text]):
            raise MagicDecError(f"{where}: {text} {value[text]!r}: give a " + (
                "record's path, relative to this file's folder" if text == "trace" else "sentence"))
    return Acceptance(rate(value["alpha"], where), rates(value.get("siblings", []), where),
                      rates(value.get("positions", []), where),
                      None if value.get("bottom") is None else rate(value["bottom"], where),
                      value.get("source") or f"{path.name}: {key}",
                      path.parent / value["trace"] if "trace" in value else None,
                      factors(value.get("sequence_factors", []), where))


def factors(values, where: str) -> tuple[float, ...]:
    if not isinstance(values, list) or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not
                                           (0 <= v < math.inf) for v in values):
        raise MagicDecError(f"{where}: sequence_factors {values!r}: give a list of numbers >= 0 (each sequence's "
                            "acceptance over its batch's)")
    return tuple(float(v) for v in values)


def load_acceptance(path: Path | None, flag: str = "--acceptance") -> dict[str, Acceptance]:
    if path is None:
        return {}
    try:
        given = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MagicDecError(f"{flag} {path}: cannot read it as JSON ({type(e).__name__}: {e}); give a file "
                            "mapping option labels or drafter names to acceptance rates") from None
    if not isinstance(given, dict):
        raise MagicDecError(f"{flag} {path}: give a JSON object mapping option labels or drafter names to rates")
    return {k: acceptance_entry(v, k, Path(path), flag) for k, v in given.items() if k != META}
