"""Greedy speculation's ids against plain decoding's, on a device, for every registered drafter: its example options as
a chain, each of its `compare` variants, a token tree (`--tree_width 2`) where it drafts trees, a Sequoia-shaped tree
(`--tree_nodes`) where it drafts shaped ones, the forwards only some options make (a refresh's scores, a
re-indexed window, a windowed head's KV), and the self-draft's compositions the planner ranks (each low-bit weight
format as a chain and as trees, each quantized KV copy). Random weights at llama-68m's shapes, so the check is losslessness, not
acceptance; under `--step_mode cuda_graphs` every step, proposal and tree acceptance is replayed from a graph keyed by
its forward plan, which the CPU tests cannot reach.

    python benchmarks/greedy_check.py --device cuda --dtype float32 --output greedy_check.json

A drafter that needs a file this script cannot make (REST's datastore: `--datastore FILE` adds it) is listed as not
run, with the reason."""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from magicdec import drafters, files  # noqa: E402
from magicdec.cli import run_record  # noqa: E402
from magicdec.device import environment  # noqa: E402
from magicdec.errors import MagicDecError  # noqa: E402
from magicdec.options import as_flags  # noqa: E402
from magicdec.harness.sweep_grid import parse_shard  # noqa: E402

SHAPED = ["--tree_nodes", "12", "--tree_rates", "0.8", "0.5", "0.4"]
# forwards that only these options make: (drafter, options)
EXTRA = [("selfspec", {"refresh": 2, "draft_policy": "snapkv"}), ("selfspec", {"reindex": True}),
         ("eagle", {"head_kv": "full", "head_budget": None, "head_sinks": None}),
         ("eagle", {"eagle3": True, "eagle3_layers": [1, 2]}),
         ("eagle", {"dynamic_tree_nodes": 12, "dynamic_tree_topk": 4}),  # EAGLE-2's topology as device data
         ("eagle", {"eagle3": True, "eagle3_layers": [1, 2], "dynamic_tree_nodes": 12, "dynamic_tree_topk": 4}),
         ("hierarchy", {"draft": None, "draft_name": "JackFram/llama-68m"})]
# what a run names besides the example: the draft model; a budget above SnapKV's 32-token observation window
GIVEN = {"standalone": {"draft_name": "JackFram/llama-68m"}, "hierarchy": {"draft": "ngram"},
         "selfspec": {"draft_budget": 128}}
NEEDS = {"rest": "datastore"}  # drafter -> the option naming a file it needs
# the compositions the planner ranks and the atlas reports: each low-bit draft weight format as a chain, a width-2
# tree and a Sequoia-shaped tree; each quantized draft KV copy as a chain
TREES = ({}, {"tree_width": 2}, {"tree_nodes": 12, "tree_rates": [0.8, 0.5, 0.4]})
COMPOSED = [("selfspec", {"draft_weights": w} | tree) for w in ("int8", "fp8", "int4") for tree in TREES] + \
    [("selfspec", {"draft_kv": kv}) for kv in ("int8", "int4")]


def cases(datastore: str | None, only: str | None = None) -> tuple[list[tuple[str, list[str]]], dict[str, str]]:
    """(drafter, its flags) to check, and the drafters not run with the reason; `only`: "compositions" (COMPOSED's)
    or "extras" (EXTRA's and COMPOSED's: the forwards and compositions no drafter's example makes)."""
    todo, skipped = [], {}
    for name, kind in ({} if only else drafters.registry()).items():
        given = GIVEN.get(name, {}) | ({"datastore": datastore} if name in NEEDS and datastore else {})
        if name in NEEDS and not datastore:
            skipped[name] = f"needs --{NEEDS[name]} FILE"
            continue
        example = dict(kind.example) | given
        base = ["--drafter", name, *as_flags(example)]
        todo.append((name, base))
        for variant in kind.variants:
            if variant:
                todo.append((name, ["--drafter", name, *as_flags(example | variant)]))
        if kind.supports_trees:
            todo.append((name, base + ["--tree_width", "2"]))
        if kind.drafts_shaped_trees:
            todo.append((name, base + SHAPED))
    for name, extra in ([] if only == "compositions" else EXTRA) + COMPOSED:  # True: a switch; None: a key dropped
        if name in drafters.names():
            options = drafters.get(name).example | GIVEN.get(name, {}) | extra
            todo.append((name, ["--drafter", name, *as_flags(options)]))
    seen = set()
    return [c for c in todo if not ((key := (c[0], tuple(c[1]))) in seen or seen.add(key))], skipped


def quietly(argv: list[str]) -> dict:
    """run_record without its printed summary."""
    with contextlib.redirect_stdout(io.StringIO()):
        return run_record(argv)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--step_mode", default="cuda_graphs")
    p.add_argument("--prefix_len", type=int, default=1536)
    p.add_argument("--gen_len", type=int, default=128)
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--gamma", type=int, default=3)
    p.add_argument("--datastore", help="a REST datastore (magicdec datastore) for the rest drafter")
    p.add_argument("--only", choices=["compositions", "extras"], default=None,
                   help="compositions: only the self-draft's low-bit weight and KV compositions (COMPOSED); extras: "
                        "those and the forwards only some options make (EXTRA: EAGLE-2's dynamic trees among them)")
    p.add_argument("--match", nargs="+", default=None, metavar="TEXT",
                   help="only the configurations whose flags contain one of these (e.g. 'draft_weights int4' "
                        "'draft_kv'): what an earlier call did not reach")
    p.add_argument("--shard", default="1/1",
                   help="I/N: every N-th configuration from the I-th (N GPUs each check a part, into its own --output)")
    p.add_argument("--output", type=Path, required=True,
                   help="the JSON, rewritten after each configuration (a run cut short keeps what it checked)")
    a = p.parse_args(argv)
    common = ["--random_weights", "--model_name", "JackFram/llama-68m", "--prefix_len", str(a.prefix_len), "--B",
              str(a.B), "--gen_len", str(a.gen_len), "--device", a.device, "--dtype", a.dtype, "--step_mode",
              a.step_mode, "--save_tokens", "--no_progress", "--ignore_eos"]
    try:
        todo, skipped = cases(a.datastore, a.only)
        if a.match:
            todo = [c for c in todo if any(m in " ".join(c[1]) for m in a.match)]
            if not todo:
                raise MagicDecError(f"--match {a.match}: no configuration's flags contain any of them; give a "
                                    "drafter's option as it is written in EXTRA or COMPOSED, e.g. 'draft_kv'")
        shard, shards = parse_shard(a.shard)
        todo = todo[shard - 1::shards]
        reference = quietly(common)["generated_ids"]
        out = {"environment": environment(torch.device(a.device)), "options": " ".join(common), "gamma": a.gamma, "shard": a.shard,
               "rows": [], "planned": len(todo), "not_run": skipped, "all_same": True}
        for name, extra in todo:
            record = quietly(common + ["--gamma", str(a.gamma)] + extra)
            same = record["generated_ids"] == reference
            m = record["metrics"]
            out["rows"].append({"drafter": name, "options": " ".join(extra[2:]), "same_ids": same,
                                "acceptance_length": m.get("acceptance_length"), "iterations": m.get("iterations")})
            out["all_same"] = out["all_same"] and same
            files.write_json(a.output, out, "the greedy check")
            print(f"{name:10s} {' '.join(extra[2:]):60s} same ids: {same}", flush=True)
        rows = out["rows"]
        print(f"{sum(r['same_ids'] for r in rows)} of {len(rows)} configurations give plain decoding's ids"
              + (f"; not run: {skipped}" if skipped else ""))
        return 0 if out["all_same"] else 1
    except MagicDecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
