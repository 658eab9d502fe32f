"""longspec benchmark (a standalone draft), launched as in the MagicDec seed (see README.md for the flags), where
--target names the target and --model the draft; the same as `magicdec run --drafter standalone --model TARGET
--draft DRAFT`:

    torchrun --standalone --nproc_per_node=1 tests/longspec_benchmark.py --target T/model.pth --model D/model.pth [flags]
"""
import sys

from magicdec.cli import run_main, run_record

DESCRIPTION = ("Standalone draft: a small model (--model here, as in MagicDec; --draft in magicdec run) with a small KV "
               "cache (--draft_policy) drafts for --target.")
DEFAULTS = {"drafter": "standalone"}
RENAMED = {"--model": "--draft", "--target": "--model"}  # the seed's longspec names, as magicdec run names them


def translate(argv: list[str]) -> list[str]:
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        out.append(RENAMED.get(name, name) + eq + value)
    return out


def run(argv=None) -> dict:
    return run_record(translate(argv or []), DESCRIPTION, DEFAULTS)


if __name__ == "__main__":
    run_main(translate(sys.argv[1:]), DESCRIPTION, DEFAULTS, rename={"--model": "--target", "--draft": "--model"})
