"""Every registered drafter side by side over one shared prefill: what the harness is for, on any machine.

    magicdec compare                      # SmolLM2-135M (real weights) on a book, greedy and sampled, on this machine

The target's cache is prefilled once; each drafter (each of its `variants`) is prepared over it and generates, timed
in turns with the plain baseline. For each: acceptance α, acceptance length (tokens per verification Ω), tokens per
verification of the whole batch, its cost terms measured here (T_D/T_T, T_V/T_T), whether its greedy output equals
plain decoding's, and the cost model's prediction of its speedup for a real serving shape (Llama-3.1-8B at 32K on an
H100, from the committed device profile in magicdec/analysis/profiles/) at the α measured here: a prediction, labelled so.
The speed measured on this machine is shown too, and says it is no claim where the machine is a CPU (decode is
memory-bound only on a GPU; on a CPU verification is compute-bound).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from magicdec.analysis import cost_model as cm
from magicdec import device as dev
from magicdec import drafters, files
from magicdec import options as opt
from magicdec.harness import timing
from magicdec.config import check_context, ModelArgs
from magicdec.harness.engine import Engine
from magicdec.errors import MagicDecError
from magicdec.harness.run_config import RunConfig, writable_folder
from magicdec.harness.trial import Timed, Trial

PROFILES = cm.PROFILES
SAMPLED = {"temperature": 0.6, "top_p": 0.9}
DEFAULT_SHAPES = "HuggingFaceTB/SmolLM2-135M"  # the default target's (SmolLM2-135M-Instruct's) shapes


def trained_heads(folder: Path | None) -> dict[str, Path]:
    """drafter name -> the trained head under `folder` for it (--heads: one subfolder per head, as train-head --out
    writes them)."""
    if folder is None:
        return {}
    if not folder.is_dir():
        raise MagicDecError(f"--heads {folder}: no such folder; give the folder holding heads trained by magicdec "
                            "train-head (one subfolder each)")
    from magicdec.model import heads
    found = {}
    for d in sorted(p for p in folder.iterdir() if p.is_dir()):
        try:
            name = drafters.canonical(heads.detect(d))
        except MagicDecError:
            continue  # not a head: other files may share the folder
        if name in found:
            raise MagicDecError(f"--heads {folder}: {found[name].name} and {d.name} both hold a {name} head; keep one")
        found[name] = d
    if not found:
        raise MagicDecError(f"--heads {folder} holds no trained head (a subfolder with a head's config.json and "
                            "weights, as magicdec train-head --out writes)")
    return found


def variants(base: dict, engine: Engine, heads: dict[str, Path], given: dict) -> list[dict]:
    """Every variant of every registered drafter: its name, options, config (greedy), the models it loads, or why
    it cannot run here (a check of the config, or of the engine against the models' configs and memory), or why it
    has nothing to measure (a head drafter given no trained head). `given`: options the side by side has for any
    drafter that takes them (a draft model, a datastore)."""
    out = []
    for name, kind in drafters.registry().items():
        takes = {k: v for k, v in given.items() if v is not None and k in opt.keys(kind.Config)}
        for extra in kind.variants:
            options = base | {"drafter": name} | takes | extra | ({"head": str(heads[name])} if name in heads else {})
            v = {"drafter": name, "options": options, "why": None, "untrained": None}
            v["cfg"] = RunConfig.from_options(options, strict=False)
            try:
                v["cfg"].check()
                v["untrained"] = kind.untrained(v["cfg"])
                if v["untrained"] is None:
                    v["models"] = engine.check(v["cfg"])
            except MagicDecError as e:
                v["why"] = str(e)
            out.append(v)
    return out


def prediction(options: dict, summary: dict | None, alpha: float | None, gamma: int, a, profile) -> dict:
    """The cost model's speedup for this drafter config at the prediction shape (random weights: shapes only), on
    the profiled device (cost_model.load_profile's)."""
    if not alpha:
        return {"none": "no acceptance measured" if alpha is None else "no drafted token was kept (alpha 0)"}
    device, overheads, _ = profile
    shape = {"random_weights": True, "model_name": a.predict_model, "B": a.predict_B, "prefix_len": a.predict_prefix,
             "gen_len": a.gen_len, "device": "cpu", "dataset": "stdlib"}
    drop = {"model", "tokenizer", "dataset", "head"} | ({"draft"} if options.get("draft") != "ngram" else set())
    cfg = RunConfig.from_options({k: v for k, v in options.items() if k not in drop} | shape, strict=False)
    kind = cfg.drafter
    if kind.models(cfg):
        return {"none": f"no draft model of {a.predict_model}'s shapes named for the prediction"}
    device = cm.Device(**(vars(device) | {"verify_overhead_s": overheads.get(kind.name, 0.0)}))
    p = kind.predict(cfg, ModelArgs.from_name(a.predict_model), {}, device, alpha, gamma, cfg.lookahead, summary)
    return p or {"none": f"the cost model has no model of {kind.name}"}


def check_options(a) -> None:
    """Every option of the side by side, before any model is converted or loaded."""
    counts = {"--B": a.B, "--prefix_len": a.prefix_len, "--gen_len": a.gen_len, "--gamma": a.gamma,
              "--repeats": a.repeats, "--predict_B": a.predict_B, "--predict_prefix": a.predict_prefix}
    for flag, value in counts.items():
        if value < 1:
            raise MagicDecError(f"{flag} {value}: give a positive count" +
                                (" (the side by side compares drafts: each drafts at least one token)"
                                 if flag == "--gamma" else ""))
    if a.repeats > timing.MAX_ROUNDS:
        raise MagicDecError(f"--repeats {a.repeats}: at most {timing.MAX_ROUNDS} timed rounds per drafter")
    if a.skip_tokens < 0:
        raise MagicDecError(f"--skip_tokens {a.skip_tokens}: give 0 or more tokens to skip at the book's start")
    target = ModelArgs.from_name(DEFAULT_SHAPES) if a.model is None else \
        ModelArgs.from_checkpoint_dir(a.model if a.model.is_dir() else a.model.parent)
    check_context(target, a.prefix_len, a.gen_len + a.gamma + 1, "gen_len + gamma + 1", f"{target.name}'s")
    predicted = ModelArgs.from_name(a.predict_model)
    if a.predict_prefix + a.gen_len + a.gamma + 1 > predicted.max_seq_len:
        raise MagicDecError(f"--predict_prefix {a.predict_prefix} + gen_len + gamma + 1 exceeds {predicted.name}'s "
                            f"context of {predicted.max_seq_len} tokens: lower --predict_prefix")


def compare(a) -> dict:
    check_options(a)
    base = {"B": a.B, "prefix_len": a.prefix_len, "gen_len": a.gen_len, "gamma": [a.gamma], "dataset": a.dataset,
            "skip_tokens": a.skip_tokens, "progress": False} | ({"model": a.model} if a.model else {}) | \
        ({"device": a.device} if a.device else {})
    target = RunConfig.from_options(base, strict=False)
    target.check()
    if a.output:
        writable_folder(a.output.parent, f"--output {a.output}")
    profile = cm.load_profile(a.profile)
    heads = trained_heads(a.heads)
    engine = Engine(target)
    engine.check(target)  # the baseline's own shape and memory: every row is timed beside it
    with tempfile.TemporaryDirectory(prefix="magicdec_compare_") as tmp:
        given = {"draft": str(a.draft) if a.draft else None,
                 "datastore": str(a.datastore) if a.datastore else other_books_datastore(engine, target, Path(tmp))}
        return side_by_side(a, base, target, engine, profile, variants(base, engine, heads, given))


def other_books_datastore(engine: Engine, target: RunConfig, folder: Path) -> str | None:
    """REST's datastore for the side by side, where the prompts come from a folder of books: the folder's other
    books (the prompts' own left out, or the draft would read the answers), tokenized by the target's tokenizer."""
    from magicdec import data
    from magicdec.drafters.datastore import Datastore

    w = target.workload
    source = data.resolve_source(w.dataset)
    tokenizer = engine.load_tokenizer()
    if source.kind != "folder" or tokenizer is None:
        return None
    data.load_prompts(tokenizer, w.B, w.prefix_len, source, w.skip_tokens, bos_id=engine.target_config.bos_id)
    own = {name for name, _ in source.used}
    books = [b for b in sorted(Path(source.location).glob("*.txt")) if b.name not in own]
    if not books:
        return None
    docs = [tokenizer.encode(b.read_text(encoding="utf-8", errors="replace"), bos=False) for b in books]
    path = folder / "other_books.npz"
    Datastore.build(docs, tokenizer, [b.name for b in books]).save(path)
    return str(path)


def side_by_side(a, base: dict, target: RunConfig, engine: Engine, profile, found: list[dict]) -> dict:
    runnable = [v for v in found if v["why"] is None and v["untrained"] is None]
    engine.load_target()
    queries = max((v["cfg"].drafter.prefill_queries(v["cfg"]) for v in runnable), default=0)
    ahead = max((v["cfg"].lookahead for v in runnable), default=0)
    trial = Trial(engine, target, queries=queries, ahead=ahead)  # one prefill, shared by every drafter
    batch = trial.batch
    modes = {"greedy": {}, "sampled": SAMPLED} if not a.greedy_only else {"greedy": {}}
    record = {"command": "magicdec compare " + " ".join(a.argv), "model_config": engine.target_config.to_dict(),
              "prompt_source": batch.prompt_source, "prefill_s": batch.seconds,
              "environment": dev.environment(engine.device),
              "prediction": {"model": a.predict_model, "B": a.predict_B, "prefix_len": a.predict_prefix,
                             "profile": profile[2]}, "rows": []}
    print_heading(record, a)
    table = Table(record)
    rows = record["rows"]
    for v in found:  # what does not run says so first
        if v["why"] is not None or v["untrained"] is not None:
            rows += [variant_row(v, mode) | ({"skipped": v["why"]} if v["why"] else {"untrained": v["untrained"]})
                     for mode in modes]
    table.print_rows(rows)
    with tqdm(total=len(runnable) * len(modes), desc="drafters", unit="row", disable=not a.progress,
              leave=False) as bar:
        def emit(row: dict) -> None:
            rows.append(row)
            table.print_rows([row], bar)
            bar.update()

        for mode, sampling in modes.items():
            measure(trial, RunConfig.from_options(base | sampling, strict=False), runnable, mode, sampling, a, profile,
                    bar, emit)
            dev.release_memory(engine.device)
    print(table.legend)
    files.write_record(a.output, record)
    return record


def variant_row(v: dict, mode: str) -> dict:
    return {"drafter": v["drafter"], "label": v["cfg"].describe(), "decoding": mode, "options": v["options"]}


def measure(trial: Trial, base_cfg: RunConfig, runnable: list[dict], mode: str, sampling: dict, a, profile, bar,
            emit) -> None:
    """Every runnable variant prepared over the shared prefill, then timed with the plain baseline in rounds from
    the same prompt (one machine state for all; each round's speculative runs pair with its baseline run): each
    variant's row goes to `emit` as soon as its rounds and the baseline's are done."""
    engine, made, decoders = trial.engine, [], []
    with torch.inference_mode():
        for v in runnable:
            bar.set_postfix_str(f"preparing {v['cfg'].describe()}, {mode}")
            cfg = RunConfig.from_options(v["options"] | sampling)
            drafter, draft_s, notes = trial.prepare(cfg, v["models"])
            made.append(variant_row(v, mode) | {"draft_preparation_s": draft_s, "preparation_notes": notes or None})
            decoders.append(engine.decoder(cfg, drafter, a.gamma))
        decoders = [engine.decoder(base_cfg)] + decoders
        done: dict[int, Timed] = {}

        def on_done(i: int, timed: Timed) -> None:
            done[i] = timed
            if 0 not in done:  # each row's speedup divides by the baseline's rounds
                return
            for j in ([i] if i else sorted(done)[1:]):
                emit(variant_result(made[j - 1], done[j], done[0], sampling, a, profile))

        bar.set_postfix_str(f"timing, {mode}")
        trial.time(decoders, base_cfg, repeats=a.repeats, on_done=on_done)


def variant_result(row: dict, timed: Timed, base: Timed, sampling: dict, a, profile) -> dict:
    """A variant's row: its metrics against the baseline's timed in the same rounds, and the cost model's
    prediction at the α measured."""
    m = timed.metrics(a.B, base.metrics(a.B), a.gamma)
    out, b_out = timed.out, base.out
    summary = m["speculation"].get("drafter")
    return row | {"alpha": m["alpha"], "acceptance_length": m["omega"],
                  "tokens_per_verification": m["omega_effective"], "T_D_over_T_T": m.get("T_D_over_T_T"),
                  "T_V_over_T_T": m.get("T_V_over_T_T"), "measured_speedup": m.get("measured_speedup"),
                  "equals_plain_decoding": bool(torch.equal(out, b_out)) if not sampling else None,
                  "drafter_summary": summary,
                  "predicted": prediction(row["options"] | sampling, summary, m["alpha"], a.gamma, a, profile)}


def f(x, fmt="{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def print_heading(record: dict, a) -> None:
    prof = record["prediction"]["profile"]
    print(f"{record['model_config'].get('name')}, {a.B} x {a.prefix_len} tokens ({record['prompt_source']}), "
          f"{a.gen_len} generated, gamma {a.gamma}; prefill {f(record['prefill_s'])} s, shared by every drafter")
    print(f"predicted: the cost model for {a.predict_model} at {a.predict_B} x {a.predict_prefix} on "
          f"{prof.get('device')} (profile measured {prof.get('measured')}) at the alpha measured here: a prediction, "
          "not a measurement")


class Table:
    """The side by side's rows, printed as each completes (above the progress bar), in fixed columns."""
    HEAD = ("drafter", "decoding", "alpha", "acceptance length", "tokens / verification", "T_D/T_T here",
            "T_V/T_T here", "predicted speedup", "speedup here", "output = plain greedy")
    WIDTHS = (42, 8, 6, 10, 12, 8, 8, 10, 28, 6)

    def __init__(self, record: dict):
        env = record["environment"]
        self.gpu = "gpu" in env
        here = env.get("gpu") or f"{env.get('cpu', '')} CPU".strip()
        self.legend = ("alpha: drafted tokens kept / examined; acceptance length: tokens per verification (kept + "
                       "the target's own); T_D/T_T, T_V/T_T: a draft step and a verification over a plain decode "
                       f"step on this machine ({here}); speedup here: against plain decoding timed in turns with "
                       "it on this machine" + ("" if self.gpu else ", where a CPU's figure is no speed claim "
                                               "(verification is compute-bound on a CPU; decode is memory-bound "
                                               "only on a GPU)"))
        self.header_printed = False

    def line(self, cells) -> str:
        return "  ".join(f"{str(c):<{w}}" for c, w in zip(cells, self.WIDTHS)).rstrip()

    def cells(self, r: dict) -> list:
        if "skipped" in r:
            return [r["label"], r["decoding"], "not run: " + r["skipped"]]
        if "untrained" in r:
            return [r["label"], r["decoding"], r["untrained"]]
        p = r["predicted"]
        speed = f(r["measured_speedup"]) + "x"
        if not self.gpu:
            speed += " (CPU: no claim)"
        elif not r["alpha"]:
            speed += " (nothing kept)"
        return [r["label"], r["decoding"], f(r["alpha"], "{:.3f}"), f(r["acceptance_length"]),
                f(r["tokens_per_verification"]), f(r["T_D_over_T_T"]), f(r["T_V_over_T_T"]),
                f(p["speedup"]) + "x" if "speedup" in p else p.get("none", "no model"), speed,
                {True: "yes", False: "NO", None: "—"}[r["equals_plain_decoding"]]]

    def print_rows(self, rows: list[dict], bar=None) -> None:
        def write(line: str) -> None:  # above the bar, and at once: a pipe would hold it back
            (bar.write if bar is not None else print)(line)
            sys.stdout.flush()

        for r in rows:
            if not self.header_printed:
                write(self.line(self.HEAD))
                self.header_printed = True
            cells = self.cells(r)
            write(self.line(cells) if len(cells) > 3 else "  ".join(
                f"{str(c):<{w}}" for c, w in zip(cells[:2], self.WIDTHS)) + "  " + cells[2])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="magicdec compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="the target's model.pth (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dataset", default=None,
                   help="where the prompt comes from (as magicdec run --dataset; default: the public-domain Gutenberg "
                        "books that ship with the tests, in a clone; else auto: PG-19 when reachable, else Python's "
                        "docs)")
    p.add_argument("--skip_tokens", type=int, default=8000, help="tokens skipped at the start of the book")
    p.add_argument("--B", type=int, default=1, help="batch size")
    p.add_argument("--prefix_len", type=int, default=2048, help="prompt length in tokens")
    p.add_argument("--gen_len", type=int, default=32,
                   help="tokens generated per sequence (32 keeps the job within 2 minutes on a 2-core CPU)")
    p.add_argument("--gamma", type=int, default=3, help="tokens drafted per verification")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per drafter and baseline, in turns")
    p.add_argument("--greedy_only", action="store_true", help="skip the sampled (T 0.6, top-p 0.9) runs")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when a GPU is visible)")
    p.add_argument("--profile", type=Path, default=PROFILES / "h100.json",
                   help="the device profile the predictions use (measured bandwidth, matmul rate, fixed costs)")
    p.add_argument("--predict_model", default="meta-llama/Meta-Llama-3.1-8B", help="the shapes predicted for")
    p.add_argument("--predict_prefix", type=int, default=32768, help="the prompt length predicted for")
    p.add_argument("--predict_B", type=int, default=8, help="the batch size predicted for")
    p.add_argument("--draft", type=Path, default=None,
                   help="the standalone draft's model.pth (a small model sharing the target's tokenizer); without it "
                        "the standalone row says it needs one")
    p.add_argument("--datastore", type=Path, default=None,
                   help="REST's datastore (magicdec datastore); default: built here from the dataset folder's other "
                        "books, the prompts' own left out")
    p.add_argument("--heads", type=Path, default=None,
                   help="a folder of heads trained by magicdec train-head, one subfolder each (--out DIR/eagle, "
                        "DIR/medusa, ...): their drafters are compared with them; without one a head drafter has "
                        "nothing of its own to measure and its row says so")
    p.add_argument("--no_progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--output", type=Path, default=None, help="write the side by side as JSON here")
    a = p.parse_args(argv)
    a.argv = argv
    if a.dataset is None:  # a book, offline and the same everywhere: the excerpts a clone carries for its tests
        books = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "gutenberg"
        a.dataset = str(books) if books.is_dir() else "auto"
    compare(a)
    return 0


if __name__ == "__main__":
    from magicdec.errors import one_line_errors

    with one_line_errors():
        raise SystemExit(main())
