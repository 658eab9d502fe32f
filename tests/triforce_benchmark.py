"""TriForce's command lines on this engine: hierarchical self-speculation (a bottom draft under the target's own
weights over its retrieval cache, verified by the target over its full cache). TriForce's flags mean here what they
mean there and become the selfspec flags below; every other selfspec flag passes through (tensor parallelism with
torchrun and --rank_group, --B, --random_weights, --synthetic_acceptance / --synthetic_bottom, --baseline, ...):

    TriForce              here
    --prefill N           --prefix_len N
    --budget N            --draft_budget N (the middle's retrieval cache; --draft_policy retrieval)
    --chunk_size N        --chunk_size N
    --gamma N             --gamma N (tokens the middle hands the target per verification)
    --temp T, --top_p P   --temperature T, --top_p P
    --draft_cache_budget  --bottom_budget (the bottom model's StreamingLLM cache)
    --dataset D           --dataset D
    --on_chip N           --offload --on_chip N (the target's KV beyond N layers in host memory: test/offloading.py)

TriForce's bottom is llama-68m drafting one token at a time (--gamma_bottom 1); here --draft PATH/model.pth names a
bottom model (with --random_weights: --draft_name JackFram/llama-68m), and without one the bottom is prompt lookup
(--draft ngram), which needs no checkpoint. TriForce's own example (on one A100: 2.2x):

    torchrun --standalone --nproc_per_node=1 tests/triforce_benchmark.py --prefill 124928 --budget 4096 \\
        --chunk_size 8 --top_p 0.9 --temp 0.6 --gamma 6 --dataset DIR --model checkpoints/.../model.pth --baseline
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from magicdec import runs  # noqa: E402

RENAMED = {"--prefill": "--prefix_len", "--budget": "--draft_budget", "--temp": "--temperature",
           "--draft_cache_budget": "--bottom_budget"}
# TriForce's defaults (test/on_chip.py) where they are not ours; a bottom model only where one is named
DEFAULTS = {"--prefix_len": "32768", "--draft_budget": "4096", "--chunk_size": "8", "--gamma": "6",
            "--temperature": "0.6", "--top_p": "0.9", "--gen_len": "256", "--bottom_budget": "256",
            "--gamma_bottom": "1", "--draft_policy": "retrieval"}


def translate(argv: list[str]) -> list[str]:
    """TriForce's flags as selfspec's, its defaults where a flag is absent, and --hierarchy."""
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        out.append(RENAMED.get(name, name) + eq + value)
    given = {a.partition("=")[0] for a in out if a.startswith("--")}
    for flag, value in DEFAULTS.items():
        if flag not in given:
            out += [flag, value]
    if "--draft" not in given and "--draft_name" not in given:
        out += ["--draft", "ngram"]
    if "--on_chip" in given and "--offload" not in given:
        out.append("--offload")
    return ["--hierarchy", *out]


def run(argv=None) -> dict:
    return runs.run("selfspec", translate(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
    sys.argv[1:] = translate(sys.argv[1:])
    runs.main("selfspec")
