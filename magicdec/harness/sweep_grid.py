"""A sweep file (TOML) read into its grid of points: the run options every point shares, its axes, the tables of
its methods, checked against the run options and the drafters before anything runs.

The file's keys are run options (`magicdec run --help`), shared by every point; a list is an axis (one point per
value), except `skip_tokens`, whose list is several batches of prompts every point is timed on (their totals
recorded, each batch's own numbers under "batches"). Options of a drafter apply to the drafters that take them;
a table named after a method holds what applies to it alone:

    model_name = "meta-llama/Meta-Llama-3.1-8B"   # any run option
    prefix_len = [32768]                          # an axis
    B = [1, 4, 13]
    gamma = [2, 3]
    decoding = ["greedy", "sampled"]              # greedy, or sampled at temperature 0.6, top-p 0.9
    methods = ["baseline", "selfspec", "lookup", "auto"]   # baseline, any drafter, auto (the planner), plan
    synthetic_acceptance = 0.8                    # a number, or {"4096" = 0.84, "100000" = 0.79} (log-interpolated)
    [selfspec]
    draft_policy = ["streaming", "snapkv"]
    [lookup]
    synthetic_acceptance = 0.5                    # a drafter's own acceptance rate
    [auto]
    drafter = "selfspec"                          # what the planner drafts with; budgets: the draft_budget axis
    tree_width = [1, 3]                           # optional: chain or token tree (a tree: chain <-> tree per verification)
    tree_nodes = [0, 20, 32]                      # optional: Sequoia trees of these many nodes too (0: none)
    [plan]                                        # every drafter's options ranked, as `magicdec run --plan`
    confirm = 3                                   # time the top 3, keep the measured best (0 or absent: auto)
    acceptance = "acceptance.json"                # rates per option (else synthetic_acceptance: iid, sensitivity)
    profile = "magicdec/analysis/profiles/h100.json"   # optional (default: this GPU's); top = 20: rows kept

A plan point is one per (prefix_len, B, decoding), recorded as `magicdec run --plan` records (harness/plan_run.py),
on the first batch of prompts, after its group's other points.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from magicdec import drafters
from magicdec import options as opt
from magicdec.errors import MagicDecError
from magicdec.harness import plan_run
from magicdec.harness.run_config import PLAN_ACCEPTANCE, RUN_OPTIONS, SECTIONS, SPECULATIVE_ONLY, RunConfig
from magicdec.model import draft_weights as dw

MODES = {"greedy": {"temperature": 0.0, "top_p": 1.0, "top_k": 0},
         "sampled": {"temperature": 0.6, "top_p": 0.9, "top_k": 0}}  # the sampled mode every real-model α reports
SWEEP_KEYS = {"methods": None, "decoding": ["greedy"], "history": [], "skip_tokens": 8000,
              "synthetic_acceptance": None}
# the keys of sweep files written before the run config (results/*/sweep.toml), as they are named now
RENAMED = {"prefix_lens": "prefix_len", "batch_sizes": "B", "budgets": "draft_budget", "gammas": "gamma",
           "draft_policies": "draft_policy", "modes": "decoding"}
AXIS_LISTS = {"gamma"}  # list-valued options whose flat list in a sweep file is an axis (several gammas: one each)
# the run options a sweep file takes (where a record goes is the sweep's; what a plan takes, its [plan] table)
TAKEN = RUN_OPTIONS - opt.keys(SECTIONS["output"]) - opt.keys(SECTIONS["plan"])
PLANNERS = ("baseline", "auto", "plan")  # the methods that are no drafter


@dataclass
class Point:
    """One run of the grid: its config, the method it belongs to, its readable name, and for auto what the
    planner chooses among."""
    method: str
    cfg: RunConfig  # auto: the base drafter's config at its smallest budget (the planner picks the budget)
    name: str = ""
    candidates: dict | None = None  # auto: the budgets and gammas the planner chooses among

    @property
    def key(self) -> str:
        """The record's file name: readable, then the hash of everything that changes the point's result."""
        identity = self.cfg.hash() if self.candidates is None else hashlib.sha256(json.dumps(
            [self.cfg.identity(), self.candidates], sort_keys=True).encode()).hexdigest()[:12]
        return f"{self.name}_{identity}"


def load_config(path: Path) -> dict:
    """The sweep file's keys, legacy names renamed, checked against the run options and the drafters."""
    try:
        given = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise MagicDecError(f"cannot read sweep config {path}: {e}") from None
    cfg = {RENAMED.get(k, k): v for k, v in given.items()}
    if "prefill_backend" in cfg:
        raise MagicDecError(f"{path}: prefill_backend is gone: attn_backend serves prefill and decode alike (auto: "
                            "triton on a GPU, which prefills through flex attention)")
    known = set(SWEEP_KEYS) | TAKEN
    tables = {k for k, v in cfg.items() if isinstance(v, dict) and k != "synthetic_acceptance"}
    drafter_keys = set().union(*(opt.keys(k.Config) for k in drafters.registry().values()))
    unknown = sorted(set(cfg) - known - drafter_keys - tables - {"draft"})
    if unknown:
        raise MagicDecError(f"{path}: unknown keys {unknown}; a sweep takes run options (magicdec run --help), "
                            f"{sorted(SWEEP_KEYS)}, and a table per method")
    cfg = SWEEP_KEYS | cfg
    if cfg["methods"] is None:
        raise MagicDecError(f"{path}: name the methods: methods = [\"baseline\", ...] (any of {drafters.names()}, "
                            "auto: the planner's budget, and plan: its ranking of every drafter's options)")
    if "auto" in cfg["methods"] and "drafter" not in (cfg.get("auto") or {}):
        raise MagicDecError(f"{path}: method auto plans a drafter's budget: name it in an [auto] table (drafter = "
                            f"\"{drafters.names()[0]}\", one of {drafters.names()})")
    if "plan" in cfg["methods"] and "acceptance" not in (cfg.get("plan") or {}) and cfg["synthetic_acceptance"] is None:
        raise MagicDecError(f"{path}: method plan ranks with acceptance: give a [plan] table's acceptance = "
                            "\"FILE.json\" (rates per option) or synthetic_acceptance = A (iid, a sensitivity)")
    for key in ("methods", "decoding", "history"):
        if not isinstance(cfg[key], list) or not all(isinstance(v, str) for v in cfg[key]):
            raise MagicDecError(f"{path}: {key} must be a list of names, got {cfg[key]!r}")
    if not cfg["methods"]:
        raise MagicDecError(f"{path}: methods is empty: name the methods to run (any of {drafters.names()}, baseline, "
                            "and auto: the planner)")
    try:
        methods = [m if m in PLANNERS else drafters.canonical(m) for m in cfg["methods"]]
    except MagicDecError as e:
        raise MagicDecError(f"{path}: methods: {e}") from None
    cfg["methods"] = methods
    for table in tables:
        if table not in methods:
            raise MagicDecError(f"{path}: table [{table}] names no method of this sweep (methods: {methods})")
        check_table(path, table, cfg[table])
    for where, table in [("", cfg)] + [(f"[{t}] ", cfg[t]) for t in tables]:
        check_synthetic(path, where, table.get("synthetic_acceptance"))
    bad = set(cfg["decoding"]) - set(MODES)
    if bad or not cfg["decoding"]:
        raise MagicDecError(f"{path}: decoding must be among {list(MODES)}, got {cfg['decoding']}")
    missing = [h for h in cfg["history"] if not Path(h).is_dir()]
    if missing:
        raise MagicDecError(f"{path}: history directories {missing} do not exist: give earlier sweeps' output_dirs")
    skips = batch_skips(cfg)
    if not skips or any(not isinstance(k, int) or isinstance(k, bool) or k < 0 for k in skips) or \
            len(set(skips)) < len(skips):
        raise MagicDecError(f"{path}: skip_tokens must be a non-negative integer or a list of distinct ones (one batch "
                            f"of prompts each), got {cfg['skip_tokens']!r}")
    return cfg


def check_table(path, method: str, table: dict) -> None:
    """A method's table holds options that method takes: the run's (not where its record goes), its drafter's, and
    for auto the drafter it plans; another drafter's option there would be dropped without a word. [plan] holds
    the plan's own keys (plan_run.table_options)."""
    if method == "plan":
        plan_run.table_options(path, table)
        return
    base = table.get("drafter") if method == "auto" else method
    if method == "auto" and not isinstance(base, str):
        raise MagicDecError(f"{path}: [auto] drafter = {base!r}: name the drafter the planner plans, one of "
                            f"{drafters.names()}")
    try:
        kind = drafters.get(base) if base != "baseline" else None
    except MagicDecError as e:
        raise MagicDecError(f"{path}: [{method}] drafter: {e}") from None
    own = TAKEN | (opt.keys(kind.Config) if kind else set())
    if kind is None:
        own -= SPECULATIVE_ONLY
    unknown = sorted(set(table) - own - ({"drafter"} if method == "auto" else set()))
    if unknown:
        owners = drafters.owners(unknown[0])
        whose = f"an option of {', '.join(owners)}" if owners else "no run option (magicdec run --help)"
        raise MagicDecError(f"{path}: [{method}] {unknown[0]} is {whose}, not of {base}: move it to its method's table "
                            "or drop it")


def check_synthetic(path, where: str, given) -> None:
    """synthetic_acceptance: a rate, or a table of rates by prefix length (interpolated in log prefix)."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if given is None or number(given) or (isinstance(given, dict) and given and all(
            k.isdigit() and int(k) > 0 and number(v) for k, v in given.items())):
        return
    raise MagicDecError(f"{path}: {where}synthetic_acceptance = {given!r}: give a rate in [0, 1], or rates by prefix "
                        'length, e.g. {"4096" = 0.84, "100000" = 0.79}')


def batch_skips(cfg: dict) -> list[int]:
    """Where each batch's prompts start in the books: `skip_tokens` is one batch, or a list of several."""
    skip = cfg["skip_tokens"]
    return list(skip) if isinstance(skip, list) else [skip]


def synthetic_alpha(given, prefix: int) -> float | None:
    """The acceptance rate to simulate at this prefix: one number, or a table interpolated in log(prefix)."""
    if given is None or isinstance(given, (int, float)):
        return given
    pts = sorted((int(k), float(v)) for k, v in given.items())
    if prefix <= pts[0][0]:
        return pts[0][1]
    for (p0, a0), (p1, a1) in zip(pts, pts[1:]):
        if prefix <= p1:
            return a0 + (a1 - a0) * (math.log(prefix) - math.log(p0)) / (math.log(p1) - math.log(p0))
    return pts[-1][1]


def axes(values: dict) -> list[dict]:
    """Every combination of the list-valued keys (an axis each), the others as they are. A list-valued option
    (rank_group) is an axis only as a list of lists; gamma's flat list is an axis."""
    def as_axis(key, value):
        if not isinstance(value, list):
            return [value]
        if key in LIST_OPTIONS and key not in AXIS_LISTS:
            return value if value and all(isinstance(v, list) for v in value) else [value]
        return value
    keys = sorted(values)
    grids = [as_axis(k, values[k]) for k in keys]
    for k, g in zip(keys, grids):
        if not g:
            raise MagicDecError(f"sweep key {k} is an empty list: give at least one value")
    return [dict(zip(keys, combo)) for combo in itertools.product(*grids)]


LIST_OPTIONS = {f.name for s in SECTIONS.values() for f in opt.fields(s) if f.metadata["nargs"]} | \
    {f.name for k in drafters.registry().values() for f in opt.fields(k.Config) if f.metadata["nargs"]}


def none_words(values: dict) -> dict:
    """TOML has no null: the word "none" stands for an option left unset (refresh off)."""
    def fix(v):
        if isinstance(v, list):
            return [fix(x) for x in v]
        return None if v == "none" else v
    return {k: fix(v) for k, v in values.items()}


def points_of(cfg: dict, path: str = "") -> tuple[list[Point], dict[str, dict[str, int]]]:
    """Every point of the grid (baselines first in each group), and why points were left out (per method: reason ->
    count)."""
    run_keys = RUN_OPTIONS
    shared = {k: v for k, v in cfg.items() if k not in SWEEP_KEYS and not isinstance(v, dict)}
    out, dropped = [], {}
    for method in cfg["methods"]:
        table = dict(cfg.get(method) or {})
        planned_by = plan_run.table_options(path, table) if method == "plan" else {}  # a plan point's: the baseline's
        table = {} if method == "plan" else table
        base = drafters.canonical(table.pop("drafter")) if method == "auto" else method
        kind = drafters.get(base) if base not in ("baseline", "plan") else None
        own = run_keys | (opt.keys(kind.Config) if kind else set())
        if kind is None:  # the baseline takes no speculation option; a plan, its iid rates
            own -= opt.keys(SECTIONS["speculation"]) - (PLAN_ACCEPTANCE if planned_by else set())
        values = {k: v for k, v in (shared | table).items() if k in own}
        synthetic = table.get("synthetic_acceptance", cfg.get("synthetic_acceptance")) if kind or planned_by else None
        values.pop("synthetic_acceptance", None)
        candidates = None
        if method == "auto":  # one point: the planner picks the budget, AutoGamma the gamma per verification
            budgets = values.pop("draft_budget", [256])
            gammas = values.pop("gamma", [1, 2, 3, 4])
            budgets, gammas = (budgets if isinstance(budgets, list) else [budgets],
                               gammas if isinstance(gammas, list) else [gammas])
            values |= {"gamma": ["auto"], "max_gamma": max(gammas), "draft_budget": min(budgets)}
            candidates = {"budgets": sorted(budgets), "gammas": sorted(set(gammas)), "formats": None}
            if "draft_weights" in values:  # the planner chooses the format too; memory is checked for the largest copy
                formats = values["draft_weights"] if isinstance(values["draft_weights"], list) else \
                    [values["draft_weights"]]
                values["draft_weights"] = max(formats, key=lambda f: 0 if f == "bf16" else dw.BITS[f])
                candidates["formats"] = formats
                if values["draft_weights"] != "int4" and "draft_group" in values:  # int4's, applied if chosen
                    candidates["draft_group"] = values.pop("draft_group")
            if "tree_width" in values:  # the planner chooses chain or tree (a tree: AutoGamma switches chain <-> tree)
                widths = values.pop("tree_width")
                candidates["widths"] = sorted(set(widths if isinstance(widths, list) else [widths]))
            if "tree_nodes" in values:  # ... or a Sequoia tree of so many nodes, as deep as the planned gamma
                nodes = values.pop("tree_nodes")
                candidates["nodes"] = sorted(set(nodes if isinstance(nodes, list) else [nodes]))
        for mode in cfg["decoding"]:
            for point_values in axes(none_words(values)):
                point_values |= MODES[mode] | {"skip_tokens": batch_skips(cfg)[0], "progress": False} | (
                    {"drafter": base} if kind else {}) | planned_by
                alpha = synthetic_alpha(synthetic, point_values.get("prefix_len", 4000))
                if alpha is not None:
                    point_values["synthetic_acceptance"] = alpha
                if candidates:
                    prefix = point_values.get("prefix_len", 4000)
                    fitting = [b for b in candidates["budgets"] if b < prefix]
                    point_values["draft_budget"] = min(fitting or candidates["budgets"])
                point_cfg = RunConfig.from_options(point_values, strict=False, where=f"{path}: ")  # bad values: raise
                try:
                    point_cfg.check()
                except MagicDecError as e:  # a combination the run refuses (a budget beyond a prefix): left out
                    dropped.setdefault(method, {})
                    dropped[method][str(e)] = dropped[method].get(str(e), 0) + 1
                    continue
                point = Point(method, point_cfg, candidates=candidates)
                point.name = point_name(point, mode)
                out.append(point)
    order = {"baseline": 0}
    out.sort(key=lambda p: (p.cfg.workload.prefix_len, p.cfg.workload.B, order.get(p.method, 1)))
    return out, dropped


def point_name(point: Point, mode: str) -> str:
    c = point.cfg
    label = point.method if point.method in ("auto", "plan") else c.describe().replace(" ", "-").replace(">", "-")
    gamma = "" if point.method in PLANNERS else "_g" + "-".join(map(str, c.speculation.gamma))
    return f"{label}_P{c.workload.prefix_len}_B{c.workload.B}_{mode}{gamma}"


def group_key(point: Point) -> tuple:
    """Points that share a target cache and prefilled prompts: same target, batch, prompts and runtime."""
    w, r, m = point.cfg.workload, point.cfg.runtime, point.cfg.models
    return (w.prefix_len, w.B, w.dataset, w.seed, m.model, m.model_name, m.random_weights, m.tokenizer,
            r.step_mode, r.offload, r.on_chip, r.skip_prefill, r.prefill_chunk)


def shard_of(points: list[Point], i: int, n: int) -> list[Point]:
    """Shard i of n (1-based): every n-th group of points that share a target cache, counted in the grid's order, so
    that n GPUs of one host each run one shard into their own folder (the report reads the folders together)."""
    keys = list(dict.fromkeys(map(group_key, points)))
    if n > len(keys):
        raise MagicDecError(f"--shard {i}/{n}: the grid has {len(keys)} groups of points (a context and a batch each); "
                            f"give at most {len(keys)} shards")
    mine = set(keys[i - 1::n])
    return [p for p in points if group_key(p) in mine]


def parse_shard(text: str, where: str = "each run into its own --output_dir") -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not 1 <= int(m[1]) <= int(m[2]):
        raise MagicDecError(f"--shard {text}: give I/N with 1 <= I <= N (e.g. --shard 2/4: the second of four "
                            f"shards, {where})")
    return int(m[1]), int(m[2])


def planned(cfg: RunConfig, planner: dict) -> RunConfig:
    """An auto point's config at the planner's choice (its budget, and its weight format where it chose one; a
    width-W tree at its width, AutoGamma then choosing a chain or the tree and its depth per verification; a Sequoia
    tree at its nodes and gamma, which then runs fixed: the planner chose its shape for the batch)."""
    fmt = planner.get("draft_weights")
    chosen = {"draft_weights": fmt} if fmt else {}
    if fmt == "int4" and planner.get("draft_group"):
        chosen["draft_group"] = planner["draft_group"]
    if (planner.get("tree_width") or 1) > 1:
        chosen["tree_width"] = planner["tree_width"]
    if planner.get("tree_nodes"):
        chosen |= {"tree_nodes": planner["tree_nodes"], "gamma": [planner["gamma"]]}
    return replace_options(cfg, draft_budget=planner["budget"], **chosen)


def room_ahead(point: Point) -> int:
    """What a point's caches hold past the prompt; an auto point choosing among trees, its largest."""
    candidates = point.candidates or {}
    widths, nodes = candidates.get("widths") or [1], candidates.get("nodes") or [0]
    largest = point.cfg.speculation.largest
    return point.cfg.lookahead + max(largest * (max(widths) - 1), max(nodes) - 1 - largest, 0)


def replace_options(cfg: RunConfig, **changes) -> RunConfig:
    """The config with some options changed (a new frozen config: nothing is mutated)."""
    given = cfg.options() | changes
    if changes.get("drafter") == "baseline":
        given = {k: v for k, v in given.items() if k in RUN_OPTIONS}
        given = {k: v for k, v in given.items() if k not in opt.keys(SECTIONS["speculation"]) or k == "drafter"}
    return RunConfig.from_options(given, strict=False)
