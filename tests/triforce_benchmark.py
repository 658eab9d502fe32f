"""TriForce's command lines on this engine: hierarchical self-speculation (a bottom draft under the target's own
weights over its retrieval cache, verified by the target over its full cache), the same as `magicdec run --drafter
hierarchy`. TriForce's flags mean here what they mean there; every other run flag passes through (tensor
parallelism with torchrun and --rank_group, --B, --random_weights, --synthetic_acceptance / --synthetic_bottom,
--baseline, ...):

    TriForce              here
    --prefill N           --prefix_len N
    --budget N            --draft_budget N (the middle's retrieval cache; --draft_policy retrieval)
    --chunk_size N        --chunk_size N
    --gamma N             --gamma N (tokens the middle hands the target per verification)
    --temp T, --top_p P   --temperature T, --top_p P
    --draft_cache_budget  --bottom_budget (the bottom model's StreamingLLM cache)
    --dataset D           --dataset D
    --on_chip N           --offload --on_chip N (the target's KV beyond N layers in host memory: test/offloading.py)

TriForce's defaults apply (prefill 32768, budget 4096, gamma 6, T 0.6, top-p 0.9, 256 tokens) where a model is named
(--model or --random_weights); with the default model, SmolLM2 (an 8K context), the prefill is 4000 and the budget
512. TriForce's bottom is llama-68m drafting one token at a time (--gamma_bottom 1); here --draft PATH/model.pth names
a bottom model (with --random_weights: --draft_name JackFram/llama-68m), and without one the bottom is prompt lookup
(--draft ngram), which needs no checkpoint. TriForce's own example (on one A100: 2.2x):

    torchrun --standalone --nproc_per_node=1 tests/triforce_benchmark.py --prefill 124928 --budget 4096 \\
        --chunk_size 8 --top_p 0.9 --temp 0.6 --gamma 6 --dataset DIR --model checkpoints/.../model.pth --baseline
"""
import sys

from magicdec.cli import run_main, run_record

RENAMED = {"--prefill": "--prefix_len", "--budget": "--draft_budget", "--temp": "--temperature",
           "--draft_cache_budget": "--bottom_budget"}
# TriForce's defaults (test/on_chip.py) where they are not ours
TRIFORCE = {"drafter": "hierarchy", "prefix_len": 32768, "draft_budget": 4096, "chunk_size": 8, "gamma": [6],
            "temperature": 0.6, "top_p": 0.9, "gen_len": 256, "bottom_budget": 256, "gamma_bottom": 1,
            "draft_policy": "retrieval", "draft": "ngram"}
SMOLLM2 = {"prefix_len": 4000, "draft_budget": 512}  # the default model's 8K context


def translate(argv: list[str]) -> tuple[list[str], dict]:
    """TriForce's flags as ours, and the defaults that apply: TriForce's, or the default model's where none is named."""
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        out.append(RENAMED.get(name, name) + eq + value)
    given = {a.partition("=")[0] for a in out if a.startswith("--")}
    if "--on_chip" in given and "--offload" not in given:
        out.append("--offload")
    named = bool(given & {"--model", "--random_weights", "--replay"})
    return out, TRIFORCE | ({} if named else SMOLLM2)


def description(defaults: dict) -> str:
    return __doc__.split("\n\n")[0].replace("\n", " ")


def run(argv=None) -> dict:
    args, defaults = translate(argv or [])
    return run_record(args, description(defaults), defaults)


if __name__ == "__main__":
    args, defaults = translate(sys.argv[1:])
    run_main(args, __doc__, defaults, rename={ours: theirs for theirs, ours in RENAMED.items()})
