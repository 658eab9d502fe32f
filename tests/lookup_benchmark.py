"""prompt-lookup benchmark (no draft model), launched as the MagicDec seed launches its others (see README.md for the flags):

    torchrun --standalone --nproc_per_node=1 tests/lookup_benchmark.py [flags]   # or plain python
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from magicdec import runs  # noqa: E402


def run(argv=None) -> dict:
    return runs.run("lookup", argv)


if __name__ == "__main__":
    runs.main("lookup")
