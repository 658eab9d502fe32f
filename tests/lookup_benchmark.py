"""lookup benchmark, launched as in the MagicDec seed (see README.md for the flags); the same as
`magicdec run --drafter lookup`:

    torchrun --standalone --nproc_per_node=1 tests/lookup_benchmark.py [flags]   # or plain python
"""
from magicdec.cli import run_main, run_record

DESCRIPTION = "Prompt lookup: no draft model; the tokens that followed the latest earlier occurrence of the last n tokens (n = --ngram_max..1) in the prompt and output are proposed."
DEFAULTS = {"drafter": "lookup"}


def run(argv=None) -> dict:
    return run_record(argv, DESCRIPTION, DEFAULTS)


if __name__ == "__main__":
    run_main(None, DESCRIPTION, DEFAULTS)
