"""magicdec beside gpt-fast (the design it follows) on one GPU: the same weights, prompt tokens, prefix and token
counts, greedy, timed in interleaved rounds.

gpt-fast runs from a checkout given as a path (--gpt_fast DIR; never copied here): its model.py's `Transformer` holds
magicdec's random weights, tensor for tensor (wqkv's q and k rows reordered to its interleaved RoPE: a copy; every
other tensor shared), and its generate.py's own functions run it: `prefill`, then `decode_n_tokens` with
`decode_one_token` compiled as its `main` compiles it (torch.compile, reduce-overhead, fullgraph) for plain decoding;
`speculative_decode`, with `model_forward` compiled too, in the loop its `generate` runs it in, for speculative
decoding with a draft model. gpt-fast's speculative_decode fails at batch 1 since its batched generation (its issue
#209), so --gpt_fast_speculative DIR2 names a checkout of an earlier commit whose generate.py drives that phase, over
DIR's model.py. magicdec runs as `magicdec run` does: the engine (magicdec/harness/engine.py) prefills, prepares a standalone
draft over its full KV cache, and its Decoder runs on CUDA graphs.

Each phase (a prefix length, plain or speculative) warms both engines up (gpt-fast: compilation and its CUDA graphs;
magicdec: graph capture), then times --rounds rounds, each running gpt-fast and magicdec once, the order alternating
from round to round. A round's ratio is magicdec's decode tokens/s over gpt-fast's; the figure is the median of the
rounds' ratios with their min and max. Plain decoding also reports the bytes a decode step must read (weights + the
KV of the tokens before it) over its time, as a fraction of the GPU's measured copy bandwidth, for both engines.
Writes OUTPUT/gpt_fast_peer.json after every phase.

    python benchmarks/gpt_fast_peer.py --gpt_fast ../gpt-fast --gpt_fast_speculative ../gpt-fast-bc04265 \
        --output results/gpt_fast_peer
"""
import argparse
import contextlib
import importlib
import importlib.util
import statistics
import subprocess
import sys
import time
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from magicdec import device as dev
from magicdec import files
from magicdec.harness import metrics as met
from magicdec.config import ModelArgs
from magicdec.harness.engine import Engine, first_tokens
from magicdec.errors import MagicDecError
from magicdec.decoding.generate import decode
from magicdec.harness.run_config import RunConfig

MIN_ROUNDS = 3
GPT_FAST = "https://github.com/pytorch-labs/gpt-fast"
RECORD = "gpt_fast_peer.json"
# gpt-fast has no greedy switch: its sampler at temperature 0 divides the logits by 1e-5, so its softmax is one-hot at
# the argmax and the exponential race picks it (exact ties between logits are broken at random, not by index)
GREEDY = {"temperature": 0.0, "top_k": None}
CLOCKS = {
    "gpt-fast": "wall clock (time.perf_counter) from an idle GPU (torch.cuda.synchronize) to the end of the decode "
                "loop (synchronize again): decode_n_tokens' gen_len - 1 steps, or the speculative_decode loop to "
                "gen_len tokens; its prefill before, not timed (gpt-fast's own clock is the same wall clock around "
                "generate, prefill included)",
    "magicdec": "the decode loop's own wall clock (Decoder.seconds): from its first host sync to its last, one sync "
                "per iteration, as every magicdec run is timed; its prefill before, not timed"}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpt_fast", type=Path, required=True, metavar="DIR",
                   help=f"a checkout of {GPT_FAST} (its generate.py and model.py are imported from there)")
    p.add_argument("--gpt_fast_commit", metavar="HASH",
                   help="the commit DIR holds, where DIR is no git checkout (a copy of one); checked against its git "
                        "where it is one")
    p.add_argument("--gpt_fast_speculative", type=Path, metavar="DIR2",
                   help="another checkout whose generate.py drives the speculative phase (over DIR's model.py): "
                        "gpt-fast's speculative_decode fails at batch 1 since its batched generation (commit 61c193d, "
                        "its issue #209); bc04265, the commit before, runs it (default: DIR's)")
    p.add_argument("--gpt_fast_speculative_commit", metavar="HASH", help="the commit DIR2 holds (as --gpt_fast_commit)")
    p.add_argument("--output", type=Path, required=True, metavar="DIR", help=f"the record goes to DIR/{RECORD}")
    p.add_argument("--model_name", default="meta-llama/Meta-Llama-3.1-8B",
                   help="the target's shapes (magicdec/config.py KNOWN_MODELS); random weights")
    p.add_argument("--draft_name", default="meta-llama/Llama-3.2-1B",
                   help="the draft's shapes, random weights; the target's name drafts with the target's own weights")
    p.add_argument("--prefix_lens", type=int, nargs="*", default=[4096, 32768],
                   help="plain decoding at these (none: speculative only)")
    p.add_argument("--speculative_prefix_lens", type=int, nargs="*", default=[32768],
                   help="speculative decoding at these (none: plain only)")
    p.add_argument("--gen_len", type=int, default=128, help="tokens per run, the prefill's first included")
    p.add_argument("--gamma", type=int, default=5, help="tokens drafted per verification, both engines "
                                                        "(gpt-fast's speculate_k)")
    p.add_argument("--rounds", type=int, default=MIN_ROUNDS, help=f"interleaved rounds, at least {MIN_ROUNDS}")
    p.add_argument("--gpt_fast_prefill_chunk", type=int, default=2048,
                   help="gpt-fast's prefill in chunks of this many tokens through its own forward (not timed): one "
                        "32K-token forward would hold 8 GB of logits")
    p.add_argument("--seed", type=int, default=0, help="random weights and prompt ids")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no_progress", action="store_true", help="no progress bars (the stage lines stay)")
    return p.parse_args(argv)


# ---------------------------------------------------------------- bad input, before anything loads

def check_checkout(folder: Path, flag: str = "--gpt_fast") -> Path:
    if not folder.is_dir():
        raise MagicDecError(f"{flag} {folder}: no such folder; clone {GPT_FAST} and pass its path")
    missing = [name for name in ("generate.py", "model.py") if not (folder / name).is_file()]
    if missing:
        raise MagicDecError(f"{flag} {folder} has no {' or '.join(missing)}: pass the root of a {GPT_FAST} "
                            "checkout")
    return folder.resolve()


def checkout_commit(folder: Path, given: str | None, flag: str = "--gpt_fast") -> tuple[str, str]:
    """(gpt-fast's commit, where it was read): the folder's own git (its top level, not a repository around it),
    else the commit given (FLAG_commit); both must agree."""
    def git(*args):
        try:
            out = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    head = git("rev-parse", "HEAD") if top and Path(top).resolve() == folder else None
    if head and given and not head.startswith(given) and not given.startswith(head):
        raise MagicDecError(f"{flag}_commit {given} contradicts {folder}'s git HEAD {head}: drop it or check out "
                            "that commit")
    if head:
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return head, f"git rev-parse HEAD in {flag}{' (uncommitted changes)' if dirty else ''}"
    if given:
        return given, f"{flag}_commit"
    raise MagicDecError(f"{flag} {folder} is no git checkout, so its commit is unknown: pass {flag}_commit HASH (the "
                        "commit it was copied from)")


def check_cli(cli) -> None:
    if cli.rounds < MIN_ROUNDS:
        raise MagicDecError(f"--rounds {cli.rounds}: at least {MIN_ROUNDS} interleaved rounds (a median and its "
                            "spread)")
    for flag, values in (("--prefix_lens", cli.prefix_lens), ("--speculative_prefix_lens", cli.speculative_prefix_lens),
                         ("--gen_len", [cli.gen_len]), ("--gamma", [cli.gamma]),
                         ("--gpt_fast_prefill_chunk", [cli.gpt_fast_prefill_chunk])):
        if any(v < 2 if flag.endswith("prefix_lens") else v < 1 for v in values):
            raise MagicDecError(f"{flag} {' '.join(map(str, values))}: must be positive (a prefix at least 2)")
    if not cli.prefix_lens and not cli.speculative_prefix_lens:
        raise MagicDecError("nothing to time: give --prefix_lens or --speculative_prefix_lens")


def check_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise MagicDecError(f"--device {name}: this benchmark times torch.compile's and magicdec's CUDA graphs, and no "
                            "CUDA device is visible; run it on a GPU machine")
    return device


def gpt_fast_args(gpt_fast_model, a: ModelArgs, flag: str):
    """gpt-fast's ModelArgs at magicdec's shapes; a one-line error for what its model cannot build."""
    if a.head_dim != a.dim // a.n_heads:
        raise MagicDecError(f"{flag} {a.name}: head_dim {a.head_dim} is not dim / n_heads, which gpt-fast's model "
                            "always takes")
    if a.attention_bias:
        raise MagicDecError(f"{flag} {a.name} has q/k/v biases, which gpt-fast's model has not")
    scaling = a.rope_scaling
    if scaling is not None and scaling.get("rope_type") != "llama3":
        raise MagicDecError(f"{flag} {a.name}: {scaling.get('rope_type')} RoPE scaling; gpt-fast's model has llama3's "
                            "only")
    if scaling is not None:
        scaling = {k: scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                           "original_max_position_embeddings")}
    return gpt_fast_model.ModelArgs(block_size=a.max_seq_len, vocab_size=a.vocab_size, n_layer=a.n_layers,
                                    n_head=a.n_heads, dim=a.dim, intermediate_size=a.intermediate_size,
                                    n_local_heads=a.n_kv_heads, rope_base=a.rope_base, norm_eps=a.norm_eps,
                                    rope_scaling=scaling)


def gpt_fast_bytes(models: list[ModelArgs], slots: int, chunk: int, item: int) -> int:
    """What gpt-fast allocates beside magicdec for one phase: per model its KV cache and its bool causal mask over
    `slots` (made as ones, then tril: twice), its reordered wqkv and its RoPE table; the largest model's prefill chunk
    logits and a decode step's K and V expanded to every query head."""
    slots = -(-slots // 8) * 8  # setup_caches rounds up to a multiple of 8
    total = 0
    for a in models:
        total += 2 * a.n_layers * slots * a.n_kv_heads * a.head_dim * item + 2 * slots * slots
        total += a.n_layers * (a.n_heads + 2 * a.n_kv_heads) * a.head_dim * a.dim * item
        total += a.max_seq_len * a.head_dim * item
    a = models[0]
    return total + chunk * a.vocab_size * item + 2 * slots * a.n_heads * a.head_dim * item


def check_gpt_fast_fits(engine: Engine, largest: RunConfig, phases: list[tuple[int, list[ModelArgs], int]],
                        chunk: int) -> int:
    """magicdec's run at its largest (the engine's estimate) and gpt-fast's largest phase ((prefix, models, slots)
    each) together within the GPU's free memory, checked before anything is allocated; returns gpt-fast's bytes."""
    from magicdec.harness.engine import activation_rows, memory_needed

    item = torch.empty((), dtype=engine.dtype).element_size()
    ours = memory_needed(1, activation_rows(largest), engine.dtype, engine.plan(largest)[1])["total"]
    theirs = max(gpt_fast_bytes(models, slots, chunk, item) for _, models, slots in phases)
    free, spare = dev.memory(engine.device)[0], dev.headroom(engine.device)
    if ours + theirs + spare > free:
        gib = 1 << 30
        raise MagicDecError(f"magicdec ({ours / gib:.1f} GiB) and gpt-fast ({theirs / gib:.1f} GiB: its caches and "
                            f"causal masks) together, plus {spare / gib:.1f} GiB headroom, exceed the {free / gib:.1f} "
                            f"GiB free on {engine.device}: lower --prefix_lens / --speculative_prefix_lens")
    return theirs


# ---------------------------------------------------------------- one set of tensors, two engines

def interleaved_qk(wqkv: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """magicdec's fused wqkv (transformers' layout: RoPE rotates dimension i with i + D/2 of each head) with each q
    and k head's rows reordered to gpt-fast's (it rotates 2i with 2i + 1): row 2i + j takes row j * D/2 + i. Queries
    and keys are reordered alike, so their dot products, and the logits, stay the same; v is kept."""
    q, k, v = wqkv.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim])

    def reorder(w, heads):
        return w.reshape(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(heads * head_dim, -1)

    return torch.cat([reorder(q, n_heads), reorder(k, n_kv_heads), v])


def gpt_fast_state(model) -> dict:
    """magicdec model's tensors under gpt-fast's names (the same names): shared, but for the reordered wqkv."""
    a = model.args
    state = dict(model.state_dict())
    for i in range(a.n_layers):
        name = f"layers.{i}.attention.wqkv.weight"
        state[name] = interleaved_qk(state[name], a.n_heads, a.n_kv_heads, a.head_dim)
    return state


def load_module(path: Path, name: str):
    """A file as a module under `name` (gpt-fast's files are no package): registered, as an import would be."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def import_model(folder: Path):
    """gpt-fast's model.py as a module (it imports torch only)."""
    return load_module(folder / "model.py", "gpt_fast_model")


CONFIGS = ("torch._inductor.config", "torch._dynamo.config", "torch._functorch.config")


def config_copy() -> dict:
    """Every value of the torch config modules gpt-fast's generate.py may set."""
    return {name: importlib.import_module(name).get_config_copy() for name in CONFIGS}


def changed(before: dict, after: dict) -> dict:
    """{config module: {key: value}} that differ between two config_copy()s."""
    out = {}
    for name in CONFIGS:
        diff = {}
        for key, value in after[name].items():
            try:
                same = before[name].get(key) == value
            except Exception:  # noqa: BLE001 - a value that cannot be compared counts as changed
                same = False
            if not same:
                diff[key] = value
        if diff:
            out[name] = diff
    return out


def no_tokenizer(*args, **kwargs):
    raise RuntimeError("gpt-fast's tokenizer.py could not be imported")


class GptFastModel:
    """gpt-fast's model.py, and its Transformers made on magicdec models' tensors."""

    def __init__(self, folder: Path):
        self.folder, self.module = folder, import_model(folder)
        self.states = {}  # id(magicdec model) -> (the model, its tensors under gpt-fast's names)

    def transformer(self, model):
        """A gpt-fast Transformer on `model`'s tensors (magicdec's), caches not yet set up: each call a new one, so
        a draft that is the target has caches of its own."""
        if id(model) not in self.states:
            with torch.no_grad():
                self.states[id(model)] = (model, gpt_fast_state(model))
        state = self.states[id(model)][1]
        with torch.device("meta"):
            out = self.module.Transformer(gpt_fast_args(self.module, model.args, "--model_name"))
        out.load_state_dict(state, assign=True, strict=True)
        return out.eval().requires_grad_(False)


class GptFast:
    """gpt-fast's generate.py imported from a checkout over a model.py (`model`: the same checkout's, or another's),
    its torch settings (generate.py sets inductor's on import) applied around gpt-fast's own calls only, and its
    steps compiled as its `main` compiles them."""

    def __init__(self, folder: Path, model: GptFastModel, tag: str = "plain"):
        self.folder, self.model = folder, model
        before, path = config_copy(), list(sys.path)
        saved = {k: sys.modules.get(k) for k in ("model", "tokenizer")}
        # generate.py does `from model import Transformer` and `from tokenizer import get_tokenizer`
        sys.modules["model"] = model.module
        try:
            sys.modules["tokenizer"] = load_module(folder / "tokenizer.py", f"gpt_fast_tokenizer_{tag}")
            self.tokenizer_note = "gpt-fast's tokenizer.py imported (unused: the prompts are token ids)"
        except (ImportError, OSError) as e:  # sentencepiece / tiktoken missing: the benchmark tokenizes nothing
            sys.modules["tokenizer"] = stub = types.ModuleType("tokenizer")
            stub.get_tokenizer = no_tokenizer
            self.tokenizer_note = f"gpt-fast's tokenizer.py not importable ({type(e).__name__}: {e}); a stub stood in"
        try:
            self.generate = load_module(folder / "generate.py", f"gpt_fast_generate_{tag}")
        finally:
            sys.path[:] = path  # it appends its parent folder
            for k, v in saved.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v
        after = config_copy()
        self.settings = changed(before, after)
        for name, values in self.settings.items():  # magicdec's own compiles (its prefill's flex attention) keep theirs
            sys.modules[name].load_config({k: before[name][k] for k in values})
        self.plain = {"decode_one_token": self.generate.decode_one_token, "model_forward": self.generate.model_forward}

    def own_settings(self):
        """A context with gpt-fast's torch settings (what importing its generate.py set)."""
        stack = contextlib.ExitStack()
        for name, values in self.settings.items():
            stack.enter_context(sys.modules[name].patch(values))
        return stack

    def compile(self) -> None:
        """generate.main's compilation: decode_one_token and, for speculation, model_forward (each compiled at its
        first call, so only what a phase times is compiled)."""
        for name, fn in self.plain.items():
            setattr(self.generate, name, torch.compile(fn, mode="reduce-overhead", fullgraph=True))

    def prefill(self, model, prompts: torch.Tensor, chunk: int) -> torch.Tensor:
        """generate.prefill over the prompt [1, P] in chunks (its forward takes any positions); the first token."""
        with torch.no_grad(), self.own_settings():
            for start in range(0, prompts.shape[1], chunk):
                piece = prompts[:, start:start + chunk]
                pos = torch.arange(start, start + piece.shape[1], device=prompts.device)
                first = self.generate.prefill(model, piece, pos, **GREEDY)
        return first

    def decode(self, model, first: torch.Tensor, prefix_len: int, n: int, device) -> "Run":
        """generate.decode_n_tokens as generate() calls it: n - 1 tokens after the prefill's, timed."""
        with torch.no_grad(), self.own_settings():
            pos = torch.tensor([prefix_len], device=first.device, dtype=torch.int)  # generate()'s input_pos
            graphs = compiled_graphs()
            dev.sync(device)
            start = time.perf_counter()
            tokens, _ = self.generate.decode_n_tokens(model, first.view(1, -1), pos, n - 1, **GREEDY)
            dev.sync(device)
            seconds = time.perf_counter() - start
        out = torch.cat([first.view(-1), *(t.view(-1) for t in tokens)])
        return Run(seconds, n - 1, out.tolist(), graphs_compiled=compiled_graphs() - graphs)

    def speculate(self, model, draft, first: torch.Tensor, prefix_len: int, n: int, gamma: int, device) -> "Run":
        """generate.speculative_decode in the loop generate() runs it in (the position kept on the host, each call's
        tokens clipped to the n asked for), timed; its accepted draft tokens per verification counted as generate's
        accept_counts count them."""
        with torch.no_grad(), self.own_settings():
            pos, end, token = prefix_len, prefix_len + n - 1, first
            out, accepted = [first.view(-1)], []
            graphs = compiled_graphs()
            dev.sync(device)
            start = time.perf_counter()
            while pos < end:
                new = self.generate.speculative_decode(model, draft, token.view(()), pos, gamma, **GREEDY)
                accepted.append(len(new) - 1)
                added = min(end - pos, len(new))
                out.append(new[:added])
                pos += added
                token = new[-1]
            dev.sync(device)
            seconds = time.perf_counter() - start
        verifications, kept, examined = counted(accepted, gamma)
        return Run(seconds, n - 1, torch.cat(out).tolist(), verifications, kept, examined,
                   compiled_graphs() - graphs)


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process: a count that grows inside a timed run means a compilation
    was timed."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ---------------------------------------------------------------- rounds and what they give

@dataclass
class Run:
    """One timed generation: its seconds, the tokens it decoded (the prefill's first not counted), all its tokens,
    and, speculating, its verifications and drafted tokens kept and examined (positions 0..kept, at most gamma)."""
    seconds: float
    decoded: int
    tokens: list
    verifications: int | None = None
    accepted: int | None = None
    examined: int | None = None
    graphs_compiled: int = 0

    @property
    def rate(self) -> float:
        return self.decoded / self.seconds


def counted(accepted: list[int], gamma: int) -> tuple[int, int, int]:
    """(verifications, drafted tokens kept, drafted positions examined) from each verification's kept count:
    magicdec's convention (stats.Counts), a verification examining its positions up to its first rejection."""
    return len(accepted), sum(accepted), sum(min(a + 1, gamma) for a in accepted)


def interleaved_rounds(runners: dict, rounds: int, progress: bool = False, desc: str = "rounds") -> dict:
    """Each runner once per round, in the given order in even rounds and reversed in odd ones (neither engine is
    always the one that runs after the pause between rounds); {name: [Run per round]}."""
    names = list(runners)
    out = {name: [] for name in names}
    for r in tqdm(range(rounds), desc=desc, disable=not progress, leave=False):
        for name in names if r % 2 == 0 else names[::-1]:
            out[name].append(runners[name]())
    return out


def paired_ratio(ours: list[Run], theirs: list[Run]) -> dict:
    """Our decode rate over theirs in each round, the median of those ratios and their min and max (metrics'
    paired_speedups: never a ratio of medians, which pairs runs of different rounds)."""
    paired = met.paired_speedups({"round_tokens_per_s": [r.rate for r in ours]},
                                 {"round_tokens_per_s": [r.rate for r in theirs]})
    low, high = paired["measured_speedup_range"]
    return {"per_round": paired["measured_speedup_rounds"], "median": paired["measured_speedup"], "min": low,
            "max": high}


def acceptance(runs: list[Run]) -> dict:
    """Acceptance over every timed run: alpha (drafted tokens kept / examined) and tokens per verification."""
    v, kept, examined = (sum(getattr(r, k) for r in runs) for k in ("verifications", "accepted", "examined"))
    return {"verifications": v, "accepted_tokens": kept, "alpha": kept / examined if examined else None,
            "tokens_per_verification": (kept + v) / v if v else None}


def bandwidth(model, config: ModelArgs, prefix_len: int, gen_len: int, dtype, runs: list[Run], copy_bw) -> dict:
    """The bytes one decode step must read (metrics.bandwidth_metrics: the weights and the KV of the tokens before
    it, mean over the run) over each round's step time, against the copy bandwidth."""
    per = [met.bandwidth_metrics(model, config, 1, prefix_len, gen_len, dtype, r.seconds, copy_bw) for r in runs]
    fractions = [p.get("bandwidth_fraction_of_copy") for p in per]
    return {"bytes_per_step": per[0]["bytes_per_step"],
            "achieved_GBps_per_round": [p["achieved_bandwidth_GBps"] for p in per],
            "fraction_of_copy_per_round": fractions,
            "fraction_of_copy_median": statistics.median(fractions) if None not in fractions else None}


def common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def engine_summary(runs: list[Run], warm_up_s: float) -> dict:
    """An engine's rounds; its first run (untimed: compilation or graph capture, and one run), and that less its
    median timed run: about what compiling or capturing cost."""
    rates = [r.rate for r in runs]
    out = {"round_s": [r.seconds for r in runs], "round_decoded_tokens": [r.decoded for r in runs],
           "round_tokens_per_s": rates, "median_tokens_per_s": statistics.median(rates), "min_tokens_per_s": min(rates),
           "max_tokens_per_s": max(rates), "first_run_s": warm_up_s,
           "first_run_less_median_s": warm_up_s - statistics.median(r.seconds for r in runs),
           "graphs_compiled_while_timed": [r.graphs_compiled for r in runs]}
    if runs[0].verifications is not None:
        out["acceptance"] = acceptance(runs)
    return out


def phase_record(prefix_len: int, mode: str, runs: dict, warm_up_s: dict, bandwidth_of=None) -> dict:
    """One phase's part of the record: each engine's rounds, the paired ratio, (plain) bandwidth, and how far the
    two engines' greedy tokens agree (bf16 numerics differ, so they part somewhere)."""
    ours, theirs = runs["magicdec"], runs["gpt-fast"]
    engines = {name: engine_summary(r, warm_up_s[name]) for name, r in runs.items()}
    if bandwidth_of is not None:
        for name, r in runs.items():
            engines[name]["bandwidth"] = bandwidth_of(r)
    return {"prefix_len": prefix_len, "mode": mode, "engines": engines,
            "magicdec_over_gpt_fast": paired_ratio(ours, theirs),
            "agreement": {"first_token_equal": ours[-1].tokens[0] == theirs[-1].tokens[0],
                          "common_prefix_tokens": common_prefix(ours[-1].tokens, theirs[-1].tokens),
                          "of": len(ours[-1].tokens)}}


# ---------------------------------------------------------------- the run

class Phases:
    """Both engines over one prefix: magicdec's prefilled batch, and each phase (plain, speculative) built, warmed up
    and timed. `drivers`: gpt-fast's generate.py for each mode."""

    def __init__(self, cli, drivers: dict, engine: Engine, options: dict, draft_model, copy_bw, say):
        self.cli, self.drivers, self.engine, self.options = cli, drivers, engine, options
        self.draft_model, self.copy_bw, self.say = draft_model, copy_bw, say
        self.device = engine.device

    def config(self, prefix_len: int, speculative: bool) -> RunConfig:
        return RunConfig.from_options(self.options | {"prefix_len": prefix_len} |
                                      (speculation(self.cli) if speculative else {}))

    def magicdec_runner(self, decoder, cache, first, prev, prefix_len: int, n: int):
        """One timed magicdec generation from the prompt (the cache rolled back to it: an earlier phase's runs left
        it further on)."""
        lengths = torch.full_like(cache.lengths, prefix_len)

        def run():
            with torch.inference_mode():
                cache.rollback(lengths)
                torch.manual_seed(self.cli.seed + 1)
                graphs = compiled_graphs()
                out, counts = decode(decoder, cache, first, n, [], prev=prev)
                stats = decoder.stats
            spec = decoder.gamma > 0
            return Run(decoder.seconds, int((counts - 1).sum()), out[0].tolist(),
                       stats.verifications if spec else None, sum(stats.kept) if spec else None,
                       sum(stats.reached) if spec else None, compiled_graphs() - graphs)
        return run

    def gpt_fast_models(self, gf: GptFast, prefix_len: int, speculative: bool):
        """Fresh gpt-fast Transformers (target, and draft) with caches as generate() sizes them: prompt + gen_len,
        + gamma + 1 when speculating; torch.compile's state reset first, so each phase compiles its own static
        shapes (as one gpt-fast process does)."""
        torch._dynamo.reset()
        dev.release_memory(self.device)
        slots = prefix_len + self.cli.gen_len + (self.cli.gamma + 1 if speculative else 0)
        models = [gf.model.transformer(self.engine.target)]
        if speculative:
            models.append(gf.model.transformer(self.draft_model))
        with torch.device(self.device):
            for m in models:
                m.setup_caches(max_batch_size=1, max_seq_length=slots)
        return models

    def run(self, prefix_len: int, modes: list[str]):
        """Each mode's record at this prefix as it is done (a phase that fails: its one-line error, and on)."""
        engine, say = self.engine, self.say
        cfg = self.config(prefix_len, "speculative" in modes)
        models = engine.plan(cfg)[0]  # its memory was checked at the largest prefix
        say(f"prefix {prefix_len}: magicdec prefill")
        batch = engine.prefill(cfg)
        first, prev = first_tokens(cfg, batch)
        for mode in modes:
            speculative = mode == "speculative"
            try:
                record = self.phase(prefix_len, mode, cfg if speculative else self.config(prefix_len, False), models,
                                    batch, first, prev)
            except Exception as e:  # noqa: BLE001 - gpt-fast on a torch it predates may fail: say so, go on
                if isinstance(e, MagicDecError):
                    raise
                traceback.print_exc()
                text = str(e).strip().splitlines()
                record = {"prefix_len": prefix_len, "mode": mode,
                          "error": f"{type(e).__name__}: {text[0] if text else ''}"[:500]}
                say(f"prefix {prefix_len} {mode}: failed: {record['error']}")
            torch._dynamo.reset()
            dev.release_memory(self.device)
            yield record

    def phase(self, prefix_len, mode, cfg, models, batch, first, prev) -> dict:
        cli, engine, say, device = self.cli, self.engine, self.say, self.device
        gf, n, speculative = self.drivers[mode], cli.gen_len, mode == "speculative"
        drafter = None
        if speculative:
            say(f"prefix {prefix_len} {mode}: magicdec draft prefill")
            drafter = engine.prepare(cfg, batch, models)[0]
        decoder = engine.decoder(cfg, drafter, cli.gamma if speculative else 0)
        ours = self.magicdec_runner(decoder, batch.cache, first, prev, prefix_len, n)
        say(f"prefix {prefix_len} {mode}: gpt-fast caches and prefill")
        gf_models = self.gpt_fast_models(gf, prefix_len, speculative)
        gf_first = [gf.prefill(m, batch.prompts, cli.gpt_fast_prefill_chunk) for m in gf_models][0]
        if speculative:
            theirs = lambda: gf.speculate(gf_models[0], gf_models[1], gf_first, prefix_len, n, cli.gamma,  # noqa: E731
                                          device)
        else:
            theirs = lambda: gf.decode(gf_models[0], gf_first, prefix_len, n, device)  # noqa: E731
        say(f"prefix {prefix_len} {mode}: gpt-fast's first run (torch.compile: minutes)")
        warm_up = {"gpt-fast": dev.timed(theirs, device)[1]}
        say(f"prefix {prefix_len} {mode}: magicdec's first run (CUDA graph capture)")
        warm_up["magicdec"] = dev.timed(ours, device)[1]
        say(f"prefix {prefix_len} {mode}: {cli.rounds} interleaved rounds")
        runs = interleaved_rounds({"gpt-fast": theirs, "magicdec": ours}, cli.rounds, not cli.no_progress,
                                  desc=f"prefix {prefix_len} {mode}")
        bandwidth_of = None
        if not speculative:
            bandwidth_of = lambda r: bandwidth(engine.target, engine.target_config, prefix_len, n,  # noqa: E731
                                               engine.dtype, r, self.copy_bw)
        record = phase_record(prefix_len, mode, runs, warm_up, bandwidth_of)
        record["gpt_fast_cache_slots"] = gf_models[0].max_seq_length
        record["magicdec_cache_slots"] = batch.cache.max_len
        if speculative:
            record["gamma"] = cli.gamma
        return record


def speculation(cli) -> dict:
    """magicdec's run options for the speculative phase: a standalone draft over its full KV cache, like gpt-fast's."""
    return {"drafter": "standalone", "draft_name": cli.draft_name, "draft_budget": 0, "gamma": [cli.gamma]}


def checkout(folder: Path, commit: str | None, flag: str) -> dict:
    """A gpt-fast checkout's path and commit, checked (one-line errors) before anything loads."""
    folder = check_checkout(folder, flag)
    commit, source = checkout_commit(folder, commit, flag)
    return {"path": folder, "commit": commit, "commit_source": source}


def cloned_decode_loop(older: "GptFast") -> str:
    """The earlier checkout's speculative_decode drives its draft through decode_n_tokens, whose loop feeds each
    step's output straight back as the next input (`cur_token = next_token.view(1, -1)`); under torch 2.11's
    CUDA-graph trees the next replay overwrites that output and the run fails. gpt-fast's later decode_n_tokens clones
    it (`cur_token = next_token.clone()`, with its batched shapes); the same clone, and nothing else, is made here in
    the earlier loop: one edit of ours, recorded."""
    import inspect

    before = "cur_token = next_token.view(1, -1)"
    text = inspect.getsource(older.generate.decode_n_tokens)
    if before not in text:
        return "unchanged (its loop has no `" + before + "`)"
    exec(compile(text.replace(before, before + ".clone()"), str(older.folder / "generate.py"), "exec"),
         older.generate.__dict__)
    return f"one edit of ours: `{before}` -> `{before}.clone()` (gpt-fast's later loop clones it too)"


def main(argv=None) -> dict:
    start = time.perf_counter()
    cli = parse(argv)
    source = {"plain": checkout(cli.gpt_fast, cli.gpt_fast_commit, "--gpt_fast")}
    source["speculative"] = source["plain"] if cli.gpt_fast_speculative is None else checkout(
        cli.gpt_fast_speculative, cli.gpt_fast_speculative_commit, "--gpt_fast_speculative")
    check_cli(cli)
    device = check_device(cli.device)
    target_args, draft_args = ModelArgs.from_name(cli.model_name), ModelArgs.from_name(cli.draft_name)
    files.writable_folder(cli.output, "--output")
    path = cli.output / RECORD

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {text}", file=sys.stderr, flush=True)

    plain = sorted(set(cli.prefix_lens))
    speculative = sorted(set(cli.speculative_prefix_lens))
    model = GptFastModel(source["plain"]["path"])  # gpt-fast's code only: no weights yet
    gpt_fast_args(model.module, target_args, "--model_name")
    gpt_fast_args(model.module, draft_args, "--draft_name")
    drivers = {"plain": GptFast(source["plain"]["path"], model, "plain")}
    drivers["speculative"] = drivers["plain"] if source["speculative"] is source["plain"] else GptFast(
        source["speculative"]["path"], model, "speculative")
    if drivers["speculative"] is not drivers["plain"]:
        source["speculative"]["decode_n_tokens"] = cloned_decode_loop(drivers["speculative"])
    # magicdec's side as `magicdec run` times it: random weights, greedy, EOS ignored (gpt-fast never stops at one),
    # CUDA graphs, its fused kernels and its attention backend
    options = {"model_name": cli.model_name, "random_weights": True, "B": 1, "gen_len": cli.gen_len,
               "seed": cli.seed, "device": cli.device, "ignore_eos": True, "step_mode": "cuda_graphs",
               "progress": not cli.no_progress}
    largest = RunConfig.from_options(options | {"prefix_len": max(plain + speculative)} |
                                     (speculation(cli) if speculative else {}))
    engine = Engine(largest)
    models = engine.check(largest)  # context and memory at the largest prefix, before any weight is made
    gen, ahead = cli.gen_len, cli.gamma + 1  # gpt-fast's caches: generate()'s max_seq_length
    gpt_fast_need = check_gpt_fast_fits(engine, largest, [(p, [target_args], p + gen) for p in plain] + [
        (p, [target_args, draft_args], p + gen + ahead) for p in speculative], cli.gpt_fast_prefill_chunk)
    say("copy bandwidth")
    copy_bw = dev.copy_bandwidth(device)
    say(f"random weights: {target_args.name}" + (f" and {draft_args.name}" if speculative else ""))
    engine.load_target()  # outside inference mode: gpt-fast's forward shares these tensors
    draft_model = engine.load(models["draft"][0], None) if speculative else None
    for driver in {id(d): d for d in drivers.values()}.values():
        driver.compile()
    draft_is_target = draft_model is engine.target
    record = {
        "benchmark": "gpt_fast_peer", "environment": dev.environment(device),
        "gpt_fast": {
            "model.py": {k: str(v) for k, v in source["plain"].items()},
            **{f"generate.py ({mode})": {**{k: str(v) for k, v in source[mode].items()},
                                         "torch_settings_it_sets": drivers[mode].settings,
                                         "tokenizer": drivers[mode].tokenizer_note}
               for mode in ("plain", "speculative") if mode == "plain" or speculative},
            "compiled": "decode_one_token and model_forward: torch.compile(mode='reduce-overhead', fullgraph=True), "
                        "as generate.main does, each at its first call; prefill eager (its default)",
            "prefill": f"generate.prefill in chunks of {cli.gpt_fast_prefill_chunk} tokens (not timed)"},
        "magicdec": {"step_mode": largest.runtime.step_mode, "attn_backend": engine.backend,
                     "fused_kernels": largest.runtime.fuse, "dtype": str(engine.dtype),
                     "draft": "standalone, its full KV cache (draft_budget 0), its own prefill"},
        "model": target_args.name, "model_config": target_args.to_dict(),
        "draft": draft_args.name if speculative else None,
        "draft_config": draft_args.to_dict() if speculative else None,
        "weights": f"random: magicdec.model.transformer.random_state_dict(seed {cli.seed}), made once; gpt-fast's Transformer "
                   "holds the same tensors (wqkv's q and k rows reordered to its interleaved RoPE, a copy)"
                   + ("; the draft is the target's own weights" if draft_is_target else ""),
        "prompt": "seeded random token ids (data.random_prompts), the same ids for both engines",
        "decoding": "greedy: magicdec's argmax; gpt-fast's sampler at temperature 0 (logits / 1e-5, one-hot)",
        "acceptance_source": None if not speculative else (
            "each engine's own greedy verification of the same draft (neither synthetic: gpt-fast has no such "
            "mode); " + ("the draft is the target, so each verification keeps nearly all gamma" if draft_is_target
                         else "a random draft and a random target agree on almost no token, so alpha is about 0 on "
                              "both: the rounds compare what each engine's speculative loop costs (gamma draft steps "
                              "and one verification of gamma + 1 tokens per token), not a trained draft's speedup")),
        "settings": {"B": 1, "prefix_lens": plain, "speculative_prefix_lens": speculative, "gen_len": cli.gen_len,
                     "gamma": cli.gamma, "rounds": cli.rounds, "seed": cli.seed,
                     "gpt_fast_prefill_chunk": cli.gpt_fast_prefill_chunk},
        "clocks": CLOCKS,
        "ratio": "magicdec's decode tokens/s over gpt-fast's in the same round; the figure is the median of the "
                 "rounds' ratios, with their min and max",
        "bandwidth": "bytes a decode step must read (weights, and the KV of the tokens before it) over its time, as "
                     "a fraction of the copy bandwidth; the same bytes for both engines (gpt-fast's attention reads "
                     "every slot of its cache, masked: gpt_fast_cache_slots)",
        "copy_bandwidth_GBps": copy_bw / 1e9 if copy_bw else None,
        "gpt_fast_memory_estimate_GiB": gpt_fast_need / 2**30, "phases": []}
    phases = Phases(cli, drivers, engine, options, draft_model, copy_bw, say)
    for prefix_len in sorted(set(plain) | set(speculative)):
        modes = (["plain"] if prefix_len in plain else []) + (["speculative"] if prefix_len in speculative else [])
        for phase in phases.run(prefix_len, modes):
            record["phases"].append(phase)
            record["elapsed_s"] = time.perf_counter() - start
            record["peak_memory_GiB"] = (dev.peak_memory(device) or 0) / 2**30
            files.write_json(path, record)  # after every phase: a run cut short keeps what it measured
            say(f"wrote {path}")
    print_summary(record)
    return record


def print_summary(record: dict) -> None:
    env = record["environment"]
    print(f"\n{record['model']} (random weights), B = 1, gen_len {record['settings']['gen_len']}, "
          f"{env.get('gpu', env['device'])}, torch {env['torch']}, gpt-fast "
          f"{record['gpt_fast']['model.py']['commit'][:12]}\n")
    print("| prefix | mode | gpt-fast tokens/s | magicdec tokens/s | magicdec / gpt-fast [min-max] | "
          "fraction of copy bandwidth (gpt-fast, magicdec) | alpha (gpt-fast, magicdec) |")
    print("|---|---|---|---|---|---|---|")
    for p in record["phases"]:
        if "error" in p:
            print(f"| {p['prefix_len']} | {p['mode']} | error: {p['error']} | | | | |")
            continue
        e, r = p["engines"], p["magicdec_over_gpt_fast"]
        bw = " / ".join(f"{e[k]['bandwidth']['fraction_of_copy_median']:.2f}" for k in ("gpt-fast", "magicdec")
                        if e[k].get("bandwidth", {}).get("fraction_of_copy_median") is not None)
        alpha = " / ".join(f"{e[k]['acceptance']['alpha']:.2f}" for k in ("gpt-fast", "magicdec")
                           if (e[k].get("acceptance") or {}).get("alpha") is not None)
        print(f"| {p['prefix_len']} | {p['mode']} | {e['gpt-fast']['median_tokens_per_s']:.1f} | "
              f"{e['magicdec']['median_tokens_per_s']:.1f} | {r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}] | "
              f"{bw or '-'} | {alpha or '-'} |")


if __name__ == "__main__":
    from magicdec.errors import one_line_errors

    with one_line_errors():  # bad input: one line, exit status 2
        main()
