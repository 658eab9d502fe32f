"""selfspec benchmark, launched as in the MagicDec seed (see README.md for the flags); the same as
`magicdec run --drafter selfspec`:

    torchrun --standalone --nproc_per_node=1 tests/selfspec_benchmark.py [flags]   # or plain python
"""
from magicdec.cli import run_main, run_record

DESCRIPTION = "Self-speculation: the target drafts with a small KV cache (--draft_policy) and verifies with its full cache (--hierarchy: TriForce's two levels)."
DEFAULTS = {"drafter": "selfspec"}


def run(argv=None) -> dict:
    return run_record(argv, DESCRIPTION, DEFAULTS)


if __name__ == "__main__":
    run_main(None, DESCRIPTION, DEFAULTS)
