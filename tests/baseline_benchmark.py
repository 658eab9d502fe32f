"""baseline benchmark, launched as in the MagicDec seed (see README.md for the flags); the same as
`magicdec run --drafter baseline`:

    torchrun --standalone --nproc_per_node=1 tests/baseline_benchmark.py [flags]   # or plain python
"""
from magicdec.cli import run_main, run_record

DESCRIPTION = "Autoregressive baseline: prefill, then one target step per token."
DEFAULTS = {"drafter": "baseline"}


def run(argv=None) -> dict:
    return run_record(argv, DESCRIPTION, DEFAULTS)


if __name__ == "__main__":
    run_main(None, DESCRIPTION, DEFAULTS)
